"""The audit projector: folds the event topics into PostgreSQL exactly once.

The liveness topic (registry leases, worker heartbeats) is read with the others, but its
events are not chained nor stored as events: a heartbeat only updates its worker's
summary row (last heartbeat, address, free slots and KV blocks, lease epoch) and the
`worker_heartbeats` times the purge view reads; leases are not kept. Periodic proofs of
life are not part of the record an auditor verifies.

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

Everything Python does for a batch (decode, dedupe, chain, leaf hashes, fold, COPY
text) happens in `prepare_batch`, before its transaction; `write_batch` then only runs
SQL. `run` prepares batch n+1 in a thread while batch n is being written, so the one
core Python gets and PostgreSQL's work overlap instead of taking turns. Preparing ahead
means the chain heads, offsets and current-state rows the preparer sees include a batch
not yet committed; that is sound because this projector is the only writer (see the
fence above) and because any failure drops all of it and reloads from PostgreSQL.

Personal fields are sealed before anything is hashed (`services.audit.sealing`), with
the tenants' data keys (`services.audit.keys`); a `TenantPurgeRequested` destroys its
tenant's key in the batch that stores it.

Durability: the embedded PostgreSQL commits asynchronously (`synchronous_commit=off`),
which is safe for batches because their offsets commit with them: a batch lost in a
crash is read from Kafka again. A batch whose effects leave the database must be on disk
before they do, so it commits synchronously: one that signs checkpoints (published to
the note folder and over HTTP once committed; a re-projection could otherwise sign a
different tree of the same size) or destroys a tenant key (the purge proof reports it).
"""

from __future__ import annotations

import base64
import contextlib
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, Table, delete, func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import SQLAlchemyError

from services.audit import fold
from services.audit.chain import GENESIS, link
from services.audit.keys import KeyRing, load_kek, vacuum_keys, write_key_changes
from services.audit.merkle import CompactRange, leaf_hash
from services.audit.metrics import ProjectorMetrics
from services.audit.pgcopy import CopyData, CopyFormat, copy_data
from services.audit.publication import CheckpointFolder
from services.audit.sealing import ERASED, seal
from services.audit.signing import CheckpointSigner, load_signer, log_origin
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
from services.audit.verifier import Checkpoint
from services.config import Settings
from services.contracts import structs
from services.eventlog.backoff import Backoff
from services.eventlog.consumer import EventConsumer, Record, Rejected
from services.eventlog.errors import EventLogError

log = logging.getLogger(__name__)

PartitionKey = tuple[str, int]

EventRecord = Record[structs.AnyEnvelope]
"""What the projector reads: records decoded by `contracts.structs` (see `open`)."""


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


@dataclass(frozen=True)
class PolledBatch:
    """What one poll returned and the consumer positions covering it."""

    records: list[EventRecord]
    positions: dict[PartitionKey, int]
    rejected: list[Rejected]


@dataclass
class Ahead:
    """What the preparer has reached: committed state plus batches prepared after it."""

    heads: dict[PartitionKey, PartitionHead]
    positions: dict[PartitionKey, int]
    keys: KeyRing
    state: fold.FoldState = field(default_factory=fold.FoldState)
    signed: dict[PartitionKey, int] = field(default_factory=dict)
    """The largest tree size signed per partition (committed or prepared)."""
    unsigned_since: dict[PartitionKey, float] = field(default_factory=dict)
    """Partitions with events no checkpoint covers: since when (monotonic seconds)."""


