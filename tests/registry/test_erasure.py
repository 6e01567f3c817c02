"""A tenant purge erases the tenant's adapter blobs, keeps what a live tenant still
references or what an upload may be about to reference, and records it on the log."""

from __future__ import annotations

import hashlib
import io
import os
import time
from dataclasses import replace
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
    uuid7,
)
from services.eventlog import EventProducer
from services.registry import erasure
from services.registry.blobstore import LocalBlobStore
from services.registry.domain import ArtifactFacts
from services.registry.erasure import _erase, erasure_candidates, pending_erasures, restore_upload
from tests.registry.artifacts import build_adapter
from tests.registry.conftest import (
    TENANT,
    RunningRegistry,
    domain_events,
    publish,
    register_base,
    registry_settings,
)
from tests.waiting import wait_for

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


def test_erase_deletes_every_purged_file_however_recent_and_is_decided_once(
        tmp_path: Path) -> None:
    """No grace period: a purged version's file written a moment ago (an upload of the same
    bytes in flight, say) is erased too; only what a live version holds stays."""
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
    log.add(AdapterVersionPublished(  # published after the purge: it keeps the config
        adapter_id="a", version=3, label="v3", base_model="b", base_model_digest=_digest("base"),
        sha256=_digest("new"), config_sha256=config, size_bytes=1, rank=4, lora_alpha=8.0,
        target_modules=["q_proj"], dtype="float16", owner="o"), "adapter/a", ACME,
        now + timedelta(seconds=1))
    decision = _erase(log.state, blobs, "p1")
    payload = decision.payload
    assert isinstance(payload, TenantBlobsDeleted)
    assert payload.deleted == sorted([old, recent]) and payload.kept == [config]
    assert not blobs.exists(old) and not blobs.exists(recent) and blobs.exists(config)
    assert decision.stream == tenant_stream(ACME) and decision.seq == 2
    log.state.apply(Envelope.new(payload, stream=decision.stream, seq=decision.seq,
                                 actor="registry/erasure", tenant=ACME))
    assert log.state.purges["p1"].blobs == payload and pending_erasures(log.state) == []
    with pytest.raises(Exception, match="already erased"):
        _erase(log.state, blobs, "p1")


def test_an_upload_whose_bytes_a_purge_erased_meanwhile_is_stored_again(
        tmp_path: Path) -> None:
    """The publish command re-stores its own files when an erasure ran between the upload
    and the command (both under the command lock), so no version points at nothing."""
    blobs = LocalBlobStore(tmp_path)
    files = build_adapter(seed=9)
    facts = ArtifactFacts(hashlib.sha256(files.weights).hexdigest(),
                          hashlib.sha256(files.config).hexdigest(), len(files.weights), 4, 8.0,
                          ("q_proj",), "float32")
    weights = io.BytesIO(files.weights)
    restore_upload(blobs, facts, files.config, weights)  # the erasure ran: both gone
    assert b"".join(blobs.read(facts.sha256)) == files.weights
    assert b"".join(blobs.read(facts.config_sha256)) == files.config
    written = blobs.modified_at(facts.sha256)
    restore_upload(blobs, facts, files.config, weights)  # nothing erased: nothing written
    assert blobs.modified_at(facts.sha256) == written
    with pytest.raises(RuntimeError, match="hash to"):
        restore_upload(blobs, replace(facts, sha256="0" * 64), files.config, weights)


