"""May this version get traffic? The one release rule the registry and the serving rule share.

The registry refuses a switch, a split or a rollout stage that would send traffic to a
version this rule refuses (409, the reason names the failed gate), and
`services.catalog.serving` never chooses such a version, so a router or worker that folds
a split written before the rule existed still never serves it.

A version may get traffic unless one of these holds (checked in this order):
1. a canary rollout rolled it back, and no admin override came after that rollback;
2. it requires a quality gate (`AdapterVersionPublished.gate_required`, decided by the
   registry at publish, or a gate requested for it later) and no admin override came
   after its latest gate request, and that gate is missing, pending, failed or expired.
   A gate that could not complete (no worker, timeout, a worker that stopped) is
   expired: FAILED, never passed.

Only event timestamps are compared, so every reader of the same log agrees whatever order
it read the two topics in. Versions published before gates existed have
`gate_required` false and keep serving as they did.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from services.catalog.gates import assign_worker
from services.catalog.state import Adapter, AdapterVersion, CatalogState
from services.contracts.events import GateRequest


def release_refusal(adapter: Adapter, number: int, version: AdapterVersion) -> str | None:
    """Why this version may get no traffic now; None when it may.

    The answer depends on folded events only (never on the clock), so it is worked out
    once per change of the version's release state and read on every request after that.
    """
    cached = version.release_cache
    if cached is not None and cached[0] == version.release_generation:
        return cached[1]
    answer = _refusal(adapter, number, version)
    version.release_cache = (version.release_generation, answer)
    return answer


def _refusal(adapter: Adapter, number: int, version: AdapterVersion) -> str | None:
    name = f"{adapter.adapter_id}@{number}"
    override_at = version.override[0] if version.override else None
    if version.canary_rollback is not None:
        rolled_at, why = version.canary_rollback
        if override_at is None or override_at < rolled_at:
            return f"{name}: {why}"
    gate = version.gate
    if not version.published.gate_required and gate is None:
        return None
    if override_at is not None and (gate is None or override_at > gate.requested_at):
        return None
    if gate is None:
        return (f"{name} has no quality gate (published without a regression set): attach "
                "one, or an admin overrides with a reason")
    status = gate.status
    if status == "passed":
        return None
    if status == "pending":
        runner = gate.request.worker_id or "no worker"
        return f"{name}: quality gate {gate.gate_id} is pending (assigned to {runner})"
    failures = gate.failures
    shown = "; ".join(failures[:3]) + (f"; and {len(failures) - 3} more"
                                      if len(failures) > 3 else "")
    return f"{name}: quality gate {gate.gate_id} {status}: {shown}"


def gate_baseline(adapter: Adapter, number: int) -> int | None:
    """The previous stable version a new version's gate compares with: the adapter's active
    version, when there is one other than this version and it is neither disabled nor
    purged."""
    active = adapter.active_version
    if active is None or active == number:
        return None
    version = adapter.versions.get(active)
    if version is None or version.disabled or version.purged_by is not None:
        return None  # a purged version's files are erased: compare with the base model
    return active


@dataclass(frozen=True)
class GateSpec:
    """A regression set the registry stored, to be run as a gate (decided into an event)."""

    regression_set_sha256: str
    cases: int
    gate_id: str
    timeout_s: float


def gate_workers(state: CatalogState, base_digest: str, now: datetime) -> list[str]:
    """Live workers (fresh heartbeat) on this base model: who may run its gates. Not a
    worker in merged mode: its weights hold an adapter, so it cannot run the base model
    or another version."""
    return [w for w in state.live_workers(now) if state.worker_bases.get(w) == base_digest
            and w not in state.merged_workers]


def gate_request(state: CatalogState, spec: GateSpec, base_digest: str,
                 baseline_version: int | None, now: datetime) -> GateRequest:
    """The request event's content: one live worker on the base, chosen by the gate id."""
    return GateRequest(gate_id=spec.gate_id, regression_set_sha256=spec.regression_set_sha256,
                       cases=spec.cases,
                       worker_id=assign_worker(spec.gate_id, gate_workers(state, base_digest,
                                                                           now)),
                       baseline_version=baseline_version, timeout_s=spec.timeout_s)


@dataclass(frozen=True)
class Overdue:
    """A pending gate that can no longer complete, and why (a `QualityGateExpired`)."""

    adapter_id: str
    version: int
    gate_id: str
    cause: Literal["no_worker", "timeout", "worker_lost"]
    reason: str


def overdue_gates(state: CatalogState, now: datetime) -> list[Overdue]:
    """Pending gates with no worker, past their deadline, or whose worker went silent."""
    found = []
    for gate_id, (adapter_id, number) in state.gates.items():
        gate = state.gate(gate_id)
        if gate is None or gate.status != "pending":
            continue
        version = state.adapters[adapter_id].versions[number]
        worker = gate.request.worker_id
        overdue: Overdue | None = None
        if worker is None:
            overdue = Overdue(adapter_id, number, gate_id, "no_worker",
                              f"no live worker serves base model "
                              f"{version.published.base_model!r} to run the gate")
        elif now > gate.deadline:
            overdue = Overdue(adapter_id, number, gate_id, "timeout",
                              f"no result from {worker} within {gate.request.timeout_s:g} s")
        elif worker not in state.live_workers(now):
            seen = state.heartbeats.get(worker)
            overdue = Overdue(adapter_id, number, gate_id, "worker_lost",
                              f"{worker} stopped heartbeating (last "
                              f"{seen.isoformat(timespec='seconds') if seen else 'never'}) "
                              "before reporting")
        if overdue is not None:
            found.append(overdue)
    return found
