"""Another tenant's resource is answered exactly as a missing one, on every registry route
that names one, reads and writes: a caller cannot learn which names other tenants use.
The registry's log keeps the real reason. Real registry over HTTP, real broker."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from tests.registry.artifacts import build_adapter
from tests.registry.conftest import RunningRegistry, publish, register_base

pytestmark = pytest.mark.slow

THEIRS = {"adapter": "acme-bot", "alias": "acme-line"}
"""Names the acme publisher uses; the rival asks for them."""
NOBODYS = {"adapter": "ghost-bot", "alias": "ghost-line"}
"""Names nobody uses, spelt with as many characters."""
STEP = {"rollout_id": "r", "from_stage": 0, "reason": "because"}
JUDGED = {**STEP, "judgement": {
    "window_start": "2026-01-01T00:00:00Z", "window_end": "2026-01-01T00:01:00Z",
    "canary": {"version": 2, "requests": 60, "errors": 0},
    "baseline": {"version": 1, "requests": 60, "errors": 0}, "verdict": "advance"}}


def requests(names: dict[str, str], purge_id: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, path, httpx kwargs) of every route that names an adapter, alias, rollout or
    purge, for the names in `names`."""
    a, al = names["adapter"], names["alias"]
    return [
        ("GET", f"/v1/adapters/{a}", {}),
        ("GET", f"/v1/adapters/{a}/versions", {}),
        ("GET", f"/v1/adapters/{a}/versions/1", {}),
        ("GET", f"/v1/adapters/{a}/versions/1/gate", {}),
        ("POST", f"/v1/adapters/{a}/versions/1/gate", {"data": {"reason": "re-run"}}),
        ("PUT", f"/v1/adapters/{a}/active", {"json": {"version": 1}}),
        ("POST", f"/v1/adapters/{a}/rollback", {"json": {"reason": "bad"}}),
        ("POST", f"/v1/adapters/{a}/versions/1/disable", {"json": {"reason": "bad"}}),
        ("POST", f"/v1/adapters/{a}/versions/1/enable", {"json": {}}),
        ("GET", f"/v1/aliases/{al}", {}),
        ("GET", f"/v1/aliases/{al}/rollout", {}),
        ("POST", f"/v1/aliases/{al}/rollout/rollback", {"json": STEP}),
        ("POST", f"/v1/aliases/{al}/rollout/halt", {"json": STEP}),
        ("POST", f"/v1/aliases/{al}/rollout/resume", {"json": STEP}),
        ("POST", f"/v1/aliases/{al}/rollout/advance", {"json": JUDGED}),
        # an adapter named inside a request: a new alias over it, a rollout of it
        ("PUT", "/v1/aliases/rival-line", {"json": {"split": [
            {"adapter_id": a, "version": 1, "weight": 100}]}}),
        ("POST", "/v1/aliases/rival-line/rollout", {"json": {"adapter_id": a, "version": 2}}),
        ("GET", f"/v1/purges/{purge_id}", {}),
    ]


def answer(response: httpx.Response, name: str) -> tuple[int, str]:
    """Status and body with the asked name blanked: what must not differ."""
    return response.status_code, response.text.replace(name, "NAME")


def test_another_tenants_names_read_as_missing_ones(
        registry: RunningRegistry, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="loraplane.registry")
    with registry.client() as admin, registry.client("publisher") as acme, \
            registry.client("rival") as rival:
        register_base(admin)
        for n in (1, 2):
            assert publish(acme, THEIRS["adapter"], build_adapter(seed=n), f"v{n}"
                           ).status_code == 201
        assert acme.put(f"/v1/adapters/{THEIRS['adapter']}/active", json={"version": 1}
                        ).status_code == 200
        started = acme.post(f"/v1/aliases/{THEIRS['alias']}/rollout",
                            json={"adapter_id": THEIRS["adapter"], "version": 2})
        assert started.status_code == 201, started.text
        purge = acme.post("/v1/tenants/acme/search/prod/purge", json={"deadline_s": 5})
        assert purge.status_code == 202, purge.text
        theirs_purge = purge.json()["purge_id"]
        nobodys_purge = "0" * len(theirs_purge)

        compared = 0
        for (method, path, kw), (_, ghost_path, ghost_kw) in zip(
                requests(THEIRS, theirs_purge), requests(NOBODYS, nobodys_purge), strict=True):
            got = rival.request(method, path, **kw)
            missing = rival.request(method, ghost_path, **ghost_kw)
            name = next((v for v in (*THEIRS.values(), theirs_purge) if v in path or
                         v in str(kw)), "")
            ghost = next((v for v in (*NOBODYS.values(), nobodys_purge) if v in ghost_path or
                          v in str(ghost_kw)), "")
            named_inside = path.startswith("/v1/aliases/rival-line") and method == "PUT"
            assert got.status_code == (422 if named_inside else 404), (method, path, got.text)
            assert answer(got, name) == answer(missing, ghost), (method, path)
            assert "another tenant" not in got.text and "acme/search" not in got.text
            compared += 1
        assert compared == len(requests(THEIRS, theirs_purge))
        # the owner still sees its own, and an admin everything
        assert acme.get(f"/v1/adapters/{THEIRS['adapter']}").status_code == 200
        assert admin.get(f"/v1/purges/{theirs_purge}").status_code == 200

        # names are one namespace: creating one another tenant uses is refused as taken,
        # naming no tenant
        taken = publish(rival, THEIRS["adapter"], build_adapter(seed=9), "v1",
                        org="rival", team="x", project="y")
        assert taken.status_code == 409 and "acme/search" not in taken.text, taken.text
        split = rival.put(f"/v1/aliases/{THEIRS['alias']}", json={"split": [
            {"adapter_id": THEIRS["adapter"], "version": 1, "weight": 100}]})
        assert split.status_code == 409 and "acme/search" not in split.text, split.text

    # the real reason, for the operator and the audit
    refusals = [r.getMessage() for r in caplog.records if r.name == "loraplane.registry"
                and "belongs to another tenant" in r.getMessage()]
    assert any(f"adapter '{THEIRS['adapter']}' belongs to another tenant (acme/search/prod)"
               in m for m in refusals), refusals
    assert any(f"alias '{THEIRS['alias']}' belongs to another tenant" in m for m in refusals)
    assert any(f"purge '{theirs_purge}' belongs to another tenant" in m for m in refusals)
