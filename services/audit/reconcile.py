"""`audit verify --against-kafka`: the store and the Kafka log, partition by partition.

The hash chain shows that stored rows were not changed after they were stored; it cannot
show that every event of the log was stored, nor name an event that was deleted from the
store together with its row. Kafka, the system of record, can. For every partition this
walks the log (read_committed, from its low watermark up to the projector's committed
offset) and the stored rows in offset order, side by side, and names:

- `MISSING IN STORE`: an event on the log the store does not hold (a deleted row, or one
  never written), with its event id, type and offset;
- `MISSING ON KAFKA`: a stored event the log does not hold at that offset (a forged row,
  or a log that lost records), above the low watermark;
- `DIFFERS`: both hold the offset but not the same event: another event id, or other
  bytes. The stored form is compared with what sealing the log's record gives: bytes
  outside personal fields must be equal, and each personal field must open (under its
  tenant's key) to the log's value, unless the key was destroyed by a purge.

Not problems, and counted instead: records below the low watermark (retention removed
them from the log, the store keeps them), records past the projector's committed offset
(not projected yet), replay barriers (never stored), dead-lettered records (stored in
`dead_letters`), and a second copy of an event id already stored at another offset (the
projector stores an event once). The liveness topic is not compared: its events are
summarised, never stored one by one.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition
from sqlalchemy import Engine, select

from services.audit.chain import chained_topics
from services.audit.keys import KeyVault
from services.audit.sealing import (
    ERASED,
    SealingError,
    masked,
    personal_literals,
    sealable,
    unseal,
)
from services.audit.tables import consumer_offsets, dead_letters, events
from services.config import Settings
from services.contracts.codec import EventValidationError, decode
from services.eventlog.client import consumer_config
from services.eventlog.errors import BrokerUnavailable

ERASED_MARK = b"\x00erased\x00"
"""What `unseal` puts where a key was destroyed: no log value can be equal to it."""


@dataclass(frozen=True)
class Discrepancy:
    kind: str
    topic: str
    partition: int
    offset: int
    event_id: str | None
    detail: str

    def describe(self) -> str:
        return (f"{self.kind} topic={self.topic} partition={self.partition} "
                f"offset={self.offset} event_id={self.event_id}: {self.detail}")


@dataclass
class ReconcileReport:
    partitions: int = 0
    matched: int = 0
    expired: int = 0
    """Stored events older than the log's retention."""
    pending: int = 0
    """Log records past the projector's committed offset."""
    skipped: int = 0
    """Barriers, dead letters and duplicates of stored events."""
    shredded: int = 0
    """Matched events with a personal field whose key a purge destroyed."""
    problems: list[Discrepancy] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _log_records(consumer: Consumer, topic: str, partition: int, start: int,
                 end: int) -> Iterator[tuple[int, bytes | None]]:
    """(offset, value) of the committed records in [start, end)."""
    if start >= end:
        return
    consumer.assign([TopicPartition(topic, partition, start)])
    # consume() waits its whole timeout unless the batch fills: short waits, and stop at
    # the end offset or at partition EOF (transaction markers leave gaps in offsets)
    stalled = time.monotonic() + 15.0
    while True:
        messages = consumer.consume(500, timeout=0.1)
        if not messages and time.monotonic() > stalled:
            raise BrokerUnavailable(f"{topic}[{partition}]: no records before offset {end}")
        for message in messages:
            stalled = time.monotonic() + 15.0
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    return
                raise BrokerUnavailable(f"{topic}[{partition}]: {error.str()}")
            if message.offset() >= end:
                return
            yield message.offset(), message.value()
            if message.offset() == end - 1:
                return


class _Compare:
    def __init__(self, vault: KeyVault, report: ReconcileReport) -> None:
        self.vault = vault
        self.report = report

    def problem(self, stored: Any, value: bytes) -> str | None:
        """Why the stored row is not the log's record, or None when it is."""
        try:
            envelope = decode(value)
        except EventValidationError as exc:
            return f"the log's record is not a valid event ({exc})"
        if envelope.event_id != stored.event_id:
            return f"the log has event {envelope.event_id} here"
        base, _, _ = sealable(envelope, value)
        kind, event_id, data = stored.type, stored.event_id, bytes(stored.canonical)
        if masked(kind, data) != masked(kind, base):
            return "stored bytes differ from the log's record outside personal fields"
        try:
            opened = unseal(kind, event_id, data, self.vault, erased=ERASED_MARK)
        except SealingError as exc:
            return f"a sealed field does not open: {exc}"
        erased = False
        for (f, i, mine), (_, _, theirs) in zip(personal_literals(kind, opened),
                                                 personal_literals(kind, base), strict=True):
            if mine in (ERASED_MARK, ERASED.encode()) and mine != theirs:
                erased = True
            elif mine != theirs:
                return f"personal field {f} #{i} differs from the log's value"
        self.report.shredded += erased
        return None


