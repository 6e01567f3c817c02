"""Single-writer guarantees on the real broker: fencing, restart equality, idempotent retry."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

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


class FailingCommits:
    """A confluent Producer whose next commit times out (a transient broker error); all
    else reaches the real producer and the real broker."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.armed = True

    def commit_transaction(self, *args: Any) -> None:
        if self.armed:
            self.armed = False
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "injected: commit timed out",
                                            retriable=True))
        self._inner.commit_transaction(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_fenced_instance_never_takes_the_log_back(reg_settings: Settings) -> None:
    # A leases once, at its start: nothing tells it that B fenced it until it writes
    quiet = reg_settings.model_copy(update={"lease_interval_s": 3600.0})
    first = RunningRegistry(quiet, registry_id="registry-a").start()
    second: RunningRegistry | None = None
    try:
        with first.client() as a:
            register_base(a)
            assert publish(a, "bot", build_adapter(), "v1").status_code == 201
        second = RunningRegistry(reg_settings, registry_id="registry-b").start()
        producer = first.node._producer
        assert producer is not None
        producer._producer = FailingCommits(producer._producer)  # type: ignore[assignment]
        with first.client() as a:
            answers = [publish(a, "bot", build_adapter(seed=n), f"zombie{n}")
                       for n in range(3)]  # a transient error, then the retries
        with second.client() as b:
            taken = publish(b, "bot", build_adapter(seed=9), "v2")
            assert taken.status_code == 201, taken.text  # the new writer still writes
            assert b.get("/readyz").status_code == 200
        assert [answer.status_code for answer in answers] == [503] * 3
        assert answers[-1].json()["code"] == "fenced"
        with first.client() as a:
            ready = a.get("/readyz")
            assert ready.status_code == 503 and ready.json()["reason"].startswith("fenced")
    finally:
        if second is not None:
            second.stop()
        first.stop()
    labels = [e.payload.label for e in domain_events(reg_settings)
              if e.type == "AdapterVersionPublished"]
    assert labels == ["v1", "v2"]


def test_an_event_the_fold_cannot_take_stops_writes_until_skipped(
        reg_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    original = CatalogState.apply

    def apply(self: CatalogState, envelope: Any, position: Any = None) -> None:
        if getattr(envelope.payload, "label", None) == "poison":
            raise ValueError("a fold bug")
        original(self, envelope, position)

    monkeypatch.setattr(CatalogState, "apply", apply)
    running = RunningRegistry(reg_settings).start()
    try:
        with running.client() as admin:
            register_base(admin)
            assert publish(admin, "bot", build_adapter(), "v1").status_code == 201
            poisoned = publish(admin, "bot", build_adapter(seed=1), "poison")
            assert poisoned.status_code == 503, poisoned.text
            assert poisoned.json()["code"] == "halted"
            ready = admin.get("/readyz")
            assert ready.status_code == 503
            reason = ready.json()["reason"]
            assert "AdapterVersionPublished" in reason and "a fold bug" in reason
            event_id = ready.json()["halted"]["event_id"]
            later = admin.put("/v1/adapters/bot/active", json={"version": 1})
            assert later.status_code == 503 and later.json()["code"] == "halted"
            assert admin.get("/v1/adapters/bot").json()["latest_version"] == 1  # reads go on
    finally:
        running.stop()
    assert [e.payload.label for e in domain_events(reg_settings)
            if e.type == "AdapterVersionPublished"] == ["v1", "poison"]

    # the operator decides to skip it: the fold goes past it, writes resume
    skipping = reg_settings.model_copy(update={"fold_skip_events": [event_id]})
    running = RunningRegistry(skipping).start()
    try:
        with running.client() as admin:
            assert admin.get("/readyz").status_code == 200
            assert publish(admin, "bot", build_adapter(seed=2), "v3").status_code == 201
    finally:
        running.stop()


def test_a_client_lost_to_a_fatal_answer_that_is_not_fencing_is_replaced(
        reg_settings: Settings) -> None:
    from tests.eventlog.test_transactions import RefusedAbort

    quiet = reg_settings.model_copy(update={"lease_interval_s": 3600.0})
    running = RunningRegistry(quiet).start()
    try:
        with running.client() as admin:
            register_base(admin)
            assert publish(admin, "bot", build_adapter(), "v1").status_code == 201
            producer = running.node._producer
            assert producer is not None
            producer._producer = RefusedAbort(producer._producer)  # type: ignore[assignment]
            failed = publish(admin, "bot", build_adapter(seed=1), "lost")
            assert failed.status_code == 503 and failed.json()["code"] != "fenced", failed.text
            retried = publish(admin, "bot", build_adapter(seed=2), "v2")
            assert retried.status_code == 201, retried.text
            assert admin.get("/readyz").status_code == 200
    finally:
        running.stop()
    assert [e.payload.label for e in domain_events(reg_settings)
            if e.type == "AdapterVersionPublished"] == ["v1", "v2"]
