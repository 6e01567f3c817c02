"""Canary analysis: figures from request traces, and a stage's verdict. No I/O.

The canary controller computes `Judgement`s with `judge`, and the registry recomputes the
verdict with the same function from the figures the controller sends before it writes a
stage change, so an advance or a rollback is only ever written with figures that justify
it under the rollout's own plan (carried in the log, not in either process's settings).

Figures (`arm_figures`) come from `RequestServed` traces only: a trace counts for the
version that served it, in the window that holds its `started_at`. `requests` counts
`ok` and `error` traces; `aborted` (the client went away) and `rejected` (refused before
the engine, e.g. the version wall) say nothing about the version and are left out. The
p95 is the nearest-rank 95th percentile of `finished_at - started_at`.

A stage's verdict:
- `wait` while either arm has fewer than `min_requests` traces in the window (at the
  100% stage only the canary is counted: the baseline figures are those of the last
  judged stage, since the baseline serves nothing any more);
- `rollback` as soon as the canary's error rate exceeds `max_error_ratio` x the
  baseline's (or `error_rate_floor`, whichever is higher), or its p95 exceeds
  `max_p95_ms`, or `max_p95_ratio` x the baseline's p95: a bad canary is not left at its
  stage for the rest of the stage's minimum time;
- otherwise `wait` until the stage has lasted `min_stage_s`, then `advance` (at the last
  stage: complete, the canary becomes the adapter's active version).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import numpy as np

from services.contracts.events import ArmFigures, Judgement, RolloutPlan, ServedRequest

COUNTED = frozenset({"ok", "error"})


@dataclass(frozen=True)
class TraceSample:
    started_at: datetime
    latency_ms: float
    error: bool


def sample_of(request: ServedRequest) -> TraceSample | None:
    """A trace as the analysis counts it; None for traces it leaves out."""
    if request.status not in COUNTED:
        return None
    latency = (request.finished_at - request.started_at).total_seconds() * 1000.0
    return TraceSample(request.started_at, max(0.0, latency), request.status == "error")


def p95(latencies: list[float]) -> float | None:
    """Nearest-rank 95th percentile."""
    if not latencies:
        return None
    ordered = sorted(latencies)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def arm_figures(version: int, samples: Iterable[TraceSample]) -> ArmFigures:
    counted = list(samples)
    errors = sum(1 for s in counted if s.error)
    n = len(counted)
    return ArmFigures(version=version, requests=n, errors=errors,
                      error_rate=errors / n if n else None,
                      p95_ms=p95([s.latency_ms for s in counted]))


def _pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate * 100:.1f}%"


def judge(plan: RolloutPlan, stage: int, canary: ArmFigures, baseline: ArmFigures, *,
          window_start: datetime, window_end: datetime, stage_elapsed_s: float,
          baseline_from_window: bool = True) -> Judgement:
    """The verdict on one stage; see the module doc."""
    def verdict(kind: str, reasons: list[str]) -> Judgement:
        return Judgement(window_start=window_start, window_end=window_end, canary=canary,
                         baseline=baseline, baseline_from_window=baseline_from_window,
                         verdict=kind, reasons=reasons)  # type: ignore[arg-type]

    short = []
    if canary.requests < plan.min_requests:
        short.append(f"canary v{canary.version}: {canary.requests} of {plan.min_requests} "
                     "requests")
    if baseline.requests < plan.min_requests or baseline.error_rate is None:
        if baseline_from_window:
            short.append(f"baseline v{baseline.version}: {baseline.requests} of "
                         f"{plan.min_requests} requests")
        else:
            short.append("no judged baseline figures to compare with")
    if short:
        return verdict("wait", ["not enough traffic to judge: " + "; ".join(short)])
    assert canary.error_rate is not None and baseline.error_rate is not None
    failed = []
    allowed = max(plan.max_error_ratio * baseline.error_rate, plan.error_rate_floor)
    if canary.error_rate > allowed:
        failed.append(f"error rate {_pct(canary.error_rate)} ({canary.errors}/{canary.requests})"
                      f" > {plan.max_error_ratio:g} x baseline {_pct(baseline.error_rate)} "
                      f"({baseline.errors}/{baseline.requests})"
                      + (f", floor {_pct(plan.error_rate_floor)}" if plan.error_rate_floor
                         else ""))
    if canary.p95_ms is not None and canary.p95_ms > plan.max_p95_ms:
        failed.append(f"p95 {canary.p95_ms:.0f} ms > bound {plan.max_p95_ms:.0f} ms")
    if (plan.max_p95_ratio is not None and canary.p95_ms is not None
            and baseline.p95_ms is not None and baseline.p95_ms > 0
            and canary.p95_ms > plan.max_p95_ratio * baseline.p95_ms):
        failed.append(f"p95 {canary.p95_ms:.0f} ms > {plan.max_p95_ratio:g} x baseline "
                      f"{baseline.p95_ms:.0f} ms")
    if failed:
        return verdict("rollback", failed)
    healthy = (f"error rate {_pct(canary.error_rate)} vs baseline {_pct(baseline.error_rate)}"
               f" (limit {_pct(allowed)}), p95 {canary.p95_ms:.0f} ms (bound "
               f"{plan.max_p95_ms:.0f} ms)")
    if stage_elapsed_s < plan.min_stage_s:
        return verdict("wait", [f"healthy so far: {healthy}; {stage_elapsed_s:.0f} s of "
                                f"{plan.min_stage_s:g} s at {plan.stages[stage]}%"])
    return verdict("advance", [healthy])


def same_verdict(plan: RolloutPlan, stage: int, submitted: Judgement,
                 stage_elapsed_s: float) -> Judgement:
    """The judgement recomputed from the submitted figures (what the registry trusts)."""
    return judge(plan, stage, submitted.canary, submitted.baseline,
                 window_start=submitted.window_start, window_end=submitted.window_end,
                 stage_elapsed_s=stage_elapsed_s,
                 baseline_from_window=submitted.baseline_from_window)


class _Arm:
    """One version's samples as parallel lists ordered by start time (epoch seconds)."""

    __slots__ = ("errors", "latencies", "times")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.latencies: list[float] = []
        self.errors: list[bool] = []

    def add(self, sample: TraceSample) -> None:
        at = sample.started_at.timestamp()
        index = len(self.times)
        if index and self.times[-1] > at:
            index = bisect.bisect_right(self.times, at)
        self.times.insert(index, at)
        self.latencies.insert(index, sample.latency_ms)
        self.errors.insert(index, sample.error)

    def span(self, start: datetime, end: datetime) -> tuple[int, int]:
        return (bisect.bisect_left(self.times, start.timestamp()),
                bisect.bisect_left(self.times, end.timestamp()))

    def drop_before(self, cutoff: datetime) -> None:
        cut = bisect.bisect_left(self.times, cutoff.timestamp())
        if cut:
            del self.times[:cut], self.latencies[:cut], self.errors[:cut]