@pytest.mark.slow
def test_purge_erases_the_tenants_blobs_through_the_api(
        settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = registry_settings(settings, tmp_path / "blobs")
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
            response = admin.post("/v1/tenants/acme/search/prod/purge", json={})
            assert response.status_code == 202, response.text
            purge_id = response.json()["purge_id"]
            purge = admin.get(f"/v1/purges/{purge_id}").json()
            exclusive = set(digests["acme-mine"]) - set(digests["rival-copy"])
            assert purge["blobs_deleted"] == sorted(exclusive) and mine.sha256 in exclusive
            assert sorted(purge["blobs_kept"]) == sorted(set(digests["rival-copy"]))
            assert not any(blobs.exists(d) for d in exclusive)
            assert all(blobs.exists(d) for d in digests["rival-copy"])
            assert purge["status"] == "met" and purge["blobs_erased_at"] is not None
            # the registry shows the versions as purged, and refuses to serve them again
            version = admin.get("/v1/adapters/acme-mine/versions/1").json()
            assert (version["purged"], version["purged_by"]) == (True, purge_id)
            assert admin.get("/v1/adapters/acme-mine").json()["purged_versions"] == [1]
            switched = admin.put("/v1/adapters/acme-mine/active", json={"version": 1})
            assert switched.status_code == 409 and purge_id in switched.json()["detail"]
            # its bytes back on disk (an erasure not run yet): the blob route still refuses
            blobs.put(mine.weights)
            with running.client("worker") as worker:
                refused = worker.get(f"/v1/blobs/sha256/{mine.sha256}")
                assert refused.status_code == 404, refused.text
                assert refused.json()["code"] == "purged"
                assert purge_id in refused.json()["detail"]
                shared_sha = digests["rival-copy"][0]
                assert worker.get(f"/v1/blobs/sha256/{shared_sha}").status_code == 200
                # published again after the purge: a live version, served as usual
                assert publish(admin, "acme-mine", mine, "v2").status_code == 201
                again = worker.get(f"/v1/blobs/sha256/{mine.sha256}")
                assert again.status_code == 200 and again.content == mine.weights
            assert admin.put("/v1/adapters/acme-mine/active",
                             json={"version": 2}).status_code == 200
    finally:
        running.stop()
    looked: list[list[str]] = []
    monkeypatch.setattr(erasure, "pending_erasures",
                        lambda state: looked.append(pending_erasures(state)) or looked[-1])
    again = RunningRegistry(reg).start()  # the start-up resumption finds nothing to do
    try:
        assert wait_for(lambda: looked, 30, message="the start-up resumption") == [[]]
    finally:
        again.stop()  # joins the resumption: it wrote whatever it was going to
    erased = [e for e in domain_events(reg) if e.type == "TenantBlobsDeleted"]
    assert len(erased) == 1 and erased[0].tenant == ACME
    assert erased[0].payload.deleted == sorted(exclusive)


def test_taking_the_writer_role_erases_what_earlier_writers_left_and_only_that(
        settings: Settings, tmp_path: Path) -> None:
    """A purge committed with no erasure (a writer that crashed in between) is erased when
    an instance takes the role; one committed later by another producer is not, however
    long the instance runs: erasing it is that purge's own request's work."""
    reg = registry_settings(settings, tmp_path / "blobs")
    left, later = TenantRef(org="left", team="t", project="p"), RIVAL

    def inject(producer: EventProducer, tenant: TenantRef) -> str:
        purge_id = uuid7().hex
        producer.publish(Envelope.new(TenantPurgeRequested(purge_id=purge_id, deadline_s=60),
                                      stream=tenant_stream(tenant), seq=1, actor="admin",
                                      tenant=tenant))
        return purge_id

    with EventProducer(reg, client_id="crashed-writer") as producer:
        before = inject(producer, left)
        running = RunningRegistry(reg, registry_id="r-after").start()
        try:
            after = inject(producer, later)
            with running.client("admin") as admin:
                wait_for(lambda: admin.get(f"/v1/purges/{after}").status_code == 200, 30,
                         message="the later purge folded")
                erased = wait_for(
                    lambda: admin.get(f"/v1/purges/{before}").json()["blobs_erased_at"], 30,
                    message="the earlier purge erased on taking the role")
                assert erased is not None
                time.sleep(1.0)  # well past the resumer's poll: it had its chance
                assert admin.get(f"/v1/purges/{after}").json()["blobs_erased_at"] is None
        finally:
            running.stop()
    erasures = [e.payload.purge_id for e in domain_events(reg)
                if e.type == "TenantBlobsDeleted"]
    assert erasures == [before]
