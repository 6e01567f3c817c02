"""One registry instance: its transactional producer, its fold of the log, its lease.

The command path (`execute`) is the single-writer discipline of ARCHITECTURE.md:
  idempotency check → decide one event on the folded state → publish it in its own
  transaction → wait until this instance's own consumer has folded it → answer.
Commands are serialised by one lock, so every decision sees the previous command's event
(sequence numbers stay gap-free and If-Match checks are exact). Reads never touch the
broker: they take the state lock for a moment and answer from memory, so they keep
working while the broker is down.

Failure handling:
- `ProducerFenced`: another instance initialised the same transactional id; this one
  refuses every later write (503) and stops leasing. Reads keep working.
- Any other produce failure (broker down, timeout): 503 with Retry-After. The failed
  transaction is aborted by the producer, or by the broker when the next producer with
  our id initialises; nothing of it becomes visible. The next write first re-creates the
  producer and re-reads the log up to a fresh barrier before deciding anything.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from services.catalog.state import CatalogState, LogPosition
from services.config import Settings
from services.contracts.events import Envelope, ReplayBarrier
from services.eventlog import (
    EventConsumer,
    EventLogError,
    EventProducer,
    ProducerFenced,
    Record,
    RecordPosition,
    ensure_topics,
)
from services.registry.domain import Decision, next_epoch, renew_lease
from services.registry.metrics import RegistryMetrics

log = logging.getLogger("loraplane.registry")

Partition = tuple[str, int]


class WritesUnavailable(Exception):
    """A write that cannot be taken now: 503 with Retry-After."""

    def __init__(self, message: str, *, retry_after_s: int = 1, fenced: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.fenced = fenced


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
        self.registry_id = registry_id or f"registry-{uuid.uuid4().hex[:12]}"
        self.state = CatalogState(stale_after_s=settings.stale_lease_threshold_s)
        self.state_lock = threading.RLock()
        self._folded = threading.Condition(self.state_lock)
        self._applied: dict[Partition, int] = {}
        self._partitions: list[Partition] = []
        self._command_lock = threading.Lock()
        self._producer: EventProducer | None = None
        self._producer_broken = False
        self.fenced = False
        self.epoch = 0
        self.ready = threading.Event()
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start replaying in the background; `ready` is set once replay reached a barrier."""
        fold = threading.Thread(target=self._fold_thread, name=f"{self.registry_id}-fold",
                                daemon=True)
        self._threads.append(fold)
        fold.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=15)
        if self._producer is not None and not self._producer_broken and not self.fenced:
            try:
                self._producer.close()
            except EventLogError as exc:  # pragma: no cover - best effort at shutdown
                log.warning("closing producer: %s", exc)
        self._producer = None
        self.metrics.ready.set(0)

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

    def _open(self) -> EventConsumer:
        """Fence any older instance, then fold everything before a barrier of our own."""
        ensure_topics(self.settings)
        self._producer = self._new_producer()  # init_transactions fences older instances
        consumer = EventConsumer(self.settings, self.settings.topics,
                                 reader_id=self.registry_id)
        try:
            self._partitions = consumer.assignment
            consumer.catch_up(self._fold, producer=self._producer,
                              timeout_s=max(30.0, self.settings.registry_write_timeout_s))
            self._sync_positions(consumer)
        except BaseException:
            consumer.close()
            raise
        with self.state_lock:
            self.epoch = next_epoch(self.state)
        self.metrics.lease_epoch.set(self.epoch)
        return consumer

    def _fold_thread(self) -> None:
        consumer: EventConsumer | None = None
        while consumer is None and not self._stop.is_set():
            try:
                consumer = self._open()
            except Exception as exc:
                self.last_error = f"start-up: {exc}"
                log.warning("registry start-up failed, retrying: %s", exc)
                self._stop.wait(1.0)
        if consumer is None:
            return
        self.ready.set()
        self.metrics.ready.set(1)
        self.metrics.writable.set(1)
        lease = threading.Thread(target=self._lease_thread, name=f"{self.registry_id}-lease",
                                 daemon=True)
        self._threads.append(lease)
        lease.start()
        try:
            while not self._stop.is_set():
                try:
                    # consume() waits its whole timeout unless the batch fills, so wait for
                    # one record (a command is waiting on it), then drain without waiting.
                    records = consumer.poll(timeout=0.1, max_records=1)
                    if records:
                        records += consumer.poll(timeout=0, max_records=500)
                    for record in records:
                        self._fold(record)
                    self._sync_positions(consumer)
                except Exception as exc:
                    self.last_error = f"fold: {exc}"
                    log.warning("fold loop: %s", exc)
                    self._stop.wait(0.5)
        finally:
            consumer.close()

    def _fold(self, record: Record) -> None:
        position = LogPosition(record.topic, record.partition, record.offset)
        with self._folded:
            try:
                self.state.apply(record.envelope, position)
            except Exception:  # a fold bug must not stop the registry from reading
                log.exception("cannot fold %s %s", record.envelope.type, record.envelope.event_id)
            self._applied[(record.topic, record.partition)] = record.offset + 1
            self._folded.notify_all()
        self.metrics.events_folded.labels(record.envelope.type).inc()

    def _sync_positions(self, consumer: EventConsumer) -> None:
        """Positions include barriers and skipped records, which `_fold` never sees."""
        positions = consumer.positions()
        with self._folded:
            changed = False
            for key, offset in positions.items():
                if offset > self._applied.get(key, 0):
                    self._applied[key] = offset
                    changed = True
            if changed:
                self._folded.notify_all()

    def wait_folded(self, position: RecordPosition | LogPosition, timeout_s: float) -> bool:
        key = (position.topic, position.partition)
        with self._folded:
            return self._folded.wait_for(lambda: self._applied.get(key, 0) > position.offset,
                                         timeout=timeout_s)

    # --- the lease -----------------------------------------------------------------------

    def _lease_thread(self) -> None:
        interval = self.settings.lease_interval_s
        while not self._stop.is_set() and not self.fenced:
            try:
                self.renew_lease()
            except WritesUnavailable as exc:
                log.warning("lease not renewed: %s", exc.message)
            self._stop.wait(interval)

    def renew_lease(self) -> Committed:
        expires = datetime.now(UTC) + timedelta(seconds=self.settings.lease_ttl_s)
        return self.execute("lease", lambda s: renew_lease(s, self.registry_id, self.epoch,
                                                           expires),
                            actor=self.registry_id)

    # --- writes --------------------------------------------------------------------------

    def execute(self, command: str, decide: Callable[[CatalogState], Decision], *,
                actor: str, idempotency_key: str | None = None,
                expect: tuple[str, str] | None = None, trace_id: str | None = None) -> Committed:
        """Run one command; `expect` is (event type, stream) for idempotent replays."""
        started = time.perf_counter()
        outcome = "error"
        try:
            with self._command_lock:
                if idempotency_key and expect is not None:
                    with self.state_lock:
                        prior = self.state.prior_answer(actor, idempotency_key, *expect)
                    if prior is not None:
                        outcome = "replayed"
                        return Committed(prior.envelope, prior.position, replayed=True)
                self._check_writable()
                with self.state_lock:
                    decision = decide(self.state)
                envelope = Envelope.new(decision.payload, stream=decision.stream,
                                        seq=decision.seq, actor=actor, tenant=decision.tenant,
                                        trace_id=trace_id)
                written = self._publish(envelope)
                if not self.wait_folded(written, self.settings.registry_write_timeout_s):
                    raise WritesUnavailable(
                        f"event committed at {written.topic}[{written.partition}]@"
                        f"{written.offset} but not read back yet; retry with the same "
                        "Idempotency-Key")
                outcome = "ok"
                return Committed(envelope, LogPosition(written.topic, written.partition,
                                                       written.offset))
        except WritesUnavailable:
            outcome = "unavailable"
            raise
        finally:
            self.metrics.commands.labels(command, outcome).inc()
            if outcome == "ok":
                self.metrics.command_seconds.labels(command).observe(
                    time.perf_counter() - started)

    def _check_writable(self) -> None:
        if self.fenced:
            raise WritesUnavailable("this registry instance was fenced by a newer one; "
                                    "send writes to the current instance", retry_after_s=5,
                                    fenced=True)
        if not self.ready.is_set():
            raise WritesUnavailable("registry is replaying the log", retry_after_s=1)

    def _fence(self, exc: Exception) -> WritesUnavailable:
        self.fenced = True
        self.metrics.writable.set(0)
        self.metrics.ready.set(0)
        log.error("fenced: %s", exc)
        return WritesUnavailable(f"this registry instance was fenced: {exc}", retry_after_s=5,
                                 fenced=True)

    def _publish(self, envelope: Envelope) -> RecordPosition:
        try:
            producer = self._writer()
            return producer.publish(envelope)
        except ProducerFenced as exc:
            raise self._fence(exc) from exc
        except (EventLogError, TimeoutError) as exc:
            self._producer_broken = True
            self.last_error = f"write: {exc}"
            raise WritesUnavailable(f"event log unavailable: {exc}",
                                    retry_after_s=max(1, round(
                                        self.settings.registry_write_timeout_s))) from exc

    def _writer(self) -> EventProducer:
        """The producer; after a failed write, a fresh one synced to a new barrier."""
        if self._producer is not None and not self._producer_broken:
            return self._producer
        self._producer = None
        producer = self._new_producer()
        barriers = [
            (Envelope.new(ReplayBarrier(reader=self.registry_id, nonce=uuid.uuid4().hex,
                                        partition=p),
                          stream=f"barrier/{self.registry_id}/{t}/{p}", seq=1,
                          actor=self.registry_id), t, p)
            for t, p in self._partitions
        ]
        for position in producer.publish_all(barriers):
            if not self.wait_folded(position, self.settings.registry_write_timeout_s):
                raise TimeoutError(f"did not read back barrier {position}")
        with self.state_lock:
            lease = self.state.lease
            if lease is not None and lease.registry_id != self.registry_id:
                self.epoch = max(self.epoch, lease.epoch + 1)
        self._producer = producer
        self._producer_broken = False
        return producer

    # --- status --------------------------------------------------------------------------

    @property
    def writable(self) -> bool:
        return self.ready.is_set() and not self.fenced and not self._producer_broken
