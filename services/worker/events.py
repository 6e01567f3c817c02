"""Worker events: acks, heartbeats and request traces, sent by one thread of their own.

Nothing that serves tokens waits on the broker: the engine loop and the gRPC front only
append to an outbox; this thread numbers the events on the worker's streams (`worker/{id}`
on worker-events; heartbeats on `heartbeat/{id}` on the liveness topic; gap-free `seq`
continuing what the log already holds for each), writes them
through the project's `EventProducer` in order, and retries with backoff while the broker
is away (events are kept, in order, not dropped). A `WorkerHeartbeat` goes out every
`heartbeat_interval_s`.

Request traces answer "which digest served request R" (`served_by`) and must outlive the
worker: with `worker_trace_durable` (the default) `trace` returns a future that is set
once the broker acknowledged the `RequestServed` holding it, and the gRPC front sends the
request's final message only then. The thread writes queued traces as soon as it is
free, all of them in one event (group commit): while one write waits for its
acknowledgement, the traces of requests finishing meanwhile gather for the next, so a
busy worker still writes few events and the engine loop never waits. With it off, traces
are batched every `worker_trace_flush_s` (or 200 traces) and nothing waits for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from services.catalog.state import heartbeat_stream
from services.config import Settings
from services.contracts.events import (
    Envelope,
    Payload,
    RequestServed,
    ServedRequest,
    TenantRef,
    WorkerHeartbeat,
)
from services.eventlog import Backoff, EventLogError, EventProducer
from services.worker.follower import worker_stream

log = logging.getLogger("loraplane.worker.events")

MAX_TRACES_PER_EVENT = 200

Durable = Future[None]
"""Set once a trace is in the log (acknowledged by the broker)."""


class WorkerEvents:
    """The outbox and the thread that empties it."""

    def __init__(self, settings: Settings, worker_id: str,
                 heartbeat: Callable[[], WorkerHeartbeat | None],
                 producer_factory: Callable[[], EventProducer] | None = None) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.stream = worker_stream(worker_id)
        self.beats = heartbeat_stream(worker_id)
        self._heartbeat = heartbeat
        self._factory = producer_factory or (lambda: EventProducer(
            settings, client_id=f"{worker_id}-events", timeout_s=10.0))
        self._producer: EventProducer | None = None
        self.durable = settings.worker_trace_durable
        self._outbox: deque[tuple[Payload, TenantRef | None, str | None, list[Durable]]] = \
            deque()
        self._traces: list[ServedRequest] = []
        self._waiters: list[Durable] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_seq: dict[str, int] = {}
        self._numbered: list[Envelope] = []
        self._numbered_waiters: list[Durable] = []
        self.sent = 0
        self.last_error: str | None = None
        self._beat_now = False

    # --- producers of events (any thread) ------------------------------------------------

    def emit(self, payload: Payload, *, tenant: TenantRef | None = None,
             trace_id: str | None = None) -> None:
        with self._lock:
            self._outbox.append((payload, tenant, trace_id, []))
        self._wake.set()

    def trace(self, served: ServedRequest) -> Durable | None:
        """Queue a request's trace; with `durable`, the future its final message waits on."""
        waiter: Durable | None = Future() if self.durable else None
        with self._lock:
            self._traces.append(served)
            if waiter is not None:
                self._waiters.append(waiter)
            full = len(self._traces) >= MAX_TRACES_PER_EVENT
        if full or waiter is not None:
            self._wake.set()
        return waiter

    def beat_now(self) -> None:
        """Send a heartbeat at once rather than at the next interval (the drain's)."""
        self._beat_now = True
        self._wake.set()

    @property
    def unsent(self) -> int:
        with self._lock:
            return len(self._outbox) + len(self._traces) + len(self._numbered)

    # --- the thread ----------------------------------------------------------------------

    def start(self, last_seq: dict[str, int]) -> None:
        """Begin sending; `last_seq` is each stream's last number already in the log."""
        self._next_seq = {stream: last_seq.get(stream, 0) + 1
                          for stream in (self.stream, self.beats)}
        self._thread = threading.Thread(target=self._run, name="worker-events", daemon=True)
        self._thread.start()

    def stop(self, flush_timeout_s: float = 10.0) -> None:
        """Send what is queued (traces included), then stop."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=flush_timeout_s + 5)
        if self._producer is not None:
            try:
                self._producer.close()
            except EventLogError as exc:  # pragma: no cover - best effort at shutdown
                log.warning("closing the event producer: %s", exc)

    def _run(self) -> None:
        interval = self.settings.heartbeat_interval_s
        flush = self.settings.worker_trace_flush_s
        next_beat = time.monotonic()
        next_flush = time.monotonic() + flush
        backoff = Backoff()
        while True:
            now = time.monotonic()
            stopping = self._stop.is_set()
            if (now >= next_beat or self._beat_now) and not stopping:
                self._beat_now = False
                beat = self._heartbeat()
                if beat is not None:
                    self.emit(beat)
                next_beat = now + interval
            if (now >= next_flush or stopping or self.durable
                    or len(self._traces) >= MAX_TRACES_PER_EVENT):
                self._batch_traces()
                next_flush = now + flush
            try:
                self._send()
                backoff.succeeded()
            except EventLogError as exc:
                self.last_error = str(exc)
                log.warning("worker events not sent yet (%d waiting): %s", self.unsent, exc)
                self._producer = None
                if stopping:
                    return
                backoff.wait(self._stop)
                continue
            if stopping:
                return
            self._wake.wait(max(0.0, min(next_beat, next_flush) - time.monotonic()))
            self._wake.clear()

    def _batch_traces(self) -> None:
        with self._lock:
            traces, self._traces = self._traces, []
            waiters, self._waiters = self._waiters, []
            for start in range(0, len(traces), MAX_TRACES_PER_EVENT):
                last = start + MAX_TRACES_PER_EVENT >= len(traces)
                self._outbox.append((RequestServed(
                    worker_id=self.worker_id,
                    requests=traces[start:start + MAX_TRACES_PER_EVENT]), None, None,
                    waiters if last else []))

    def _send(self) -> None:
        """Number what is queued, then write it; on failure the same envelopes (same
        event ids, same seqs) are written again, so a retry can only duplicate what
        readers drop by event id, never leave a gap."""
        with self._lock:  # moved from the outbox to the numbered in one hold of the lock:
            # `unsent` read between the two counted neither and said 0 with a batch unsent
            items = list(self._outbox)
            self._outbox.clear()
            for payload, tenant, trace_id, waiters in items:
                self._numbered_waiters.extend(waiters)
                stream = self.beats if isinstance(payload, WorkerHeartbeat) else self.stream
                self._numbered.append(Envelope.new(payload, stream=stream,
                                                   seq=self._next_seq[stream],
                                                   actor=self.worker_id, tenant=tenant,
                                                   trace_id=trace_id))
                self._next_seq[stream] += 1
        if not self._numbered:
            return
        if self._producer is None:
            self._producer = self._factory()
        self._producer.publish_all([(e, None, None) for e in self._numbered])
        self.sent += len(self._numbered)
        self._numbered = []
        waiters, self._numbered_waiters = self._numbered_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
