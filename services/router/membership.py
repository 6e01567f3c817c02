"""Which workers are in the ring, what each holds per tier, and how busy each is.

A fold of the worker events, pure: the caller passes `seen_at` (its monotonic clock when
it read the event) and `now`. A `WorkerHeartbeat` is a worker's full report (address,
base model, adapters held per tier, free slots and KV blocks) and replaces the previous
one; `AdapterLoaded` / `AdapterUnloaded` between two heartbeats update what it holds. A
worker that has missed `misses` heartbeats (`misses * interval_s` without one) leaves
the ring; its next heartbeat brings it back. A heartbeat that says `draining` (the worker
got SIGTERM) takes it out at the next `expire`, without waiting for missed beats, and
keeps it out until a heartbeat of a new process says otherwise.

Missing heartbeats only mean a silent worker when the partition that carries them is
being read: while a partition's leader fails over (a broker killed), nothing at all is
read from it for several seconds, and every worker whose heartbeats go there would leave
the ring at once although all of them serve. So a worker is taken out only once
something newer than its last heartbeat was read from its partition (another worker's
heartbeat, a lease) and that partition has been read for an interval since it last
stalled (the heartbeats held up behind the failover arrive in a burst, in any order),
or, when that partition stays silent, after `stall_grace_s` more.

The router also remembers where it sent an adapter cold a moment ago (`note_sent`): for
up to `misses` heartbeat intervals that worker counts as `loading` it, so the next
requests follow it there instead of each forcing another cold load elsewhere, and the
cold-load cap counts one load, not one per request until the next heartbeat.

In-flight counts are the router's own (requests it forwarded and has not seen end): they
move with every request, while a heartbeat is up to a second old.

A worker in merged mode (its heartbeat's `merged_mode`) serves one adapter and nothing
else: it is never in a base model's general pool (`eligible`, `serves_base`), only among
`merged_for` that adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from services.contracts.events import (
    AdapterLoaded,
    AdapterUnloaded,
    Envelope,
    MergedMode,
    WorkerHeartbeat,
)
from services.router.ring import Tier

_NOBODY: dict[str, Tier] = {}
Source = tuple[str, int]
"""(topic, partition) a record was read from."""


@dataclass
class WorkerView:
    worker_id: str
    address: str
    base_model: str
    base_digest: str
    seen_at: float
    held: dict[str, Tier] = field(default_factory=dict)
    """Adapter weights sha256 → tier, as the worker last reported."""
    source: Source | None = None
    """(topic, partition) its heartbeats are read from."""
    sent: dict[str, float] = field(default_factory=dict)
    """Adapter sha256 → when this router last placed it here cold."""
    free_slots: int = 0
    free_kv_blocks: int = 0
    merged_mode: MergedMode | None = None
    """Set for a worker dedicated to one adapter merged into its weights."""
    base_weights: str = "dense"
    """How it computes the base (`WorkerHeartbeat.base_weights`): a trace the router
    writes for it says so too."""

    @property
    def dedication(self) -> tuple[str, int | None] | None:
        """(adapter id, pinned version) of a worker in merged mode; None otherwise."""
        mode = self.merged_mode
        return None if mode is None else (mode.adapter_id, mode.pinned_version)


class Membership:
    def __init__(self, *, interval_s: float = 1.0, misses: int = 3,
                 stall_grace_s: float = 15.0) -> None:
        self.interval_s = interval_s
        self.misses = misses
        self.stall_grace_s = stall_grace_s
        self._source_seen: dict[Source, tuple[float, float]] = {}
        """(topic, partition) → when the newest record read from it was seen, and when it
        was first read after its last gap of more than two intervals."""
        self.workers: dict[str, WorkerView] = {}
        self.live: set[str] = set()
        """Workers in the ring now; changed only by `observe` and `expire`."""
        self.draining: set[str] = set()
        """Workers whose last heartbeat said they are draining: out at the next `expire`."""
        self.in_flight: dict[str, int] = {}
        self.generation = 0
        """Moves whenever a pool (`pool_entry`) or `merged_for` may have changed."""
        self._eligible: dict[str | None, tuple[frozenset[str], list[int]]] = {}
        """Base digest (None = any) → (live workers on it, their total in-flight count)."""
        self._merged: dict[str, tuple[str, ...]] | None = None
        """Adapter id → live workers in merged mode for it (built when asked)."""
        self._held_by: dict[str, dict[str, Tier]] = {}
        """Adapter sha256 → {worker: tier}: `WorkerView.held` inverted, kept as events fold,
        so placement asks one dict per request instead of three per worker it looks at."""
        self._sent_by: dict[str, dict[str, float]] = {}
        """Adapter sha256 → {worker: when}: `WorkerView.sent` inverted, likewise."""

    @property
    def timeout_s(self) -> float:
        return self.interval_s * self.misses

    def observe(self, envelope: Envelope, seen_at: float, source: Source | None = None) -> bool:
        """Fold one event (`source`: where it was read); True when it brought a worker
        (back) into the ring."""
        if source is not None:
            last, resumed = self._source_seen.get(source, (float("-inf"), seen_at))
            if seen_at > last:
                if seen_at - last > 2 * self.interval_s:
                    resumed = seen_at
                self._source_seen[source] = (seen_at, resumed)
        p = envelope.payload
        if isinstance(p, WorkerHeartbeat):
            view = self.workers.get(p.worker_id)
            if view is not None and seen_at < view.seen_at:
                return False  # an older report read late changes nothing
            held: dict[str, Tier] = {a.sha256: a.tier for a in p.loaded}
            if view is None:
                view = self.workers[p.worker_id] = WorkerView(
                    p.worker_id, p.address, p.base_model, p.base_model_digest, seen_at)
            if (view.base_digest != p.base_model_digest
                    or view.dedication != (None if p.merged_mode is None else
                                           (p.merged_mode.adapter_id,
                                            p.merged_mode.pinned_version))):
                self._changed()
            view.address = p.address
            view.base_model = p.base_model
            view.base_digest = p.base_model_digest
            view.seen_at = seen_at
            view.source = source
            self._reindex_held(view, held)
            view.free_slots = p.free_slots
            view.free_kv_blocks = p.free_kv_blocks
            view.merged_mode = p.merged_mode
            view.base_weights = p.base_weights
            for sha in list(view.sent):
                if sha in held:
                    self._unsend(view, sha)
            if p.draining:
                self.draining.add(p.worker_id)
                return False
            self.draining.discard(p.worker_id)
            joined = p.worker_id not in self.live
            if joined:
                self._changed()
            self.live.add(p.worker_id)
            return joined
        if isinstance(p, AdapterLoaded):
            view = self.workers.get(p.worker_id)
            if view is not None:
                view.held[p.sha256] = p.tier
                self._held_by.setdefault(p.sha256, {})[view.worker_id] = p.tier
                self._unsend(view, p.sha256)
        elif isinstance(p, AdapterUnloaded):
            view = self.workers.get(p.worker_id)
            if view is not None and view.held.pop(p.sha256, None) is not None:
                self._drop(self._held_by, p.sha256, view.worker_id)
        return False

    def _reindex_held(self, view: WorkerView, held: dict[str, Tier]) -> None:
        """A heartbeat replaces what the worker holds: move the worker in the sha index."""
        worker, index = view.worker_id, self._held_by
        for sha in view.held.keys() - held.keys():
            self._drop(index, sha, worker)
        for sha, tier in held.items():
            index.setdefault(sha, {})[worker] = tier
        view.held = held

    def _unsend(self, view: WorkerView, sha256: str) -> None:
        if view.sent.pop(sha256, None) is not None:
            self._drop(self._sent_by, sha256, view.worker_id)

    @staticmethod
    def _drop(index: dict[str, dict[str, Any]], sha256: str, worker: str) -> None:
        workers = index.get(sha256)
        if workers is not None:
            workers.pop(worker, None)
            if not workers:
                del index[sha256]

    def expire(self, now: float) -> list[str]:
        """Take out of the ring every worker draining, or silent for `misses` intervals
        while its heartbeat partition was read (or for `stall_grace_s` more while it was
        not); returns them."""
        gone = [w for w in self.live
                if w in self.draining or self._silent(self.workers[w], now)]
        for worker in gone:
            self.live.discard(worker)
            view = self.workers[worker]
            for sha in list(view.sent):
                self._unsend(view, sha)
        if gone:
            self._changed()
        return sorted(gone)

    def _silent(self, view: WorkerView, now: float) -> bool:
        silence = now - view.seen_at
        if silence <= self.timeout_s:
            return False
        if view.source is None or silence > self.timeout_s + self.stall_grace_s:
            return True
        # its partition read past its last heartbeat, and flowing for an interval: silent
        last, resumed = self._source_seen.get(view.source, (float("-inf"), now))
        return last > view.seen_at and now - resumed > self.interval_s

    def _changed(self) -> None:
        """Who is live, on which base, in which mode changed: drop the cached pools."""
        self.generation += 1
        self._eligible.clear()
        self._merged = None

    def tier(self, worker: str, sha256: str, now: float) -> Tier | None:
        return self.holding(sha256, now)(worker)

    def holding(self, sha256: str, now: float) -> Callable[[str], Tier | None]:
        """Worker → where it holds this adapter at `now` (`loading`: sent there cold a moment
        ago); what placement asks of the few workers it looks at, one request at a time.
        Where the router sent this adapter nowhere lately (most requests), that is the sha's
        holder map's own `get`: no Python frame per worker looked at."""
        held = self._held_by.get(sha256, _NOBODY)
        sent = self._sent_by.get(sha256)
        if sent is None:
            return held.get
        timeout_s = self.timeout_s

        def tier(worker: str) -> Tier | None:
            found = held.get(worker)
            if found is not None and found != "disk":
                return found
            at = sent.get(worker)
            if at is not None and now - at <= timeout_s:
                return "loading"
            return found

        return tier

    def note_sent(self, worker: str, sha256: str, now: float) -> None:
        view = self.workers.get(worker)
        if view is not None and view.held.get(sha256) in (None, "disk"):
            view.sent[sha256] = now
            self._sent_by.setdefault(sha256, {})[worker] = now

    def serves_base(self, worker: str, base_digest: str | None) -> bool:
        """Does the worker take this base model's general traffic (live, on it, and not in
        merged mode)?"""
        if worker not in self.live:
            return False
        view = self.workers[worker]
        if view.merged_mode is not None:
            return False
        return base_digest is None or view.base_digest == base_digest

    def merged_for(self, adapter_id: str) -> tuple[str, ...]:
        """Live workers in merged mode for this adapter (whichever version they hold)."""
        if self._merged is None:
            index: dict[str, list[str]] = {}
            for worker in sorted(self.live):
                mode = self.workers[worker].merged_mode
                if mode is not None:
                    index.setdefault(mode.adapter_id, []).append(worker)
            self._merged = {a: tuple(ws) for a, ws in index.items()}
        return self._merged.get(adapter_id, ())

    def pool(self, base_digest: str | None) -> tuple[frozenset[str], int]:
        """`eligible` and the requests in flight over those workers (kept as requests come
        and go), in one lookup: the request path wants both."""
        found = self._eligible.get(base_digest) or self.pool_entry(base_digest)
        return found[0], found[1][0]

    def eligible(self, base_digest: str | None) -> frozenset[str]:
        """Live workers on this base model (any base for None); cached until a change."""
        return self.pool_entry(base_digest)[0]

    def pool_entry(self, base_digest: str | None) -> tuple[frozenset[str], list[int]]:
        """The cached pool itself: its list's one item is the in-flight total, kept current
        by `acquire` and `release`, so a holder reads it there until `generation` moves."""
        found = self._eligible.get(base_digest)
        if found is None:
            workers = frozenset(w for w in self.live if self.serves_base(w, base_digest))
            found = self._eligible[base_digest] = (
                workers, [sum(self.in_flight.get(w, 0) for w in workers)])
        return found

    def acquire(self, worker: str) -> None:
        self.in_flight[worker] = self.in_flight.get(worker, 0) + 1
        for workers, total in self._eligible.values():
            if worker in workers:
                total[0] += 1

    def release(self, worker: str) -> None:
        count = self.in_flight.get(worker, 0)
        if count <= 0:
            return
        self.in_flight[worker] = count - 1
        for workers, total in self._eligible.values():
            if worker in workers:
                total[0] -= 1

    def address(self, worker: str) -> str:
        return self.workers[worker].address

    def holders(self, sha256: str) -> Iterable[str]:
        return (w for w in self._held_by.get(sha256, _NOBODY) if w in self.live)
