"""Refill a broker that kept nothing from the audit store, before any service starts.

Tansu keeps its log in memory, and an Apache Kafka whose log folder was lost is just as
empty; the audit store in PostgreSQL still holds every adapter and worker event. When the
broker's topics are all empty and the store is not, `up` republishes the store with
`audit replay-to-kafka` (original bytes, ids, keys and partitions, in chain order) and
then moves the projector's stored offsets to where those events now sit: the refilled
partitions hold exactly the stored rows, in order, so partition P of topic T ends at the
number of rows stored for it, and the liveness topic (never stored) starts at zero.
Without that the projector would wait past the end of the new, shorter log and skip the
first new events (KAFKA_NOTES: an `assign()` reader keeps its old position).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from confluent_kafka import Consumer, TopicPartition
from sqlalchemy import Engine, func, select, update

from services.audit.replay import replay_to_kafka
from services.audit.tables import consumer_offsets, events
from services.config import Settings
from services.eventlog.client import consumer_config

log = logging.getLogger("loraplane.up")


@dataclass(frozen=True)
class Refill:
    events: int
    by_topic: dict[str, int]


def broker_is_empty(settings: Settings) -> bool:
    """No record in any partition of the fan-out topics (low = high = 0 everywhere)."""
    consumer = Consumer(consumer_config(settings, "loraplane-up-refill-check"))
    try:
        metadata = consumer.list_topics(timeout=15)
        for topic in settings.topics:
            for p in metadata.topics[topic].partitions:
                _, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                if high > 0:
                    return False
        return True
    finally:
        consumer.close()


def stored_events(engine: Engine) -> dict[tuple[str, int], int]:
    """Rows per (topic, partition) in the audit store."""
    with engine.connect() as conn:
        rows = conn.execute(select(events.c.topic, events.c.partition, func.count())
                            .group_by(events.c.topic, events.c.partition))
        return {(r[0], r[1]): int(r[2]) for r in rows}


def refill_if_empty(settings: Settings, engine: Engine) -> Refill | None:
    """Republish the store into an empty broker; None when there was nothing to do."""
    stored = stored_events(engine)
    if not stored or not broker_is_empty(settings):
        return None
    report = replay_to_kafka(settings, engine)
    with engine.begin() as conn:
        for row in conn.execute(select(consumer_offsets.c.consumer, consumer_offsets.c.topic,
                                       consumer_offsets.c.partition)).all():
            conn.execute(update(consumer_offsets)
                         .where(consumer_offsets.c.consumer == row.consumer,
                                consumer_offsets.c.topic == row.topic,
                                consumer_offsets.c.partition == row.partition)
                         .values(next_offset=stored.get((row.topic, row.partition), 0),
                                 updated_at=func.now()))
    log.info("refilled the broker from the audit store: %d events %s", report.total,
             dict(report.produced))
    return Refill(report.total, dict(report.produced))
