"""Contract of the log follower (`services/eventlog/follower.py`), on real brokers.

Any fold works with it; these tests use a small one that records what it was given, so
each promise is checked on its own: ready means everything committed before the start
is folded, snapshots bound the replay and are never trusted across logs, a fold error
halts, an operator can skip the event, types not wanted are never decoded.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient

from services.config import Settings
from services.contracts.events import AdapterDisabled, Envelope, TenantRef, WorkerHeartbeat
from services.eventlog import EventProducer, Record
from services.eventlog.follower import FollowerHalted, LogFollower
from services.eventlog.topics import ensure_topics
from tests.conftest import drop_isolation, isolated_settings
from tests.eventlog.test_plumbing import records_on
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

TENANT = TenantRef(org="acme", team="ml", project="support")


class Recorder:
    """A fold that keeps the event ids it took, in order; `poison` makes it raise."""

    wanted_types = frozenset({"AdapterDisabled", "WorkerHeartbeat"})

    def __init__(self, version: str = "recorder/1") -> None:
        self.fold_version = version
        self.ids: list[str] = []
        self.poison: set[str] = set()

    def apply(self, record: Record) -> None:
        event_id = str(record.envelope.event_id)
        if event_id in self.poison:
            raise ValueError("this fold cannot take it")
        self.ids.append(event_id)

    def dump(self) -> Any:
        return {"ids": list(self.ids)}

    def load(self, document: Any | None) -> None:
        self.ids = list(document["ids"]) if document else []


def disabled(n: int, adapter: str = "bot") -> Envelope:
    return Envelope.new(AdapterDisabled(adapter_id=f"{adapter}{n % 5}", version=1 + n,
                                        reason="t"),
                        stream=f"adapter/{adapter}{n % 5}", seq=1 + n // 5, actor="t",
                        tenant=TENANT)


def heartbeat(n: int) -> Envelope:
    return Envelope.new(WorkerHeartbeat(worker_id=f"w{n % 2}", address="a", base_model="b",
                                        base_model_digest="0" * 64),
                        stream=f"heartbeat/w{n % 2}", seq=1 + n, actor=f"w{n % 2}")


def produce(settings: Settings, events: list[Envelope]) -> None:
    with EventProducer(settings) as producer:
        producer.publish_all([(e, None, None) for e in events])


def follow(settings: Settings, fold: Recorder, name: str | None = "reader"
           ) -> LogFollower:
    follower = LogFollower(settings, fold, reader_id=f"follower-{uuid.uuid4().hex[:6]}",
                           snapshot_name=name)
    follower.start()
    assert follower.wait_ready(30), follower.status()
    return follower


@pytest.fixture
def log_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"snapshot_every_events": 10**9,
                                       "snapshot_every_s": 3600})


@pytest.fixture(params=["apache", "tansu"])
def broker_settings(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Settings]:
    bootstrap = request.getfixturevalue(
        "kafka_bootstrap" if request.param == "apache" else "tansu_bootstrap")
    value = isolated_settings(bootstrap, None, kafka_broker=request.param,
                              snapshot_dir=tmp_path / "snapshots")
    yield value
    drop_isolation(value, None)


def test_ready_means_everything_before_the_start_is_folded_and_nothing_is_written(
        broker_settings: Settings) -> None:
    events = [disabled(n) for n in range(40)] + [heartbeat(n) for n in range(6)]
    produce(broker_settings, events)
    fold = Recorder()
    follower = follow(broker_settings, fold, name=None)
    try:
        with follower.lock:
            assert sorted(fold.ids) == sorted(str(e.event_id) for e in events)
        late = disabled(99)
        produce(broker_settings, [late])
        assert follower.sync(10)
        with follower.lock:
            assert fold.ids[-1] == str(late.event_id)
    finally:
        follower.stop()
    again = Recorder()
    follower = follow(broker_settings, again, name=None)  # a second reader sees no more
    follower.stop()
    assert len(again.ids) == len(events) + 1


def test_snapshot_bounds_the_replay_and_equals_a_full_one(log_settings: Settings) -> None:
    produce(log_settings, [disabled(n) for n in range(30)] + [heartbeat(n) for n in range(3)])
    first = Recorder()
    follow(log_settings, first).stop()  # a clean stop writes the snapshot
    snapshot = json.loads((log_settings.snapshot_root / "reader.snapshot.json").read_text())
    assert snapshot["fold_version"] == "recorder/1" and len(snapshot["state"]["ids"]) == 33
    assert set(snapshot["topics"]) == {log_settings.adapter_events_topic,
                                       log_settings.worker_events_topic}
    tail = [disabled(n) for n in range(30, 37)]
    produce(log_settings, tail)

    resumed = Recorder()
    follower = follow(log_settings, resumed)
    status = follower.status()
    follower.stop()
    assert status["started_from"] == "snapshot"
    # the tail, plus the liveness topic, which snapshots do not cover (read in full)
    assert status["folded"] == len(tail) + 3
    full = Recorder()
    follow(log_settings, full, name=None).stop()
    assert sorted(set(resumed.ids)) == sorted(set(full.ids))
    assert len(resumed.ids) == len(full.ids) + 3  # the heartbeats folded twice: idempotent


def recreate_topics(settings: Settings) -> None:
    drop_isolation(settings, None)
    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap})
    wait_for(lambda: not set(settings.topics) & set(admin.list_topics(timeout=10).topics), 30,
             interval_s=0.2, message="the topics deleted")
    # KafkaException: still being deleted
    wait_for(lambda: ensure_topics(settings) or True, 30, interval_s=0.5,
             ignoring=(KafkaException,), message="the topics created again")


def test_a_snapshot_of_another_fold_or_another_log_is_ignored(log_settings: Settings) -> None:
    produce(log_settings, [disabled(n) for n in range(10)])
    follow(log_settings, Recorder()).stop()

    other_fold = Recorder(version="recorder/2")
    follower = follow(log_settings, other_fold)
    assert follower.status()["started_from"] == "beginning"
    follower.stop()

    path = log_settings.snapshot_root / "reader.snapshot.json"
    follow(log_settings, Recorder()).stop()
    document = json.loads(path.read_text())
    path.write_text(json.dumps({**document, "cluster_id": "another-cluster"}))
    follower = follow(log_settings, Recorder())
    assert follower.status()["started_from"] == "beginning"
    follower.stop()

    # the topics deleted and created again with other events: same names, same cluster
    recreate_topics(log_settings)
    fresh = [disabled(n, adapter="new") for n in range(12)]
    produce(log_settings, fresh)
    recreated = Recorder()
    follower = follow(log_settings, recreated)
    follower.stop()
    assert follower.status()["started_from"] == "beginning"
    assert sorted(recreated.ids) == sorted(str(e.event_id) for e in fresh)

    (log_settings.snapshot_root / "reader.snapshot.json").write_bytes(b"{not json")
    broken = Recorder()
    follow(log_settings, broken).stop()
    assert len(broken.ids) == len(fresh)


def test_a_fold_error_halts_until_the_operator_skips_the_event(log_settings: Settings) -> None:
    before, bad, after = [disabled(n) for n in range(5)], disabled(5), disabled(6)
    produce(log_settings, [*before, bad, after])
    fold = Recorder()
    fold.poison = {str(bad.event_id)}
    follower = LogFollower(log_settings, fold, reader_id="halting", snapshot_name="halting")
    follower.start()
    assert not follower.wait_ready(10)
    halt = follower.halt
    assert halt is not None and halt.event_id == str(bad.event_id)
    assert "cannot fold AdapterDisabled" in halt.reason
    assert "this fold cannot take it" in halt.reason
    with pytest.raises(FollowerHalted):
        follower.wait_applied(halt.topic, halt.partition, halt.offset, 1)
    with pytest.raises(FollowerHalted):
        follower.sync(1)
    follower.stop()
    assert str(bad.event_id) not in fold.ids
    assert not (log_settings.snapshot_root / "halting.snapshot.json").exists()

    skipping = log_settings.model_copy(update={"fold_skip_events": [str(bad.event_id)]})
    fold = Recorder()
    fold.poison = {str(bad.event_id)}
    follower = LogFollower(skipping, fold, reader_id="skipping", snapshot_name="halting")
    follower.start()
    assert follower.wait_ready(20) and follower.halt is None
    follower.stop()
    assert sorted(fold.ids) == sorted(str(e.event_id) for e in [*before, after])


def test_wait_applied_returns_once_the_record_is_folded(log_settings: Settings) -> None:
    fold = Recorder()
    follower = follow(log_settings, fold, name=None)
    try:
        with EventProducer(log_settings) as producer:
            event = disabled(1)
            position = producer.publish(event)
        assert follower.wait_applied(position.topic, position.partition, position.offset, 10)
        with follower.lock:
            assert str(event.event_id) in fold.ids
        assert not follower.wait_applied(position.topic, position.partition,
                                         position.offset + 5, 0.3)
    finally:
        follower.stop()


def test_types_the_fold_does_not_want_are_never_decoded(log_settings: Settings) -> None:
    raw = Producer({"bootstrap.servers": log_settings.kafka_bootstrap})
    # not even valid JSON: a reader that decoded it would dead-letter it
    raw.produce(log_settings.worker_events_topic, key=b"worker/w1", value=b"{garbage",
                headers={"type": "RequestServed"})
    raw.flush(10)
    produce(log_settings, [disabled(1)])
    fold = Recorder()
    follower = follow(log_settings, fold, name=None)
    follower.stop()
    assert len(fold.ids) == 1
    assert records_on(log_settings, log_settings.dead_letter_topic) == 0  # never decoded


def test_readers_share_the_lock_while_the_follower_folds(log_settings: Settings) -> None:
    produce(log_settings, [disabled(n) for n in range(200)])
    fold = Recorder()
    follower = LogFollower(log_settings, fold, reader_id="locked")
    seen: list[int] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            with follower.lock:
                seen.append(len(fold.ids))

    reader = threading.Thread(target=read)
    reader.start()
    follower.start()
    assert follower.wait_ready(30)
    stop.set()
    reader.join()
    follower.stop()
    assert seen == sorted(seen) and len(fold.ids) == 200
