"""Contract suite of the event plumbing, run on Apache Kafka and on Tansu."""

from __future__ import annotations

import json
import threading
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from services.config import Settings
from services.contracts.codec import EventValidationError
from services.contracts.events import AdapterDisabled, Envelope, TenantRef
from services.eventlog import EventConsumer, EventProducer
from services.eventlog.consumer import RecentIds

pytestmark = pytest.mark.slow

TENANT = TenantRef(org="acme", team="ml", project="support")


def disabled(version: int, adapter: str = "acme-support", seq: int | None = None) -> Envelope:
    return Envelope.new(AdapterDisabled(adapter_id=adapter, version=version, reason="test"),
                        stream=f"adapter/{adapter}", seq=seq or version, actor="tester",
                        tenant=TENANT)


def read_all(settings: Settings, reader: str, **kwargs: object) -> list[Envelope]:
    seen: list[Envelope] = []
    with EventConsumer(settings, [settings.adapter_events_topic], reader_id=reader,
                       **kwargs) as consumer:  # type: ignore[arg-type]
        consumer.catch_up(lambda r: seen.append(r.envelope))
    return seen


def test_round_trip_keeps_order_per_stream(any_broker_settings: Settings) -> None:
    events = [disabled(v) for v in range(1, 51)]
    with EventProducer(any_broker_settings) as producer:
        positions = [producer.publish(e) for e in events]
    assert len({p.partition for p in positions}) == 1, "one stream must stay in one partition"
    seen = read_all(any_broker_settings, "reader-order")
    assert [e.event_id for e in seen] == [e.event_id for e in events]
    assert seen == events


def records_on(settings: Settings, topic: str) -> int:
    """Every record of `topic`, counted by a plain consumer to partition EOF."""
    probe = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": "count",
                      "enable.partition.eof": True, "isolation.level": "read_uncommitted"})
    try:
        partitions = probe.list_topics(topic, timeout=10).topics[topic].partitions
        probe.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        count, ended = 0, set()
        while len(ended) < len(partitions):
            message = probe.poll(5)
            assert message is not None, "no partition EOF"
            if message.error():
                ended.add(message.partition())
            else:
                count += 1
        return count
    finally:
        probe.close()


def test_catch_up_writes_nothing_and_sees_what_was_committed_before_it(
        any_broker_settings: Settings) -> None:
    settings = any_broker_settings
    with EventProducer(settings) as producer:
        # several events in one batch: Tansu's ListOffsets would then report the end wrong
        producer.publish_all([(disabled(v, adapter=f"a{v % 3}", seq=v), None, None)
                              for v in range(1, 13)])
        seen: list[Envelope] = []
        with EventConsumer(settings, [settings.adapter_events_topic],
                           reader_id="reader-eof") as consumer:
            assert consumer.catch_up(lambda r: seen.append(r.envelope)) == 12
            producer.publish(disabled(13, adapter="a1", seq=13))
            assert consumer.catch_up(lambda r: seen.append(r.envelope)) == 1  # re-catch-up
            assert consumer.catch_up(lambda r: seen.append(r.envelope)) == 0
    assert sorted(e.payload.version for e in seen) == list(range(1, 14))
    assert records_on(settings, settings.adapter_events_topic) == 13  # nothing written


def test_producer_refuses_invalid_event_naming_the_field(any_broker_settings: Settings) -> None:
    document = disabled(1).to_json()
    document["payload"]["version"] = 0
    with EventProducer(any_broker_settings) as producer, \
            pytest.raises(EventValidationError) as err:
        producer.publish(document)
    assert err.value.field == "payload.version"
    assert "payload.version" in str(err.value)
    assert read_all(any_broker_settings, "reader-invalid") == []


def test_invalid_record_goes_to_dead_letters_and_reading_goes_on(
        any_broker_settings: Settings) -> None:
    settings = any_broker_settings
    raw = Producer({"bootstrap.servers": settings.kafka_bootstrap})
    bad_schema = disabled(1).to_json()
    bad_schema["payload"]["adapter_id"] = "NOT A SLUG"
    raw.produce(settings.adapter_events_topic, key=b"adapter/acme-support", value=b"{not json")
    raw.produce(settings.adapter_events_topic, key=b"adapter/acme-support",
                value=json.dumps(bad_schema).encode())
    raw.flush(10)
    with EventProducer(settings) as producer:
        producer.publish(disabled(2))
    seen = read_all(settings, "reader-dlq")
    assert [e.payload.version for e in seen] == [2]

    dlq = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": "unused",
                    "enable.auto.commit": False})
    partitions = dlq.list_topics(settings.dead_letter_topic, timeout=10) \
        .topics[settings.dead_letter_topic].partitions
    dlq.assign([TopicPartition(settings.dead_letter_topic, p, OFFSET_BEGINNING)
                for p in partitions])
    reasons = []
    for _ in range(100):
        message = dlq.poll(0.2)
        if message is not None and message.error() is None:
            reasons.append(dict(message.headers())["reason"].decode())
        if len(reasons) == 2:
            break
    dlq.close()
    assert any("not JSON" in r for r in reasons)
    assert any("payload.adapter_id" in r for r in reasons)


def test_redelivered_event_is_handled_once(any_broker_settings: Settings) -> None:
    event = disabled(1)
    with EventProducer(any_broker_settings) as producer:
        producer.publish(event)
        producer.publish(event)  # a retry after a lost ack lands twice on the log
    seen = read_all(any_broker_settings, "reader-dedupe")
    assert [e.event_id for e in seen] == [event.event_id]


def test_assign_resumes_from_given_offsets(any_broker_settings: Settings) -> None:
    settings = any_broker_settings
    with EventProducer(settings) as producer:
        first = producer.publish(disabled(1))
        producer.publish(disabled(2))
    start = {(first.topic, first.partition): first.offset + 1}
    seen = read_all(settings, "reader-resume", start_offsets=start)
    assert [e.payload.version for e in seen] == [2]


def test_run_loop_stops_cleanly(any_broker_settings: Settings) -> None:
    settings = any_broker_settings
    got: list[Envelope] = []
    stop = threading.Event()
    consumer = EventConsumer(settings, [settings.adapter_events_topic], reader_id="runner")
    thread = threading.Thread(target=consumer.run, args=(lambda r: (got.append(r.envelope),
                                                                     stop.set()), stop))
    thread.start()
    with EventProducer(settings) as producer:
        producer.publish(disabled(1))
    thread.join(30)
    consumer.close()
    assert not thread.is_alive()
    assert [e.payload.version for e in got] == [1]


def test_batch_dedupe_agrees_with_one_by_one_and_stays_bounded() -> None:
    ids = [uuid.UUID(int=n) for n in (1, 2, 1, 3, 4, 2, 5, 1)]
    one_by_one, batched = RecentIds(10), RecentIds(10)
    assert batched.add_all(ids) == [one_by_one.add(i) for i in ids]
    assert batched.add_all(ids[:3]) == [one_by_one.add(i) for i in ids[:3]] == [False] * 3
    small = RecentIds(3)  # trimmed once a batch: within it, every id is remembered
    assert small.add_all(ids) == [True, True, False, True, True, False, True, False]
    assert len(small._ids) == 3
