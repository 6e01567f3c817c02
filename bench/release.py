"""Release safety: what the traffic rule costs the request path, and a controller tick.

Run from the repository root::

    python bench/release.py [--quick] [--requests 200000] [--rollouts 200]

1. The serving rule on the request path (`resolve_reference` on an alias split 90/10),
   with the release rule consulted for versions that carry a passed quality gate, against
   the same catalog where the versions were published before gates existed (the rule
   returns at once): the ratio is what gating costs the router and every worker per
   request. Same process, interleaved rounds, median of the rounds.
2. One canary controller tick (`next_steps`) over `--rollouts` running rollouts, each with
   2 x 3,000 request traces in its window: what a restarted or busy controller spends to
   judge every rollout once.

Writes bench/results/release.json; every figure carries its settings and load average.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import BenchRun, Figure, load_average
from services.catalog.canary import TraceBook, TraceSample
from services.catalog.serving import resolve_reference
from services.catalog.state import CatalogState
from services.contracts.events import (
    AdapterVersionPublished,
    AdapterVersionSwitched,
    Envelope,
    GateCaseResult,
    GateCheckResult,
    GateOutput,
    GateRequest,
    Payload,
    QualityGateCompleted,
    RolloutPlan,
    SplitEntry,
    TenantRef,
    TrafficSplitChanged,
)
from services.registry.release_commands import start_rollout
from services.release.controller import next_steps

RESULTS = Path(__file__).resolve().parent / "results" / "release.json"
SHA = "ab" * 32
TENANT = TenantRef(org="acme", team="search", project="prod")
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _event(payload: Payload, stream: str, seq: int, seconds: float) -> Envelope:
    return Envelope.new(payload, stream=stream, seq=seq, actor="bench", tenant=TENANT,
                        occurred_at=T0 + timedelta(seconds=seconds))


def catalog(gated: bool, adapters: int = 100, cases: int = 32) -> CatalogState:
    """`adapters` adapters with v1 active and v2 on a 10% canary split of alias a{i}."""
    state = CatalogState()
    for i in range(adapters):
        aid, stream = f"a{i}", f"adapter/a{i}"
        for version in (1, 2):
            gate = GateRequest(gate_id=f"g{i}-{version}", regression_set_sha256=SHA,
                               cases=cases, worker_id="w1", timeout_s=600) if gated else None
            state.apply(_event(AdapterVersionPublished(
                adapter_id=aid, version=version, label=f"v{version}", base_model="m",
                base_model_digest=SHA, sha256=f"{i * 10 + version:064x}", config_sha256=SHA,
                size_bytes=1, rank=8, lora_alpha=16, target_modules=["q_proj"],
                dtype="float16", owner="o", gate_required=gated, quality_gate=gate),
                stream, version, 0))
            if gated:
                output = GateOutput(role="new", tokens=1, tokens_sha256=SHA, text_sha256=SHA,
                                    text="x", finish_reason="length")
                check = GateCheckResult(kind="regex", verdict="pass")
                state.apply(_event(QualityGateCompleted(
                    worker_id="w1", gate_id=f"g{i}-{version}", adapter_id=aid, version=version,
                    base_model_digest=SHA, regression_set_sha256=SHA, adapter_sha256=SHA,
                    passed=True, cases=[GateCaseResult(case_id=f"c{c}", line=c + 1,
                                                       prompt_sha256=SHA, outputs=[output],
                                                       checks=[check], passed=True)
                                        for c in range(cases)]), "worker/w1", 1, 1))
        state.apply(_event(AdapterVersionSwitched(adapter_id=aid, from_version=None,
                                                  to_version=1), stream, 3, 2))
        state.apply(_event(TrafficSplitChanged(alias=f"p{i}", split=[
            SplitEntry(adapter_id=aid, version=2, weight=10),
            SplitEntry(adapter_id=aid, version=1, weight=90)]), f"alias/p{i}", 1, 3))
    return state


def time_resolve(state: CatalogState, n: int, adapters: int) -> float:
    started = time.perf_counter()
    for k in range(n):
        resolve_reference(state, TENANT, f"p{k % adapters}", f"user-{k}")
    return (time.perf_counter() - started) / n * 1e6


def bench_rule(requests: int, rounds: int = 7) -> dict[str, object]:
    gated, plain = catalog(True), catalog(False)
    per_round = requests // rounds
    time_resolve(gated, 2000, 100)
    time_resolve(plain, 2000, 100)
    g, p = [], []
    for _ in range(rounds):
        g.append(time_resolve(gated, per_round, 100))
        p.append(time_resolve(plain, per_round, 100))
    return {"gated_us": statistics.median(g), "ungated_us": statistics.median(p),
            "ratio": statistics.median(g) / statistics.median(p),
            "settings": {"requests": requests, "rounds": rounds, "adapters": 100,
                         "split": "90/10", "gate_cases": 32}}


def bench_tick(rollouts: int, per_arm: int = 3000) -> dict[str, object]:
    state = catalog(True, adapters=rollouts, cases=1)
    plan = RolloutPlan(stages=[5, 25, 50, 100], min_stage_s=600, window_s=900,
                       max_error_ratio=1.5, min_requests=50, max_p95_ms=5000)
    book = TraceBook(retention=timedelta(hours=2))
    for i in range(rollouts):
        decision = start_rollout(state, f"p{i}", f"a{i}", 2, plan, f"r{i}")
        state.apply(Envelope.new(decision.payload, stream=decision.stream, seq=decision.seq,
                                 actor="bench", tenant=decision.tenant,
                                 occurred_at=T0 + timedelta(seconds=10)))
        for version in (1, 2):
            for k in range(per_arm):
                book.add(f"a{i}", version, TraceSample(
                    T0 + timedelta(seconds=11 + k * 0.25), 40.0 + k % 7, k % 50 == 0))
    now = T0 + timedelta(seconds=11 + per_arm * 0.25 + 5)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        steps = next_steps(state, book, now, settle_s=3)
        times.append((time.perf_counter() - started) * 1000)
    assert len(steps) == rollouts
    return {"tick_ms": statistics.median(times), "per_rollout_us":
            statistics.median(times) * 1000 / rollouts,
            "settings": {"rollouts": rollouts, "traces_per_arm_in_window": per_arm}}


def figures(result: dict[str, Any]) -> list[Figure]:
    rule, tick = result["serving_rule"], result["controller_tick"]
    rs = rule["settings"]
    return [
        Figure("serving rule per request, versions with passed gates", round(rule["gated_us"], 2),
               "us", baseline="the same catalog, versions published before gates",
               baseline_value=round(rule["ungated_us"], 2), better="lower",
               settings=f"{rs['requests']:,} resolves of a {rs['split']} alias split over "
                        f"{rs['adapters']} adapters, {rs['gate_cases']} gate cases, median "
                        f"of {rs['rounds']} interleaved rounds",
               load_average=result.get("load_average_after")),
        Figure("canary controller tick over every running rollout", round(tick["tick_ms"], 1),
               "ms", settings=f"{tick['settings']['rollouts']} rollouts, "
               f"{tick['settings']['traces_per_arm_in_window']:,} traces per arm in the "
               "window, median of 5 ticks", load_average=result.get("load_average_after")),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="20,000 resolves and 50 rollouts (a minute at most)")
    parser.add_argument("--requests", type=int, default=None, help="default 200,000")
    parser.add_argument("--rollouts", type=int, default=None, help="default 200")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    run = BenchRun("release", quick=args.quick)
    requests = args.requests or (20_000 if args.quick else 200_000)
    rollouts = args.rollouts or (50 if args.quick else 200)
    load_before = load_average()
    result = {"serving_rule": bench_rule(requests),
              "controller_tick": bench_tick(rollouts),
              "load_average_before": load_before, "load_average_after": load_average()}
    run.save(args.out, result, figures(result))


if __name__ == "__main__":
    main()
