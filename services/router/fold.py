"""The router's fold of the log, read by the shared follower (`services.eventlog.follower`).

`RouterFold` is what the router's `LogFollower` folds into: the dispatcher's catalog,
membership and ring (`Dispatcher.fold`), and the last number of every router's witness
stream (`services.router.witness`: a restarted router continues its stream without a
gap). Its snapshot holds the catalog and those numbers; membership comes from the
liveness topic, which the follower reads from its start every time.

The request path reads that state on the event loop's thread without a lock, so the fold
changes it only there: until the follower is ready (nothing reads the state yet) records
are folded in the follower's thread as they come; from then on they are handed to the
event loop, which folds them between two requests' decisions, and a snapshot's dump is
taken there too. `seen_at`, the monotonic time membership takes an event to have been
emitted: for replayed events the event's age (`occurred_at` against the wall clock, so a
worker silent for a minute is not taken for live at start), for live ones the moment
the loop folds them (so clock skew between machines does not move workers in or out of
the ring).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from datetime import UTC, datetime

from services.catalog.snapshot import FOLD_VERSION, Document, dump_state, load_state
from services.eventlog import Record
from services.router.dispatch import Dispatcher
from services.router.witness import CutWitness

log = logging.getLogger("loraplane.router")

ROUTER_STREAM_PREFIX = "router/"
DUMP_TIMEOUT_S = 30.0
"""How long the follower waits for the event loop to take a snapshot's dump."""


class RouterFold:
    """The dispatcher's state as a log follower's fold; see the module doc."""

    fold_version = f"{FOLD_VERSION}+router/1"
    wanted_types = None
    """Every type: the catalog's, the workers' (membership) and the routers' own traces."""

    def __init__(self, dispatcher: Dispatcher, witness: CutWitness | None = None) -> None:
        self.dispatcher = dispatcher
        self.witness = witness
        self.router_seqs: dict[str, int] = {}
        """Per router witness stream: its last sequence number in the log."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[Record] = []
        self._lock = threading.Lock()

    # --- the follower's side (its thread) ---------------------------------------------------

    def go_live(self, loop: asyncio.AbstractEventLoop) -> None:
        """From now on records are folded on `loop` (call in the follower's thread, when it
        is ready: its `on_ready`)."""
        self._loop = loop

    def apply(self, record: Record) -> None:
        envelope = record.envelope
        if envelope.stream.startswith(ROUTER_STREAM_PREFIX):
            self.router_seqs[envelope.stream] = max(self.router_seqs.get(envelope.stream, 0),
                                                    envelope.seq)
        loop = self._loop
        if loop is None:
            age = (datetime.now(UTC) - envelope.occurred_at).total_seconds()
            d = self.dispatcher
            d.fold(envelope, d.clock() - max(0.0, age), (record.topic, record.partition))
            if self.witness is not None:
                self.witness.observe(envelope)
            return
        with self._lock:
            first = not self._pending
            self._pending.append(record)
        if first:
            loop.call_soon_threadsafe(self.drain)

    def dump(self) -> Document:
        loop = self._loop
        if loop is None:
            return self._dump()
        done: concurrent.futures.Future[Document] = concurrent.futures.Future()

        def take() -> None:
            self.drain()  # everything the follower folded so far, and nothing after
            try:
                done.set_result(self._dump())
            except BaseException as exc:
                done.set_exception(exc)

        loop.call_soon_threadsafe(take)
        return done.result(timeout=DUMP_TIMEOUT_S)

    def load(self, document: Document | None) -> None:
        assert self._loop is None, "a follower loads its fold only before it is ready"
        catalog = None
        if document is not None:
            catalog = load_state(document["catalog"])
        self.dispatcher.reset(catalog)
        self.router_seqs = dict(document["router_seqs"]) if document else {}
        if self.witness is not None:
            self.witness.restart_numbering(self.router_seqs.get(self.witness.stream, 0))

    def _dump(self) -> Document:
        return {"catalog": dump_state(self.dispatcher.catalog),
                "router_seqs": dict(self.router_seqs)}

    # --- the event loop's side -------------------------------------------------------------

    def drain(self) -> None:
        """Fold what the follower handed over (on the event loop's thread)."""
        with self._lock:
            records, self._pending = self._pending, []
        if not records:
            return
        d = self.dispatcher
        now = d.clock()
        for record in records:
            try:
                d.fold(record.envelope, now, (record.topic, record.partition))
            except Exception:  # a fold bug must not stop the router from reading
                log.exception("cannot fold %s %s", record.envelope.type,
                              record.envelope.event_id)

