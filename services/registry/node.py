"""One registry instance: its transactional producer, its fold of the log, its lease.

The command path (`execute`) is the single-writer discipline of docs/registry.md ("One writer"):
  idempotency check → decide one event on the folded state → publish it in its own
  transaction → wait until this instance's own follower has folded it → answer.
Commands are serialised by one lock, so every decision sees the previous command's event
(sequence numbers stay gap-free and If-Match checks are exact). Reads never touch the
broker: they take the state lock for a moment and answer from memory, so they keep
working while the broker is down.

Start-up: the instance initialises its transactional producer first (which fences any
older instance and settles its open transaction), then its `LogFollower` loads the
newest snapshot and replays the tail of the log. Until that replay is done, every write
and every read of the catalog answers 503 (`StateUnavailable`): a half-replayed state
would answer 404 for adapters that exist, or refuse a retried write that did commit.

Every write has one deadline (`registry_write_timeout_s`) from the moment its request is
handled, queueing behind other writes included; at the deadline it answers 503.

Who writes (`registry_election`):
- `start` (one registry): an instance takes the writer role when it starts, fencing any
  older one. Fenced (the producer says so, or the log shows a newer instance's lease),
  it refuses every later write (503 `fenced`) and stops leasing, until it is restarted.
  It never initialises its `transactional.id` again, which would fence the current
  writer and take the log back.
- `lease` (an active registry and standbys): an instance starts as a standby that folds
  the log and serves reads; writes answer 503 `standby`. When nothing from the writer
  (no adapter event, no lease of another instance) has been folded for `lease_ttl_s`
  (plus a random part of a lease interval, so standbys do not all move at once; at
  start, counted from the start), and a re-read of the log to its end confirms it, the
  standby takes over: it
  initialises the `transactional.id` (Kafka fences the old writer: its open transaction
  is aborted and it can never commit again), re-reads the log to its end (so it decides
  on everything the old writer committed), and leases at the next epoch. An active
  instance that is fenced, or sees a newer instance's lease, steps down to standby
  without a restart and gives the new writer a full `lease_ttl_s` before it would take
  over again, so the role does not ping-pong. Two instances never both commit: the
  broker refuses every commit of a fenced producer.
Readiness is what `/readyz` answers: 200 only while this instance is the writer and a
write (its lease, every `lease_interval_s`, or any command) committed within the last
`2 x lease_interval_s`. A write that hangs (a paused broker, a partition, fewer in-sync
replicas than `min.insync.replicas`) sets no error until its deadline, so the age of the
last commit is what keeps readiness from claiming writes that cannot commit.

Failure handling:
- Any produce failure (broker down, timeout): 503 with Retry-After; `/readyz` says
  "not writable" until a write succeeds again. The
  failed transaction is aborted, and before the next decision the follower re-reads the
  log to its end, so a transaction whose outcome was unknown is folded if it committed.
- A record the fold cannot take halts the follower: writes answer 503 and `/readyz` says
  which event, until an operator acts (see `services/eventlog/follower.py`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from services.catalog.snapshot import CatalogFold
from services.catalog.state import CatalogState, LogPosition
from services.config import Settings
from services.contracts.events import Envelope, RegistryLease
from services.eventlog import (
    EventLogError,
    EventProducer,
    ProducerFenced,
    Record,
    RecordPosition,
    ensure_topics,
)
from services.eventlog.follower import FollowerHalted, LogFollower
from services.registry.domain import CommandEvent, next_epoch, renew_lease
from services.registry.metrics import RegistryMetrics

log = logging.getLogger("loraplane.registry")


Outcome = Literal["not_written", "unknown", "committed"]


class WritesUnavailable(Exception):
    """A request that cannot be answered now: 503 with Retry-After.

    `code` is the problem's stable code: `replaying`, `halted`, `fenced`, `standby`,
    `timeout` or `unavailable` (the event log did not take the write). `outcome` tells a
    client what became of its command: `not_written` (refused before anything was sent to
    the log: safe to send elsewhere), `unknown` (the write was sent and may have committed:
    retry with the same Idempotency-Key) or `committed` (it is in the log; a retry with the
    same key gets its answer).
    """

    def __init__(self, message: str, *, retry_after_s: int = 1,
                 code: str = "unavailable", outcome: Outcome = "not_written") -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.code = code
        self.outcome = outcome

    @property
    def fenced(self) -> bool:
        return self.code == "fenced"


class Deadline:
    """The moment a request must have its answer by."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())