def reconcile(settings: Settings, engine: Engine, vault: KeyVault, *,
              consumer: str = "audit") -> ReconcileReport:
    report = ReconcileReport()
    compare = _Compare(vault, report)
    kafka = Consumer(consumer_config(settings, "loraplane-audit-reconcile"))
    try:
        metadata = kafka.list_topics(timeout=15)
        with engine.connect() as conn:
            projected = {(r.topic, r.partition): r.next_offset for r in conn.execute(
                select(consumer_offsets).where(consumer_offsets.c.consumer == consumer))}
            stored_partitions = {(r.topic, r.partition) for r in conn.execute(
                select(events.c.topic, events.c.partition).distinct())}
        keys = set(stored_partitions)
        for topic in chained_topics(settings):
            info = metadata.topics.get(topic)
            keys |= {(topic, p) for p in (info.partitions if info is not None else ())}
        for topic, partition in sorted(keys):
            report.partitions += 1
            low, high = kafka.get_watermark_offsets(TopicPartition(topic, partition),
                                                    timeout=10, cached=False)
            end = min(high, projected.get((topic, partition), 0))
            report.pending += max(0, high - max(end, low))
            _partition(engine, kafka, compare, topic, partition, low, end, report)
    finally:
        kafka.close()
    return report


def _partition(engine: Engine, kafka: Consumer, compare: _Compare, topic: str, partition: int,
               low: int, end: int, report: ReconcileReport) -> None:
    def problem(kind: str, offset: int, event_id: Any, detail: str) -> None:
        report.problems.append(Discrepancy(kind, topic, partition, offset,
                                           str(event_id) if event_id else None, detail))

    with engine.connect() as conn:
        dead = {r.offset for r in conn.execute(
            select(dead_letters.c.offset).where(dead_letters.c.topic == topic,
                                                dead_letters.c.partition == partition))}
        rows = conn.execute(select(events.c.offset, events.c.event_id, events.c.type,
                                   events.c.canonical)
                            .where(events.c.topic == topic, events.c.partition == partition)
                            .order_by(events.c.offset)).yield_per(1000)
        stored = iter(rows)
        row = next(stored, None)
        while row is not None and row.offset < low:
            report.expired += 1
            row = next(stored, None)
        for offset, value in _log_records(kafka, topic, partition, low, end):
            while row is not None and row.offset < offset:
                problem("MISSING ON KAFKA", row.offset, row.event_id,
                        f"stored {row.type} is not on the log")
                row = next(stored, None)
            if row is not None and row.offset == offset:
                if value is not None and bytes(row.canonical) == value:
                    report.matched += 1
                else:
                    why = compare.problem(row, value or b"")
                    if why is None:
                        report.matched += 1
                    else:
                        problem("DIFFERS", offset, row.event_id, why)
                row = next(stored, None)
                continue
            _unstored(conn, offset, value, offset in dead, report, problem)
        while row is not None:
            if row.offset < end:
                problem("MISSING ON KAFKA", row.offset, row.event_id,
                        f"stored {row.type} is not on the log")
            else:
                problem("MISSING ON KAFKA", row.offset, row.event_id,
                        f"stored {row.type} lies past the projector's committed offset {end}")
            row = next(stored, None)


def _unstored(conn: Any, offset: int, value: bytes | None, dead_lettered: bool,
              report: ReconcileReport, problem: Any) -> None:
    """A log record with no stored row at its offset: expected, or missing."""
    if dead_lettered:
        report.skipped += 1
        return
    try:
        document = json.loads(value or b"")
        event_id, kind = document.get("event_id"), document.get("type")
    except (ValueError, AttributeError):
        problem("MISSING IN STORE", offset, None, "an unreadable record was neither stored "
                                                  "nor dead-lettered")
        return
    if kind == "ReplayBarrier":
        report.skipped += 1
        return
    try:
        wanted = uuid.UUID(str(event_id))
    except ValueError:
        wanted = None
    stored_at = None if wanted is None else conn.execute(
        select(events.c.offset).where(events.c.event_id == wanted)).scalar()
    if stored_at is not None and stored_at < offset:
        report.skipped += 1  # a redelivered copy: the event is stored once, at its first
        return
    problem("MISSING IN STORE", offset, event_id, f"{kind} on the log is not in the store")

