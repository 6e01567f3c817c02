"""Quality-gate runs inside the engine, among the serving traffic.

`services.worker.gates` hands a run over (`EngineLoop.start_gate`); here, in the loop's
thread, its adapters are placed in free slots (or it waits, and is tried again every
second, until there is room it may take), its requests are submitted beside the serving
ones, and once the last one ends the run's verdict goes to its `done`. The slots it placed
are freed afterwards unless something else holds them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.contracts.events import QualityGateCompleted
from services.worker.engine import (
    AdapterDigest,
    Engine,
    EngineError,
    GenerationResult,
    LoraAdapter,
)
from services.worker.gate_runner import GateRun
from services.worker.residency import Residency

log = logging.getLogger("loraplane.worker.engine_loop")

RETRY_EVERY_S = 1.0
"""A run waiting for room is tried again at most this often."""


@dataclass
class GateInFlight:
    """A quality-gate run inside the engine: its requests, their results, its slots."""

    run: GateRun
    adapters: dict[AdapterDigest, LoraAdapter]
    done: Callable[[QualityGateCompleted], None]
    results: dict[str, GenerationResult] = field(default_factory=dict)
    pending: set[str] = field(default_factory=set)
    placed: list[AdapterDigest] = field(default_factory=list)
    held: list[AdapterDigest] = field(default_factory=list)


class GatesInEngine:
    """The gate runs this worker's engine is running or waiting to run."""

    def __init__(self, engine: Engine, residency: Residency,
                 refusal: Callable[[], str | None]) -> None:
        self.engine = engine
        self.residency = residency
        self.refusal = refusal
        """Why this worker runs no gate now (merged mode), or None."""
        self._running: dict[str, GateInFlight] = {}
        self._requests: dict[str, str] = {}
        """Request id → the gate id it belongs to."""
        self._waiting: list[GateInFlight] = []
        self._tried = 0.0

    def owns(self, request_id: str) -> bool:
        return request_id in self._requests

    def start(self, gate: GateInFlight) -> None:
        refusal = self.refusal()
        if refusal is not None:
            gate.done(gate.run.failed(refusal))
            return
        pools = self.engine.adapters
        for digest, adapter in gate.adapters.items():
            if not pools.is_loaded(digest):
                if not self.residency.room_for_gate(adapter):
                    self._release(gate)  # no room it may take now: try again later
                    self._waiting.append(gate)
                    return
                try:
                    pools.place(adapter)
                except EngineError as exc:
                    self._release(gate)
                    gate.done(gate.run.failed(f"{type(exc).__name__}: {exc}"))
                    return
                gate.placed.append(digest)
            self.residency.hold(digest)
            gate.held.append(digest)
        try:
            for request in gate.run.requests():
                self.engine.submit(request)
                gate.pending.add(request.request_id)
                self._requests[request.request_id] = gate.run.job.gate_id
        except EngineError as exc:
            for rid in gate.pending:
                self.engine.abort(rid)
                self.engine.pop_result(rid)
                self._requests.pop(rid, None)
            self._release(gate)
            gate.done(gate.run.failed(f"{type(exc).__name__}: {exc}"))
            return
        self._running[gate.run.job.gate_id] = gate

    def retry_waiting(self) -> None:
        """Start the runs that waited for room again (at most every `RETRY_EVERY_S`)."""
        now = time.monotonic()
        if not self._waiting or now - self._tried <= RETRY_EVERY_S:
            return
        self._tried = now
        waiting, self._waiting = self._waiting, []
        for gate in waiting:
            self.start(gate)

    def finished(self, rid: str, result: GenerationResult) -> None:
        """One of a run's requests ended; the last one decides the run."""
        gate = self._running.get(self._requests.pop(rid, ""))
        if gate is None:
            return
        gate.pending.discard(rid)
        gate.results[rid] = result
        if gate.pending:
            return
        del self._running[gate.run.job.gate_id]
        self._release(gate)
        try:
            answer = gate.run.result(gate.results)
        except Exception as exc:  # a check that cannot be evaluated fails the gate
            log.exception("gate %s", gate.run.job.gate_id)
            answer = gate.run.failed(f"{type(exc).__name__}: {exc}")
        gate.done(answer)

    def sweep(self) -> None:
        """Take the results of runs' requests the engine ended outside a step."""
        for rid in list(self._requests):
            result = self.engine.pop_result(rid)
            if result is not None:
                self.finished(rid, result)

    def _release(self, gate: GateInFlight) -> None:
        """Let go of the gate's slots; unload those it placed that nothing else holds."""
        for digest in gate.held:
            self.residency.release(digest)
        gate.held = []
        for digest in gate.placed:
            self.residency.drop_if_unheld(digest)
        gate.placed = []
