"""The registry's release commands: quality gates, overrides, canary rollouts. No I/O.

Like `services.registry.domain`, each function reads the folded `CatalogState` and either
refuses (`Refusal`) or decides the one event the command writes. Rollout steps are
written on the alias's stream as `TrafficSplitChanged` carrying a `RolloutStep` (so
every reader that follows splits follows rollouts unchanged); completion is the
`AdapterVersionSwitched` that makes the canary the active version. A step the canary
controller asks for is re-judged here from the figures it sends, under the rollout's own
plan (`services.catalog.canary.same_verdict`): a step the figures do not justify is
refused.
"""

from __future__ import annotations

from datetime import datetime

from services.catalog.canary import same_verdict
from services.catalog.release_rule import (
    GateSpec,
    Overdue,
    gate_baseline,
    gate_request,
    release_refusal,
)
from services.catalog.serving import unservable_reason
from services.catalog.state import Adapter, CatalogState, Refusal, Rollout, alias_stream
from services.contracts.events import (
    AdapterVersionSwitched,
    Judgement,
    QualityGateExpired,
    QualityGateRequested,
    ReleaseOverridden,
    RolloutHalted,
    RolloutPlan,
    RolloutResumed,
    RolloutStep,
    SplitEntry,
    TrafficSplitChanged,
)
from services.registry.domain import CommandEvent, adapter_event, check_expected

# --- quality gates ---------------------------------------------------------------------------


def request_gate(state: CatalogState, adapter_id: str, number: int, spec: GateSpec, *,
                 reason: str, now: datetime, expected: int | None = None,
                 idempotency_key: str | None = None) -> CommandEvent:
    """A new gate run for a version that is not serving (a serving version is gated by
    publishing a new one: re-judging it could only cut traffic with no fallback)."""
    adapter = state.adapter(adapter_id)
    check_expected("adapter", adapter_id, adapter.seq, expected)
    version = state.version(adapter_id, number)
    if adapter.active_version == number or _in_split(state, adapter_id, number):
        raise Refusal("conflict", f"{adapter_id}@{number} is serving traffic; publish a new "
                                  "version to gate a change")
    current = version.gate
    if current is not None and current.status == "pending":
        raise Refusal("conflict", f"quality gate {current.gate_id} of {adapter_id}@{number} "
                                  "is still pending")
    request = gate_request(state, spec, version.published.base_model_digest,
                           gate_baseline(adapter, number), now)
    return adapter_event(adapter, QualityGateRequested(
        adapter_id=adapter_id, version=number, gate=request, reason=reason,
        idempotency_key=idempotency_key))


def _in_split(state: CatalogState, adapter_id: str, number: int) -> bool:
    return any(e.adapter_id == adapter_id and e.version == number and e.weight > 0
               for alias in state.aliases.values() for e in alias.split)


def expire_gate(state: CatalogState, overdue: Overdue) -> CommandEvent:
    """Record that a gate cannot complete: it is FAILED from now on."""
    gate = state.gate(overdue.gate_id)
    if gate is None or gate.status != "pending":
        raise Refusal("conflict", f"quality gate {overdue.gate_id} is not pending")
    adapter = state.adapter(overdue.adapter_id)
    return adapter_event(adapter, QualityGateExpired(
        adapter_id=overdue.adapter_id, version=overdue.version, gate_id=overdue.gate_id,
        cause=overdue.cause, reason=overdue.reason[:1024]))


def override_release(state: CatalogState, adapter_id: str, number: int, reason: str, *,
                     expected: int | None = None,
                     idempotency_key: str | None = None) -> CommandEvent:
    """An admin clears a version for traffic; refused when nothing blocks it."""
    adapter = state.adapter(adapter_id)
    check_expected("adapter", adapter_id, adapter.seq, expected)
    version = state.version(adapter_id, number)
    refused = release_refusal(adapter, number, version)
    if refused is None:
        raise Refusal("conflict", f"{adapter_id}@{number} may already get traffic; nothing to "
                                  "override")
    return adapter_event(adapter, ReleaseOverridden(
        adapter_id=adapter_id, version=number, reason=reason, lifted=[refused[:1024]],
        idempotency_key=idempotency_key))


# --- canary rollouts ---------------------------------------------------------------------------


def _arms(adapter_id: str, canary: int, baseline: int, weight: int) -> list[SplitEntry]:
    entries = [SplitEntry(adapter_id=adapter_id, version=canary, weight=weight)]
    if weight < 100:
        entries.append(SplitEntry(adapter_id=adapter_id, version=baseline, weight=100 - weight))
    return entries


