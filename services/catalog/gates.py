"""Quality-gate rules every reader shares: who runs a gate, and when a result is a pass.

No I/O. The registry decides with `assign_worker` which live worker runs a gate (written
into the request event, so readers never recompute it); every fold of the log judges a
`QualityGateCompleted` with `result_failures`, recomputing the verdict from the case
results instead of trusting the worker's `passed` flag.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from services.contracts.events import (
    GATE_TEXT_CHARS,
    GateCaseResult,
    GateOutput,
    GateRequest,
    QualityGateCompleted,
)


def assign_worker(gate_id: str, candidates: Iterable[str]) -> str | None:
    """Rendezvous hashing: the candidate with the highest hash of (gate, worker).

    Deterministic for a given set, and gates spread evenly over the workers of a base model.
    """
    best: tuple[bytes, str] | None = None
    for worker in candidates:
        score = hashlib.sha256(f"{gate_id}\x1f{worker}".encode()).digest()
        if best is None or score > best[0]:
            best = (score, worker)
    return best[1] if best else None


def tokens_digest(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()


def gate_output(role: str, version: int | None, text: str, token_ids: Sequence[int],
                finish_reason: str) -> GateOutput:
    """An output as a gate result carries it: digests of the whole, text up to the limit."""
    return GateOutput(role=role,  # type: ignore[arg-type]
                      version=version, tokens=len(token_ids),
                      tokens_sha256=tokens_digest(token_ids),
                      text_sha256=hashlib.sha256(text.encode()).hexdigest(),
                      text=text[:GATE_TEXT_CHARS], truncated=len(text) > GATE_TEXT_CHARS,
                      finish_reason=finish_reason[:16])


def case_summary(case: GateCaseResult) -> str:
    failed = [c for c in case.checks if c.verdict == "fail"]
    what = "; ".join(f"{c.kind}: {c.detail}" if c.detail else c.kind for c in failed)
    return f"case {case.case_id} (line {case.line}): {what or 'failed'}"


def result_failures(result: QualityGateCompleted, request: GateRequest) -> list[str]:
    """Why a result is not a pass (empty list: it passed). Recomputed by every reader."""
    failures = []
    if result.error:
        failures.append(f"run failed on {result.worker_id}: {result.error}")
    if result.regression_set_sha256 != request.regression_set_sha256:
        failures.append("result is for another regression set")
    if result.baseline_version != request.baseline_version:
        failures.append(f"compared with version {result.baseline_version}, not the requested "
                        f"{request.baseline_version}")
    if not result.error and len(result.cases) != request.cases:
        failures.append(f"{len(result.cases)} of {request.cases} cases reported")
    for case in result.cases:
        if any(c.verdict == "fail" for c in case.checks) or not case.passed:
            failures.append(case_summary(case))
    if not failures and not result.passed:
        failures.append("the worker reported a failure")
    return failures
