"""What the canary controller asks the registry to do now, from the log alone. No I/O.

`next_steps` reads the shared fold (rollouts, their plans and stage clocks, all from
adapter-events) and the request traces (`TraceBook`, from RequestServed on
worker-events) and returns at most one step per running rollout:
- `halt` when the rollout can no longer be judged: its canary or baseline version became
  unservable by other means (disabled, rolled back by hand) — a human decides then;
- `rollback` / `advance` when `services.catalog.canary.judge` says so over the stage's
  window (the stage's last `window_s`, ending `settle_s` ago so late trace batches are
  not missed);
- nothing while the verdict is `wait`.
Nothing here depends on the controller's memory: a restarted controller folds the same
log and arrives at the same stage, clock and figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from services.catalog.canary import TraceBook, arm_figures, judge
from services.catalog.serving import unservable_reason
from services.catalog.state import CatalogState, Rollout
from services.contracts.events import Judgement

StepKind = Literal["advance", "rollback", "halt"]


@dataclass(frozen=True)
class ControllerStep:
    kind: StepKind
    alias: str
    rollout_id: str
    from_stage: int
    reason: str
    judgement: Judgement | None = None

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.rollout_id, self.from_stage, self.kind)


def _unservable(state: CatalogState, rollout: Rollout, version: int) -> str | None:
    adapter = state.adapters.get(rollout.adapter_id)
    found = adapter.versions.get(version) if adapter else None
    if adapter is None or found is None:
        return f"{rollout.adapter_id}@{version} does not exist"
    return unservable_reason(adapter, version, found)


def judge_rollout(rollout: Rollout, book: TraceBook, now: datetime,
                  settle_s: float) -> Judgement | None:
    """The current stage's judgement; None before the stage has a window at all."""
    started = rollout.stage_started_at or rollout.started_at
    end = now - timedelta(seconds=settle_s)
    start = max(started, end - timedelta(seconds=rollout.plan.window_s))
    if end <= start:
        return None
    canary = book.figures(rollout.adapter_id, rollout.canary_version, start, end)
    if rollout.final_stage:
        last = rollout.last_judgement
        baseline = last.baseline if last is not None else arm_figures(
            rollout.baseline_version, [])
        from_window = False
    else:
        baseline = book.figures(rollout.adapter_id, rollout.baseline_version, start, end)
        from_window = True
    return judge(rollout.plan, rollout.stage, canary, baseline, window_start=start,
                 window_end=end, stage_elapsed_s=(now - started).total_seconds(),
                 baseline_from_window=from_window)


def next_steps(state: CatalogState, book: TraceBook, now: datetime,
               settle_s: float) -> list[ControllerStep]:
    steps = []
    for alias, rollout in sorted(state.rollouts.items()):
        if rollout.status != "running":
            continue
        why = _unservable(state, rollout, rollout.canary_version)
        if why is None and not rollout.final_stage:
            why = _unservable(state, rollout, rollout.baseline_version)
            why = f"baseline {why}" if why else None
        if why is not None:
            steps.append(ControllerStep("halt", alias, rollout.rollout_id, rollout.stage,
                                        f"cannot judge: {why}"))
            continue
        judgement = judge_rollout(rollout, book, now, settle_s)
        if judgement is None or judgement.verdict == "wait":
            continue
        steps.append(ControllerStep(judgement.verdict, alias, rollout.rollout_id,
                                    rollout.stage, "; ".join(judgement.reasons), judgement))
    return steps
