"""Fault scenarios on a multi-host cluster, under load, each checked afterwards.

Run from the repository root, as root (network namespaces)::

    python bench/chaos.py [--quick] [--scenarios a,b] [--seed 1]

Starts the cluster of `services/cluster/topology.py` (13 hosts in network namespaces: a
three-node Kafka quorum, PostgreSQL, two registries, two routers, three workers on a tiny
random model, the projector and the canary controller), then runs every scenario of
`tests/cluster/scenarios.py` (or those named) one after another on it, restoring the
cluster between them. Each scenario's history is written next to the result
(`.loraplane/test-state/chaos/NAME.history.json`); the results, with the checker's
anomalies, go to bench/results/chaos.json, which `bench/report.py` renders. `make chaos`
runs the full set.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import RESULTS, BenchRun, Figure  # noqa: E402
from tests.cluster.conftest import cluster_available, start_rig  # noqa: E402
from tests.cluster.scenarios import QUICK, SCENARIOS, run_scenario, target_of  # noqa: E402
from tests.conftest import CACHE, service_dir  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"the quick set ({', '.join(QUICK)}) with shorter faults")
    parser.add_argument("--scenarios", help="comma-separated names (default: all)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "chaos.json")
    args = parser.parse_args()
    why = cluster_available()
    if why is not None:
        print(f"chaos: cannot run here: {why}", file=sys.stderr)
        return 2
    names = args.scenarios.split(",") if args.scenarios else \
        (list(QUICK) if args.quick else list(SCENARIOS))
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"chaos: unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}",
              file=sys.stderr)
        return 2
    # SIGTERM stops the run like Ctrl-C: the cluster's teardown still runs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bench = BenchRun("chaos", quick=args.quick)
    out_dir = CACHE.parent / "test-state" / "chaos"
    results: list[dict[str, Any]] = []
    with service_dir("chaos") as where:
        started = time.monotonic()
        rig = start_rig(where, out_dir)
        startup_s = round(time.monotonic() - started, 1)
        print(f"[chaos] cluster up in {startup_s} s: {rig.cluster.timings}", flush=True)
        try:
            for index, name in enumerate(names):
                result = run_scenario(rig.cluster, SCENARIOS[name], seed=args.seed + index,
                                      quick=args.quick, files=rig.files,
                                      target=target_of(rig.cluster, rig.inference_token),
                                      out_dir=out_dir)
                print(f"[chaos] {result['line']}", flush=True)
                for anomaly in result["check"]["anomalies"]:
                    print(f"[chaos]   anomaly: {anomaly['check']}: {anomaly['detail']}",
                          flush=True)
                results.append(result)
        finally:
            rig.cluster.stop()
    anomalies = sum(r["anomalies"] for r in results)
    figures = [Figure("harness start-up", rig.cluster.timings["total"], "s", better="lower",
                      settings="13 hosts, 3 Kafka nodes, tiny random Llama workers")]
    for result in results:
        takeover = result["notes"].get("takeover_s")
        gen = result["latency"]["generate"]
        figures.append(Figure(
            f"{result['scenario']}: anomalies", result["anomalies"], "anomalies",
            better="lower", target="0", meets_target=result["anomalies"] == 0,
            settings=f"seed {result['seed']}, {result['seconds']} s"))
        if gen["p99_fault_ms"] is not None:
            figures.append(Figure(
                f"{result['scenario']}: generate p99 during the fault", gen["p99_fault_ms"],
                "ms", baseline="p99 before the fault (same run)",
                baseline_value=gen["p99_before_ms"], better="lower"))
        if takeover is not None:
            figures.append(Figure(f"{result['scenario']}: registry takeover", takeover, "s",
                                  better="lower", target="< 10 s", meets_target=takeover < 10))
    for result in results:  # histories stay on disk; the document keeps the summary
        result["check"] = {"anomalies": result["check"]["anomalies"],
                           "anomalies_by_check": result["check"]["anomalies_by_check"],
                           "stats": result["check"]["stats"]}
    bench.save(args.out, {"startup": rig.cluster.timings, "scenarios": results,
                          "anomalies": anomalies}, figures)
    return 1 if anomalies else 0


if __name__ == "__main__":
    sys.exit(main())