def start_rollout(state: CatalogState, alias: str, adapter_id: str, canary: int,
                  plan: RolloutPlan, rollout_id: str, *, baseline: int | None = None,
                  reason: str = "", expected: int | None = None,
                  idempotency_key: str | None = None) -> CommandEvent:
    """Put the canary on the alias at the plan's first stage, the baseline taking the rest."""
    adapter = state.adapter(adapter_id)
    current = state.aliases.get(alias)
    check_expected("alias", alias, current.seq if current else 0, expected)
    if current is not None and current.tenant is not None and current.tenant != adapter.tenant:
        raise Refusal("conflict", f"alias {alias!r} belongs to tenant {current.tenant.key}")
    running = state.rollouts.get(alias)
    if running is not None and running.status in ("running", "halted"):
        raise Refusal("conflict", f"alias {alias!r} already has rollout {running.rollout_id} "
                                  f"({running.status} at {running.weight}%)")
    version = state.version(adapter_id, canary)
    refused = unservable_reason(adapter, canary, version)
    if refused:
        raise Refusal("conflict", refused)
    if baseline is None:
        baseline = gate_baseline(adapter, canary)
        if baseline is None:
            raise Refusal("conflict", f"adapter {adapter_id!r} has no active version to be the "
                                      "baseline; switch a first version directly")
    if baseline == canary:
        raise Refusal("invalid", "the canary and the baseline are the same version")
    base_version = state.version(adapter_id, baseline)
    refused = unservable_reason(adapter, baseline, base_version)
    if refused:
        raise Refusal("conflict", f"baseline {refused}")
    weight = plan.stages[0]
    step = RolloutStep(rollout_id=rollout_id, action="started", alias=alias,
                       adapter_id=adapter_id, canary_version=canary, baseline_version=baseline,
                       stage=0, weight=weight, plan=plan, reason=reason)
    payload = TrafficSplitChanged(alias=alias, split=_arms(adapter_id, canary, baseline, weight),
                                  previous=list(current.split) if current else [],
                                  rollout=step, idempotency_key=idempotency_key)
    return CommandEvent(payload, alias_stream(alias), (current.seq if current else 0) + 1,
                    adapter.tenant)


def no_rollout(alias: str) -> str:
    """How a missing rollout is answered (another tenant's too, in the same words)."""
    return f"alias {alias!r} has no rollout"


def _rollout(state: CatalogState, alias: str, rollout_id: str, from_stage: int,
             statuses: tuple[str, ...] = ("running",)) -> Rollout:
    rollout = state.rollouts.get(alias)
    if rollout is None:
        raise Refusal("not_found", no_rollout(alias))
    if rollout.rollout_id != rollout_id:
        raise Refusal("conflict", f"rollout {rollout_id} is not the current one of {alias!r} "
                                  f"({rollout.rollout_id})")
    if rollout.status not in statuses:
        raise Refusal("conflict", f"rollout {rollout_id} is {rollout.status}")
    if rollout.stage != from_stage:
        raise Refusal("conflict", f"rollout {rollout_id} is at stage {rollout.stage} "
                                  f"({rollout.weight}%), not {from_stage}")
    return rollout


def _elapsed_s(rollout: Rollout, now: datetime) -> float:
    started = rollout.stage_started_at or rollout.started_at
    return (now - started).total_seconds()


def _check_judgement(rollout: Rollout, judgement: Judgement, want: str,
                     now: datetime) -> Judgement:
    started = rollout.stage_started_at or rollout.started_at
    if judgement.window_start < started:
        raise Refusal("invalid", f"window starts {judgement.window_start.isoformat()}, before "
                                 f"the stage began ({started.isoformat()})")
    if judgement.window_end < judgement.window_start:
        raise Refusal("invalid", "window ends before it starts")
    if judgement.canary.version != rollout.canary_version or \
            judgement.baseline.version != rollout.baseline_version:
        raise Refusal("invalid", "the figures are not for this rollout's two versions")
    if judgement.baseline_from_window == rollout.final_stage:
        raise Refusal("invalid", "at the 100% stage the baseline figures are the last judged "
                                 "ones (baseline_from_window false), and only there")
    if rollout.final_stage:
        last = rollout.last_judgement
        if last is None or last.baseline != judgement.baseline:
            raise Refusal("invalid", "baseline figures differ from the last judged stage's")
    again = same_verdict(rollout.plan, rollout.stage, judgement, _elapsed_s(rollout, now))
    if again.verdict != want:
        raise Refusal("conflict", f"the figures give {again.verdict!r}, not {want!r}: "
                                  + "; ".join(again.reasons))
    return again


def _refuse_unservable(state: CatalogState, adapter: Adapter, number: int) -> None:
    refused = unservable_reason(adapter, number, state.version(adapter.adapter_id, number))
    if refused:
        raise Refusal("conflict", refused)


