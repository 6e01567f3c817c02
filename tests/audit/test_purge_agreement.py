"""The registry's purge status equals the `purge_proofs` view for every purge.

One log, two readers, one rule (`services/catalog/purge.py`): the real registry decides
the purges (listing the live workers in each request) and answers GET /v1/purges/{id};
the projector folds the same events into PostgreSQL and the view answers. Acks arrive on
time, late, with references still held, repeated, and from a worker nobody expected; and
a purge is met only once its blobs are erased: two purges whose erasure is missing or
late (written as a registry that crashed before erasing, or erased after the deadline,
would have written them) are pending and missed for both readers.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text

from services.audit.projector import AuditProjector
from services.catalog.state import tenant_stream
from services.config import Settings
from services.contracts.events import (
    Envelope,
    TenantBlobsDeleted,
    TenantPurged,
    TenantPurgeRequested,
    TenantRef,
    WorkerHeartbeat,
    uuid7,
)
from services.eventlog import EventProducer
from tests.registry.artifacts import LLAMA_DIGEST
from tests.registry.conftest import RunningRegistry, registry_settings
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

TENANTS = [TenantRef(org="acme", team="search", project=p) for p in "abcdefg"]


@pytest.fixture
def site(migrated_settings: Settings, db_engine: Engine,
         tmp_path: Path) -> Iterator[tuple[RunningRegistry, AuditProjector]]:
    settings = registry_settings(migrated_settings, tmp_path / "blobs",
                                 audit_signing_key="33" * 32, audit_kek="44" * 32)
    running = RunningRegistry(settings).start()
    projector = AuditProjector(running.settings, db_engine)
    yield running, projector
    projector.close()
    running.stop()


class Workers:
    """Fake workers writing heartbeats and TenantPurged acks with chosen timestamps."""

    def __init__(self, producer: EventProducer) -> None:
        self.producer = producer
        self.seqs: dict[str, int] = {}

    def send(self, worker: str, payload: Any, at: datetime | None = None,
             tenant: TenantRef | None = None) -> None:
        self.seqs[worker] = self.seqs.get(worker, 0) + 1
        self.producer.publish(Envelope.new(payload, stream=f"worker/{worker}",
                                           seq=self.seqs[worker], actor=worker,
                                           tenant=tenant, occurred_at=at))

    def heartbeat(self, worker: str) -> None:
        self.send(worker, WorkerHeartbeat(worker_id=worker, address="127.0.0.1:1",
                                          base_model="tiny-llama",
                                          base_model_digest=LLAMA_DIGEST))

    def ack(self, worker: str, purge: dict, *, late: bool = False,
            refcounts_zero: bool = True) -> None:
        requested = datetime.fromisoformat(purge["requested_at"])
        at = (requested + timedelta(seconds=purge["deadline_s"] + 5) if late
              else requested + timedelta(milliseconds=100))
        self.send(worker, TenantPurged(worker_id=worker, purge_id=purge["purge_id"],
                                       kv_blocks_freed=2, adapters_unloaded=1,
                                       refcounts_zero=refcounts_zero), at=at)


def _purge(client: Any, tenant: TenantRef, deadline_s: float) -> dict:
    response = client.post(f"/v1/tenants/{tenant.org}/{tenant.team}/{tenant.project}/purge",
                           json={"deadline_s": deadline_s})
    assert response.status_code == 202, response.text
    body: dict = response.json()
    return body


def _view(engine: Engine) -> dict[str, dict]:
    with engine.connect() as conn:
        return {r.purge_id: dict(r._mapping) for r in conn.execute(text(
            "SELECT purge_id, status, workers_expected, workers_done, workers_acked, "
            "blobs_erased_at FROM purge_proofs"))}


def _registry_purge(producer: EventProducer, tenant: TenantRef, deadline_s: float,
                    erased_after_s: float | None) -> dict:
    """A purge as the registry writes it, with its erasure `erased_after_s` later (None:
    never, like a registry that crashed before erasing and has not restarted)."""
    purge_id = uuid7().hex
    at = datetime.now(UTC)
    stream = tenant_stream(tenant)
    producer.publish(Envelope.new(TenantPurgeRequested(
        purge_id=purge_id, deadline_s=deadline_s, expected_workers=["w1", "w2"]),
        stream=stream, seq=1, actor="admin", tenant=tenant, occurred_at=at))
    if erased_after_s is not None:
        producer.publish(Envelope.new(TenantBlobsDeleted(purge_id=purge_id), stream=stream,
                                      seq=2, actor="registry/erasure", tenant=tenant,
                                      occurred_at=at + timedelta(seconds=erased_after_s)))
    return {"purge_id": purge_id, "requested_at": at.isoformat(), "deadline_s": deadline_s,
            "deadline": (at + timedelta(seconds=deadline_s)).isoformat()}


def test_registry_and_view_agree_on_every_purge(
        site: tuple[RunningRegistry, AuditProjector], db_engine: Engine) -> None:
    registry, projector = site
    with EventProducer(registry.settings, client_id="fake-workers") as producer, \
            registry.client("admin") as client:
        workers = Workers(producer)
        nobody = _purge(client, TENANTS[4], 3600)  # no worker alive yet: nothing to clear
        for worker in ("w1", "w2"):
            workers.heartbeat(worker)
        wait_for(lambda: len(registry.node.state.heartbeats) >= 2, 10,
                 message="both workers' heartbeats folded")
        on_time = _purge(client, TENANTS[0], 3600)
        late = _purge(client, TENANTS[1], 0.5)
        held = _purge(client, TENANTS[2], 3600)
        repeated = _purge(client, TENANTS[3], 3600)
        assert on_time["expected_workers"] == ["w1", "w2"] and nobody["expected_workers"] == []
        unerased = _registry_purge(producer, TENANTS[5], 3600, None)
        erased_late = _registry_purge(producer, TENANTS[6], 0.5, 5.0)

        workers.ack("w1", on_time)
        workers.ack("w2", on_time)
        workers.ack("w1", late, late=True)  # after its deadline: does not count
        workers.ack("w2", late)
        workers.ack("w1", held, refcounts_zero=False)  # references still held: not yet
        workers.ack("w3", held)  # a worker the request did not list: does not count
        workers.ack("w2", held)
        workers.ack("w1", repeated, refcounts_zero=False)
        workers.ack("w1", repeated)  # a later ack with refcounts at zero counts
        workers.ack("w2", repeated)
        workers.ack("w2", repeated)  # and a duplicate changes nothing
        for worker in ("w1", "w2"):  # every ack in time: only the blobs are missing or late
            workers.ack(worker, unerased)
            workers.ack(worker, erased_late)
    due = max(datetime.fromisoformat(late["deadline"]),
              datetime.fromisoformat(erased_late["deadline"]))
    wait_for(lambda: datetime.now(UTC) > due, 10,  # `late` is past due: missed, not pending
             message="the short deadlines past")

    expected = {"met": {nobody["purge_id"], on_time["purge_id"], repeated["purge_id"]},
                "missed": {late["purge_id"], erased_late["purge_id"]},
                "pending": {held["purge_id"], unerased["purge_id"]}}
    ids = set().union(*expected.values())

    def both_complete() -> tuple[dict[str, dict], dict[str, dict]] | None:
        projector.project_batch(timeout=0.2)
        view = _view(db_engine)
        with registry.client("admin") as client:
            answers = {i: client.get(f"/v1/purges/{i}").json() for i in ids}
        acked = sum(len(a["acks"]) for a in answers.values())
        done = ids <= set(view) and acked == 15 and sum(
            len(v["workers_acked"]) for v in view.values()) == 13
        return (view, answers) if done else None

    view, answers = wait_for(both_complete, 60, interval_s=0,
                             message="every purge and ack in the registry and the view")
    for purge_id in ids:
        assert answers[purge_id]["status"] == view[purge_id]["status"], purge_id
        assert answers[purge_id]["expected_workers"] == view[purge_id]["workers_expected"]
        counted = sorted({a["worker_id"] for a in answers[purge_id]["acks"]
                          if a["on_time"] and a["refcounts_zero"]
                          and a["worker_id"] in answers[purge_id]["expected_workers"]})
        assert counted == view[purge_id]["workers_done"], purge_id
        erased_at = answers[purge_id]["blobs_erased_at"]
        assert (datetime.fromisoformat(erased_at) if erased_at else None) == \
            view[purge_id]["blobs_erased_at"], purge_id
    assert {s: {i for i in ids if view[i]["status"] == s} for s in expected} == expected
    assert view[held["purge_id"]]["workers_acked"] == ["w1", "w2", "w3"]
    assert view[held["purge_id"]]["workers_done"] == ["w2"]
    assert view[unerased["purge_id"]]["workers_done"] == ["w1", "w2"]
    assert view[unerased["purge_id"]]["blobs_erased_at"] is None
    assert view[on_time["purge_id"]]["blobs_erased_at"] is not None
