"""Exactly-once projection under crashes, and dead letters for bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka import Producer
from sqlalchemy import Connection, Engine, select, text

from services.audit import fold
from services.audit.metrics import LagCollector
from services.audit.projector import AuditProjector, ProjectionConflict
from services.audit.tables import adapter_versions, consumer_offsets, worker_adapters, workers
from services.audit.verify import verify_store
from services.config import Settings
from tests.audit.conftest import count_events, drain, settle
from tests.audit.scenario import mixed, produce, recorded
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def assert_exactly_once(engine: Engine, produced: list) -> None:
    """Every produced event stored once, chains gap-free, state rows not doubled."""
    kept = recorded(produced)
    with engine.connect() as conn:
        ids = [r[0] for r in conn.execute(text("SELECT event_id FROM events"))]
        assert len(ids) == len(set(ids)) == len(kept)
        assert set(ids) == {e.event_id for e in kept}
        gaps = conn.execute(text(
            'SELECT topic, "partition", count(*) AS n, max(chain_index) AS last '
            'FROM events GROUP BY 1, 2')).all()
        assert all(r.n == r.last + 1 for r in gaps), gaps
        traces = conn.execute(text("SELECT count(*) FROM request_traces")).scalar_one()
        expected = sum(len(e.payload.requests) for e in produced if e.type == "RequestServed")
        assert traces == expected
        beats = conn.execute(text("SELECT count(*) FROM worker_heartbeats")).scalar_one()
        assert beats == sum(1 for e in produced if e.type == "WorkerHeartbeat")
    report = verify_store(engine)
    assert report.ok, [p.describe() for p in report.problems]


def test_failure_between_insert_and_commit_loses_and_duplicates_nothing(
        audit_settings: Settings, projector: AuditProjector, db_engine: Engine) -> None:
    produced = list(mixed(1500, seed=3))
    produce(audit_settings, produced)
    settings = audit_settings.model_copy(update={"audit_batch_size": 200})
    crashing = AuditProjector(settings, db_engine)
    batches = 0

    def explode(conn: Connection) -> None:
        nonlocal batches
        batches += 1
        if batches in (2, 5):  # rows, state, checkpoints and offsets all written: now die
            assert conn.execute(text("SELECT count(*) FROM events")).scalar_one() > 0
            raise RuntimeError("injected crash before commit")

    crashing.before_commit = explode
    failures = 0

    def all_stored() -> bool:
        nonlocal failures
        if count_events(db_engine) >= len(recorded(produced)):
            return True
        try:
            crashing.project_batch(timeout=0.2)
        except RuntimeError:
            failures += 1  # project_batch dropped its consumer; the next call re-seeks
        return False

    wait_for(all_stored, 60, interval_s=0, message="every event stored despite the crashes")
    settle(crashing)
    crashing.close()
    assert failures == 2
    assert_exactly_once(db_engine, produced)


def test_a_second_projector_fences_the_first_whose_cached_state_is_then_reloaded(
        audit_settings: Settings, projector: AuditProjector, db_engine: Engine) -> None:
    produced = list(mixed(1200, seed=13))
    produce(audit_settings, produced[:800])
    settings = audit_settings.model_copy(update={"audit_batch_size": 200})
    first, second = AuditProjector(settings, db_engine), AuditProjector(settings, db_engine)
    try:
        while count_events(db_engine) == 0:
            first.project_batch(timeout=0.5)  # `first` now caches state and offsets
        drain(second, len(recorded(produced[:800])))  # the rest, moving offsets and state
        produce(audit_settings, produced[800:])  # whose folding depends on that state
        with pytest.raises(ProjectionConflict):
            first.project_batch(timeout=0.5)
        drain(first, len(recorded(produced)))  # reopened: offsets, state reloaded
    finally:
        first.close()
        second.close()
    assert_exactly_once(db_engine, produced)
    expected = fold.FoldState()
    for envelope in produced:
        fold.apply(expected, envelope)
    expected.take_changes()  # builds each worker's set from its newest heartbeat
    with db_engine.connect() as conn:
        assert {r.worker_id: dict(r._mapping) for r in conn.execute(select(workers))
                } == expected.workers
        assert {(r.adapter_id, r.version): dict(r._mapping)
                for r in conn.execute(select(adapter_versions))} == expected.versions
        assert {(r.worker_id, r.adapter_id, r.version): dict(r._mapping)
                for r in conn.execute(select(worker_adapters))} == {
            (w, *k): row for w, rows in expected.worker_adapters.items()
            for k, row in rows.items()}


def _env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}
    for name in ("database_url", "kafka_bootstrap", "adapter_events_topic",
                 "worker_events_topic", "liveness_topic", "dead_letter_topic", "state_dir",
                 "audit_batch_size", "audit_checkpoint_every", "audit_checkpoint_every_s",
                 "audit_signing_key"):
        env[f"LORAPLANE_{name.upper()}"] = str(getattr(settings, name))
    env["LORAPLANE_LOG_LEVEL"] = "WARNING"
    env["LORAPLANE_AUDIT_METRICS_PORT"] = "0"  # any free port: tests run side by side
    return env


def _count(engine: Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


def _serve(settings: Settings) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "audit"],
                            cwd=REPO, env=_env(settings), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def _stored(engine: Engine, at_least: int, proc: subprocess.Popen[bytes],
            timeout_s: float = 90, table: str = "events") -> int:
    """The row count of `table` once it reaches `at_least`; fails if the service exits."""
    def count() -> int | None:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        n = _count(engine, table)
        return n if n >= at_least else None

    return wait_for(count, timeout_s, interval_s=0.02, message=f"{at_least} rows in {table}")


def _caught_up(settings: Settings, engine: Engine) -> bool:
    """The projector's committed offsets are at the end of every partition (lag 0)."""
    def committed() -> dict[tuple[str, int], int]:
        with engine.connect() as conn:
            return {(r.topic, r.partition): r.next_offset for r in conn.execute(
                select(consumer_offsets.c.topic, consumer_offsets.c.partition,
                       consumer_offsets.c.next_offset)
                .where(consumer_offsets.c.consumer == "audit"))}

    lags = [s.value for f in LagCollector(settings, committed).collect() for s in f.samples]
    return bool(lags) and not any(lags)


