"""The log follower: the one loop every process that folds the log runs.

A follower owns an assign-all consumer thread (`EventConsumer`) and hands every record it
reads to a fold, under a lock the process's readers share. It gives the process five
things, so no service writes them again:

- **bounded start-up**: it loads the newest snapshot of the fold (`snapshots.py`),
  resumes each partition at the record the snapshot ends with, checks that record is
  still there, and replays only the tail. A snapshot from another cluster, another
  incarnation of a topic, another partition layout or another `fold_version` is ignored
  and the log is replayed in full. Snapshots are written every `snapshot_every_events`
  records read or `snapshot_every_s` seconds (whichever first, only if anything was
  read) and on a clean stop, atomically, by a background thread.
- **ready**: set once every partition has reported its end from a fetch that began after
  the follower started (see `consumer.py`): everything committed before the start is
  folded. Nothing is written to the log for this.
- **read-your-writes**: `wait_applied(topic, partition, offset)` returns once the record
  at that position has been folded (a writer waits for its own event).
- **sync**: `sync()` returns once everything committed before the call is folded (a
  writer whose last write failed re-reads the log before it decides again).
- **halting**: a record the fold cannot take stops the follower where it is. `halt`
  says which event and why; `wait_applied` and `sync` raise `FollowerHalted`; the state
  stays as it was before that event and no snapshot is written. It stays halted until an
  operator acts: a fixed fold (restart), or the event's id in `LORAPLANE_FOLD_SKIP_EVENTS`
  (restart; the follower then logs and skips it). A follower never folds past an event
  it could not fold, so a writer never decides on a state that has left the log.

Topics in `full_replay_topics` (by default the liveness topic: short lived, compacted)
are not covered by snapshots: they are read from their beginning at every start, so the
fold must take their events idempotently (newest lease, newest heartbeat).

Interface, for the registry, workers and router:

    follower = LogFollower(settings, fold, reader_id="worker-3", snapshot_name="worker-3")
    follower.start()
    follower.wait_ready(timeout_s)            # or poll follower.ready (an Event)
    with follower.lock: read fold state       # the fold is applied under this lock
    follower.wait_applied(topic, partition, offset, timeout_s) -> bool
    follower.sync(timeout_s) -> bool
    follower.halt                             # None, or Halt(reason, position, event)
    follower.status()                         # a dict for /readyz and logs
    follower.stop()                           # writes a last snapshot
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from services.config import Settings
from services.eventlog.backoff import Backoff
from services.eventlog.consumer import (
    Anchor,
    AnchorMismatch,
    EventConsumer,
    Record,
    TopicPartitionKey,
)
from services.eventlog.errors import EventLogError
from services.eventlog.snapshots import Snapshot, SnapshotStore

log = logging.getLogger(__name__)


class Fold(Protocol):
    """What a follower folds into (`services.catalog.snapshot.CatalogFold` is one)."""

    @property
    def fold_version(self) -> str:
        """Changes whenever the fold's rules or its document change: older snapshots are
        then ignored."""
        ...

    @property
    def wanted_types(self) -> Collection[str] | None:
        """Event types the fold takes; others are skipped undecoded. None: all."""
        ...

    def apply(self, record: Record) -> None:
        """Fold one record; raising halts the follower at this record."""
        ...

    def dump(self) -> Any:
        """The state as a JSON document, sharing nothing mutable with the state."""
        ...

    def load(self, document: Any | None) -> None:
        """Replace the state by a dumped one, or by the empty state (None)."""
        ...


@dataclass(frozen=True)
class Halt:
    """Why a follower stopped: the record it could not fold."""

    reason: str
    topic: str
    partition: int
    offset: int
    event_id: str | None = None
    event_type: str | None = None


class FollowerHalted(EventLogError):
    """The follower stopped at a record it could not fold; see `halt`."""

    def __init__(self, halt: Halt) -> None:
        super().__init__(halt.reason)
        self.halt = halt


class LogFollower:
    """Keeps `fold` current with `topics`; see the module doc."""

    def __init__(
        self,
        settings: Settings,
        fold: Fold,
        *,
        reader_id: str,
        topics: Collection[str] | None = None,
        snapshot_name: str | None = None,
        full_replay_topics: Collection[str] | None = None,
        lock: threading.RLock | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.fold = fold
        self.reader_id = reader_id
        self.topics = list(topics if topics is not None else settings.topics)
        self.full_replay_topics = frozenset(
            full_replay_topics if full_replay_topics is not None
            else {settings.liveness_topic}) & set(self.topics)
        self.store = SnapshotStore(settings.snapshot_root, snapshot_name) \
            if snapshot_name else None
        self.lock = lock or threading.RLock()
        self._changed = threading.Condition(self.lock)
        self.ready = threading.Event()
        self.halt: Halt | None = None
        self.last_error: str | None = None
        self._on_ready = on_ready
        self._skip = frozenset(settings.fold_skip_events)
        self._applied: dict[TopicPartitionKey, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._writer: threading.Thread | None = None
        self._established = False
        """The fold's state belongs to this log (loaded and checked, or replayed from
        the start): a reopened consumer resumes where it stood, never reloads."""
        self._resume: tuple[dict[TopicPartitionKey, int], dict[TopicPartitionKey, Anchor]] = (
            {}, {})
        self._sync_wanted = 0
        self._sync_started = 0
        self._sync_done = 0
        self._started = 0.0
        self._read_at_snapshot = 0
        self._snapshot_at = 0.0
        self._stats: dict[str, Any] = {"started_from": None, "snapshot_records": 0,
                                       "folded": 0, "seconds_to_ready": None,
                                       "snapshots_written": 0, "snapshot_bytes": 0}

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"{self.reader_id}-follower",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop reading; a follower that is ready and not halted writes a last snapshot."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._writer is not None:
            self._writer.join(timeout_s)
        with self._changed:
            self._changed.notify_all()

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.ready.is_set():
            if self.halt is not None or self._stop.is_set():
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self.ready.wait(0.1 if left is None else min(0.1, left))
        return True

    # --- waiting for the fold ------------------------------------------------------------

    def applied(self, topic: str, partition: int) -> int:
        """The next offset of the partition still to fold (everything below is folded)."""
        with self.lock:
            return self._applied.get((topic, partition), 0)

    def wait_applied(self, topic: str, partition: int, offset: int, timeout_s: float) -> bool:
        """True once the record at `offset` is folded; False at the timeout."""
        key = (topic, partition)
        with self._changed:
            done = self._changed.wait_for(
                lambda: self._applied.get(key, 0) > offset or self.halt is not None
                or self._stop.is_set(), timeout=max(0.0, timeout_s))
            if done and self._applied.get(key, 0) > offset:
                return True
            if self.halt is not None:
                raise FollowerHalted(self.halt)
            return False

    def sync(self, timeout_s: float) -> bool:
        """True once everything committed before this call is folded; False at the timeout."""
        with self._changed:
            self._sync_wanted += 1
            target = self._sync_wanted
            self._changed.wait_for(lambda: self._sync_done >= target or self.halt is not None
                                   or self._stop.is_set(), timeout=max(0.0, timeout_s))
            if self._sync_done >= target:
                return True
            if self.halt is not None:
                raise FollowerHalted(self.halt)
            return False

    def status(self) -> dict[str, Any]:
        halt = self.halt
        return {"ready": self.ready.is_set(), "halted": halt is not None,
                "halt": halt.__dict__ if halt else None, "last_error": self.last_error,
                **self._stats}

    # --- the reading thread --------------------------------------------------------------

    def _run(self) -> None:
        backoff = Backoff(first=0.5)
        use_snapshot = self.store is not None
        while not self._stop.is_set() and self.halt is None:
            consumer: EventConsumer | None = None
            try:
                consumer = self._open(use_snapshot)
                backoff.succeeded()
                self._follow(consumer)
            except AnchorMismatch as exc:
                if self._established:
                    self._halt_on(f"the log changed under this reader (lost or recreated): "
                                  f"{exc}", None)
                else:
                    log.warning("%s: snapshot does not match the log (%s); replaying in full",
                                self.reader_id, exc)
                    use_snapshot = False
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("%s: reading the log failed (%s); retrying in %.1fs",
                            self.reader_id, exc, backoff.pause)
                if consumer is not None and self._established:
                    self._resume = (consumer.positions(), consumer.last_read())
                backoff.wait(self._stop)
            finally:
                if consumer is not None:
                    consumer.close()

    def _open(self, use_snapshot: bool) -> EventConsumer:
        if self._established:
            positions, anchors = self._resume
            return self._consumer(
                positions, {k: a for k, a in anchors.items()
                            if k[0] not in self.full_replay_topics})
        started = time.monotonic()
        snapshot = self._usable_snapshot() if use_snapshot else None
        read_s = time.monotonic() - started
        consumer = self._consumer({}, dict(snapshot.anchors) if snapshot else {})
        opened_s = time.monotonic() - started - read_s
        if snapshot is not None and consumer.cluster_id != snapshot.cluster_id:
            log.warning("%s: snapshot is from cluster %s, the broker is %s; replaying in full",
                        self.reader_id, snapshot.cluster_id, consumer.cluster_id)
            consumer.close()
            snapshot = None
            consumer = self._consumer({}, {})
        with self._changed:
            loading = time.monotonic()
            self.fold.load(snapshot.state if snapshot else None)
            self._applied = {}
            self._stats.update(started_from="snapshot" if snapshot else "beginning",
                               snapshot_records=snapshot.records if snapshot else 0, folded=0,
                               snapshot_read_s=round(read_s, 3),
                               snapshot_load_s=round(time.monotonic() - loading, 3),
                               consumer_open_s=round(opened_s, 3))
            self._read_at_snapshot = snapshot.records if snapshot else 0
        self._snapshot_at = time.monotonic()
        self._established = snapshot is None  # a snapshot counts once its anchors check out
        return consumer

    def _consumer(self, positions: dict[TopicPartitionKey, int],
                  anchors: dict[TopicPartitionKey, Anchor]) -> EventConsumer:
        return EventConsumer(self.settings, self.topics, reader_id=self.reader_id,
                             start_offsets=positions, anchors=anchors,
                             wanted_types=self.fold.wanted_types)

    def _usable_snapshot(self) -> Snapshot | None:
        assert self.store is not None
        snapshot = self.store.load()
        if snapshot is None:
            return None
        durable = set(self.topics) - self.full_replay_topics
        if snapshot.fold_version != self.fold.fold_version:
            log.info("%s: snapshot is of fold %s, this reader folds %s; replaying in full",
                     self.reader_id, snapshot.fold_version, self.fold.fold_version)
            return None
        if set(snapshot.partitions) != durable:
            log.info("%s: snapshot covers topics %s, this reader reads %s; replaying in full",
                     self.reader_id, sorted(snapshot.partitions), sorted(durable))
            return None
        return snapshot

    def _follow(self, consumer: EventConsumer) -> None:
        while not self._stop.is_set():
            if self._sync_wanted > self._sync_started:
                self._sync_started = self._sync_wanted
                consumer.restart_catch_up()
            if self.ready.is_set():
                # consume() waits its whole timeout unless the batch fills: wait for one
                # record (a writer may be waiting on it), then drain without waiting.
                records = consumer.poll(timeout=0.1, max_records=1)
                if records:
                    records += consumer.poll(timeout=0, max_records=2000)
            else:
                records = consumer.poll(timeout=0.2, max_records=5000)
            if not self._fold_all(records):
                return
            if not self._established and not consumer.anchors_pending:
                self._established = True  # every anchor checked: the snapshot is this log's
            positions = consumer.positions()
            with self._changed:
                for key, offset in positions.items():
                    if offset > self._applied.get(key, 0):
                        self._applied[key] = offset
                if consumer.caught_up:
                    self._sync_done = self._sync_started
                self._changed.notify_all()
            if consumer.caught_up and self._established and not self.ready.is_set():
                self._stats["seconds_to_ready"] = round(time.monotonic() - self._started, 3)
                log.info("%s: caught up from %s in %.2fs (%d records folded)", self.reader_id,
                         self._stats["started_from"], self._stats["seconds_to_ready"],
                         self._stats["folded"])
                self.ready.set()
                if self._on_ready is not None:
                    self._on_ready()
            self._maybe_snapshot(consumer, positions)
        self._maybe_snapshot(consumer, consumer.positions(), final=True)

    def _fold_all(self, records: list[Record]) -> bool:
        """Fold a batch under the lock; False when a record halted the follower."""
        if not records:
            return True
        with self._changed:
            for record in records:
                if self._skip and str(record.envelope.event_id) in self._skip:
                    log.warning("%s: skipping event %s (%s) as LORAPLANE_FOLD_SKIP_EVENTS says",
                                self.reader_id, record.envelope.event_id, record.envelope.type)
                else:
                    try:
                        self.fold.apply(record)
                    except Exception as exc:
                        self._halt_on(f"cannot fold {record.envelope.type} "
                                      f"{record.envelope.event_id} at {record.topic}"
                                      f"[{record.partition}]@{record.offset}: {exc!r}", record)
                        return False
                self._applied[(record.topic, record.partition)] = record.offset + 1
                self._stats["folded"] += 1
            self._changed.notify_all()
        return True

    def _halt_on(self, reason: str, record: Record | None) -> None:
        log.error("%s halted: %s. Writes stop until an operator acts (fix the fold and "
                  "restart, or list the event id in LORAPLANE_FOLD_SKIP_EVENTS).",
                  self.reader_id, reason)
        with self._changed:
            self.halt = Halt(reason, record.topic if record else "",
                             record.partition if record else -1,
                             record.offset if record else -1,
                             str(record.envelope.event_id) if record else None,
                             record.envelope.type if record else None)
            self._changed.notify_all()

    # --- snapshots -----------------------------------------------------------------------

    def _maybe_snapshot(self, consumer: EventConsumer, positions: dict[TopicPartitionKey, int],
                        final: bool = False) -> None:
        if self.store is None or self.halt is not None or not self._established:
            return
        read = sum(positions.values())
        fresh = read - self._read_at_snapshot
        due = (fresh >= self.settings.snapshot_every_events
               or time.monotonic() - self._snapshot_at >= self.settings.snapshot_every_s)
        if fresh <= 0 or not (due or final):
            return
        if self._writer is not None and self._writer.is_alive():
            if not final:
                return  # the previous one is still being written
            self._writer.join()
        counts = {t: 0 for t in self.topics if t not in self.full_replay_topics}
        for topic, partition in consumer.partitions:
            if topic in counts:
                counts[topic] = max(counts[topic], partition + 1)
        snapshot = Snapshot(
            fold_version=self.fold.fold_version, cluster_id=consumer.cluster_id,
            partitions=counts,
            anchors={k: a for k, a in consumer.last_read().items() if k[0] in counts},
            state=self.fold.dump(), records=read)
        self._read_at_snapshot = read
        self._snapshot_at = time.monotonic()
        self._writer = threading.Thread(target=self._write_snapshot, args=(snapshot,),
                                        name=f"{self.reader_id}-snapshot", daemon=not final)
        self._writer.start()
        if final:
            self._writer.join()

    def _write_snapshot(self, snapshot: Snapshot) -> None:
        assert self.store is not None
        try:
            size = self.store.save(snapshot)
        except OSError as exc:
            log.warning("%s: cannot write snapshot %s: %s", self.reader_id, self.store.path, exc)
            return
        self._stats["snapshots_written"] += 1
        self._stats["snapshot_bytes"] = size
