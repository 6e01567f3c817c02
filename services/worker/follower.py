"""The worker's reading of the log: the shared `LogFollower` over a fold of its own.

`services.eventlog.follower.LogFollower` reads every partition of every topic with
`assign()` (so every worker sees every event), drops redelivered `event_id`s, restarts
from a snapshot of the fold plus the log's tail, and says when the worker has caught up.
`WorkerFold` is what it folds: the one catalog fold (`CatalogFold`, as the registry and
the router fold it) plus what only this worker needs:

- its own past events (`OwnHistory`): the last sequence number of each of its streams
  (the next event continues it without a gap), which versions it held on the device and
  which failed, which purges it acknowledged. That is what lets a restarted worker come
  back to the same adapter states; it is part of the snapshot like the catalog.
- the newest registry lease's own timestamp, the version wall's clock.

`CatalogFollower` keeps the surface the rest of the worker uses (`state` and `lock`, `own`,
`caught_up`, `on_batch` for events folded once caught up).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from services.catalog.snapshot import FOLD_VERSION, CatalogFold
from services.catalog.state import FOLDED_TYPES, CatalogState, heartbeat_stream
from services.config import Settings
from services.contracts.events import (
    AdapterLoaded,
    AdapterLoadFailed,
    AdapterUnloaded,
    Envelope,
    KVInvalidated,
    RegistryLease,
    RequestServed,
    TenantPurged,
)
from services.eventlog import Record
from services.eventlog.follower import LogFollower

VersionKey = tuple[str, int]

OWN_TYPES = frozenset(cls.event_type() for cls in (
    AdapterLoaded, AdapterUnloaded, AdapterLoadFailed, KVInvalidated, RequestServed))
"""Worker events the catalog fold skips and this worker reads for its own stream: its
states, and every type it writes, so the next number on its stream is known after a
restart (a number skipped over would be a gap)."""


def worker_stream(worker_id: str) -> str:
    return f"worker/{worker_id}"


@dataclass
class OwnHistory:
    """What this worker's own events in the log say about it (by worker id)."""

    worker_id: str
    last_seq: dict[str, int] = field(default_factory=dict)
    """Per stream (`worker/{id}`, `heartbeat/{id}`): the last sequence number written."""
    on_device: dict[VersionKey, str] = field(default_factory=dict)
    """Versions whose last event was `AdapterLoaded` on the device tier: version → sha256."""
    failed: dict[VersionKey, str] = field(default_factory=dict)
    """Versions whose last event was a non-retryable `AdapterLoadFailed`: version → error."""
    acked_purges: set[str] = field(default_factory=set)

    def apply(self, envelope: Envelope) -> None:
        p = envelope.payload
        if getattr(p, "worker_id", None) != self.worker_id:
            return
        if envelope.stream in (worker_stream(self.worker_id), heartbeat_stream(self.worker_id)):
            self.last_seq[envelope.stream] = max(self.last_seq.get(envelope.stream, 0),
                                                 envelope.seq)
        if isinstance(p, AdapterLoaded):
            key = (p.adapter_id, p.version)
            self.failed.pop(key, None)
            if p.tier == "device":
                self.on_device[key] = p.sha256
        elif isinstance(p, AdapterUnloaded):
            self.on_device.pop((p.adapter_id, p.version), None)
        elif isinstance(p, AdapterLoadFailed) and not p.retryable:
            key = (p.adapter_id, p.version)
            self.on_device.pop(key, None)
            self.failed[key] = p.error
        elif isinstance(p, TenantPurged):
            self.acked_purges.add(p.purge_id)

    def dump(self) -> dict[str, Any]:
        return {"last_seq": self.last_seq,
                "on_device": [[k[0], k[1], v] for k, v in self.on_device.items()],
                "failed": [[k[0], k[1], v] for k, v in self.failed.items()],
                "acked_purges": sorted(self.acked_purges)}

    @classmethod
    def load(cls, worker_id: str, document: dict[str, Any] | None) -> OwnHistory:
        if document is None:
            return cls(worker_id)
        return cls(worker_id, dict(document["last_seq"]),
                   {(a, int(n)): v for a, n, v in document["on_device"]},
                   {(a, int(n)): v for a, n, v in document["failed"]},
                   set(document["acked_purges"]))