class CommandLock:
    """The one lock commands run under: first come, first served, with leases ahead of
    the queue. A plain lock let a lease lose the race for it again and again to client
    writes queued behind slow commits, until its deadline: writes committed every few
    seconds while no lease did, and every worker's version wall ran out (the cluster's
    registry-kill run, right after a takeover)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._held = False
        self._queue: list[tuple[int, int]] = []
        self._tickets = itertools.count()

    def acquire(self, timeout: float, *, urgent: bool = False) -> bool:
        with self._changed:
            ticket = (0 if urgent else 1, next(self._tickets))
            heapq.heappush(self._queue, ticket)
            if self._changed.wait_for(lambda: not self._held and self._queue[0] == ticket,
                                      timeout=None if math.isinf(timeout) else
                                      max(0.0, timeout)):
                heapq.heappop(self._queue)
                self._held = True
                return True
            self._queue.remove(ticket)
            heapq.heapify(self._queue)
            self._changed.notify_all()
            return False

    def release(self) -> None:
        with self._changed:
            self._held = False
            self._changed.notify_all()


@dataclass(frozen=True)
class Committed:
    """A command's event: just written, or the first answer to a retried idempotent key."""

    envelope: Envelope
    position: LogPosition | None
    replayed: bool = False


class RegistryNode:
    def __init__(self, settings: Settings, metrics: RegistryMetrics | None = None,
                 registry_id: str | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or RegistryMetrics()
        self.registry_id = (registry_id or settings.registry_id
                            or f"registry-{uuid.uuid4().hex[:12]}")
        self.election = settings.registry_election
        self.fold = CatalogFold(settings.stale_lease_threshold_s, on_folded=self._count)
        self.follower = LogFollower(settings, self.fold, reader_id=self.registry_id,
                                    snapshot_name="registry")
        self.state_lock = self.follower.lock
        self._command_lock = CommandLock()
        self._producer: EventProducer | None = None
        self._fenced: str | None = None
        self._needs_sync = False
        self.write_error: str | None = None
        """Why the last write failed; None once one succeeds."""
        self.epoch = 0
        self.ready = threading.Event()
        """Set once the log is replayed: the state is complete and reads are answered."""
        self.active = threading.Event()
        """Set while this instance holds the writer role."""
        self.on_activate: list[Callable[[CatalogState], None]] = []
        """Called with the folded state, under the command lock, each time this instance
        takes the writer role: what was pending then is what earlier writers left."""
        self.stepped_down: str | None = None
        """Why this instance last gave up the writer role (lease election)."""
        self.last_takeover_s: float | None = None
        """Seconds from the last write folded from the old writer to this instance's
        first lease, at its last takeover."""
        self.last_error: str | None = None
        self._writer_seen = time.monotonic()
        """When the last sign of a writer (an adapter event, another instance's lease) was
        folded: the standby's clock for a silent writer."""
        self._last_commit: float | None = None
        self._last_lease: float | None = None
        """When a lease of this instance last committed (monotonic)."""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def state(self) -> CatalogState:
        """The folded catalog; read it under `state_lock`."""
        return self.fold.state

    def _count(self, record: Record) -> None:
        envelope = record.envelope
        self.metrics.events_folded.labels(envelope.type).inc()
        if record.topic == self.settings.adapter_events_topic or (
                isinstance(envelope.payload, RegistryLease)
                and envelope.payload.registry_id != self.registry_id):
            self._writer_seen = time.monotonic()

    @property
    def role(self) -> str:
        if not self.ready.is_set():
            return "starting"
        return "active" if self.active.is_set() else "standby"

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Replay in the background, then write (`start` election, fencing older
        instances first) or stand by (`lease`); see the module doc."""
        self._spawn(self._start_up, "start")

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=f"{self.registry_id}-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=15)
        self.follower.stop()
        if self._producer is not None and self.active.is_set() and self.writable:
            try:
                self._producer.close()
            except EventLogError as exc:  # pragma: no cover - best effort at shutdown
                log.warning("closing producer: %s", exc)
        self._producer = None
        self.active.clear()
        self.metrics.ready.set(0)
        self.metrics.writable.set(0)
        self.metrics.active.set(0)

    def _new_producer(self) -> EventProducer:
        # A transaction begun right after the previous commit can meet CONCURRENT_TRANSACTIONS
        # until the broker has written the commit markers; librdkafka then retries after
        # retry.backoff.ms (default 100 ms). A short backoff keeps that retry cheap.
        timeout = self.settings.registry_write_timeout_s
        return EventProducer(
            self.settings, transactional_id=self.settings.registry_transactional_id,
            client_id=self.registry_id, timeout_s=timeout,
            **{"message.timeout.ms": int(timeout * 1000), "retry.backoff.ms": 5,
               "retry.backoff.max.ms": 100})

    def _start_up(self) -> None:
        while not self._stop.is_set():
            try:
                ensure_topics(self.settings)
                if self.election == "start":
                    self._producer = self._new_producer()  # fences older instances
                break
            except Exception as exc:
                self.last_error = f"start-up: {exc}"
                log.warning("registry start-up failed, retrying: %s", exc)
                self._stop.wait(1.0)
        if self._stop.is_set():
            return
        self.follower.start()
        while not self.follower.wait_ready(0.2):
            if self._stop.is_set() or self.follower.halt is not None:
                return
        self.ready.set()
        self.metrics.ready.set(1)
        if self.election == "start":
            assert self._producer is not None
            self._command_lock.acquire(math.inf, urgent=True)
            try:
                self._activate(self._producer)
            finally:
                self._command_lock.release()
        else:
            log.info("%s: replayed; standing by (writes go to the instance holding the "
                     "lease)", self.registry_id)
            self._spawn(self._election_thread, "election")
        self._spawn(self._lease_thread, "lease")

    def _activate(self, producer: EventProducer) -> None:
        """Take the writer role with a producer that has just fenced every other one;
        the caller holds the command lock and has folded the log to its end."""
        self._producer = producer
        with self.state_lock:
            self.epoch = next_epoch(self.state)
            for hook in self.on_activate:
                hook(self.state)
        self._fenced = None
        self.write_error = None
        self._needs_sync = False
        self._last_commit = time.monotonic()
        self.active.set()
        self.metrics.lease_epoch.set(self.epoch)
        self.metrics.writable.set(1)
        self.metrics.active.set(1)

    # --- the lease and the election ----------------------------------------------------

    def _lease_thread(self) -> None:
        """A lease every `lease_interval_s`, at a fixed rate: a slow renewal does not push
        the next one back (readiness counts on a commit every interval). After one that
        took longer than an interval, half an interval passes first, so the writes queued
        behind it get the command lock."""
        interval = self.settings.lease_interval_s
        due = time.monotonic()
        while not self._stop.is_set() and self._fenced is None:
            if self.active.is_set():
                try:
                    self.renew_lease()
                except WritesUnavailable as exc:
                    log.warning("lease not renewed: %s", exc.message)
            due = max(due + interval, time.monotonic() + interval / 2)
            self._stop.wait(due - time.monotonic())

    def renew_lease(self) -> Committed:
        """One lease, with a write's deadline: over a slow link a commit takes seconds, and
        a lease that gave up after one interval would never commit there, while the
        version wall of every worker ran out although writes still went through."""
        deadline = Deadline(self.settings.registry_write_timeout_s)
        return self.execute("lease", self._lease_decision, actor=self.registry_id,
                            deadline=deadline)

    def writer_silent_s(self) -> float:
        """Seconds since this instance last folded a sign of a writer."""
        return time.monotonic() - self._writer_seen

    def _election_thread(self) -> None:
        """Take over once the writer has been silent for `lease_ttl_s` (counted from this
        instance's start when nobody has ever leased), plus a random part of a lease
        interval: standbys started together, or noticing the same silence, do not all
        take over at once (each would fence the one before; safe, but a needless
        failover)."""
        ttl = self.settings.lease_ttl_s
        tick = min(0.25, self.settings.lease_interval_s / 4)
        jitter = random.Random()
        wait = ttl + jitter.uniform(0, self.settings.lease_interval_s)
        while not self._stop.wait(tick):
            if self.active.is_set() or self.follower.halt is not None:
                continue
            if self.writer_silent_s() < wait:
                continue
            # Read the log to its end first: a reader that is merely behind must not
            # mistake its own lag for a silent writer.
            try:
                if not self.follower.sync(ttl):
                    continue
            except FollowerHalted:
                continue
            silent = self.writer_silent_s()
            if silent < wait:
                continue
            with self.state_lock:
                never_leased = self.state.lease is None
            if never_leased:
                self._take_over(None, "no writer has leased yet")
            else:
                self._take_over(silent, f"nothing from the writer for {silent:.1f}s")
            wait = ttl + jitter.uniform(0, self.settings.lease_interval_s)

    def _take_over(self, silent: float | None, why: str) -> None:
        """`silent`: how long the old writer had been silent (None: there was none)."""
        started = time.monotonic()
        log.warning("%s: %s; taking over the writer role", self.registry_id, why)
        try:
            producer = self._new_producer()  # Kafka fences the old writer here
        except Exception as exc:
            self.last_error = f"taking over: {exc}"
            log.warning("%s: cannot take over: %s", self.registry_id, exc)
            return
        timeout = self.settings.registry_write_timeout_s
        if not self._command_lock.acquire(timeout, urgent=True):
            return
        try:
            try:
                synced = self.follower.sync(timeout)
            except FollowerHalted:
                synced = False
            if not synced or self._stop.is_set():
                self.last_error = "taking over: the log could not be read to its end"
                log.warning("%s: %s; staying standby", self.registry_id, self.last_error)
                return
            self._activate(producer)
        finally:
            self._command_lock.release()
        self.stepped_down = None
        try:
            self.renew_lease()
        except WritesUnavailable as exc:
            log.warning("%s: first lease after taking over failed: %s", self.registry_id,
                        exc.message)
            return
        if silent is None:
            log.warning("%s: took the writer role at epoch %d", self.registry_id, self.epoch)
            return
        self.last_takeover_s = round(silent + time.monotonic() - started, 3)
        self.metrics.takeovers.inc()
        self.metrics.takeover_seconds.set(self.last_takeover_s)
        log.warning("%s: took over the writer role at epoch %d, %.2fs after the last sign "
                    "of the old writer", self.registry_id, self.epoch, self.last_takeover_s)

    # --- state checks --------------------------------------------------------------------

    def require_state(self) -> None:
        """The folded state is complete and current enough to answer from (reads, and the
        checks a write makes before it queues)."""
        halt = self.follower.halt
        if halt is not None and not self.ready.is_set():
            raise WritesUnavailable(f"the registry stopped replaying: {halt.reason}",
                                    retry_after_s=30, code="halted")
        if not self.ready.is_set():
            raise WritesUnavailable("the registry is replaying the log; retry shortly",
                                    retry_after_s=1, code="replaying")

    def _check_writable(self) -> None:
        self.require_state()
        halt = self.follower.halt
        if halt is not None:
            raise WritesUnavailable(f"writes are stopped: {halt.reason}", retry_after_s=30,
                                    code="halted")
        self._check_not_superseded()
        if self._fenced is not None:
            raise WritesUnavailable(f"this registry instance lost the writer role "
                                    f"({self._fenced}); send writes to the current one",
                                    retry_after_s=5, code="fenced")
        if not self.active.is_set():
            raise WritesUnavailable(f"this registry instance is a standby ({self._holder()}); "
                                    "send writes to the active one", retry_after_s=1,
                                    code="standby")

    def _holder(self) -> str:
        with self.state_lock:
            lease = self.state.lease
        if lease is None:
            return "no instance holds the lease yet"
        return f"instance {lease.registry_id} leased at epoch {lease.epoch}"

    def _check_not_superseded(self) -> None:
        """A newer instance that leases has fenced this one, whether or not our producer
        has been told yet."""
        if not self.active.is_set():
            return
        with self.state_lock:
            lease = self.state.lease
        if (lease is not None and lease.registry_id != self.registry_id
                and lease.epoch >= self.epoch):
            self._fence(f"instance {lease.registry_id} leases at epoch {lease.epoch}")

    def _fence(self, why: str, outcome: Outcome = "not_written") -> WritesUnavailable:
        """Another instance holds the writer role: `start` election stays read-only until
        restarted, `lease` election steps down to standby."""
        if self.active.is_set():
            self.active.clear()
            self._producer = None  # fenced for good: never flushed, never initialised again
            self.metrics.active.set(0)
            self.metrics.writable.set(0)
            if self.election == "lease":
                self.stepped_down = why
                self._writer_seen = time.monotonic()  # the new writer gets a full lease_ttl_s
                log.warning("%s: lost the writer role (%s); standing by", self.registry_id,
                            why)
            else:
                self._fenced = why
                self.metrics.ready.set(0)
                log.error("fenced: %s; read-only until restarted", why)
        code = "fenced" if self.election == "start" else "standby"
        return WritesUnavailable(f"this registry instance lost the writer role ({why}); "
                                 "send writes to the current one", retry_after_s=5,
                                 code=code, outcome=outcome)

    # --- writes --------------------------------------------------------------------------

    def execute(self, command: str, decide: Callable[[CatalogState], CommandEvent], *,
                actor: str, idempotency_key: str | None = None,
                expect: tuple[str, str] | None = None, request_sha256: str | None = None,
                trace_id: str | None = None, deadline: Deadline | None = None) -> Committed:
        """Run one command; `expect` is (event type, stream) for idempotent replays, and
        `request_sha256` the fingerprint a reused key must match."""
        deadline = deadline or Deadline(self.settings.registry_write_timeout_s)
        started = time.perf_counter()
        outcome = "error"
        try:
            self.require_state()
            if not self._command_lock.acquire(deadline.left(), urgent=command == "lease"):
                raise WritesUnavailable(
                    f"no answer within {deadline.seconds:g}s: earlier writes are still "
                    "waiting on the event log", retry_after_s=self._retry_after(),
                    code="timeout")
            try:
                self.require_state()
                if idempotency_key and expect is not None:
                    with self.state_lock:
                        prior = self.state.prior_answer(actor, idempotency_key, *expect,
                                                        request_sha256=request_sha256)
                    if prior is not None:
                        outcome = "replayed"
                        return Committed(prior.envelope, prior.position, replayed=True)
                self._check_writable()
                producer = self._ready_producer(deadline)
                committed = self._commit(producer, decide, actor, trace_id, request_sha256,
                                         deadline)
                outcome = "ok"
                if command != "lease" and self._lease_overdue():
                    self._lease_before_answering(producer, deadline)
                return committed
            finally:
                self._command_lock.release()
        except WritesUnavailable:
            outcome = "unavailable"
            raise
        finally:
            self.metrics.commands.labels(command, outcome).inc()
            if outcome == "ok":
                self.metrics.command_seconds.labels(command).observe(
                    time.perf_counter() - started)

    def _commit(self, producer: EventProducer, decide: Callable[[CatalogState], CommandEvent],
                actor: str, trace_id: str | None, request_sha256: str | None,
                deadline: Deadline) -> Committed:
        """Decide on the folded state, write the event and wait until it is folded back;
        the caller holds the command lock."""
        with self.state_lock:
            decision = decide(self.state)
        payload = decision.payload
        if request_sha256 and "request_sha256" in type(payload).model_fields:
            payload = payload.model_copy(update={"request_sha256": request_sha256})
        envelope = Envelope.new(payload, stream=decision.stream, seq=decision.seq, actor=actor,
                                tenant=decision.tenant, trace_id=trace_id)
        written = self._publish(producer, envelope, deadline)
        if not self._wait_folded(written, deadline):
            raise WritesUnavailable(
                f"event committed at {written.topic}[{written.partition}]@{written.offset} "
                "but not read back yet; retry with the same Idempotency-Key", code="timeout",
                outcome="committed")
        if isinstance(payload, RegistryLease):
            self._last_lease = time.monotonic()
        return Committed(envelope, LogPosition(written.topic, written.partition,
                                               written.offset))

    def _lease_decision(self, state: CatalogState) -> CommandEvent:
        expires = datetime.now(UTC) + timedelta(seconds=self.settings.lease_ttl_s)
        return renew_lease(state, self.registry_id, self.epoch, expires)

    def _lease_overdue(self) -> bool:
        return (self._last_lease is None
                or time.monotonic() - self._last_lease > self.settings.lease_interval_s)

    def _lease_before_answering(self, producer: EventProducer, deadline: Deadline) -> None:
        """A write that commits when no lease has for an interval (the first after an
        outage, or one that hung through it) leases before it is answered. Answered first,
        it was acknowledged while the workers' version walls still counted from the lease
        before the outage; they ran out a moment later, until the lease thread's next turn
        (half an interval after its failed renewal), and requests were refused while writes
        went through (the cluster's kafka-leader-kill run). The write itself stands if the
        lease fails: it is committed."""
        try:
            self._commit(producer, self._lease_decision, self.registry_id, None, None,
                         Deadline(max(deadline.left(), self.settings.lease_interval_s)))
        except WritesUnavailable as exc:
            log.warning("lease after a write not renewed: %s", exc.message)

    def _retry_after(self) -> int:
        return max(1, round(self.settings.registry_write_timeout_s))

    def _ready_producer(self, deadline: Deadline) -> EventProducer:
        """The producer, after a failed write: its transaction aborted and the log re-read
        to its end, so the next decision sees whatever that write left."""
        producer = self._producer
        if producer is None:
            raise WritesUnavailable("the registry is starting", code="replaying")
        if not self._needs_sync:
            return producer
        try:
            producer.recover(deadline.left())
            synced = self.follower.sync(deadline.left())
        except ProducerFenced as exc:
            raise self._fence(str(exc)) from exc
        except FollowerHalted as exc:
            raise WritesUnavailable(f"writes are stopped: {exc}", retry_after_s=30,
                                    code="halted") from exc
        except EventLogError as exc:
            self._note_write_error(f"recovering from the last failed write: {exc}")
            raise WritesUnavailable(f"event log unavailable: {exc}",
                                    retry_after_s=self._retry_after()) from exc
        if not synced:
            raise WritesUnavailable("re-reading the log after a failed write took too long",
                                    retry_after_s=self._retry_after(), code="timeout")
        self._check_writable()
        self._needs_sync = False
        return producer

    def _publish(self, producer: EventProducer, envelope: Envelope,
                 deadline: Deadline) -> RecordPosition:
        if deadline.left() < 0.01:
            raise WritesUnavailable(f"no answer within {deadline.seconds:g}s",
                                    retry_after_s=self._retry_after(), code="timeout")
        try:
            written = producer.publish(envelope, timeout_s=deadline.left())
        except ProducerFenced as exc:
            # A commit whose answer was lost may have gone through before the fence.
            raise self._fence(str(exc), outcome="unknown") from exc
        except EventLogError as exc:
            self._needs_sync = True
            self._note_write_error(f"write: {exc}")
            raise WritesUnavailable(f"event log unavailable: {exc}",
                                    retry_after_s=self._retry_after(),
                                    outcome="unknown") from exc
        if self.write_error is not None:
            log.info("writes go through again")
        self.write_error = None
        self._last_commit = time.monotonic()
        self.metrics.writable.set(1)
        return written

    def _note_write_error(self, message: str) -> None:
        self.write_error = self.last_error = message
        self.metrics.writable.set(0)

    def _wait_folded(self, written: RecordPosition, deadline: Deadline) -> bool:
        try:
            return self.follower.wait_applied(written.topic, written.partition,
                                              written.offset, deadline.left())
        except FollowerHalted as exc:
            raise WritesUnavailable(f"the event was committed at {written.topic}"
                                    f"[{written.partition}]@{written.offset}, but writes are "
                                    f"stopped: {exc}", retry_after_s=30, code="halted",
                                    outcome="committed") from exc

    # --- status --------------------------------------------------------------------------

    @property
    def fenced(self) -> bool:
        return self._fenced is not None

    @property
    def commit_age_s(self) -> float | None:
        """Seconds since this instance's last committed write (None: it never wrote)."""
        return None if self._last_commit is None else time.monotonic() - self._last_commit

    @property
    def writable(self) -> bool:
        return self.readiness()[0]

    def read_consistency(self) -> str:
        """`linearizable` when a read answered now reflects every write committed so far.

        True of the writer while its writes commit, under the `lease` election: a standby
        takes over only after `lease_ttl_s` of silence, longer than the `2 x
        lease_interval_s` within which `readiness` requires a commit, so while this
        instance is ready no other can have committed. Evaluated after a read, it covers
        that read. A standby's reads, a writer's once its commits stop, and any under the
        `start` election (a new instance fences the old one without waiting) may lag:
        `stale-possible`."""
        lease_bounds_reads = (self.election == "lease"
                              and 2 * self.settings.lease_interval_s < self.settings.lease_ttl_s)
        ready, _ = self.readiness()
        return "linearizable" if ready and lease_bounds_reads else "stale-possible"

    def readiness(self) -> tuple[bool, str]:
        """(ready to take writes, why not): what `/readyz` says."""
        halt = self.follower.halt
        if halt is not None:
            return False, f"halted: {halt.reason}"
        if not self.ready.is_set():
            return False, "replaying the log"
        self._check_not_superseded()
        if self._fenced is not None:
            return False, f"fenced: {self._fenced}"
        if not self.active.is_set():
            return False, f"standby: {self._holder()}"
        if self.write_error is not None:
            return False, f"not writable: {self.write_error}"
        age = self.commit_age_s
        bound = 2 * self.settings.lease_interval_s
        if age is not None and age > bound:
            return False, (f"not writable: nothing committed for {age:.1f}s (a lease "
                           f"commits every {self.settings.lease_interval_s:g}s)")
        return True, "ready"
