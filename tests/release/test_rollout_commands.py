"""Rollout commands on the shared fold: every step decided, refused, and folded back."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from services.catalog.canary import judge
from services.catalog.serving import resolve_pinned, resolve_reference
from services.catalog.state import CatalogState, Refusal
from services.contracts.events import (
    AdapterVersionSwitched,
    ArmFigures,
    Envelope,
    Judgement,
    RolloutPlan,
    SplitEntry,
)
from services.registry.domain import CommandEvent, set_split
from services.registry.release_commands import (
    advance_rollout,
    halt_rollout,
    override_release,
    resume_rollout,
    roll_back_rollout,
    start_rollout,
)
from tests.catalog.test_release_rule import TENANT, at, completed, event, published, request

PLAN = RolloutPlan(stages=[5, 50, 100], min_stage_s=10, window_s=10, max_error_ratio=1.5,
                   min_requests=10, max_p95_ms=1000)


def apply(state: CatalogState, decision: CommandEvent, when: datetime) -> Envelope:
    envelope = Envelope.new(decision.payload, stream=decision.stream, seq=decision.seq,
                            actor="canary:c1", tenant=decision.tenant, occurred_at=when)
    state.apply(envelope)
    return envelope


def ready_state() -> CatalogState:
    """bot@1 active (published before gates), bot@2 with a passed gate."""
    state = CatalogState()
    for e in (event(published(1, required=False), at(-100)),
              event(AdapterVersionSwitched(adapter_id="bot", from_version=None, to_version=1),
                    at(-90)),
              event(published(2, request()), at(-50)), event(completed(), at(-40))):
        state.apply(e)
    return state


def figures(state: CatalogState, errors: int, now: datetime,
            baseline_errors: int = 0) -> Judgement:
    rollout = state.rollouts["bot-prod"]
    started = rollout.stage_started_at
    assert started is not None
    canary = ArmFigures(version=2, requests=100, errors=errors, error_rate=errors / 100,
                        p95_ms=100)
    if rollout.final_stage:
        assert rollout.last_judgement is not None
        baseline, from_window = rollout.last_judgement.baseline, False
    else:
        baseline = ArmFigures(version=1, requests=100, errors=baseline_errors,
                              error_rate=baseline_errors / 100, p95_ms=100)
        from_window = True
    return judge(rollout.plan, rollout.stage, canary, baseline, window_start=started,
                 window_end=now, stage_elapsed_s=(now - started).total_seconds(),
                 baseline_from_window=from_window)


def started() -> CatalogState:
    state = ready_state()
    apply(state, start_rollout(state, "bot-prod", "bot", 2, PLAN, "r1"), at(0))
    return state


def test_a_good_canary_walks_every_stage_then_becomes_active() -> None:
    state = started()
    rollout = state.rollouts["bot-prod"]
    assert (rollout.stage, rollout.weight, rollout.baseline_version) == (0, 5, 1)
    assert {(e.version, e.weight) for e in state.aliases["bot-prod"].split} == {(2, 5), (1, 95)}
    now = at(0)
    for stage in range(len(PLAN.stages)):
        now += timedelta(seconds=11)
        decision = advance_rollout(state, "bot-prod", "r1", stage, figures(state, 0, now),
                                   now=now)
        apply(state, decision, now)
    assert rollout.status == "completed"
    assert state.adapters["bot"].active_version == 2
    assert [(e.version, e.weight) for e in state.aliases["bot-prod"].split] == [(2, 100)]
    assert [action for _, action, _ in rollout.steps] == ["started", "advanced", "advanced",
                                                          "completed"]
    assert isinstance(decision.payload, AdapterVersionSwitched)
    assert decision.payload.rollout is not None
    assert decision.payload.rollout.judgement is not None
    assert not decision.payload.rollout.judgement.baseline_from_window


def test_advance_is_refused_without_figures_that_justify_it() -> None:
    state = started()
    early = at(5)
    with pytest.raises(Refusal, match="give 'wait'"):
        advance_rollout(state, "bot-prod", "r1", 0, figures(state, 0, early), now=early)
    now = at(11)
    bad = figures(state, 30, now)
    forged = bad.model_copy(update={"verdict": "advance"})
    with pytest.raises(Refusal, match="give 'rollback'"):
        advance_rollout(state, "bot-prod", "r1", 0, forged, now=now)
    with pytest.raises(Refusal, match="not 1"):
        advance_rollout(state, "bot-prod", "r1", 1, figures(state, 0, now), now=now)
    with pytest.raises(Refusal, match="not the current one"):
        advance_rollout(state, "bot-prod", "r0", 0, figures(state, 0, now), now=now)
    before = figures(state, 0, now).model_copy(update={"window_start": at(-5)})
    with pytest.raises(Refusal, match="before the stage began"):
        advance_rollout(state, "bot-prod", "r1", 0, before, now=now)


def test_a_bad_canary_is_rolled_back_and_never_served_again() -> None:
    state = started()
    now = at(3)
    with pytest.raises(Refusal, match="needs the figures"):
        roll_back_rollout(state, "bot-prod", "r1", 0, reason="", judgement=None, now=now)
    healthy = figures(state, 0, now)
    with pytest.raises(Refusal, match="give 'wait'"):
        roll_back_rollout(state, "bot-prod", "r1", 0, reason="", judgement=healthy, now=now)
    decision = roll_back_rollout(state, "bot-prod", "r1", 0, reason="",
                                 judgement=figures(state, 20, now, baseline_errors=2), now=now)
    apply(state, decision, now)
    rollout = state.rollouts["bot-prod"]
    assert rollout.status == "rolled_back"
    assert "error rate 20.0% (20/100) > 1.5 x baseline 2.0%" in rollout.status_reason
    assert [(e.version, e.weight) for e in state.aliases["bot-prod"].split] == [(1, 100)]
    with pytest.raises(Refusal, match="canary rollout r1 rolled it back at 5%"):
        resolve_pinned(state, TENANT, "bot", 2)
    with pytest.raises(Refusal, match="rolled it back"):
        set_split(state, "bot-prod", [SplitEntry(adapter_id="bot", version=2, weight=100)])
    with pytest.raises(Refusal, match="rolled it back"):
        start_rollout(state, "bot-prod", "bot", 2, PLAN, "r2")
    apply(state, override_release(state, "bot", 2, "fixed upstream, accepted by on-call"),
          at(20))
    start_rollout(state, "bot-prod", "bot", 2, PLAN, "r2")  # the override lifted the block


def test_start_refusals() -> None:
    state = ready_state()
    with pytest.raises(Refusal, match="same version"):
        start_rollout(state, "bot-prod", "bot", 2, PLAN, "r1", baseline=2)
    state.apply(event(published(3, request(gate_id="g3")), at(0)))
    with pytest.raises(Refusal, match="quality gate g3 is pending"):
        start_rollout(state, "bot-prod", "bot", 3, PLAN, "r1")
    apply(state, start_rollout(state, "bot-prod", "bot", 2, PLAN, "r1"), at(1))
    with pytest.raises(Refusal, match="already has rollout r1"):
        start_rollout(state, "bot-prod", "bot", 2, PLAN, "r2")
    with pytest.raises(Refusal, match="in canary rollout r1"):
        set_split(state, "bot-prod", [SplitEntry(adapter_id="bot", version=1, weight=100)])


def test_halt_and_resume_restart_the_stage_clock() -> None:
    state = started()
    apply(state, halt_rollout(state, "bot-prod", "r1", 0, reason="customer escalation"), at(4))
    rollout = state.rollouts["bot-prod"]
    assert rollout.status == "halted"
    with pytest.raises(Refusal, match="is halted"):
        advance_rollout(state, "bot-prod", "r1", 0, figures(state, 0, at(11)), now=at(11))
    apply(state, resume_rollout(state, "bot-prod", "r1", 0, reason="cleared"), at(20))
    assert rollout.status == "running" and rollout.stage_started_at == at(20)
    assert state.aliases["bot-prod"].seq == 3  # halt and resume are on the alias stream
    users = {resolve_reference(state, TENANT, "bot-prod", f"u{i}").version for i in range(300)}
    assert users == {1, 2}