class WorkerFold:
    """The catalog fold plus this worker's own history and the lease clock."""

    fold_version = f"{FOLD_VERSION}+worker/1"
    wanted_types = FOLDED_TYPES | OWN_TYPES

    def __init__(self, worker_id: str, stale_after_s: float,
                 on_folded: Callable[[Envelope], None] | None = None) -> None:
        self.worker_id = worker_id
        self.catalog = CatalogFold(stale_after_s)
        self.own = OwnHistory(worker_id)
        self.lease_at: datetime | None = None
        """`occurred_at` of the newest registry lease folded (the version wall's clock)."""
        self.lease_epoch: int | None = None
        self.on_folded = on_folded

    @property
    def state(self) -> CatalogState:
        return self.catalog.state

    def apply(self, record: Record) -> None:
        envelope = record.envelope
        if envelope.type in FOLDED_TYPES:
            self.catalog.apply(record)
        self.own.apply(envelope)
        p = envelope.payload
        if isinstance(p, RegistryLease) and (self.lease_at is None
                                             or envelope.occurred_at > self.lease_at):
            self.lease_at = envelope.occurred_at
            self.lease_epoch = p.epoch
        if self.on_folded is not None:
            self.on_folded(envelope)

    def dump(self) -> dict[str, Any]:
        return {"catalog": self.catalog.dump(), "own": self.own.dump()}

    def load(self, document: dict[str, Any] | None) -> None:
        # leases live on the liveness topic, which is read again from its start anyway
        self.catalog.load(document["catalog"] if document else None)
        self.own = OwnHistory.load(self.worker_id, document["own"] if document else None)
        self.lease_at, self.lease_epoch = None, None


class CatalogFollower:
    """This worker's fold of `settings.topics`, kept current by a `LogFollower`."""

    def __init__(self, settings: Settings, worker_id: str,
                 on_batch: Callable[[list[Envelope]], None] | None = None,
                 on_ready: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.on_batch = on_batch
        self.on_ready = on_ready
        self.fold_state = WorkerFold(worker_id, settings.stale_lease_threshold_s,
                                     on_folded=self._folded)
        self.follower = LogFollower(settings, self.fold_state, reader_id=worker_id,
                                    snapshot_name=worker_id, on_ready=self._ready)
        self.lock: threading.RLock = self.follower.lock
        self.caught_up = self.follower.ready

    # the fold, read under `lock`
    @property
    def state(self) -> CatalogState:
        return self.fold_state.state

    @property
    def own(self) -> OwnHistory:
        return self.fold_state.own

    @property
    def lease_at(self) -> datetime | None:
        return self.fold_state.lease_at

    @property
    def lease_epoch(self) -> int | None:
        return self.fold_state.lease_epoch

    def start(self) -> None:
        self.follower.start()

    def stop(self) -> None:
        self.follower.stop()

    def sync(self, timeout_s: float) -> bool:
        """True once everything committed before this call is folded (`LogFollower.sync`);
        False at the timeout, or when the follower never started (events folded directly)."""
        if not self.caught_up.is_set():
            return False
        return self.follower.sync(timeout_s)

    def fold(self, envelope: Envelope) -> None:
        """Fold one event directly (tests, in-process benches), as if read from the log."""
        with self.lock:
            self.fold_state.apply(Record("direct", 0, 0, envelope, b""))

    def _folded(self, envelope: Envelope) -> None:
        # Events folded while replaying are covered by the restore after it; from then
        # on, each one goes to the engine loop (in log order: this is the reading thread).
        if self.caught_up.is_set() and self.on_batch is not None:
            self.on_batch([envelope])

    def _ready(self) -> None:
        if self.on_ready is not None:
            self.on_ready()

