"""An active registry and a standby under lease election, on the real broker: the standby
serves reads and refuses writes, takes over when the writer falls silent, and the old
writer steps down to standby without a restart and without taking the role back."""

from __future__ import annotations

import time

import httpx
import pytest

from services.catalog.state import Lease
from services.config import Settings
from services.registry.node import RegistryNode
from tests.registry.artifacts import build_adapter
from tests.registry.conftest import (
    RunningRegistry,
    domain_events,
    log_events,
    publish,
    register_base,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def ha_settings(reg_settings: Settings) -> Settings:
    return reg_settings.model_copy(update={"registry_election": "lease", "lease_interval_s": 0.5,
                                           "lease_ttl_s": 2.0})


def lease_of(node: RegistryNode) -> Lease | None:
    with node.state_lock:
        return node.state.lease


def leases_seen(node: RegistryNode, writer: str, span_s: float) -> None:
    """Until `node` has folded `writer`'s renewals over `span_s` seconds of leases: as long
    as it would take to take over from a writer it thought silent."""
    first = wait_for(lambda: (lease := lease_of(node)) and lease.registry_id == writer and lease,
                     10, message=f"a lease of {writer}")
    wait_for(lambda: (lease := lease_of(node)) and lease.registry_id == writer and
             (lease.expires_at - first.expires_at).total_seconds() >= span_s,
             span_s + 10, message=f"{span_s:g} s of {writer}'s leases")


def test_the_standby_serves_reads_refuses_writes_and_takes_over_when_the_active_stops(
        ha_settings: Settings) -> None:
    first = RunningRegistry(ha_settings, registry_id="registry-a").start()
    second: RunningRegistry | None = None
    try:
        wait_for(first.node.active.is_set, 10, message="the first registry to take the writer role")
        second = RunningRegistry(ha_settings, registry_id="registry-b").start()
        with first.client() as a, second.client() as b:
            register_base(a)
            assert publish(a, "bot", build_adapter(), "v1").status_code == 201
            wait_for(lambda: b.get("/v1/adapters/bot").status_code == 200, 5,
                     message="the standby to fold the publish")
            assert b.get("/v1/adapters/bot").json()["latest_version"] == 1
            refused = publish(b, "bot", build_adapter(seed=1), "v2")
            assert refused.status_code == 503, refused.text
            problem = refused.json()
            assert (problem["code"], problem["outcome"]) == ("standby", "not_written")
            assert "registry-a" in problem["detail"] and "retry-after" in refused.headers
            ready = b.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["role"] == "standby"
            assert ready.json()["leaseholder"]["registry_id"] == "registry-a"
            assert a.get("/readyz").json()["role"] == "active"
        # a live writer is never taken over from
        leases_seen(second.node, "registry-a", 3 * ha_settings.lease_ttl_s)
        assert not second.node.active.is_set() and first.node.active.is_set()
        first.stop()
        stopped = time.monotonic()
        wait_for(second.node.active.is_set, 3 * ha_settings.lease_ttl_s,
                 message="the standby to take over")
        assert time.monotonic() - stopped < ha_settings.lease_ttl_s + 3.0
        with second.client() as b:
            wait_for(lambda: b.get("/readyz").status_code == 200, 5,
                     message="readiness after the takeover")
            taken = publish(b, "bot", build_adapter(seed=2), "v2")
            assert taken.status_code == 201 and taken.json()["version"] == 2, taken.text
        assert second.node.epoch > first.node.epoch
        assert second.node.last_takeover_s is not None
        assert second.node.last_takeover_s < ha_settings.lease_ttl_s + 3.0
    finally:
        if second is not None:
            second.stop()
        first.stop()
    labels = [e.payload.label for e in domain_events(ha_settings)
              if e.type == "AdapterVersionPublished"]
    assert labels == ["v1", "v2"]


def test_a_silenced_writer_is_taken_over_and_steps_down_without_a_restart(
        ha_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's process lives on but nothing it writes reaches the log (as behind a
    partition): the standby takes over, and the old writer, once it hears of it, stands
    by: it answers writes 503 `standby`, never takes the role back, and is a valid
    standby again (it would take over from the new writer in turn)."""
    first = RunningRegistry(ha_settings, registry_id="registry-a").start()
    wait_for(first.node.active.is_set, 10, message="the first registry to take the writer role")
    second = RunningRegistry(ha_settings, registry_id="registry-b").start()
    try:
        with first.client() as a:
            register_base(a)
            assert publish(a, "bot", build_adapter(), "v1").status_code == 201
        # its leases stop reaching the log: to the standby the writer looks gone
        monkeypatch.setattr(first.node, "renew_lease", lambda: None)
        try:
            wait_for(second.node.active.is_set, 4 * ha_settings.lease_ttl_s,
                     message="the standby to take over from a silent writer")
        finally:
            monkeypatch.undo()
        with second.client() as b:
            wait_for(lambda: b.get("/readyz").status_code == 200, 5, message="b ready")
            assert publish(b, "bot", build_adapter(seed=2), "v2").status_code == 201
        with first.client() as a:
            # the old writer hears of the new lease and stands by, no restart
            wait_for(lambda: a.get("/readyz").json()["role"] == "standby", 5,
                     message="the old writer to step down")
            refused = publish(a, "bot", build_adapter(seed=3), "from-old-writer")
            assert refused.status_code == 503 and refused.json()["code"] == "standby"
            assert a.get("/v1/adapters/bot").json()["latest_version"] == 2
        # no ping-pong while the new writer leases
        leases_seen(first.node, "registry-b", 3 * ha_settings.lease_ttl_s)
        assert second.node.active.is_set() and not first.node.active.is_set()
        assert first.node.stepped_down is not None
        second.stop()  # and the old writer, a standby now, takes over in turn
        wait_for(first.node.active.is_set, 4 * ha_settings.lease_ttl_s,
                 message="the stepped-down registry to take over again")
        with first.client() as a:
            wait_for(lambda: a.get("/readyz").status_code == 200, 5, message="a ready")
            assert publish(a, "bot", build_adapter(seed=4), "v3").json()["version"] == 3
    finally:
        second.stop()
        first.stop()
    events = domain_events(ha_settings)
    assert [e.payload.label for e in events if e.type == "AdapterVersionPublished"] == \
        ["v1", "v2", "v3"]
    epochs = [e.payload.epoch for e in log_events(ha_settings, ha_settings.liveness_topic)
              if e.type == "RegistryLease"]
    assert epochs == sorted(epochs) and len(set(epochs)) == 3  # a, b, then a again


def test_a_client_with_both_urls_follows_the_active(ha_settings: Settings) -> None:
    from services.client import RegistryClient

    first = RunningRegistry(ha_settings, registry_id="registry-a").start()
    wait_for(first.node.active.is_set, 10, message="the first registry to take the writer role")
    second = RunningRegistry(ha_settings, registry_id="registry-b").start()
    try:
        with first.client() as a:
            register_base(a)
            assert publish(a, "bot", build_adapter(), "v1").status_code == 201
        # the standby first in the list: writes find the active, reads are answered
        urls = f"{second.url},{first.url}"
        client_settings = ha_settings.model_copy(update={"registry_url": urls})
        with RegistryClient(client_settings, token="admin-token", retry_s=30) as client:
            assert client.switch("bot", 1)["to_version"] == 1
            first.stop()
            wait_for(second.node.active.is_set, 4 * ha_settings.lease_ttl_s, message="a takeover")
            with httpx.Client(base_url=second.url) as b:
                wait_for(lambda: b.get("/readyz").status_code == 200, 5, message="b ready")
            answer = client.disable("bot", 1, reason="after the takeover")
            assert answer["version"] == 1
            assert client.url == second.url
    finally:
        second.stop()
        first.stop()


def test_a_standby_s_refusal_is_the_answer_when_the_other_url_does_not_answer(
        ha_settings: Settings) -> None:
    """Writes sent to [standby, a registry that is down]: the client gets the standby's
    503 `standby` (and retries it within retry_s), not 'no registry' for the dead one."""
    from services.client import ClientError, RegistryClient
    from services.stack.process import free_port

    first = RunningRegistry(ha_settings, registry_id="registry-a").start()
    wait_for(first.node.active.is_set, 10, message="the first registry to take the writer role")
    second = RunningRegistry(ha_settings, registry_id="registry-b").start()
    try:
        with first.client() as a, second.client() as b:
            register_base(a)
            assert publish(a, "bot", build_adapter(), "v1").status_code == 201
            wait_for(lambda: b.get("/v1/adapters/bot").status_code == 200, 5,
                     message="the standby to fold the publish")
        urls = f"{second.url},http://127.0.0.1:{free_port()}"
        client_settings = ha_settings.model_copy(update={"registry_url": urls})
        with RegistryClient(client_settings, token="admin-token", retry_s=1.5) as client, \
                pytest.raises(ClientError, match="standby"):
            client.switch("bot", 1)
    finally:
        second.stop()
        first.stop()