def advance_rollout(state: CatalogState, alias: str, rollout_id: str, from_stage: int,
                    judgement: Judgement, *, now: datetime, automatic: bool = True,
                    idempotency_key: str | None = None) -> CommandEvent:
    """Next stage; at the last stage, completion (the canary becomes the active version)."""
    rollout = _rollout(state, alias, rollout_id, from_stage)
    judged = _check_judgement(rollout, judgement, "advance", now)
    adapter = state.adapter(rollout.adapter_id)
    _refuse_unservable(state, adapter, rollout.canary_version)
    reason = "; ".join(judged.reasons)
    if rollout.final_stage:
        step = _step(rollout, "completed", rollout.stage, judged, automatic, reason)
        return adapter_event(adapter, AdapterVersionSwitched(
            adapter_id=adapter.adapter_id, from_version=adapter.active_version,
            to_version=rollout.canary_version, alias=alias, rollout=step,
            idempotency_key=idempotency_key))
    stage = rollout.stage + 1
    step = _step(rollout, "advanced", stage, judged, automatic, reason)
    return _split_step(state, rollout, step, idempotency_key)


def roll_back_rollout(state: CatalogState, alias: str, rollout_id: str, from_stage: int, *,
                      reason: str, judgement: Judgement | None, now: datetime,
                      automatic: bool = True,
                      idempotency_key: str | None = None) -> CommandEvent:
    """All traffic back to the baseline; the canary is never served by the split again.

    The controller's rollback must carry figures that give `rollback`; an operator's
    (halted or running rollout) needs only a reason.
    """
    rollout = _rollout(state, alias, rollout_id, from_stage, ("running", "halted"))
    if judgement is not None:
        judgement = _check_judgement(rollout, judgement, "rollback", now)
        reason = reason or "; ".join(judgement.reasons)
    elif automatic:
        raise Refusal("invalid", "an automatic rollback needs the figures it was decided on")
    if not reason:
        raise Refusal("invalid", "a rollback needs a reason")
    step = _step(rollout, "rolled_back", rollout.stage, judgement, automatic, reason)
    step = step.model_copy(update={"weight": 0})
    return _split_step(state, rollout, step, idempotency_key)


def _step(rollout: Rollout, action: str, stage: int, judgement: Judgement | None,
          automatic: bool, reason: str) -> RolloutStep:
    return RolloutStep(rollout_id=rollout.rollout_id, action=action,  # type: ignore[arg-type]
                       alias=rollout.alias, adapter_id=rollout.adapter_id,
                       canary_version=rollout.canary_version,
                       baseline_version=rollout.baseline_version, stage=stage,
                       weight=rollout.plan.stages[stage], plan=rollout.plan,
                       judgement=judgement, automatic=automatic, reason=reason[:2048])


def _split_step(state: CatalogState, rollout: Rollout, step: RolloutStep,
                idempotency_key: str | None) -> CommandEvent:
    current = state.aliases[rollout.alias]
    split = _arms(rollout.adapter_id, rollout.canary_version, rollout.baseline_version,
                  step.weight) if step.weight else [
        SplitEntry(adapter_id=rollout.adapter_id, version=rollout.baseline_version, weight=100)]
    payload = TrafficSplitChanged(alias=rollout.alias, split=split,
                                  previous=list(current.split), rollout=step,
                                  idempotency_key=idempotency_key)
    return CommandEvent(payload, alias_stream(rollout.alias), current.seq + 1, rollout.tenant)


def halt_rollout(state: CatalogState, alias: str, rollout_id: str, from_stage: int, *,
                 reason: str, automatic: bool = False, judgement: Judgement | None = None,
                 idempotency_key: str | None = None) -> CommandEvent:
    rollout = _rollout(state, alias, rollout_id, from_stage)
    current = state.aliases[alias]
    return CommandEvent(RolloutHalted(alias=alias, rollout_id=rollout_id, stage=rollout.stage,
                                  reason=reason, automatic=automatic, judgement=judgement,
                                  idempotency_key=idempotency_key),
                    alias_stream(alias), current.seq + 1, rollout.tenant)


def resume_rollout(state: CatalogState, alias: str, rollout_id: str, from_stage: int, *,
                   reason: str = "", idempotency_key: str | None = None) -> CommandEvent:
    rollout = _rollout(state, alias, rollout_id, from_stage, ("halted",))
    adapter = state.adapter(rollout.adapter_id)
    _refuse_unservable(state, adapter, rollout.canary_version)
    current = state.aliases[alias]
    return CommandEvent(RolloutResumed(alias=alias, rollout_id=rollout_id, stage=rollout.stage,
                                   reason=reason, idempotency_key=idempotency_key),
                    alias_stream(alias), current.seq + 1, rollout.tenant)
