"""The registry's default rollback target equals the `rollback_candidates` view.

One log, two readers: the real registry (HTTP, Kafka) decides; the projector folds the
same events into PostgreSQL; for every adapter, after every step, both must name the
same version.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, text

from services.audit.projector import AuditProjector
from services.catalog.state import rollback_target
from services.config import Settings
from tests.registry.artifacts import build_adapter
from tests.registry.conftest import (
    RunningRegistry,
    publish,
    register_base,
    registry_settings,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def registry_and_projector(migrated_settings: Settings, db_engine: Engine,
                           tmp_path: Path) -> Iterator[tuple[RunningRegistry, AuditProjector]]:
    running = RunningRegistry(registry_settings(migrated_settings, tmp_path / "blobs")).start()
    projector = AuditProjector(running.settings, db_engine)
    yield running, projector
    projector.close()
    running.stop()


def _agree(registry: RunningRegistry, projector: AuditProjector, engine: Engine) -> dict:
    expected = {a.adapter_id: rollback_target(a) for a in registry.node.state.adapters.values()
                if a.active_version is not None}
    seen: dict[str, int | None] = {}
    for _ in range(200):
        projector.project_batch(timeout=0.1)
        with engine.connect() as conn:
            seen = {r.adapter_id: r.rollback_target for r in conn.execute(
                text("SELECT adapter_id, rollback_target FROM rollback_candidates"))}
        if seen == expected:
            return expected
    raise AssertionError(f"registry {expected} != view {seen}")


def test_registry_default_rollback_agrees_with_the_view(
        registry_and_projector: tuple[RunningRegistry, AuditProjector],
        db_engine: Engine) -> None:
    registry, projector = registry_and_projector
    with registry.client() as client:
        register_base(client)
        for adapter_id in ("alpha", "beta"):
            for n in range(1, 6):
                form = {"rollback_to": "1"} if (adapter_id, n) == ("beta", 4) else {}
                response = publish(client, adapter_id, build_adapter(seed=n), f"v{n}", **form)
                assert response.status_code == 201, response.text

        def step(method: str, url: str, **kwargs: object) -> None:
            response = client.request(method, url, **kwargs)  # type: ignore[arg-type]
            assert response.is_success, response.text
            _agree(registry, projector, db_engine)

        step("PUT", "/v1/adapters/alpha/active", json={"version": 1})
        step("PUT", "/v1/adapters/alpha/active", json={"version": 2})
        # a canary at 100% is not a switch: version 3 does not become stable
        step("PUT", "/v1/aliases/alpha-prod", json={"split": [
            {"adapter_id": "alpha", "version": 3, "weight": 100}]})
        step("PUT", "/v1/adapters/alpha/active", json={"version": 4})
        step("POST", "/v1/adapters/alpha/versions/2/disable", json={"reason": "bad eval"})
        step("PUT", "/v1/adapters/alpha/active", json={"version": 5})
        step("POST", "/v1/adapters/alpha/rollback", json={"reason": "regression"})
        step("POST", "/v1/adapters/alpha/versions/2/enable", json={"reason": "fixed"})
        step("PUT", "/v1/adapters/beta/active", json={"version": 2})
        step("PUT", "/v1/adapters/beta/active", json={"version": 4})  # declares rollback_to 1
        step("POST", "/v1/adapters/beta/versions/1/disable", json={"reason": "retired"})
        step("PUT", "/v1/adapters/beta/active", json={"version": 5})
        step("POST", "/v1/adapters/beta/rollback", json={"reason": "latency"})

    final = _agree(registry, projector, db_engine)
    assert final == {"alpha": 2, "beta": 2}
    with httpx.Client(base_url=registry.url, headers={"Authorization": "Bearer admin-token"}) as c:
        assert c.post("/v1/adapters/beta/rollback", json={"reason": "again"}).json()[
            "to_version"] == 2
