"""The audit projector: folds both topics into PostgreSQL exactly once.

Each batch (rows, dead letters and the consumer offsets covering them) is one
transaction; on start the projector seeks to the stored offsets, so a crash anywhere
leaves neither a gap nor a duplicate. It needs no consumer group.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, func, select
from sqlalchemy.dialects.postgresql import insert

from services.audit.chain import GENESIS, link
from services.audit.tables import consumer_offsets, dead_letters, events
from services.config import Settings
from services.contracts.codec import canonical_bytes
from services.eventlog.consumer import EventConsumer, Record, Rejected

log = logging.getLogger(__name__)


class AuditProjector:
    def __init__(self, settings: Settings, engine: Engine, *, name: str = "audit") -> None:
        self.settings = settings
        self.engine = engine
        self.name = name
        self._rejected: list[Rejected] = []
        self._heads: dict[tuple[str, int], bytes] = {}
        self._consumer: EventConsumer | None = None
        self.on_batch: Callable[[int], None] | None = None

    def _stored_offsets(self) -> dict[tuple[str, int], int]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(consumer_offsets.c.topic, consumer_offsets.c.partition,
                                       consumer_offsets.c.next_offset)
                                .where(consumer_offsets.c.consumer == self.name))
            return {(r.topic, r.partition): r.next_offset for r in rows}

    def _chain_heads(self) -> dict[tuple[str, int], bytes]:
        last = (select(events.c.topic, events.c.partition, func.max(events.c.id).label("id"))
                .group_by(events.c.topic, events.c.partition).subquery())
        with self.engine.connect() as conn:
            rows = conn.execute(select(events.c.topic, events.c.partition, events.c.hash)
                                .join(last, events.c.id == last.c.id))
            return {(r.topic, r.partition): bytes(r.hash) for r in rows}

    def open(self) -> None:
        self._heads = self._chain_heads()
        self._consumer = EventConsumer(
            self.settings, self.settings.topics, reader_id=f"loraplane-{self.name}",
            start_offsets=self._stored_offsets(), on_rejected=self._rejected.append,
            **{"fetch.wait.max.ms": 50})

    @property
    def consumer(self) -> EventConsumer:
        if self._consumer is None:
            self.open()
        assert self._consumer is not None
        return self._consumer

    def project_batch(self, timeout: float = 0.5) -> int:
        """Poll one batch and commit it with its offsets; returns events written."""
        consumer = self.consumer
        before = consumer.positions()
        records = consumer.poll(timeout=timeout, max_records=self.settings.audit_batch_size)
        positions = consumer.positions()
        if positions == before and not self._rejected:
            return 0
        rejected, self._rejected = self._rejected, []
        with self.engine.begin() as conn:
            known = set()
            if records:
                known = set(conn.execute(select(events.c.event_id).where(
                    events.c.event_id.in_([r.envelope.event_id for r in records]))).scalars())
            heads = dict(self._heads)
            rows = [self._row(record, heads) for record in records
                    if record.envelope.event_id not in known]
            if rows:
                conn.execute(insert(events), rows)
            if rejected:
                conn.execute(insert(dead_letters).on_conflict_do_nothing(
                    constraint="uq_dead_letters_position"), [
                    {"consumer": self.name, "topic": r.topic, "partition": r.partition,
                     "offset": r.offset, "key": r.key, "value": r.value, "reason": r.reason}
                    for r in rejected])
            changed = [{"consumer": self.name, "topic": t, "partition": p, "next_offset": o}
                       for (t, p), o in positions.items() if before.get((t, p)) != o]
            if changed:
                stmt = insert(consumer_offsets)
                conn.execute(stmt.on_conflict_do_update(
                    index_elements=["consumer", "topic", "partition"],
                    set_={"next_offset": stmt.excluded.next_offset, "updated_at": func.now()}),
                    changed)
        self._heads = heads
        if self.on_batch is not None:
            self.on_batch(len(rows))
        return len(rows)

    @staticmethod
    def _row(record: Record, heads: dict[tuple[str, int], bytes]) -> dict[str, Any]:
        envelope = record.envelope
        document = envelope.to_json()
        canonical = canonical_bytes(document)
        key = (record.topic, record.partition)
        prev = heads.get(key, GENESIS)
        heads[key] = link(prev, canonical)
        tenant = envelope.tenant
        return {
            "topic": record.topic, "partition": record.partition, "offset": record.offset,
            "event_id": envelope.event_id, "type": envelope.type,
            "schema_version": envelope.schema_version, "stream": envelope.stream,
            "seq": envelope.seq, "actor": envelope.actor,
            "tenant_org": tenant.org if tenant else None,
            "tenant_team": tenant.team if tenant else None,
            "tenant_project": tenant.project if tenant else None,
            "trace_id": envelope.trace_id, "payload": document["payload"],
            "canonical": canonical, "occurred_at": envelope.occurred_at,
            "prev_hash": prev, "hash": heads[key],
        }

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.project_batch()

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
