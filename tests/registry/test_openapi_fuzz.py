"""Property-based fuzz of the published OpenAPI spec: no input makes the registry answer 5xx.

Bounded (a few examples per operation) so it runs in well under a minute; one registry on
the session broker serves every generated case.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from services.config import Settings
from services.registry.app import create_app
from tests.conftest import drop_isolation, isolated_settings
from tests.registry.artifacts import build_adapter
from tests.registry.conftest import (
    TOKENS,
    RunningRegistry,
    publish,
    register_base,
    registry_settings,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fuzzed_registry(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[RunningRegistry]:
    base: Settings = isolated_settings(kafka_bootstrap, None)
    running = RunningRegistry(registry_settings(
        base, Path(tmp_path_factory.mktemp("fuzz-blobs")))).start()
    with running.client() as admin:
        register_base(admin)
        assert publish(admin, "bot", build_adapter(), "v1").status_code == 201
    yield running
    running.stop()
    drop_isolation(base, None)


# The spec is the app's own (the same document /openapi.json serves); building the app
# starts nothing, its lifespan only runs under a server.
schema = schemathesis.openapi.from_dict(
    create_app(Settings(blob_dir=Path(tempfile.mkdtemp()))).openapi())


@schema.parametrize()
@settings(max_examples=8, deadline=None,
          suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_input_makes_a_5xx(case: Any, fuzzed_registry: RunningRegistry) -> None:
    response = case.call(base_url=fuzzed_registry.url,
                         headers={"Authorization": f"Bearer {TOKENS['admin'][0]}"})
    assert response.status_code < 500, (case.method, case.path, response.status_code,
                                        response.text[:500])
