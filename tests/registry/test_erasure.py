"""A tenant purge erases the tenant's adapter blobs, keeps what a live tenant still
references or what an upload may be about to reference, and records it on the log."""

from __future__ import annotations

import hashlib
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from services.catalog.state import CatalogState, tenant_stream
from services.config import Settings
from services.contracts.events import (
    AdapterVersionPublished,
    Envelope,
    Payload,
    TenantBlobsDeleted,
    TenantPurgeRequested,
    TenantRef,
)
from services.registry.blobstore import LocalBlobStore
from services.registry.erasure import _erase, erasure_candidates, pending_erasures
from tests.registry.artifacts import build_adapter
from tests.registry.conftest import (
    TENANT,
    RunningRegistry,
    domain_events,
    publish,
    register_base,
    registry_settings,
)

ACME = TenantRef(**TENANT)
RIVAL = TenantRef(org="rival", team="x", project="y")
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


class Log:
    def __init__(self) -> None:
        self.state = CatalogState()
        self.seqs: dict[str, int] = {}

    def add(self, payload: Payload, stream: str, tenant: TenantRef, at: datetime) -> None:
        self.seqs[stream] = self.seqs.get(stream, 0) + 1
        self.state.apply(Envelope.new(payload, stream=stream, seq=self.seqs[stream],
                                      actor="t", tenant=tenant, occurred_at=at))

    def publish(self, adapter: str, version: int, tenant: TenantRef, weights: str,
                at: datetime) -> None:
        self.add(AdapterVersionPublished(
            adapter_id=adapter, version=version, label=f"v{version}", base_model="b",
            base_model_digest=_digest("base"), sha256=_digest(weights),
            config_sha256=_digest("config"), size_bytes=1, rank=4, lora_alpha=8.0,
            target_modules=["q_proj"], dtype="float16", owner="o"), f"adapter/{adapter}",
            tenant, at)

    def purge(self, purge_id: str, tenant: TenantRef, at: datetime) -> None:
        self.add(TenantPurgeRequested(purge_id=purge_id, deadline_s=60), tenant_stream(tenant),
                 tenant, at)


def test_candidates_are_the_tenants_digests_minus_what_a_live_version_holds() -> None:
    log = Log()
    log.publish("a", 1, ACME, "mine", T0)
    log.publish("a", 2, ACME, "shared", T0)
    log.publish("r", 1, RIVAL, "shared", T0)
    log.publish("gone", 1, RIVAL, "old-rival", T0)
    log.purge("p-rival", RIVAL, T0 + timedelta(seconds=1))  # rival purged: not live...
    log.publish("r", 2, RIVAL, "fresh", T0 + timedelta(seconds=2))  # ...except what came after
    log.purge("p1", ACME, T0 + timedelta(seconds=3))
    log.publish("a", 3, ACME, "after", T0 + timedelta(seconds=4))  # acme is back: live
    mine, shared = erasure_candidates(log.state, log.state.purges["p1"])
    assert mine == {_digest("mine"), _digest("shared"), _digest("config")}
    assert shared == {_digest("config")}  # the version published after the purge holds it
    assert pending_erasures(log.state) == ["p-rival", "p1"]


def test_erase_deletes_keeps_recent_uploads_and_is_decided_once(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path)
    log = Log()
    old = blobs.put(b"old weights")
    recent = blobs.put(b"recent weights")
    config = blobs.put(b"config")
    then = (T0 - timedelta(hours=1)).timestamp()
    for digest in (old, config):
        os.utime(blobs.path_of(digest), (then, then))
    for n, digest in enumerate((old, recent)):
        log.add(AdapterVersionPublished(
            adapter_id="a", version=n + 1, label=f"v{n}", base_model="b",
            base_model_digest=_digest("base"), sha256=digest, config_sha256=config,
            size_bytes=1, rank=4, lora_alpha=8.0, target_modules=["q_proj"], dtype="float16",
            owner="o"), "adapter/a", ACME, T0 - timedelta(hours=2))
    now = datetime.now(UTC)
    log.purge("p1", ACME, now)
    decision = _erase(log.state, blobs, "p1", timedelta(seconds=60))
    payload = decision.payload
    assert isinstance(payload, TenantBlobsDeleted)
    assert payload.deleted == sorted([old, config]) and payload.kept == [recent]
    assert not blobs.exists(old) and not blobs.exists(config) and blobs.exists(recent)
    assert decision.stream == tenant_stream(ACME) and decision.seq == 2
    log.state.apply(Envelope.new(payload, stream=decision.stream, seq=decision.seq,
                                 actor="registry/erasure", tenant=ACME))
    assert log.state.purges["p1"].blobs == payload and pending_erasures(log.state) == []
    with pytest.raises(Exception, match="already erased"):
        _erase(log.state, blobs, "p1", timedelta(0))


@pytest.mark.slow
def test_purge_erases_the_tenants_blobs_through_the_api(settings: Settings,
                                                        tmp_path: Path) -> None:
    reg = registry_settings(settings, tmp_path / "blobs", blob_erasure_grace_s=0.0)
    blobs = LocalBlobStore(tmp_path / "blobs")
    shared, mine = build_adapter(seed=1), build_adapter(seed=2)
    running = RunningRegistry(reg).start()
    try:
        with running.client("admin") as admin:
            register_base(admin)
            assert publish(admin, "acme-shared", shared, "v1").status_code == 201
            assert publish(admin, "acme-mine", mine, "v1").status_code == 201
            rival = {"org": RIVAL.org, "team": RIVAL.team, "project": RIVAL.project}
            assert publish(admin, "rival-copy", shared, "v1", **rival).status_code == 201
            with running.node.state_lock:
                digests = {a: (v.published.sha256, v.published.config_sha256)
                           for a in ("acme-shared", "acme-mine", "rival-copy")
                           for v in running.node.state.adapters[a].versions.values()}
            assert digests["acme-shared"] == digests["rival-copy"]
            time.sleep(0.05)
            response = admin.post("/v1/tenants/acme/search/prod/purge", json={})
            assert response.status_code == 202, response.text
            purge = admin.get(f"/v1/purges/{response.json()['purge_id']}").json()
        exclusive = set(digests["acme-mine"]) - set(digests["rival-copy"])
        assert purge["blobs_deleted"] == sorted(exclusive) and mine.sha256 in exclusive
        assert sorted(purge["blobs_kept"]) == sorted(set(digests["rival-copy"]))
        assert not any(blobs.exists(d) for d in exclusive)
        assert all(blobs.exists(d) for d in digests["rival-copy"])
    finally:
        running.stop()
    again = RunningRegistry(reg).start()  # the start-up resumption finds nothing to do
    try:
        time.sleep(1.0)
    finally:
        again.stop()
    erased = [e for e in domain_events(reg) if e.type == "TenantBlobsDeleted"]
    assert len(erased) == 1 and erased[0].tenant == ACME
    assert erased[0].payload.deleted == sorted(exclusive)
