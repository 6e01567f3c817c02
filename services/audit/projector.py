"""The audit projector: folds both topics into PostgreSQL exactly once.

Each batch is one transaction holding the event rows (with their chain links), the
current-state and history rows folded from them, any Merkle checkpoints that fell due,
the chain heads, the dead letters, and the consumer offsets covering all of it. On start
(and after any failure) the projector drops its consumer and seeks to the stored
offsets, so a crash at any point leaves neither a gap nor a duplicate: either the whole
batch and its offsets committed, or none of it did and it is read again.

A transaction-scoped advisory lock plus a check that the stored offsets are still the
ones this process last wrote fences a second projector of the same name: the loser
rolls back and re-reads from the winner's offsets instead of writing a fork. It needs
no consumer group.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from psycopg.types.json import Jsonb
from sqlalchemy import Connection, Engine, Table, delete, func, select, text
from sqlalchemy.dialects.postgresql import JSONB, insert
from sqlalchemy.exc import SQLAlchemyError

from services.audit import fold
from services.audit.chain import GENESIS, link
from services.audit.merkle import CompactRange, checkpoint_message, leaf_hash
from services.audit.signing import CheckpointSigner, load_signer
from services.audit.tables import (
    adapter_versions,
    adapters,
    aliases,
    chain_heads,
    checkpoints,
    consumer_offsets,
    dead_letters,
    events,
    purges,
    request_traces,
    split_history,
    version_history,
    worker_acks,
    worker_adapters,
    worker_heartbeats,
    workers,
)
from services.config import Settings
from services.eventlog.consumer import EventConsumer, Record, Rejected
from services.eventlog.errors import EventLogError

log = logging.getLogger(__name__)

PartitionKey = tuple[str, int]


class ProjectionConflict(RuntimeError):
    """The stored offsets moved under us: another projector of the same name wrote."""


@dataclass
class PartitionHead:
    """One partition's chain head and Merkle compact range after `size` events."""

    head: bytes = GENESIS
    tree: CompactRange = field(default_factory=CompactRange)

    @property
    def size(self) -> int:
        return self.tree.size

    def copy(self) -> PartitionHead:
        return PartitionHead(self.head, CompactRange(self.tree.size, self.tree.frontier))


def _pk(table: Table) -> list[str]:
    return [c.name for c in table.primary_key.columns]


def upsert(conn: Connection, table: Table, rows: Sequence[dict[str, Any]]) -> None:
    """Insert or overwrite whole rows by primary key (keys are unique within `rows`)."""
    if not rows:
        return
    keys = _pk(table)
    stmt = insert(table)
    conn.execute(stmt.on_conflict_do_update(
        index_elements=keys,
        set_={c.name: stmt.excluded[c.name] for c in table.columns if c.name not in keys}),
        list(rows))


def copy_rows(conn: Connection, table: Table | str, rows: Sequence[dict[str, Any]],
              names: Sequence[str] | None = None) -> None:
    """Append rows with COPY, inside the batch's transaction.

    COPY is one round trip for the whole batch; executemany costs one per row, which
    was most of the projection time on a two-core machine.
    """
    if not rows:
        return
    jsonb: set[str] = set()
    if isinstance(table, Table):
        names = names or [c.name for c in table.columns if c.name in rows[0]]
        jsonb = {c.name for c in table.columns if isinstance(c.type, JSONB)}
        table = table.name
    assert names is not None
    columns = ", ".join(f'"{n}"' for n in names)
    raw = conn.connection.driver_connection
    assert raw is not None
    with raw.cursor() as cursor, cursor.copy(f'COPY "{table}" ({columns}) FROM STDIN') as copy:
        if jsonb:
            for row in rows:
                copy.write_row([Jsonb(row[n]) if n in jsonb else row[n] for n in names])
        else:
            for row in rows:
                copy.write_row([row[n] for n in names])


@dataclass(frozen=True)
class PolledBatch:
    """What one poll returned and the consumer positions covering it."""

    records: list[Record]
    positions: dict[PartitionKey, int]
    rejected: list[Rejected]


