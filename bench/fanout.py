"""Fan-out latency: an adapter-log event committed by the registry → applied by 4 workers.

Real processes on loopback: Apache Kafka (KRaft, embedded), a registry, four worker
processes (`loraplane serve worker`, tiny base model), each reading every partition with
`assign()`. The bench changes an alias's traffic split `--events` times at `--rate` per
second over REST; every worker's engine loop records, for each adapter-log event it
applies, the time since the event's `occurred_at` (stamped by the registry just before
it writes the event, so this includes the commit) in the histogram
`loraplane_worker_catalog_apply_seconds`. The bench scrapes all four workers before and
after, and reports p50/p99 of the difference (linear interpolation within buckets, as
PromQL's histogram_quantile does; bucket edges 1, 2, 3, 5, 7.5, 10, 12.5, 15, 17.5, 20,
25, 30, 40, 50, 60, 75, 100, 125, 150, 200, 250 ms …). Target: p99 under 250 ms.

Usage: python bench/fanout.py [--workers 4] [--events 200] [--rate 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.registry.conftest import TENANT
from tests.worker.engine.tiny_llama import build_model
from tests.worker.harness import bench_stack, fresh_adapter, publish_files, save_report, switch

METRIC = "loraplane_worker_catalog_apply_seconds"


def scrape(port: int) -> dict[float, float]:
    """Cumulative bucket counts by upper edge."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != METRIC:
            continue
        for sample in family.samples:
            if sample.name == f"{METRIC}_bucket":
                buckets[float(sample.labels["le"])] = sample.value
    return buckets


def quantile(q: float, buckets: dict[float, float]) -> float:
    edges = sorted(buckets)
    total = buckets[edges[-1]]
    if total == 0:
        return float("nan")
    rank = q * total
    lower, below = 0.0, 0.0
    for edge in edges:
        count = buckets[edge]
        if count >= rank:
            if edge == float("inf"):
                return lower
            return lower + (edge - lower) * ((rank - below) / max(count - below, 1e-9))
        lower, below = edge, count
    return lower


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0, help="events per second")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "fanout.json"))
    args = parser.parse_args()
    with bench_stack("fanout", lambda d: build_model(d, max_position_embeddings=256)) as (
            _, stack):
        with stack.publisher() as pub:
            for version in (1, 2):
                publish_files(pub, "bot", fresh_adapter(version), f"v{version}", TENANT)
            switch(pub, "bot", 1)
        workers = [stack.worker(f"w{i}").start() for i in range(args.workers)]
        for worker in workers:
            worker.wait_serving(180)
        time.sleep(2.0)
        before = [scrape(w.metrics_port) for w in workers]
        started = time.monotonic()
        with stack.publisher() as pub:
            for i in range(args.events):
                weight = 5 + (i % 19) * 5
                response = pub.put("/v1/aliases/bot-canary", json={"split": [
                    {"adapter_id": "bot", "version": 2, "weight": weight},
                    {"adapter_id": "bot", "version": 1, "weight": 100 - weight}]})
                assert response.status_code == 200, response.text
                pause = started + (i + 1) / args.rate - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
        time.sleep(3.0)
        load_avg = os.getloadavg()
        after = [scrape(w.metrics_port) for w in workers]
    per_worker = {}
    merged: dict[float, float] = {}
    for worker, b, a in zip(workers, before, after, strict=True):
        delta = {edge: a.get(edge, 0.0) - b.get(edge, 0.0) for edge in a}
        per_worker[worker.worker_id] = {
            "events": int(delta[float("inf")]),
            "p50_ms": round(quantile(0.5, delta) * 1e3, 2),
            "p99_ms": round(quantile(0.99, delta) * 1e3, 2)}
        for edge, count in delta.items():
            merged[edge] = merged.get(edge, 0.0) + count
    report = {
        "workers": args.workers, "events_sent": args.events, "rate_per_s": args.rate,
        "events_applied_total": int(merged[float("inf")]),
        "p50_ms": round(quantile(0.5, merged) * 1e3, 2),
        "p99_ms": round(quantile(0.99, merged) * 1e3, 2),
        "target_p99_ms": 250.0,
        "per_worker": per_worker,
        "settings": {"broker": "Apache Kafka (KRaft, embedded), loopback",
                     "partitions": 3, "consumer": "assign(), fetch.wait.max.ms=10",
                     "producer": "transactional registry, linger.ms=0",
                     "note": "adapter-log events only (leases are on the liveness topic)"},
        "load_avg": [round(x, 2) for x in load_avg],
    }
    report["meets_target"] = report["p99_ms"] < 250.0
    save_report(args.out, report)


if __name__ == "__main__":
    main()
