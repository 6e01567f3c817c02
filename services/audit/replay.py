"""`audit replay-to-kafka`: refill an empty broker from the audit store.

Disaster recovery for a lost in-memory dev broker or a rebuilt cluster: every stored
event is produced again with its original bytes (hence its original event_id), key
(its stream) and partition, in the order they were first recorded (which is chain order
within each partition), so any consumer folds the
same log and deduplicates by event_id whatever it had already seen. The chain is
checked while reading, so a tampered store is not republished.

Personal fields are opened with their tenants' keys first, so the log gets the bytes it
had; a field whose key a purge destroyed is republished as `[erased]`: the erased data
does not come back through the log either.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from sqlalchemy import Engine, select

from services.audit.chain import GENESIS, link
from services.audit.keys import KeyVault, load_kek
from services.audit.sealing import unseal
from services.audit.tables import events
from services.config import Settings
from services.contracts.codec import decode
from services.eventlog.client import consumer_config, producer_config
from services.eventlog.errors import BrokerUnavailable, EventLogError
from services.eventlog.topics import ensure_topics, topic_for

log = logging.getLogger(__name__)


class ReplayRefused(RuntimeError):
    """The target is not empty, too small, or the store fails its chain check."""


@dataclass
class ReplayReport:
    produced: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.produced.values())


def _target_sizes(settings: Settings) -> dict[str, tuple[int, int]]:
    """Topic → (partitions, records present); the count is from watermarks (a hint)."""
    consumer = Consumer(consumer_config(settings, "loraplane-audit-replay-check"))
    try:
        metadata = consumer.list_topics(timeout=15)
        sizes = {}
        for topic in settings.topics:
            partitions = sorted(metadata.topics[topic].partitions)
            present = 0
            for p in partitions:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                present += max(0, high - low)
            sizes[topic] = (len(partitions), present)
        return sizes
    finally:
        consumer.close()


def replay_to_kafka(settings: Settings, engine: Engine, *, allow_nonempty: bool = False,
                    check_chain: bool = True) -> ReplayReport:
    ensure_topics(settings)
    sizes = _target_sizes(settings)
    if not allow_nonempty and any(present for _, present in sizes.values()):
        raise ReplayRefused(f"target topics are not empty ({sizes}); pass --allow-nonempty "
                            "to append anyway (consumers deduplicate by event_id)")
    producer = Producer(producer_config(settings, "loraplane-audit-replay"))
    failures: list[str] = []

    def delivered(error: KafkaError | None, message: Message) -> None:
        if error is not None:
            failures.append(error.str())

    report = ReplayReport()
    vault = KeyVault(engine, load_kek(settings))
    heads: dict[tuple[str, int], bytes] = {}
    with engine.connect() as conn:
        rows = conn.execute(select(events.c.topic, events.c.partition, events.c.chain_index,
                                   events.c.stream, events.c.canonical, events.c.prev_hash,
                                   events.c.hash, events.c.type, events.c.event_id)
                            .order_by(events.c.id)).yield_per(2000)
        for row in rows:
            canonical = bytes(row.canonical)
            key = (row.topic, row.partition)
            if check_chain:
                prev = heads.get(key, GENESIS)
                if bytes(row.prev_hash) != prev or bytes(row.hash) != link(prev, canonical):
                    raise ReplayRefused(f"{row.topic}[{row.partition}] chain index "
                                        f"{row.chain_index} fails the chain check; "
                                        "run `loraplane audit verify`")
                heads[key] = bytes(row.hash)
            canonical = unseal(row.type, row.event_id, canonical, vault)
            envelope = decode(canonical)  # nothing is produced unvalidated
            topic = topic_for(envelope, settings)
            if row.partition >= sizes[topic][0]:
                raise ReplayRefused(f"{topic} has {sizes[topic][0]} partitions; the store "
                                    f"needs partition {row.partition}")
            while True:
                try:
                    producer.produce(topic, key=row.stream.encode(), value=canonical,
                                     partition=row.partition, on_delivery=delivered,
                                     headers={"type": envelope.type})
                    break
                except BufferError:
                    producer.poll(0.5)
            producer.poll(0)
            report.produced[topic] += 1
            if failures:
                break
    remaining = producer.flush(60)
    if remaining:
        raise BrokerUnavailable(f"{remaining} replayed event(s) not acknowledged")
    if failures:
        raise EventLogError(f"replay failed: {failures[0]}")
    log.info("replayed %d events: %s", report.total, dict(report.produced))
    return report
