"""Quality gates on this worker: `gate_runner.GateDuty` says which gates are this
worker's and builds their jobs; the runs go through the engine loop between serving steps.

A gate thread (nothing here blocks the engine loop or the log follower for long):
1. reads the due gates off the fold (`GateDuty.due`, under the fold's lock; it fetches each
   gate's regression set by digest from the registry);
2. brings the adapter versions a run compares (the new one and the previous stable one)
   into the host tier through the worker's own loader, so their bytes are checked against
   the published digests like any other fetch;
3. hands the run to the engine loop (`EngineLoop.start_gate`), which places the adapters
   in slots that no serving request is using (evicting at most an idle silver or bronze
   adapter, and holding the slots until the run ends), submits the run's requests at the
   lowest QoS tier under the adapter's tenant key, and returns the result when the last
   one finishes;
4. writes `QualityGateCompleted` once per gate through the worker's event stream.

A run that cannot be done (a regression set or adapter blob the registry does not have,
adapter bytes that do not match their digests, an engine error) still answers, with the
error: the gate is failed, never left pending. A registry that is away is retried.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable

from services.contracts.events import Payload, QualityGateCompleted
from services.worker.engine import AdapterDigest, Engine, LoraAdapter
from services.worker.follower import CatalogFollower
from services.worker.gate_runner import DueGate, GateDuty, GateRun
from services.worker.pool import blobs as blob_tier
from services.worker.pool.loader import AdapterLoader

log = logging.getLogger("loraplane.worker.gates")

StartGate = Callable[[GateRun, dict[AdapterDigest, LoraAdapter],
                      Callable[[QualityGateCompleted], None]], None]


class GateWork:
    """The gate thread of one worker."""

    def __init__(self, engine: Engine, worker_id: str, follower: CatalogFollower,
                 loader: AdapterLoader, blobs: blob_tier.RegistryBlobs,
                 emit: Callable[[Payload], None], start: StartGate,
                 interval_s: float = 1.0) -> None:
        self.follower = follower
        self.loader = loader
        self.blobs = blobs
        self.emit = emit
        self.start_gate = start
        self.interval_s = interval_s
        self.base_digest = engine.base_digest
        self.duty = GateDuty(engine, worker_id, self._fetch, emit)
        self._running: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _fetch(self, digest: str) -> bytes:
        """A blob by digest, checked; `BlobMissing` when the registry cannot have it."""
        data = self.blobs.fetch(digest)
        if hashlib.sha256(data).hexdigest() != digest:
            raise blob_tier.BlobMissing(f"blob {digest} does not match its digest")
        return data

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gates", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def poke(self) -> None:
        """The fold changed: look for due gates now (any thread)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if not self.follower.caught_up.is_set():
                continue
            try:
                with self.follower.lock:
                    due = [d for d in self.duty.due(self.follower.state)
                           if d.gate.gate_id not in self._running]
            except Exception as exc:  # the registry is away: try again later
                log.warning("cannot read due quality gates yet: %s", exc)
                continue
            for gate in due:
                self._begin(gate)

    def _begin(self, due: DueGate) -> None:
        job = due.job
        if job is None:  # its regression set is missing or refused: the gate fails
            self.duty.run(due)
            return
        run = GateRun(job, self.base_digest)
        adapters: dict[AdapterDigest, LoraAdapter] = {}
        for _, _, digest in job.roles:
            if digest is None:
                continue
            fetched = self.loader.load(digest, "bronze")
            if fetched.adapter is None:
                if fetched.retryable:
                    log.warning("gate %s: adapter %s not available yet: %s", job.gate_id,
                                digest.sha256[:12], fetched.error)
                    return
                self._finished(job.gate_id, run.failed(f"adapter {digest.sha256[:12]}: "
                                                       f"{fetched.error}"))
                return
            adapters[digest] = fetched.adapter
        with self._lock:
            self._running.add(job.gate_id)
        log.info("running quality gate %s for %s@%s (%d cases)", job.gate_id, job.adapter_id,
                 job.version, len(job.regression_set.cases))
        self.start_gate(run, adapters,
                        lambda result: self._finished(job.gate_id, result))

    def _finished(self, gate_id: str, result: QualityGateCompleted) -> None:
        """Called once per run (by the engine loop, or here for a run that never started)."""
        self.emit(result)
        self.duty.done.add(gate_id)
        with self._lock:
            self._running.discard(gate_id)
        log.info("quality gate %s: %s", gate_id,
                 "passed" if result.passed else f"failed ({result.error or 'checks'})")
