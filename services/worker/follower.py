"""The worker's reader of the log: every partition of every topic, folded into `CatalogState`.

Kept to one small class with a narrow surface (`open` catches up to a barrier of its own,
`run` follows, `state` + `lock` are the fold, `on_batch` is told what arrived) so it can
be swapped for the shared log follower with snapshots (`services/eventlog/`) with little
change. Reading uses `assign()` without a consumer group, so every worker sees every
event, and the consumer drops redelivered `event_id`s, so folding stays idempotent.

Besides the catalog, it reads back this worker's own past events (`OwnHistory`): the
last sequence number of its stream (the next event continues it without a gap), which
versions it held on the device and which failed, and which purges it acknowledged. That
is what lets a restarted worker replay to the same adapter states.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from services.catalog.state import CatalogState
from services.config import Settings
from services.contracts.events import (
    AdapterLoaded,
    AdapterLoadFailed,
    AdapterUnloaded,
    Envelope,
    RegistryLease,
    TenantPurged,
)
from services.eventlog import EventConsumer, EventLogError, Record
from services.eventlog.consumer import Rejected

log = logging.getLogger("loraplane.worker.follower")

VersionKey = tuple[str, int]


def worker_stream(worker_id: str) -> str:
    return f"worker/{worker_id}"


@dataclass
class OwnHistory:
    """What this worker's own events in the log say about it (by worker id)."""

    worker_id: str
    last_seq: int = 0
    on_device: dict[VersionKey, str] = field(default_factory=dict)
    """Versions whose last event was `AdapterLoaded` on the device tier: version → sha256."""
    failed: dict[VersionKey, str] = field(default_factory=dict)
    """Versions whose last event was a non-retryable `AdapterLoadFailed`: version → error."""
    acked_purges: set[str] = field(default_factory=set)

    def apply(self, envelope: Envelope) -> None:
        p = envelope.payload
        if getattr(p, "worker_id", None) != self.worker_id:
            return
        if envelope.stream == worker_stream(self.worker_id):
            self.last_seq = max(self.last_seq, envelope.seq)
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


class CatalogFollower:
    """Folds `settings.topics` into one `CatalogState`; thread-safe readers take `lock`."""

    def __init__(self, settings: Settings, worker_id: str,
                 on_batch: Callable[[list[Envelope]], None] | None = None) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.state = CatalogState(stale_after_s=settings.stale_lease_threshold_s)
        self.lock = threading.RLock()
        self.own = OwnHistory(worker_id)
        self.lease_at: datetime | None = None
        """`occurred_at` of the newest registry lease folded (the version wall's clock)."""
        self.lease_epoch: int | None = None
        self.on_batch = on_batch
        self.caught_up = threading.Event()
        self.folded = 0
        self._consumer: EventConsumer | None = None

    def open(self, timeout_s: float = 120.0) -> int:
        """Replay the log up to a barrier this worker writes; returns events folded."""
        consumer = EventConsumer(self.settings, list(self.settings.topics),
                                 reader_id=self.worker_id, on_rejected=self._rejected)
        try:
            count = consumer.catch_up(lambda r: self.fold(r.envelope), timeout_s=timeout_s)
        except BaseException:
            consumer.close()
            raise
        self._consumer = consumer
        self.caught_up.set()
        return count

    def run(self, stop: threading.Event) -> None:
        """Follow the log until `stop`; each batch is folded, then handed to `on_batch`."""
        assert self._consumer is not None, "open() first"
        consumer = self._consumer
        try:
            while not stop.is_set():
                try:
                    # consume() waits its whole timeout unless the batch fills: wait for
                    # one record, then drain what is there without waiting.
                    records = consumer.poll(timeout=0.1, max_records=1)
                    if records:
                        records += consumer.poll(timeout=0, max_records=500)
                except EventLogError as exc:
                    log.warning("reading the log: %s", exc)
                    stop.wait(0.5)
                    continue
                if not records:
                    continue
                batch = [self._fold_record(r) for r in records]
                if self.on_batch is not None:
                    self.on_batch(batch)
        finally:
            consumer.close()
            self._consumer = None

    def _fold_record(self, record: Record) -> Envelope:
        self.fold(record.envelope)
        return record.envelope

    def fold(self, envelope: Envelope) -> None:
        with self.lock:
            try:
                self.state.apply(envelope)
            except Exception:  # a fold bug must not stop the worker from reading
                log.exception("cannot fold %s %s", envelope.type, envelope.event_id)
            self.own.apply(envelope)
            p = envelope.payload
            if isinstance(p, RegistryLease) and (
                    self.lease_at is None or envelope.occurred_at > self.lease_at):
                self.lease_at = envelope.occurred_at
                self.lease_epoch = p.epoch
            self.folded += 1

    @staticmethod
    def _rejected(rejected: Rejected) -> None:
        # Every worker reads the same bad record: the registry and the projector keep the
        # dead letters, a worker only says it skipped one.
        log.warning("skipped invalid record %s[%d]@%d: %s", rejected.topic, rejected.partition,
                    rejected.offset, rejected.reason)

