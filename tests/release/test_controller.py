"""The controller's decisions from the fold and the traces alone (no I/O)."""

from __future__ import annotations

from datetime import datetime, timedelta

from services.catalog.canary import TraceBook, TraceSample
from services.catalog.state import CatalogState
from services.contracts.events import AdapterDisabled
from services.registry.release_commands import advance_rollout, start_rollout
from services.release.controller import next_steps
from tests.catalog.test_release_rule import at, event
from tests.release.test_rollout_commands import PLAN, apply, ready_state


def traffic(book: TraceBook, start: datetime, seconds: int, per_s: dict[int, int],
            errors: dict[int, int] | None = None) -> None:
    """`per_s[v]` requests a second for version v; `errors[v]` of every 10 fail."""
    errors = errors or {}
    for second in range(seconds):
        for version, n in per_s.items():
            for i in range(n):
                when = start + timedelta(seconds=second, milliseconds=i * 1000 // n)
                book.add("bot", version, TraceSample(when, 50.0, i % 10 < errors.get(version, 0)))


def rolling() -> tuple[CatalogState, TraceBook]:
    state = ready_state()
    apply(state, start_rollout(state, "bot-prod", "bot", 2, PLAN, "r1"), at(0))
    return state, TraceBook(retention=timedelta(hours=1))


def test_waits_then_advances_on_healthy_figures() -> None:
    state, book = rolling()
    traffic(book, at(0), 20, {1: 19, 2: 1})
    assert next_steps(state, book, at(5), settle_s=1) == []  # 4 canary traces: wait
    [step] = next_steps(state, book, at(12), settle_s=1)
    assert (step.kind, step.from_stage) == ("advance", 0)
    assert step.judgement is not None
    assert step.judgement.window_start == at(1) and step.judgement.window_end == at(11)
    assert (step.judgement.canary.requests, step.judgement.baseline.requests) == (10, 190)
    # the registry takes exactly these figures
    apply(state, advance_rollout(state, "bot-prod", "r1", 0, step.judgement, now=at(12)),
          at(12))
    assert state.rollouts["bot-prod"].stage == 1


def test_rolls_back_early_on_errors() -> None:
    state, book = rolling()
    traffic(book, at(0), 4, {1: 19, 2: 5}, errors={2: 3})
    [step] = next_steps(state, book, at(4), settle_s=0.5)
    assert step.kind == "rollback"
    assert step.reason == "error rate 66.7% (12/18) > 1.5 x baseline 0.0% (0/67)"


def test_halts_when_the_canary_can_no_longer_be_judged() -> None:
    state, book = rolling()
    state.apply(event(AdapterDisabled(adapter_id="bot", version=2, reason="legal hold"), at(3)))
    [step] = next_steps(state, book, at(4), settle_s=0.5)
    assert step.kind == "halt" and "bot@2 is disabled: legal hold" in step.reason


def test_final_stage_judges_against_the_last_baseline_figures() -> None:
    state, book = rolling()
    now = at(0)
    for stage in range(len(PLAN.stages) - 1):
        weight = PLAN.stages[stage]
        traffic(book, now, 11, {1: 100 - weight, 2: weight})
        now += timedelta(seconds=11)
        [step] = next_steps(state, book, now, settle_s=0)
        assert step.kind == "advance" and step.judgement is not None
        apply(state, advance_rollout(state, "bot-prod", "r1", stage, step.judgement, now=now),
              now)
    rollout = state.rollouts["bot-prod"]
    assert rollout.final_stage
    traffic(book, now, 11, {2: 100}, errors={2: 2})  # 20% errors once it has everything
    [step] = next_steps(state, book, now + timedelta(seconds=11), settle_s=0)
    assert step.kind == "rollback" and step.judgement is not None
    assert not step.judgement.baseline_from_window
    assert step.judgement.baseline == rollout.last_judgement.baseline  # type: ignore[union-attr]
