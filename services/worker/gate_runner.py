"""A quality-gate run on a worker's engine: the base model, the previous stable version and
the new one, greedy, over every case of the regression set.

`GateRun` turns a gate request into engine requests and their results into the
`QualityGateCompleted` event; it does not step the engine, so the worker's engine loop can
submit the requests among its serving traffic (at the lowest QoS tier, under the
adapter's tenant key, so gate prompts share KV with nobody else) and hand the results back
when they finish. `run_gate` is the whole run on an engine the caller owns (tests,
benches, a worker between steps). `gates_to_run` is what a worker reads off its fold of
the log: the pending gates assigned to it that it has not answered. `GateDuty` is all of
it for a worker: which gates are due, fetching the set and the adapter files by digest,
running, emitting the result once.

A run that cannot finish (adapter bytes that do not match the published digests, an
engine error) still answers, with `error` set: the gate is FAILED, never left hanging.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from services.catalog.gates import gate_output
from services.catalog.regression import (
    CaseOutput,
    CaseRole,
    RegressionSet,
    case_passed,
    evaluate,
    parse_regression_set,
)
from services.catalog.serving import purged_reason
from services.catalog.state import CatalogState, GateState
from services.contracts.events import GateCaseResult, QualityGateCompleted
from services.worker.engine import (
    AdapterDigest,
    AdapterFiles,
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    QosTier,
    SamplingParams,
)
from services.worker.pool.blobs import BlobMissing


@dataclass(frozen=True)
class GateJob:
    """Everything a run needs, resolved from the log and the blob store."""

    gate_id: str
    worker_id: str
    adapter_id: str
    version: int
    baseline_version: int | None
    tenant_key: str
    regression_set: RegressionSet
    new: AdapterDigest
    previous: AdapterDigest | None

    @property
    def roles(self) -> list[tuple[CaseRole, int | None, AdapterDigest | None]]:
        roles: list[tuple[CaseRole, int | None, AdapterDigest | None]] = [
            ("base", None, None)]
        if self.previous is not None:
            roles.append(("previous", self.baseline_version, self.previous))
        roles.append(("new", self.version, self.new))
        return roles


def gates_to_run(state: CatalogState, worker_id: str) -> list[GateState]:
    """Pending gates assigned to this worker that it has not answered yet. Not the gate of
    a version a purge ended (`services.catalog.serving.purged_reason`): its files are
    erased and it will never be served (the registry expires the gate)."""
    found = []
    for gate_id, (adapter_id, number) in state.gates.items():
        gate = state.gate(gate_id)
        if (gate is not None and gate.status == "pending"
                and gate.request.worker_id == worker_id
                and not any(r.worker_id == worker_id for _, r in gate.results)):
            adapter = state.adapters[adapter_id]
            if purged_reason(adapter, number, adapter.versions[number]) is None:
                found.append(gate)
    return found


def job_for(state: CatalogState, gate: GateState, worker_id: str,
            fetch: Callable[[str], bytes]) -> GateJob:
    """The job of a gate, its regression set fetched (by digest) and parsed."""
    adapter_id, number = state.gates[gate.gate_id]
    adapter = state.adapters[adapter_id]
    published = adapter.versions[number].published
    baseline = gate.request.baseline_version
    previous = None
    if baseline is not None:
        p = adapter.versions[baseline].published
        previous = AdapterDigest(p.sha256, p.config_sha256)
    data = fetch(gate.request.regression_set_sha256)
    return GateJob(gate.gate_id, worker_id, adapter_id, number, baseline,
                   adapter.tenant.key if adapter.tenant else "default",
                   parse_regression_set(data, max_cases=max(gate.request.cases, 1)),
                   AdapterDigest(published.sha256, published.config_sha256), previous)


class GateRun:
    """The engine requests of one gate run, and its result event from their outputs."""

    def __init__(self, job: GateJob, base_digest: str) -> None:
        self.job = job
        self.base_digest = base_digest
        self.started = time.perf_counter()

    def request_id(self, index: int, role: str) -> str:
        return f"gate-{self.job.gate_id}-{index}-{role}"

    def requests(self) -> list[GenerationRequest]:
        out = []
        for index, numbered in enumerate(self.job.regression_set.cases):
            case = numbered.case
            for role, _, digest in self.job.roles:
                out.append(GenerationRequest(
                    prompt_token_ids=list(case.prompt_token_ids)
                    if case.prompt_token_ids is not None else None,
                    prompt=case.prompt,
                    sampling=SamplingParams(max_tokens=case.max_tokens, temperature=0.0),
                    adapter_digest=digest, tenant_key=self.job.tenant_key,
                    qos_tier=QosTier.BRONZE, request_id=self.request_id(index, role)))
        return out

    def _event(self, cases: list[GateCaseResult], passed: bool,
               error: str | None) -> QualityGateCompleted:
        job = self.job
        return QualityGateCompleted(
            worker_id=job.worker_id, gate_id=job.gate_id, adapter_id=job.adapter_id,
            version=job.version, baseline_version=job.baseline_version,
            base_model_digest=self.base_digest,
            regression_set_sha256=job.regression_set.sha256, adapter_sha256=job.new.sha256,
            passed=passed, error=error[:4096] if error else None, cases=cases,
            duration_ms=(time.perf_counter() - self.started) * 1000.0)

    def failed(self, error: str) -> QualityGateCompleted:
        return self._event([], False, error)

    def result(self, results: Mapping[str, GenerationResult]) -> QualityGateCompleted:
        cases = []
        for index, numbered in enumerate(self.job.regression_set.cases):
            outputs: dict[CaseRole, CaseOutput] = {}
            shown = []
            for role, version, _ in self.job.roles:
                r = results[self.request_id(index, role)]
                outputs[role] = CaseOutput(r.text, tuple(r.token_ids))
                shown.append(gate_output(role, version, r.text, r.token_ids,
                                         r.finish_reason.value))
            checks = evaluate(numbered.case, outputs)
            cases.append(GateCaseResult(
                case_id=numbered.case_id, line=numbered.line,
                prompt_sha256=numbered.case.prompt_sha256, outputs=shown, checks=checks,
                passed=case_passed(checks)))
        return self._event(cases, all(c.passed for c in cases), None)


def run_gate(engine: Engine, job: GateJob,
             files: Mapping[AdapterDigest, AdapterFiles]) -> QualityGateCompleted:
    """The whole run on `engine`: load the two adapters (checked against their digests),
    generate every case greedy, evaluate. Adapters it loaded are unloaded after."""
    run = GateRun(job, engine.base_digest)
    loaded_here = []
    try:
        for _, _, digest in job.roles:
            if digest is None or engine.adapters.is_loaded(digest):
                continue
            source = files.get(digest)
            if source is None:
                return run.failed(f"adapter files for {digest.sha256[:12]} are missing")
            engine.load_adapter(source, digest)
            loaded_here.append(digest)
        results = engine.generate(run.requests())
        return run.result({r.request_id: r for r in results})
    except EngineError as exc:
        return run.failed(f"{type(exc).__name__}: {exc}")
    finally:
        for digest in loaded_here:
            engine.unload_adapter(digest)


log = logging.getLogger("loraplane.worker.gates")


@dataclass(frozen=True)
class DueGate:
    """A gate this worker must answer: its job, or why none can be built (a failed gate)."""

    gate: GateState
    adapter_id: str
    version: int
    job: GateJob | None
    error: str | None = None


class GateDuty:
    """A worker's part in quality gates: run each gate assigned to it once, emit the result.

    `fetch(digest)` returns a blob's bytes (raising `BlobMissing` for one that cannot
    exist or does not match its digest: the gate fails; anything else is transient and
    the gate is tried again later); `emit` writes the result on the
    worker's stream. `due` reads the fold (call it under the fold's lock); `run` does the
    work (outside it: it fetches and generates).
    """

    def __init__(self, engine: Engine, worker_id: str, fetch: Callable[[str], bytes],
                 emit: Callable[[QualityGateCompleted], None]) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.fetch = fetch
        self.emit = emit
        self.done: set[str] = set()

    def due(self, state: CatalogState) -> list[DueGate]:
        out = []
        for gate in gates_to_run(state, self.worker_id):
            if gate.gate_id in self.done:
                continue
            adapter_id, version = state.gates[gate.gate_id]
            try:
                job = job_for(state, gate, self.worker_id, self.fetch)
            except BlobMissing as exc:
                out.append(DueGate(gate, adapter_id, version, None,
                                   f"regression set unavailable: {exc}"))
            except ValueError as exc:  # the stored set no longer parses
                out.append(DueGate(gate, adapter_id, version, None,
                                   f"regression set refused: {exc}"))
            else:
                out.append(DueGate(gate, adapter_id, version, job))
        return out

    def run(self, due: DueGate) -> QualityGateCompleted | None:
        """Run (or fail) one due gate and emit its result; None if it is to be retried."""
        job = due.job
        if job is None:
            request = due.gate.request
            result = QualityGateCompleted(
                worker_id=self.worker_id, gate_id=due.gate.gate_id, adapter_id=due.adapter_id,
                version=due.version, baseline_version=request.baseline_version,
                base_model_digest=self.engine.base_digest,
                regression_set_sha256=request.regression_set_sha256, adapter_sha256="0" * 64,
                passed=False, error=(due.error or "cannot run")[:4096])
        else:
            try:
                files = {d: AdapterFiles(self.fetch(d.config_sha256), self.fetch(d.sha256))
                         for _, _, d in job.roles if d is not None}
            except BlobMissing as exc:
                result = GateRun(job, self.engine.base_digest).failed(
                    f"adapter files unavailable: {exc}")
            except Exception as exc:  # the registry is away: try again later
                log.warning("gate %s: cannot fetch adapter files yet: %s", job.gate_id, exc)
                return None
            else:
                result = run_gate(self.engine, job, files)
        self.emit(result)
        self.done.add(due.gate.gate_id)
        return result