@dataclass
class TraceBook:
    """Recent trace samples per adapter version, ordered by start time, bounded in age.

    Figures over a window are computed with numpy on the window's slice (a count and a
    partition, no sort), so a controller judging hundreds of rollouts with thousands of
    traces each stays cheap.
    """

    retention: timedelta
    _arms: dict[tuple[str, int], _Arm] = field(default_factory=dict)

    def add(self, adapter_id: str, version: int, sample: TraceSample) -> None:
        arm = self._arms.get((adapter_id, version))
        if arm is None:
            arm = self._arms[(adapter_id, version)] = _Arm()
        arm.add(sample)

    def add_request(self, request: ServedRequest) -> None:
        if request.adapter_id is None or request.version is None:
            return
        sample = sample_of(request)
        if sample is not None:
            self.add(request.adapter_id, request.version, sample)

    def window(self, adapter_id: str, version: int, start: datetime,
               end: datetime) -> list[TraceSample]:
        arm = self._arms.get((adapter_id, version))
        if arm is None:
            return []
        low, high = arm.span(start, end)
        return [TraceSample(datetime.fromtimestamp(t, UTC), lat, err)
                for t, lat, err in zip(arm.times[low:high], arm.latencies[low:high],
                                       arm.errors[low:high], strict=True)]

    def figures(self, adapter_id: str, version: int, start: datetime,
                end: datetime) -> ArmFigures:
        """`arm_figures` of the window, without materialising its samples."""
        arm = self._arms.get((adapter_id, version))
        if arm is None:
            return arm_figures(version, [])
        low, high = arm.span(start, end)
        n = high - low
        if n == 0:
            return arm_figures(version, [])
        errors = int(np.count_nonzero(np.fromiter(arm.errors[low:high], dtype=bool, count=n)))
        latencies = np.fromiter(arm.latencies[low:high], dtype=np.float64, count=n)
        rank = max(0, math.ceil(0.95 * n) - 1)
        return ArmFigures(version=version, requests=n, errors=errors, error_rate=errors / n,
                          p95_ms=float(np.partition(latencies, rank)[rank]))

    def prune(self, now: datetime) -> None:
        cutoff = now - self.retention
        for key, arm in list(self._arms.items()):
            arm.drop_before(cutoff)
            if not arm.times:
                del self._arms[key]

    def __len__(self) -> int:
        return sum(len(a.times) for a in self._arms.values())