@dataclass(frozen=True)
class PreparedBatch:
    """One batch's transaction, built before it starts: only SQL is left to run."""

    count: int
    """Events written."""
    positions: dict[PartitionKey, int]
    """Consumer offsets this batch moves."""
    rejected: list[Rejected]
    events: CopyData
    """COPY data of the event rows (with their chain links), in chain order."""
    heads: list[dict[str, Any]]
    checkpoints: list[dict[str, Any]]
    upserts: list[tuple[Table, list[dict[str, Any]]]]
    """Current-state rows to overwrite, per table."""
    worker_sets: list[str]
    """Workers whose `worker_adapters` rows are replaced by those in `appends`."""
    appends: list[tuple[str, CopyData]]
    """(COPY statement, COPY data) of the rows appended to state and history tables."""
    purges: list[dict[str, Any]]
    purge_blobs: list[dict[str, Any]]
    erasures: list[dict[str, Any]]
    keys_created: list[dict[str, Any]]
    keys_destroyed: list[dict[str, Any]]
    topics: dict[str, int]
    """Events written per topic (for the metrics)."""

    @property
    def empty(self) -> bool:
        return not (self.count or self.positions or self.rejected or self.checkpoints)


EVENT_FORMAT = CopyFormat(events, (
    "topic", "partition", "offset", "event_id", "type", "schema_version", "stream", "seq",
    "actor", "tenant_org", "tenant_team", "tenant_project", "trace_id", "canonical",
    "occurred_at", "prev_hash", "hash", "chain_index", "leaf_hash"))
FRESH = text("""
    SELECT e.event_id FROM events e
    WHERE e.event_id IN (SELECT encode(substring(:ids FROM i * 16 + 1 FOR 16), 'hex')::uuid
                         FROM generate_series(0, :n - 1) AS i)""")
ERASE_VERSIONS = text("""
    UPDATE adapter_versions SET label = :erased, owner = :erased,
        disabled_reason = CASE WHEN disabled_reason IS NULL OR disabled_at > :at
                               THEN disabled_reason ELSE :erased END
    WHERE tenant_org = :org AND tenant_team = :team AND tenant_project = :project
      AND published_at <= :at AND (label <> :erased OR owner <> :erased
                                   OR disabled_reason <> :erased)""")
ERASE_HISTORY = text("""
    UPDATE version_history h SET reason = :erased
    FROM adapters a
    WHERE a.adapter_id = h.adapter_id AND a.tenant_org = :org AND a.tenant_team = :team
      AND a.tenant_project = :project AND h.at <= :at
      AND h.reason IS NOT NULL AND h.reason <> '' AND h.reason <> :erased""")
APPEND_FORMATS = {t.name: CopyFormat(t) for t in (
    worker_adapters, version_history, split_history, worker_heartbeats, worker_acks)}
TRACE_FORMAT = CopyFormat(request_traces, fold.TRACE_COLUMNS)


@contextlib.contextmanager
def batch_sized_gc() -> Iterator[None]:
    """Run the cyclic garbage collector about once a batch instead of every few events.

    A batch allocates some hundred container objects per event (envelopes, rows), nearly
    all freed when it commits. At the default threshold (700 allocations) the collector
    ran every few events, and each older-generation pass walked the fold cache and the
    consumer's dedupe memory: about a third of the projector's CPU.
    """
    old = gc.get_threshold()
    gc.set_threshold(50_000, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*old)