def test_sigkill_mid_projection_then_restart_gives_every_event_exactly_once(
        audit_settings: Settings, db_engine: Engine) -> None:
    produced = list(mixed(6000, seed=11))
    produce(audit_settings, produced)
    settings = audit_settings.model_copy(update={"audit_batch_size": 300,
                                                "audit_checkpoint_every": 100})
    kills = []
    for target in (900, 3000):
        proc = _serve(settings)
        seen = _stored(db_engine, target, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        kills.append((seen, count_events(db_engine)))
    proc = _serve(settings)
    try:
        _stored(db_engine, len(recorded(produced)), proc)
        beats = sum(1 for e in produced if e.type == "WorkerHeartbeat")
        _stored(db_engine, beats, proc, table="worker_heartbeats")
        # committed to the end of every partition: nothing more may appear after that
        wait_for(lambda: _caught_up(settings, db_engine), 30, interval_s=0.1,
                 message="the projector's offsets at the end of the log")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    assert all(stored < len(recorded(produced)) for _, stored in kills), kills
    assert count_events(db_engine) == len(recorded(produced))
    assert_exactly_once(db_engine, produced)


def test_invalid_records_are_dead_lettered_with_the_reason_and_projection_goes_on(
        audit_settings: Settings, projector: AuditProjector, db_engine: Engine) -> None:
    good = list(mixed(40, seed=5))
    raw = Producer({"bootstrap.servers": audit_settings.kafka_bootstrap})
    topic = audit_settings.adapter_events_topic
    unknown = good[0].to_json() | {"type": "AdapterTeleported"}
    bad_schema = good[0].to_json()
    bad_schema["payload"]["version"] = 0
    for value in (b"{not json", json.dumps(unknown).encode(), json.dumps(bad_schema).encode()):
        raw.produce(topic, key=b"adapter/x", value=value, partition=0)
    raw.flush(10)
    produce(audit_settings, good)
    drain(projector, len(recorded(good)))
    for value in (b"[1, 2]",):  # and one more after the first batches: a later batch
        raw.produce(topic, key=b"adapter/x", value=value, partition=1)
    raw.flush(10)
    projector.project_batch(timeout=1.0)
    projector.project_batch(timeout=0.5)
    with db_engine.connect() as conn:
        letters = conn.execute(text(
            'SELECT "partition", "offset", reason FROM dead_letters ORDER BY id')).all()
    reasons = [r.reason for r in letters]
    assert len(letters) == 4, reasons
    assert "not JSON" in reasons[0]
    assert "unknown event type 'AdapterTeleported'" in reasons[1]
    assert "payload.version" in reasons[2]
    assert "JSON object" in reasons[3]
    assert_exactly_once(db_engine, good)
