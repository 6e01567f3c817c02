"""Canary analysis: figures from traces and every branch of a stage's verdict."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from services.catalog.canary import (
    TraceBook,
    TraceSample,
    arm_figures,
    judge,
    p95,
    same_verdict,
    sample_of,
)
from services.contracts.events import ArmFigures, RolloutPlan, ServedRequest, TenantRef

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
PLAN = RolloutPlan(stages=[5, 25, 50, 100], min_stage_s=60, window_s=60, max_error_ratio=1.5,
                   min_requests=20, max_p95_ms=500)


def arm(version: int, requests: int, errors: int, latency_ms: float = 100.0) -> ArmFigures:
    samples = [TraceSample(T0, latency_ms, i < errors) for i in range(requests)]
    return arm_figures(version, samples)


def verdict(canary: ArmFigures, baseline: ArmFigures, elapsed: float = 120.0,
            plan: RolloutPlan = PLAN, **kwargs: object) -> tuple[str, list[str]]:
    j = judge(plan, 0, canary, baseline, window_start=T0, window_end=T0 + timedelta(seconds=60),
              stage_elapsed_s=elapsed, **kwargs)  # type: ignore[arg-type]
    return j.verdict, j.reasons


def test_plans_climb_to_100() -> None:
    for stages in ([5, 5, 100], [50, 25, 100], [5, 25], [100]):
        with pytest.raises(ValidationError):
            PLAN.model_validate({**PLAN.model_dump(), "stages": stages})


def test_p95_is_nearest_rank() -> None:
    assert p95([]) is None
    assert p95([7.0]) == 7.0
    assert p95([float(i) for i in range(1, 101)]) == 95.0
    assert p95([float(i) for i in range(1, 21)]) == 19.0


def test_arm_figures() -> None:
    figures = arm(3, 40, 4, 250)
    assert (figures.requests, figures.errors, figures.error_rate, figures.p95_ms) == \
        (40, 4, 0.1, 250)
    assert arm_figures(3, []).error_rate is None


def test_waits_for_enough_traffic_in_both_arms() -> None:
    assert verdict(arm(2, 19, 0), arm(1, 100, 0))[0] == "wait"
    kind, reasons = verdict(arm(2, 50, 0), arm(1, 10, 0))
    assert kind == "wait" and "baseline v1: 10 of 20" in reasons[0]


def test_error_rate_at_most_ratio_times_baseline() -> None:
    assert verdict(arm(2, 100, 15), arm(1, 100, 10))[0] == "advance"  # exactly 1.5x
    kind, reasons = verdict(arm(2, 100, 16), arm(1, 100, 10))
    assert kind == "rollback"
    assert "error rate 16.0% (16/100) > 1.5 x baseline 10.0% (10/100)" in reasons[0]


def test_zero_baseline_errors_mean_any_canary_error_fails_unless_floored() -> None:
    assert verdict(arm(2, 100, 1), arm(1, 100, 0))[0] == "rollback"
    floored = PLAN.model_copy(update={"error_rate_floor": 0.02})
    assert verdict(arm(2, 100, 2), arm(1, 100, 0), plan=floored)[0] == "advance"
    assert verdict(arm(2, 100, 3), arm(1, 100, 0), plan=floored)[0] == "rollback"


def test_p95_bounds() -> None:
    kind, reasons = verdict(arm(2, 100, 0, 600), arm(1, 100, 0, 100))
    assert kind == "rollback" and "p95 600 ms > bound 500 ms" in reasons[0]
    ratio = PLAN.model_copy(update={"max_p95_ratio": 1.2})
    kind, reasons = verdict(arm(2, 100, 0, 130), arm(1, 100, 0, 100), plan=ratio)
    assert kind == "rollback" and "1.2 x baseline 100 ms" in reasons[0]
    assert verdict(arm(2, 100, 0, 119), arm(1, 100, 0, 100), plan=ratio)[0] == "advance"


def test_healthy_canary_waits_out_the_stage_but_a_bad_one_goes_at_once() -> None:
    kind, reasons = verdict(arm(2, 100, 0), arm(1, 100, 0), elapsed=30)
    assert kind == "wait" and "30 s of 60 s at 5%" in reasons[0]
    assert verdict(arm(2, 100, 50), arm(1, 100, 0), elapsed=1)[0] == "rollback"


def test_final_stage_compares_with_the_last_judged_baseline() -> None:
    kind, _ = verdict(arm(2, 100, 1), arm(1, 0, 0), baseline_from_window=False)
    assert kind == "wait"  # no judged baseline figures: cannot compare
    assert verdict(arm(2, 100, 0), arm(1, 100, 0), baseline_from_window=False)[0] == "advance"


def test_the_registry_recomputes_the_same_verdict() -> None:
    j = judge(PLAN, 1, arm(2, 100, 30), arm(1, 100, 10), window_start=T0,
              window_end=T0 + timedelta(seconds=60), stage_elapsed_s=10)
    assert j.verdict == "rollback"
    assert same_verdict(PLAN, 1, j, 10).verdict == "rollback"
    forged = j.model_copy(update={"verdict": "advance"})
    assert same_verdict(PLAN, 1, forged, 100).verdict == "rollback"


def served(status: str, started: datetime, ms: float, version: int | None = 2) -> ServedRequest:
    return ServedRequest(request_id="r", trace_id="t", tenant=TenantRef(org="a", team="b",
                                                                         project="c"),
                         adapter_id="bot" if version else None, version=version,
                         adapter_sha256=None, base_model_digest="ab" * 32, prompt_tokens=1,
                         completion_tokens=1, started_at=started,
                         finished_at=started + timedelta(milliseconds=ms), status=status)


def test_traces_counted_and_windowed() -> None:
    assert sample_of(served("aborted", T0, 5)) is None
    assert sample_of(served("rejected", T0, 5)) is None
    assert sample_of(served("error", T0, 5)) == TraceSample(T0, 5.0, True)
    book = TraceBook(retention=timedelta(minutes=10))
    for second in (5, 1, 3, 30):  # out of order
        book.add_request(served("ok", T0 + timedelta(seconds=second), 10))
    book.add_request(served("ok", T0, 10, version=None))  # base model: not an arm
    window = book.window("bot", 2, T0 + timedelta(seconds=1), T0 + timedelta(seconds=5))
    assert [s.started_at.second for s in window] == [1, 3]
    assert len(book) == 4
    assert book.figures("bot", 2, T0, T0 + timedelta(seconds=31)) == arm_figures(
        2, book.window("bot", 2, T0, T0 + timedelta(seconds=31)))
    spread = TraceBook(retention=timedelta(hours=1))
    for i in range(1, 41):
        spread.add("bot", 2, TraceSample(T0 + timedelta(seconds=i), float(i), i % 8 == 0))
    window = (T0, T0 + timedelta(minutes=1))
    assert spread.figures("bot", 2, *window) == arm_figures(2, spread.window("bot", 2, *window))
    assert spread.figures("bot", 2, *window).p95_ms == 38.0
    assert spread.figures("bot", 9, *window).requests == 0
    book.prune(T0 + timedelta(minutes=10, seconds=4))
    assert len(book) == 2  # the samples at 5 s and 30 s
