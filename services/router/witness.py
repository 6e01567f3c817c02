"""The router's witness of answers cut mid-stream.

A worker killed while it streams can never trace the requests it was serving, yet their
clients got part of an answer from a known adapter version. The router saw it: when a
worker's stream breaks after the first token, the router writes the request's trace
itself, a `RequestServed` with `witness="router"` and status `cut` (the worker, the
version it pinned, the tokens it passed on; `prompt_tokens` 0: the router does not
tokenise) on its own stream `router/{router_id}` of the worker-events topic. Where the
worker did trace the request too (its trace was in the log before its final message, and
it died before that message got out), the audit store holds both and `served_by` keeps
the worker's.

The request path only appends (`record`); a thread of its own numbers the events
gap-free after what the log already holds for the stream (`observe`, fed by the router's
fold), writes them, and keeps them, in order, while the broker is away.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from services.config import Settings
from services.contracts.events import Envelope, RequestServed, ServedRequest
from services.eventlog import Backoff, EventLogError, EventProducer

log = logging.getLogger("loraplane.router.witness")


def router_stream(router_id: str) -> str:
    return f"router/{router_id}"


class CutWitness:
    """Traces of requests whose worker stream broke mid-answer, written by the router."""

    def __init__(self, settings: Settings, router_id: str,
                 producer_factory: Callable[[], EventProducer] | None = None) -> None:
        self.router_id = router_id
        self.stream = router_stream(router_id)
        self._factory = producer_factory or (lambda: EventProducer(
            settings, client_id=f"{router_id}-witness", timeout_s=10.0))
        self._producer: EventProducer | None = None
        self._last_seq = 0
        self._queue: list[tuple[str, ServedRequest]] = []
        self._numbered: list[Envelope] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.written = 0
        self.last_error: str | None = None

    def observe(self, envelope: Envelope) -> None:
        """Fold one event of the log: the stream's last number (before `start`)."""
        if envelope.stream == self.stream and envelope.seq > self._last_seq:
            self._last_seq = envelope.seq

    def restart_numbering(self, last_seq: int) -> None:
        """The stream's last number as a snapshot of the log says (before `start`)."""
        self._last_seq = last_seq

    def record(self, worker_id: str, request: ServedRequest) -> None:
        """A request `worker_id` was serving when its stream broke (any thread)."""
        with self._lock:
            self._queue.append((worker_id, request))
        self._wake.set()

    @property
    def unwritten(self) -> int:
        with self._lock:
            return len(self._queue) + len(self._numbered)

    def start(self) -> None:
        """Begin writing: the log is replayed, so the stream's last number is known."""
        self._thread = threading.Thread(target=self._run, name="router-witness", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (for up to `timeout_s`), then stop."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        if self._producer is not None:
            try:
                self._producer.close()
            except EventLogError as exc:  # pragma: no cover - best effort at shutdown
                log.warning("closing the witness producer: %s", exc)
            self._producer = None

    def _run(self) -> None:
        backoff = Backoff()
        while True:
            stopping = self._stop.is_set()
            try:
                self._write()
                backoff.succeeded()
            except EventLogError as exc:
                self.last_error = str(exc)
                log.warning("cut requests not traced yet (%d waiting): %s", self.unwritten, exc)
                self._producer = None
                if stopping:
                    return
                backoff.wait(self._stop)
                continue
            if stopping:
                return
            self._wake.wait()
            self._wake.clear()

    def _write(self) -> None:
        """One event per worker, numbered once: a failed write is retried with the same
        envelopes (readers drop a duplicate by event id, and no number is skipped)."""
        with self._lock:
            queued, self._queue = self._queue, []
        by_worker: dict[str, list[ServedRequest]] = {}
        for worker_id, request in queued:
            by_worker.setdefault(worker_id, []).append(request)
        for worker_id, requests in by_worker.items():
            self._last_seq += 1
            self._numbered.append(Envelope.new(
                RequestServed(worker_id=worker_id, requests=requests, witness="router"),
                stream=self.stream, seq=self._last_seq, actor=self.router_id))
        if not self._numbered:
            return
        if self._producer is None:
            self._producer = self._factory()
        self._producer.publish_all([(e, None, None) for e in self._numbered])
        self.written += sum(len(e.payload.requests) for e in self._numbered)  # type: ignore[attr-defined]
        self._numbered = []
