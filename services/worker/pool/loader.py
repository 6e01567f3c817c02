"""The async loader: one thread that brings adapter versions into the host tier.

Requests come from the engine loop (a request is waiting: urgent) and from prefetches
(publish or switch of a gold/platinum adapter, a router hint: background); urgent jobs
and more important QoS tiers go first. A job looks in the disk tier, then fetches from
the registry's blob store, checks both files against the published digests
(`AdapterFiles.verify`, the engine's check) on every fetch, writes blob fetches to disk,
parses and validates the adapter (`parse_adapter`) and keeps it in the host tier. The
result goes back to the engine loop through `on_done`; the engine thread never waits on
a fetch and this thread never touches the engine.

A purge cancels its tenant's digests: queued jobs are dropped, and a fetch in flight
throws its bytes away (and scrubs what it wrote to disk) instead of caching them.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.worker.engine import (
    AdapterDigest,
    AdapterDigestMismatch,
    AdapterError,
    AdapterFiles,
    LoraAdapter,
)
from services.worker.pool.blobs import (
    BlobCorrupted,
    BlobMissing,
    BlobUnavailable,
    RegistryBlobs,
)
from services.worker.pool.disk import DiskCache
from services.worker.pool.host import HostCache
from services.worker.pool.tiers import QOS_RANK, Tier

log = logging.getLogger("loraplane.worker.loader")

Parse = Callable[[AdapterFiles, AdapterDigest], LoraAdapter]


@dataclass(frozen=True)
class FetchResult:
    """What a job produced: the adapter in the host tier, or why not."""

    digest: AdapterDigest
    adapter: LoraAdapter | None
    source: Tier
    """Where the bytes came from: host, disk or blob."""
    seconds: float
    error: str | None = None
    retryable: bool = False
    """False for a digest mismatch or an invalid adapter: the version is FAILED for good."""
    refusal: str | None = None
    """The status a waiting request gets, when not the default for `retryable`."""


class AdapterLoader:
    """A priority queue of digests and the thread that works it."""

    def __init__(self, host: HostCache, disk: DiskCache, blobs: RegistryBlobs, parse: Parse,
                 on_done: Callable[[FetchResult], None]) -> None:
        self.host = host
        self.disk = disk
        self.blobs = blobs
        self.parse = parse
        self.on_done = on_done
        self._queue: queue.PriorityQueue[tuple[int, int, int, AdapterDigest | None, str]] = (
            queue.PriorityQueue())
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._pending: dict[AdapterDigest, int] = {}
        """Queued digests and the best priority they were queued with."""
        self._cancelled: set[AdapterDigest] = set()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.corrupt_on_disk = 0

    # --- control (any thread) ----------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="adapter-loader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._queue.put((-1, -1, next(self._order), None, ""))
        if self._thread is not None:
            self._thread.join(timeout=10)

    def request(self, digest: AdapterDigest, qos_tier: str, *, urgent: bool) -> None:
        """Queue a job unless one at least as urgent is queued; clears a purge's cancel."""
        priority = 0 if urgent else 1
        with self._lock:
            self._cancelled.discard(digest)
            queued = self._pending.get(digest)
            if queued is not None and queued <= priority:
                return
            self._pending[digest] = priority
        self._queue.put((priority, QOS_RANK.get(qos_tier, 3), next(self._order), digest,
                         qos_tier))

    def cancel(self, digests: set[AdapterDigest]) -> None:
        with self._lock:
            self._cancelled |= digests
            for digest in digests:
                self._pending.pop(digest, None)

    def _cancelled_now(self, digest: AdapterDigest) -> bool:
        with self._lock:
            return digest in self._cancelled

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            priority, _, _, digest, qos_tier = self._queue.get()
            if digest is None:
                continue
            with self._lock:
                if self._pending.get(digest) != priority:
                    continue  # a duplicate of a job queued more urgently, or cancelled
                del self._pending[digest]
            try:
                result = self.load(digest, qos_tier)
            except Exception as exc:  # a bug here must not kill the loader
                log.exception("loading %s", digest)
                result = FetchResult(digest, None, Tier.BLOB, 0.0, f"internal error: {exc}",
                                     retryable=True)
            self.on_done(result)

    def load(self, digest: AdapterDigest, qos_tier: str = "silver") -> FetchResult:
        """One job, in the calling thread (the bench times this path tier by tier)."""
        started = time.perf_counter()
        held = self.host.get(digest)
        if held is not None:
            return FetchResult(digest, held, Tier.HOST, time.perf_counter() - started)
        source = Tier.DISK
        files = self._from_disk(digest)
        adapter: LoraAdapter | None = None
        if files is not None:
            try:
                adapter = self._checked_parse(files, digest)
            except AdapterDigestMismatch as exc:
                self.corrupt_on_disk += 1
                log.warning("disk tier: %s; removed, fetching it again", exc)
                self.disk.discard(digest.sha256)
                self.disk.discard(digest.config_sha256)
                files = None
            except AdapterError as exc:
                return FetchResult(digest, None, source, time.perf_counter() - started,
                                   f"invalid ({source.value} tier): {exc}", retryable=False)
        if files is None:
            source = Tier.BLOB
            try:
                files = AdapterFiles(self.blobs.fetch(digest.config_sha256),
                                     self.blobs.fetch(digest.sha256))
            except (BlobUnavailable, BlobMissing) as exc:  # no verdict on the bytes
                return FetchResult(digest, None, source, time.perf_counter() - started,
                                   str(exc), retryable=True)
            except BlobCorrupted as exc:  # not FAILED: publishing the bytes again repairs it
                return FetchResult(digest, None, source, time.perf_counter() - started,
                                   f"the registry's copy is corrupted: {exc}", retryable=True,
                                   refusal="FAILED_PRECONDITION")
            try:
                adapter = self._checked_parse(files, digest)
            except (AdapterDigestMismatch, AdapterError) as exc:
                what = ("digest mismatch" if isinstance(exc, AdapterDigestMismatch)
                        else "invalid")
                return FetchResult(digest, None, source, time.perf_counter() - started,
                                   f"{what} ({source.value} tier): {exc}", retryable=False)
            self.disk.write(digest.sha256, files.weights, qos_tier)
            self.disk.write(digest.config_sha256, files.config_json, qos_tier)
        assert adapter is not None
        if self._cancelled_now(digest):  # purged while we fetched: keep nothing
            self.disk.discard(digest.sha256, scrub=True)
            self.disk.discard(digest.config_sha256, scrub=True)
            return FetchResult(digest, None, source, time.perf_counter() - started,
                               "cancelled by a tenant purge", retryable=True)
        adapter = self.host.put(adapter, qos_tier)
        return FetchResult(digest, adapter, source, time.perf_counter() - started)

    def _checked_parse(self, files: AdapterFiles, digest: AdapterDigest) -> LoraAdapter:
        """Parse the files while another thread hashes them; nothing comes out unless the
        bytes are the published ones.

        Hashing 30 MB (about 20 ms) and parsing them into the host layout take about as
        long and hashlib releases the GIL, so on two cores the check costs almost nothing
        on top of the parse. The parse only reads the bytes into a buffer of its own, which
        is dropped on a mismatch; a mismatch wins over a parse error, so corrupt bytes are
        fetched again rather than failing the version for good.
        """
        verdict: list[Exception | None] = []

        def check() -> None:
            try:
                files.verify(digest)
            except Exception as exc:  # AdapterDigestMismatch, handed to the loader thread
                verdict.append(exc)
            else:
                verdict.append(None)

        hasher = threading.Thread(target=check, name="adapter-digest", daemon=True)
        hasher.start()
        try:
            return self.parse(files, digest)
        finally:
            hasher.join()
            if verdict[0] is not None:
                raise verdict[0]  # replaces any parse error: these bytes are not the ones

    def _from_disk(self, digest: AdapterDigest) -> AdapterFiles | None:
        """Both files from the disk tier, unchecked (`_checked_parse` checks them)."""
        weights = self.disk.read(digest.sha256)
        config = self.disk.read(digest.config_sha256)
        if weights is None or config is None:
            return None
        return AdapterFiles(config, weights)
