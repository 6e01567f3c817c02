"""Single-writer guarantees on the real broker: fencing, restart equality, idempotent retry."""

from __future__ import annotations

import copy

import pytest

from services.catalog.state import CatalogState
from services.config import Settings
from tests.registry.artifacts import build_adapter
from tests.registry.conftest import (
    RunningRegistry,
    domain_events,
    log_events,
    publish,
    register_base,
)

pytestmark = pytest.mark.slow


def _snapshot(running: RunningRegistry) -> CatalogState:
    with running.node.state_lock:
        state = copy.deepcopy(running.node.state)
    state.lease = None  # each instance leases on its own; everything else must agree
    return state


def test_second_instance_fences_the_first(reg_settings: Settings) -> None:
    first = RunningRegistry(reg_settings, registry_id="registry-a").start()
    try:
        with first.client() as a:
            register_base(a)
            assert publish(a, "bot", build_adapter(), "v1").status_code == 201
        second = RunningRegistry(reg_settings, registry_id="registry-b").start()
        try:
            with first.client() as a:
                refused = publish(a, "bot", build_adapter(seed=1), "from-zombie")
                assert refused.status_code == 503, refused.text
                assert refused.json()["code"] == "fenced" and "retry-after" in refused.headers
                assert a.put("/v1/adapters/bot/active", json={"version": 1}).status_code == 503
                assert a.get("/v1/adapters/bot").status_code == 200  # reads keep working
                assert a.get("/readyz").status_code == 503
            with second.client() as b:
                taken = publish(b, "bot", build_adapter(seed=2), "v2")
                assert taken.status_code == 201 and taken.json()["version"] == 2
            assert second.node.epoch > first.node.epoch
        finally:
            second.stop()
    finally:
        first.stop()
    events = domain_events(reg_settings)
    labels = [e.payload.label for e in events if e.type == "AdapterVersionPublished"]
    assert sorted(labels) == ["v1", "v2"]  # nothing from the fenced instance
    leases = [e for e in log_events(reg_settings) if e.type == "RegistryLease"]
    assert [e.seq for e in leases] == list(range(1, len(leases) + 1))


def test_restart_replays_to_the_same_state_and_keeps_idempotency(
        reg_settings: Settings) -> None:
    key = {"Idempotency-Key": "rollback-once"}
    first = RunningRegistry(reg_settings).start()
    try:
        with first.client("publisher") as pub, first.client() as admin:
            register_base(admin)
            for n in (1, 2, 3):
                assert publish(pub, "bot", build_adapter(seed=n), f"v{n}").status_code == 201
            assert pub.put("/v1/adapters/bot/active", json={"version": 2}).status_code == 200
            assert pub.put("/v1/adapters/bot/active", json={"version": 3}).status_code == 200
            assert pub.put("/v1/aliases/prod", json={"split": [
                {"adapter_id": "bot", "version": 3, "weight": 90},
                {"adapter_id": "bot", "version": 2, "weight": 10}]}).status_code == 200
            assert pub.post("/v1/adapters/bot/versions/1/disable",
                            json={"reason": "old"}).status_code == 200
            rolled = pub.post("/v1/adapters/bot/rollback", json={"reason": "err"}, headers=key)
            assert rolled.status_code == 200 and rolled.json()["to_version"] == 2
            assert pub.post("/v1/tenants/acme/search/prod/purge", json={}).status_code == 202
            before_json = pub.get("/v1/adapters/bot/versions").json()
        before = _snapshot(first)
    finally:
        first.stop()
    events_before = len(domain_events(reg_settings))

    second = RunningRegistry(reg_settings).start()
    try:
        assert _snapshot(second) == before
        with second.client("publisher") as pub:
            assert pub.get("/v1/adapters/bot/versions").json() == before_json
            again = pub.post("/v1/adapters/bot/rollback", json={"reason": "err"}, headers=key)
            assert again.status_code == 200 and again.json() == rolled.json()
            assert again.headers["idempotent-replayed"] == "true"
    finally:
        second.stop()
    assert len(domain_events(reg_settings)) == events_before  # the retry emitted nothing