class AuditProjector:
    def __init__(self, settings: Settings, engine: Engine, *, name: str = "audit",
                 signer: CheckpointSigner | None = None,
                 metrics: ProjectorMetrics | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.name = name
        self.signer = signer
        self.metrics = metrics or ProjectorMetrics()
        self.folder = CheckpointFolder(settings.checkpoint_root)
        self._kek = load_kek(settings)
        self._rejected: list[Rejected] = []
        self._committed: dict[PartitionKey, int] = {}
        self._ahead = Ahead({}, {}, KeyRing(self._kek))
        self._consumer: EventConsumer[structs.AnyEnvelope] | None = None
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

    @staticmethod
    def _load_fold_state(conn: Connection) -> fold.FoldState:
        state = fold.FoldState()
        for r in conn.execute(select(purges.c.tenant_org, purges.c.tenant_team,
                                     purges.c.tenant_project,
                                     func.max(purges.c.requested_at).label("at"))
                              .where(purges.c.tenant_org.is_not(None))
                              .group_by(purges.c.tenant_org, purges.c.tenant_team,
                                        purges.c.tenant_project)):
            state.purged_at[(r.tenant_org, r.tenant_team, r.tenant_project)] = r.at
        return state

    def open(self) -> None:
        if self.signer is None:
            self.signer = load_signer(self.settings)
        with self.engine.connect() as conn:
            self._committed = self._stored_offsets(conn)
            heads = self._load_heads(conn)
            signed = {(r.topic, r.partition): r.size for r in conn.execute(
                select(checkpoints.c.topic, checkpoints.c.partition,
                       func.max(checkpoints.c.tree_size).label("size"))
                .group_by(checkpoints.c.topic, checkpoints.c.partition))}
            now = time.monotonic()
            self._ahead = Ahead(heads, dict(self._committed), KeyRing.load(conn, self._kek),
                                self._load_fold_state(conn), signed,
                                {k: now for k, h in heads.items() if h.size > signed.get(k, 0)})
        self.metrics.watch_lag(self.settings, lambda: dict(self._committed))
        self.publish_checkpoints()
        self._rejected = []
        self._consumer = EventConsumer(
            self.settings, self.settings.topics, reader_id=f"loraplane-{self.name}",
            start_offsets=self._committed, on_rejected=self._rejected.append,
            decoder=structs.decode, **{"fetch.wait.max.ms": 50})

    @property
    def consumer(self) -> EventConsumer[structs.AnyEnvelope]:
        if self._consumer is None:
            self.open()
        assert self._consumer is not None
        return self._consumer

    # --- one batch ------------------------------------------------------------------------

    def project_batch(self, timeout: float = 0.5) -> int:
        """Poll one batch and commit it with its offsets; returns events written."""
        try:
            return self.write_batch(self.prepare_batch(self.poll_batch(timeout)))
        except BaseException:
            # The consumer's position and dedupe memory, and the prepared state, are past
            # what was committed: drop them so the next batch starts again from Postgres.
            self.close()
            raise

    def poll_batch(self, timeout: float = 0.5) -> PolledBatch:
        """Read (and validate) up to one batch; nothing is committed yet."""
        consumer = self.consumer
        records = consumer.poll(timeout=timeout, max_records=self.settings.audit_batch_size)
        rejected = list(self._rejected)
        self._rejected.clear()
        return PolledBatch(records, consumer.positions(), rejected)

    def prepare_batch(self, batch: PolledBatch) -> PreparedBatch:
        """Build everything `batch` writes, advancing the chain heads and fold state."""
        return self._prepare(batch, self._ahead)

    def _prepare(self, batch: PolledBatch, ahead: Ahead) -> PreparedBatch:
        positions = {k: o for k, o in batch.positions.items() if ahead.positions.get(k) != o}
        fresh: list[EventRecord] = []
        if batch.records:
            with self.engine.connect() as conn:
                fresh = self._fresh(conn, batch.records)
                self._load_state(conn, ahead.state,
                                 fold.touched_keys(r.envelope for r in fresh))
        heads: dict[PartitionKey, PartitionHead] = {}
        liveness = self.settings.liveness_topic
        rows, due, stored = self._chain([r for r in fresh if r.topic != liveness], heads,
                                        ahead.heads, ahead.keys)
        due += self._due_on_time(ahead, heads, due)
        state = ahead.state
        values = iter(stored)  # one per chained record, in order
        for record in fresh:
            fold.apply(state, record.envelope,
                       None if record.topic == liveness else next(values))
        changes = state.take_changes()
        keys_created, keys_destroyed = ahead.keys.take_changes()
        ahead.heads.update(heads)
        ahead.positions.update(positions)
        appends = [(APPEND_FORMATS[name].statement, APPEND_FORMATS[name].data(rows))
                   for name, rows in (
                       ("worker_adapters", [row for w in changes.worker_adapters.values()
                                            for row in w]),
                       ("version_history", changes.version_history),
                       ("split_history", changes.split_history),
                       ("worker_heartbeats", changes.worker_heartbeats),
                       ("worker_acks", changes.worker_acks)) if rows]
        if changes.request_traces:
            appends.append((TRACE_FORMAT.statement,
                            TRACE_FORMAT.data_of_values(changes.request_traces)))
        topics: dict[str, int] = {}
        for row in rows:
            topics[row[0]] = topics.get(row[0], 0) + 1
        return PreparedBatch(
            count=len(rows), positions=positions, rejected=batch.rejected,
            events=EVENT_FORMAT.data_of_values(rows),
            heads=[{"topic": t, "partition": p, "size": h.size, "head_hash": h.head,
                    "frontier": h.tree.to_bytes()} for (t, p), h in heads.items()],
            checkpoints=due,
            upserts=[(table, rows) for table, rows in (
                (adapters, changes.adapters), (adapter_versions, changes.versions),
                (aliases, changes.aliases), (workers, changes.workers)) if rows],
            worker_sets=list(changes.worker_adapters), appends=appends,
            purges=changes.purges, purge_blobs=changes.purge_blobs,
            erasures=changes.erasures, keys_created=keys_created,
            keys_destroyed=keys_destroyed, topics=topics)

    def write_batch(self, prepared: PreparedBatch) -> int:
        """Commit one prepared batch (rows, state, checkpoints, dead letters, offsets)."""
        if prepared.empty:
            return 0
        started = time.perf_counter()
        with self.engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:lock))"),
                         {"lock": f"loraplane-audit-projector/{self.name}"})
            if self._stored_offsets(conn) != self._committed:
                raise ProjectionConflict(f"offsets of projector {self.name!r} moved: "
                                         "another instance is writing")
            if prepared.checkpoints or prepared.keys_destroyed:
                conn.execute(text("SET LOCAL synchronous_commit = on"))
            write_key_changes(conn, prepared.keys_created, prepared.keys_destroyed)
            copy_data(conn, EVENT_FORMAT.statement, prepared.events)
            for table, rows in prepared.upserts:
                upsert(conn, table, rows)
            if prepared.worker_sets:
                conn.execute(delete(worker_adapters).where(
                    worker_adapters.c.worker_id.in_(prepared.worker_sets)))
            for statement, data in prepared.appends:
                copy_data(conn, statement, data)
            if prepared.purges:
                conn.execute(insert(purges).on_conflict_do_nothing(
                    index_elements=["purge_id"]), prepared.purges)
            for blobs in prepared.purge_blobs:
                conn.execute(purges.update().where(purges.c.purge_id == blobs["purge_id"])
                             .values(**{k: v for k, v in blobs.items() if k != "purge_id"}))
            for erasure in prepared.erasures:
                params = {"erased": ERASED, "at": erasure["requested_at"],
                          "org": erasure["tenant_org"], "team": erasure["tenant_team"],
                          "project": erasure["tenant_project"]}
                conn.execute(ERASE_VERSIONS, params)
                conn.execute(ERASE_HISTORY, params)
            if prepared.heads:
                stmt = insert(chain_heads)
                conn.execute(stmt.on_conflict_do_update(
                    index_elements=["topic", "partition"],
                    set_={"size": stmt.excluded.size, "head_hash": stmt.excluded.head_hash,
                          "frontier": stmt.excluded.frontier, "updated_at": func.now()}),
                    prepared.heads)
            if prepared.checkpoints:
                conn.execute(insert(checkpoints).on_conflict_do_nothing(
                    constraint="uq_checkpoints_size"), prepared.checkpoints)
            if prepared.rejected:
                conn.execute(insert(dead_letters).on_conflict_do_nothing(
                    constraint="uq_dead_letters_position"), [
                    {"consumer": self.name, "topic": r.topic, "partition": r.partition,
                     "offset": r.offset, "key": r.key, "value": r.value, "reason": r.reason}
                    for r in prepared.rejected])
            if prepared.positions:
                stmt = insert(consumer_offsets)
                conn.execute(stmt.on_conflict_do_update(
                    index_elements=["consumer", "topic", "partition"],
                    set_={"next_offset": stmt.excluded.next_offset, "updated_at": func.now()}),
                    [{"consumer": self.name, "topic": t, "partition": p, "next_offset": o}
                     for (t, p), o in prepared.positions.items()])
            if self.before_commit is not None:
                self.before_commit(conn)
        self._committed.update(prepared.positions)
        self._after_commit(prepared, time.perf_counter() - started)
        if self.on_batch is not None:
            self.on_batch(prepared.count)
        return prepared.count

    def _after_commit(self, prepared: PreparedBatch, seconds: float) -> None:
        """Publish what the committed (and, for these, durable) batch signed; count it."""
        for cp in prepared.checkpoints:
            self.folder.publish(cp["topic"], cp["partition"], cp["tree_size"], cp["note"])
            self.metrics.checkpoints.labels(cp["topic"]).inc()
        if prepared.keys_destroyed:
            vacuum_keys(self.engine)
            self.metrics.keys_destroyed.inc(len(prepared.keys_destroyed))
        m = self.metrics
        for topic, n in prepared.topics.items():
            m.events.labels(topic).inc(n)
        for r in prepared.rejected:
            m.dead_letters.labels(r.topic).inc()
        m.batch_events.observe(prepared.count)
        m.batch_seconds.observe(seconds)
        m.last_commit.set_to_current_time()

    def publish_checkpoints(self) -> int:
        """Write every stored checkpoint note missing from the folder (after a crash
        between a commit and its publication, or into a new folder); returns how many."""
        written = 0
        with self.engine.connect() as conn:
            rows = conn.execute(select(checkpoints.c.topic, checkpoints.c.partition,
                                       checkpoints.c.tree_size, checkpoints.c.note)
                                .where(checkpoints.c.note.is_not(None))
                                .order_by(checkpoints.c.id))
            for r in rows:
                if self.folder.read(r.topic, r.partition, r.tree_size) is None:
                    self.folder.publish(r.topic, r.partition, r.tree_size, r.note)
                    written += 1
        return written

    def _fresh(self, conn: Connection, records: list[EventRecord]) -> list[EventRecord]:
        """Records whose event_id is neither stored nor earlier in this batch.

        Runs before the batch's transaction, so it sees committed rows only; the rows of a
        batch still being written cannot come back here, because the consumer drops
        event ids it has already returned. Liveness events (leases, heartbeats) are never
        stored as events: only their summary is (`_prepare`).
        """
        if not records:
            return []
        # the ids as one bytea (16 bytes each): binding a uuid[] dumps it id by id in Python
        liveness = self.settings.liveness_topic
        packed = b"".join(r.envelope.event_id.bytes for r in records if r.topic != liveness)
        seen = set(conn.execute(FRESH, {"ids": packed, "n": len(packed) // 16}).scalars())
        fresh = []
        for record in records:
            if record.envelope.event_id not in seen:
                seen.add(record.envelope.event_id)
                fresh.append(record)
        return fresh

    def _chain(self, records: Iterable[EventRecord], heads: dict[PartitionKey, PartitionHead],
               start: dict[PartitionKey, PartitionHead], keys: KeyRing
               ) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]],
                          list[dict[tuple[str, int], str]]]:
        """Event rows in their stored form (values in `EVENT_FORMAT` order), linked into
        their partition chains (continuing from `start`, left unchanged; `heads` gets the
        new heads), the checkpoints that fell due, and each record's stored personal
        values (for the fold)."""
        rows: list[tuple[Any, ...]] = []
        due: list[dict[str, Any]] = []
        stored: list[dict[tuple[str, int], str]] = []
        every = self.settings.audit_checkpoint_every
        assert self.signer is not None
        records = list(records)
        # Purges first: the two topics interleave in no fixed order, so a value dated
        # after a purge may be read before it; within a batch it still gets a fresh key.
        for record in records:
            envelope = record.envelope
            if envelope.tenant is not None and envelope.type == "TenantPurgeRequested":
                keys.destroy(envelope.tenant, envelope.payload.purge_id, envelope.occurred_at)
        for record in records:
            key = (record.topic, record.partition)
            head = heads.get(key)
            if head is None:
                head = heads[key] = start[key].copy() if key in start else PartitionHead()
            envelope = record.envelope
            tenant = envelope.tenant
            sealed = seal(envelope, record.value, keys.key_for)
            canonical = sealed.stored
            stored.append(sealed.values)
            prev, index = head.head, head.size
            leaf = leaf_hash(canonical)
            head.head = link(prev, canonical)
            head.tree.append(leaf)
            rows.append((
                record.topic, record.partition, record.offset, envelope.event_id,
                envelope.type, envelope.schema_version, envelope.stream, envelope.seq,
                envelope.actor, tenant.org if tenant else None,
                tenant.team if tenant else None, tenant.project if tenant else None,
                envelope.trace_id, canonical, envelope.occurred_at, prev, head.head, index,
                leaf))
            if head.size % every == 0:
                due.append(self._checkpoint(key, head))
        return rows, due, stored

    def _due_on_time(self, ahead: Ahead, heads: dict[PartitionKey, PartitionHead],
                     due: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Checkpoints of partitions whose newest events have waited `audit_checkpoint_
        every_s` for one: a quiet log (a demo, a small tenant) is signed on a period, as
        transparency logs publish, not only every `audit_checkpoint_every` events.

        Keeps `ahead`'s record of what is signed and since when the rest waits, given the
        batch's new `heads` and the count-based checkpoints `due` in it."""
        now = time.monotonic()
        for cp in due:
            key = (cp["topic"], cp["partition"])
            ahead.signed[key] = max(ahead.signed.get(key, 0), cp["tree_size"])
        for key, head in heads.items():
            if head.size <= ahead.signed.get(key, 0):
                ahead.unsigned_since.pop(key, None)
            else:
                ahead.unsigned_since.setdefault(key, now)
        period = self.settings.audit_checkpoint_every_s
        if not period:
            return []
        late = []
        for key, since in sorted(ahead.unsigned_since.items()):
            if now - since < period:
                continue
            head = heads.get(key) or ahead.heads[key]
            late.append(self._checkpoint(key, head))
            ahead.signed[key] = head.size
            del ahead.unsigned_since[key]
        return late

    def _checkpoint(self, key: PartitionKey, head: PartitionHead) -> dict[str, Any]:
        assert self.signer is not None
        origin = log_origin(self.settings, key[0], key[1])
        root = head.tree.root()
        note = self.signer.sign(Checkpoint(origin, head.size, root))
        note_key = self.signer.note_key(origin)
        signature = base64.b64decode(note.rstrip("\n").rsplit(" ", 1)[1])[4:]
        return {"topic": key[0], "partition": key[1], "tree_size": head.size, "root": root,
                "chain_head": head.head, "public_key": self.signer.public_key,
                "signature": signature, "origin": origin, "note": note,
                "key_name": note_key.name, "key_hash": note_key.hash}

    # --- current state ----------------------------------------------------------------------

    @staticmethod
    def _load_state(conn: Connection, state: fold.FoldState, keys: fold.TouchedKeys) -> None:
        """Load the stored rows of the touched keys not in `state` yet (committed rows:
        a key the batch being written touched is in `state` already)."""
        keys = state.missing(keys)
        if keys.adapter_ids:
            ids = sorted(keys.adapter_ids)
            for r in conn.execute(select(adapters).where(adapters.c.adapter_id.in_(ids))):
                state.adapters[r.adapter_id] = dict(r._mapping)
            for r in conn.execute(select(adapter_versions)
                                  .where(adapter_versions.c.adapter_id.in_(ids))):
                row = state.versions[(r.adapter_id, r.version)] = dict(r._mapping)
                state.scrub_version(row)  # a purge prepared but not yet committed
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
        state.mark_loaded(keys)

    # --- the loop -------------------------------------------------------------------------

    def checkpoint_now(self) -> list[dict[str, Any]]:
        """Sign the current head of every partition not yet covered by a checkpoint.

        Periodic checkpoints fall at multiples of `audit_checkpoint_every`; this one is
        for publishing (or proving) the tail in between. It locks like a batch does and
        commits synchronously before publishing.
        """
        if self.signer is None:
            self.signer = load_signer(self.settings)
        with self.engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:lock))"),
                         {"lock": f"loraplane-audit-projector/{self.name}"})
            conn.execute(text("SET LOCAL synchronous_commit = on"))
            heads = self._load_heads(conn)
            signed = {(r.topic, r.partition, r.tree_size)
                      for r in conn.execute(select(checkpoints.c.topic, checkpoints.c.partition,
                                                   checkpoints.c.tree_size))}
            due = [self._checkpoint(k, h) for k, h in sorted(heads.items())
                   if h.size and (k[0], k[1], h.size) not in signed]
            if due:
                conn.execute(insert(checkpoints).on_conflict_do_nothing(
                    constraint="uq_checkpoints_size"), due)
        for cp in due:
            self.folder.publish(cp["topic"], cp["partition"], cp["tree_size"], cp["note"])
        return due

    def run(self, stop: threading.Event) -> None:
        """Project until `stop`; any failure drops the consumer and resumes from Postgres.

        A thread polls and prepares batch n+1 (all the Python work) while this one
        writes batch n, which mostly waits on PostgreSQL with the GIL released. Offsets
        are still committed only with the rows they cover.
        """
        with batch_sized_gc():
            self._run(stop)

    def _run(self, stop: threading.Event) -> None:
        backoff = Backoff(first=0.5, most=10.0)
        last_log, written = time.monotonic(), 0
        while not stop.is_set():
            try:
                written += self._run_pipeline(stop)
                backoff.succeeded()
            except (SQLAlchemyError, EventLogError, ProjectionConflict, OSError) as exc:
                self.metrics.failures.inc()
                log.error("audit batch failed (%s); resuming from stored offsets in %.1fs",
                          exc, backoff.pause)
                backoff.wait(stop)
            finally:
                self.close()
            if time.monotonic() - last_log > 10 and written:
                log.info("projected %d events", written)
                last_log, written = time.monotonic(), 0

    def _run_pipeline(self, stop: threading.Event) -> int:
        self.consumer  # noqa: B018 - open (and seek) before the preparing thread starts
        ahead: queue.Queue[PreparedBatch | BaseException] = queue.Queue(maxsize=1)
        quit_preparing = threading.Event()
        state = self._ahead  # this pipeline's; a failure replaces it on reopening

        def hand(item: PreparedBatch | BaseException) -> None:
            while not quit_preparing.is_set():
                try:
                    ahead.put(item, timeout=0.2)
                    return
                except queue.Full:
                    continue

        def prepare() -> None:
            try:
                while not (quit_preparing.is_set() or stop.is_set()):
                    hand(self._prepare(self.poll_batch(timeout=0.2), state))
            except BaseException as exc:  # handed to the writer, which raises it
                hand(exc)

        preparer = threading.Thread(target=prepare, name=f"{self.name}-prepare", daemon=True)
        preparer.start()
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
            quit_preparing.set()
            preparer.join()  # before close(): it uses the consumer and the prepared state
        return written

    def close(self) -> None:
        if self._consumer is not None:
            try:
                self._consumer.close()
            finally:
                self._consumer = None