STAGE = "audit_events_stage"
STAGE_NAMES = ("topic", "partition", "offset", "event_id", "type", "schema_version", "stream",
               "seq", "actor", "tenant_org", "tenant_team", "tenant_project", "trace_id",
               "canonical", "occurred_at", "prev_hash", "hash", "chain_index")
STAGE_COLUMNS = ", ".join(f'"{c}"' for c in STAGE_NAMES)


class AuditProjector:
    def __init__(self, settings: Settings, engine: Engine, *, name: str = "audit",
                 signer: CheckpointSigner | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.name = name
        self.signer = signer
        self._rejected: list[Rejected] = []
        self._heads: dict[PartitionKey, PartitionHead] = {}
        self._committed: dict[PartitionKey, int] = {}
        self._consumer: EventConsumer | None = None
        self.on_batch: Callable[[int], None] | None = None
        self.before_commit: Callable[[Connection], None] | None = None
        """Test hook: runs inside the batch transaction after every write, before commit."""

    # --- state kept in PostgreSQL --------------------------------------------------------

    def _stored_offsets(self, conn: Connection) -> dict[PartitionKey, int]:
        rows = conn.execute(select(consumer_offsets.c.topic, consumer_offsets.c.partition,
                                   consumer_offsets.c.next_offset)
                            .where(consumer_offsets.c.consumer == self.name))
        return {(r.topic, r.partition): r.next_offset for r in rows}

    def _load_heads(self, conn: Connection) -> dict[PartitionKey, PartitionHead]:
        heads = {(r.topic, r.partition): PartitionHead(
                     bytes(r.head_hash), CompactRange.from_bytes(r.size, bytes(r.frontier)))
                 for r in conn.execute(select(chain_heads))}
        sizes = conn.execute(select(events.c.topic, events.c.partition,
                                    func.max(events.c.chain_index).label("last"))
                             .group_by(events.c.topic, events.c.partition))
        for r in sizes:
            key = (r.topic, r.partition)
            if key not in heads or heads[key].size != r.last + 1:
                log.warning("rebuilding chain head of %s[%d] from its rows", *key)
                heads[key] = self._rebuild_head(conn, key)
        return heads

    @staticmethod
    def _rebuild_head(conn: Connection, key: PartitionKey) -> PartitionHead:
        head = PartitionHead()
        rows = conn.execute(select(events.c.hash, events.c.canonical)
                            .where(events.c.topic == key[0], events.c.partition == key[1])
                            .order_by(events.c.chain_index)).yield_per(2000)
        for r in rows:
            head.tree.append(leaf_hash(bytes(r.canonical)))
            head.head = bytes(r.hash)
        return head

    def open(self) -> None:
        if self.signer is None:
            self.signer = load_signer(self.settings)
        with self.engine.connect() as conn:
            self._heads = self._load_heads(conn)
            self._committed = self._stored_offsets(conn)
        self._rejected = []
        self._consumer = EventConsumer(
            self.settings, self.settings.topics, reader_id=f"loraplane-{self.name}",
            start_offsets=self._committed, on_rejected=self._rejected.append,
            **{"fetch.wait.max.ms": 50})

    @property
    def consumer(self) -> EventConsumer:
        if self._consumer is None:
            self.open()
        assert self._consumer is not None
        return self._consumer

    # --- one batch ------------------------------------------------------------------------

    def project_batch(self, timeout: float = 0.5) -> int:
        """Poll one batch and commit it with its offsets; returns events written."""
        try:
            return self.write_batch(self.poll_batch(timeout))
        except BaseException:
            # The consumer's position and dedupe memory are past what was committed:
            # drop them so the next batch starts again from the stored offsets.
            self.close()
            raise

    def poll_batch(self, timeout: float = 0.5) -> PolledBatch:
        """Read (and validate) up to one batch; nothing is committed yet."""
        consumer = self.consumer
        records = consumer.poll(timeout=timeout, max_records=self.settings.audit_batch_size)
        rejected = list(self._rejected)
        self._rejected.clear()
        return PolledBatch(records, consumer.positions(), rejected)

    def write_batch(self, batch: PolledBatch) -> int:
        """Commit one polled batch (rows, state, checkpoints, dead letters, offsets)."""
        records, rejected = batch.records, batch.rejected
        changed = {k: o for k, o in batch.positions.items() if self._committed.get(k) != o}
        if not changed and not rejected and not records:
            return 0
        heads: dict[PartitionKey, PartitionHead] = {}
        with self.engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:lock))"),
                         {"lock": f"loraplane-audit-projector/{self.name}"})
            if self._stored_offsets(conn) != self._committed:
                raise ProjectionConflict(f"offsets of projector {self.name!r} moved: "
                                         "another instance is writing")
            fresh = self._fresh(conn, records)
            rows, due = self._chain(fresh, heads)
            self._insert_events(conn, rows)
            self._fold(conn, fresh)
            self._write_heads(conn, heads, due)
            if rejected:
                conn.execute(insert(dead_letters).on_conflict_do_nothing(
                    constraint="uq_dead_letters_position"), [
                    {"consumer": self.name, "topic": r.topic, "partition": r.partition,
                     "offset": r.offset, "key": r.key, "value": r.value, "reason": r.reason}
                    for r in rejected])
            if changed:
                stmt = insert(consumer_offsets)
                conn.execute(stmt.on_conflict_do_update(
                    index_elements=["consumer", "topic", "partition"],
                    set_={"next_offset": stmt.excluded.next_offset, "updated_at": func.now()}),
                    [{"consumer": self.name, "topic": t, "partition": p, "next_offset": o}
                     for (t, p), o in changed.items()])
            if self.before_commit is not None:
                self.before_commit(conn)
        self._heads.update(heads)
        self._committed.update(changed)
        if self.on_batch is not None:
            self.on_batch(len(rows))
        return len(rows)

    @staticmethod
    def _insert_events(conn: Connection, rows: list[dict[str, Any]]) -> None:
        """COPY the rows into a staging table, then let PostgreSQL derive `payload`.

        Parsing the canonical bytes into jsonb server-side saves the projector a JSON
        parse and a JSON dump per event, and the stored payload is by construction the
        one in the hashed bytes.
        """
        if not rows:
            return
        conn.execute(text(f"CREATE TEMP TABLE IF NOT EXISTS {STAGE} ON COMMIT DELETE ROWS AS "
                          f"SELECT 0::bigint AS n, {STAGE_COLUMNS} FROM events WITH NO DATA"))
        for n, row in enumerate(rows):
            row["n"] = n
        copy_rows(conn, STAGE, rows, ("n", *STAGE_NAMES))
        conn.execute(text(f"INSERT INTO events ({STAGE_COLUMNS}, payload) SELECT {STAGE_COLUMNS}, "
                          f"convert_from(canonical, 'UTF8')::jsonb -> 'payload' FROM {STAGE} "
                          "ORDER BY n"))

    def _fresh(self, conn: Connection, records: list[Record]) -> list[Record]:
        """Records whose event_id is neither stored nor earlier in this batch."""
        if not records:
            return []
        seen = set(conn.execute(text("SELECT event_id FROM events WHERE event_id = ANY(:ids)"),
                                {"ids": [r.envelope.event_id for r in records]}).scalars())
        fresh = []
        for record in records:
            if record.envelope.event_id not in seen:
                seen.add(record.envelope.event_id)
                fresh.append(record)
        return fresh

    def _chain(self, records: Iterable[Record], heads: dict[PartitionKey, PartitionHead]
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Event rows linked into their partition chains, and the checkpoints that fell due."""
        rows: list[dict[str, Any]] = []
        due: list[dict[str, Any]] = []
        every = self.settings.audit_checkpoint_every
        assert self.signer is not None
        for record in records:
            key = (record.topic, record.partition)
            head = heads.get(key)
            if head is None:
                head = heads[key] = (self._heads[key].copy() if key in self._heads
                                     else PartitionHead())
            canonical = record.value
            prev, index = head.head, head.size
            head.head = link(prev, canonical)
            head.tree.append(leaf_hash(canonical))
            envelope = record.envelope
            tenant = envelope.tenant
            rows.append({
                "topic": record.topic, "partition": record.partition, "offset": record.offset,
                "event_id": envelope.event_id, "type": envelope.type,
                "schema_version": envelope.schema_version, "stream": envelope.stream,
                "seq": envelope.seq, "actor": envelope.actor,
                "tenant_org": tenant.org if tenant else None,
                "tenant_team": tenant.team if tenant else None,
                "tenant_project": tenant.project if tenant else None,
                "trace_id": envelope.trace_id, "canonical": canonical,
                "occurred_at": envelope.occurred_at,
                "prev_hash": prev, "hash": head.head, "chain_index": index,
            })
            if head.size % every == 0:
                due.append(self._checkpoint(key, head))
        return rows, due

    def _checkpoint(self, key: PartitionKey, head: PartitionHead) -> dict[str, Any]:
        assert self.signer is not None
        root = head.tree.root()
        message = checkpoint_message(key[0], key[1], head.size, root, head.head)
        return {"topic": key[0], "partition": key[1], "tree_size": head.size, "root": root,
                "chain_head": head.head, "public_key": self.signer.public_key,
                "signature": self.signer.sign(message)}

    def _write_heads(self, conn: Connection, heads: dict[PartitionKey, PartitionHead],
                     due: list[dict[str, Any]]) -> None:
        if heads:
            stmt = insert(chain_heads)
            conn.execute(stmt.on_conflict_do_update(
                index_elements=["topic", "partition"],
                set_={"size": stmt.excluded.size, "head_hash": stmt.excluded.head_hash,
                      "frontier": stmt.excluded.frontier, "updated_at": func.now()}),
                [{"topic": t, "partition": p, "size": h.size, "head_hash": h.head,
                  "frontier": h.tree.to_bytes()} for (t, p), h in heads.items()])
        if due:
            conn.execute(insert(checkpoints).on_conflict_do_nothing(
                constraint="uq_checkpoints_size"), due)

    # --- current state ----------------------------------------------------------------------

    @staticmethod
    def _load_state(conn: Connection, keys: fold.TouchedKeys) -> fold.BatchState:
        state = fold.BatchState()
        if keys.adapter_ids:
            ids = sorted(keys.adapter_ids)
            for r in conn.execute(select(adapters).where(adapters.c.adapter_id.in_(ids))):
                state.adapters[r.adapter_id] = dict(r._mapping)
            for r in conn.execute(select(adapter_versions)
                                  .where(adapter_versions.c.adapter_id.in_(ids))):
                state.versions[(r.adapter_id, r.version)] = dict(r._mapping)
        if keys.aliases:
            for r in conn.execute(select(aliases).where(aliases.c.alias.in_(
                    sorted(keys.aliases)))):
                state.aliases[r.alias] = dict(r._mapping)
        if keys.worker_ids:
            ids = sorted(keys.worker_ids)
            for r in conn.execute(select(workers).where(workers.c.worker_id.in_(ids))):
                state.workers[r.worker_id] = dict(r._mapping)
            for r in conn.execute(select(worker_adapters)
                                  .where(worker_adapters.c.worker_id.in_(ids))):
                state.worker_adapters.setdefault(r.worker_id, {})[
                    (r.adapter_id, r.version)] = dict(r._mapping)
        return state

    def _fold(self, conn: Connection, records: list[Record]) -> None:
        if not records:
            return
        envelopes = [r.envelope for r in records]
        state = self._load_state(conn, fold.touched_keys(envelopes))
        for envelope in envelopes:
            fold.apply(state, envelope)
        upsert(conn, adapters, [state.adapters[k] for k in sorted(state.dirty_adapters)])
        upsert(conn, adapter_versions, [state.versions[k] for k in sorted(state.dirty_versions)])
        upsert(conn, aliases, [state.aliases[k] for k in sorted(state.dirty_aliases)])
        upsert(conn, workers, [state.workers[k] for k in sorted(state.dirty_workers)])
        if state.dirty_worker_adapters:
            conn.execute(delete(worker_adapters).where(
                worker_adapters.c.worker_id.in_(sorted(state.dirty_worker_adapters))))
            copy_rows(conn, worker_adapters, [
                row for w in sorted(state.dirty_worker_adapters)
                for row in state.worker_adapters.get(w, {}).values()])
        for table, rows in ((version_history, state.version_history),
                            (split_history, state.split_history),
                            (worker_heartbeats, state.worker_heartbeats),
                            (worker_acks, state.worker_acks),
                            (request_traces, state.request_traces)):
            copy_rows(conn, table, rows)
        if state.purges:
            conn.execute(insert(purges).on_conflict_do_nothing(index_elements=["purge_id"]),
                         state.purges)

    # --- the loop -------------------------------------------------------------------------

    def checkpoint_now(self) -> list[dict[str, Any]]:
        """Sign the current head of every partition not yet covered by a checkpoint.

        Periodic checkpoints fall at multiples of `audit_checkpoint_every`; this one is
        for publishing (or proving) the tail in between. It locks like a batch does.
        """
        if self.signer is None:
            self.signer = load_signer(self.settings)
        with self.engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:lock))"),
                         {"lock": f"loraplane-audit-projector/{self.name}"})
            heads = self._load_heads(conn)
            signed = {(r.topic, r.partition, r.tree_size)
                      for r in conn.execute(select(checkpoints.c.topic, checkpoints.c.partition,
                                                   checkpoints.c.tree_size))}
            due = [self._checkpoint(k, h) for k, h in sorted(heads.items())
                   if h.size and (k[0], k[1], h.size) not in signed]
            if due:
                conn.execute(insert(checkpoints).on_conflict_do_nothing(
                    constraint="uq_checkpoints_size"), due)
        return due

    def run(self, stop: threading.Event) -> None:
        """Project until `stop`; any failure drops the consumer and resumes from Postgres.

        Reading runs one batch ahead in a thread, so decoding and validating batch n+1
        overlaps writing batch n (the write mostly waits on PostgreSQL, which releases
        the GIL). Offsets are still committed only with the rows they cover.
        """
        backoff = 0.5
        last_log, written = time.monotonic(), 0
        while not stop.is_set():
            try:
                written += self._run_pipeline(stop)
                backoff = 0.5
            except (SQLAlchemyError, EventLogError, ProjectionConflict, OSError) as exc:
                log.error("audit batch failed (%s); resuming from stored offsets in %.1fs",
                          exc, backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            finally:
                self.close()
            if time.monotonic() - last_log > 10 and written:
                log.info("projected %d events", written)
                last_log, written = time.monotonic(), 0

    def _run_pipeline(self, stop: threading.Event) -> int:
        self.consumer  # noqa: B018 - open (and seek) before the reader thread starts
        ahead: queue.Queue[PolledBatch | BaseException] = queue.Queue(maxsize=1)
        quit_reading = threading.Event()

        def read() -> None:
            try:
                while not (quit_reading.is_set() or stop.is_set()):
                    batch = self.poll_batch(timeout=0.2)
                    while not quit_reading.is_set():
                        try:
                            ahead.put(batch, timeout=0.2)
                            break
                        except queue.Full:
                            continue
            except BaseException as exc:  # handed to the writer, which raises it
                ahead.put(exc)

        reader = threading.Thread(target=read, name=f"{self.name}-reader", daemon=True)
        reader.start()
        written = 0
        try:
            while not stop.is_set():
                try:
                    item = ahead.get(timeout=0.5)
                except queue.Empty:
                    continue
                if isinstance(item, BaseException):
                    raise item
                written += self.write_batch(item)
        finally:
            quit_reading.set()
            reader.join(timeout=10)
        return written

    def close(self) -> None:
        if self._consumer is not None:
            try:
                self._consumer.close()
            finally:
                self._consumer = None
