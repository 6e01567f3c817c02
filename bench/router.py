"""Router: decision cost, key movement, added latency on loopback, pre-warmed joins.

Run from the repository root::

    python bench/router.py [--quick] [--decisions 100000] [--streams 400]

1. Routing decision (`Dispatcher.decide`, the function both fronts call: tenant from the
   token, resolve the version by alias split or active version, admit through the token
   buckets, place on the ring with bounded load and adapter awareness), in process, 10,000
   tenants (each with an adapter; every tenth with a 90/10 canary alias) on 64 workers with
   random in-flight counts and holdings, after `Dispatcher.start_serving` as the server
   calls it once the log is replayed. Target: p99 under 50 us, for tenants that have asked
   before (the headline); also every tenant's first request (every cache cold) and
   requests with a split change folded every 1,000 decisions (every cached resolution
   dropped), a full garbage collection before and after `gc.freeze`, and the machine's own
   tail (a fixed loop of the same median, timed the same way: `noise_floor`).
2. Keys moved when a 17th worker joins 16 (100,000 tenant signatures; expect ~1/17).
3. Added latency per streamed request on loopback: the same stand-in worker (a grpc.aio
   server of the Inference proto, 8 tokens) called directly and through the router, turn
   about, in the same run; Apache Kafka (KRaft) is started unless LORAPLANE_KAFKA_BOOTSTRAP
   names a broker.
4. First request after a worker joins, for the keys it gains, with pre-warming (defaults)
   and without (`router_prewarm=false`, `router_affinity_window=1`: the plain ring). The
   stand-in workers take `--cold-load-ms` to load an adapter from disk and
   `--promote-ms` to promote one from host memory (the loader costs practitioners report:
   30-80 ms cold, a few ms from pinned host memory), so the figures show what the router's
   pre-warming saves, with the load costs as stated settings.

Writes bench/results/router.json; every figure carries the settings and load average.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from bench.record import BenchRun, Figure  # noqa: E402
from services.catalog.auth import Principal  # noqa: E402
from services.catalog.state import adapter_stream, alias_stream  # noqa: E402
from services.config import Settings  # noqa: E402
from services.contracts.events import (  # noqa: E402
    AdapterVersionPublished,
    AdapterVersionSwitched,
    BaseModelRegistered,
    Envelope,
    LoadedAdapter,
    SplitEntry,
    TenantRef,
    TrafficSplitChanged,
    WorkerHeartbeat,
)
from services.contracts.grpc import inference_pb2 as pb  # noqa: E402
from services.contracts.grpc import inference_pb2_grpc as pb_grpc  # noqa: E402
from services.eventlog import ensure_topics  # noqa: E402
from services.router.dispatch import Dispatcher, asked_of  # noqa: E402
from services.router.ring import Ring, ring_key  # noqa: E402
from services.router.routing import Asked  # noqa: E402
from services.stack.brokers import ApacheKafka  # noqa: E402
from tests.router.conftest import (  # noqa: E402
    CatalogWriter,
    RunningRouter,
    bearer,
    router_settings,
)
from tests.router.standin import BASE_DIGEST, ServerLoop, StandInWorker  # noqa: E402

HIGH = {t: 1e12 for t in ("platinum", "gold", "silver", "bronze")}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --- 1. decision cost -------------------------------------------------------------------------


def decision_router(rnd: random.Random, tenants: int = 10_000, workers: int = 64
                    ) -> tuple[Dispatcher, list[tuple[Principal, str]], float]:
    """A router that has folded a catalog of `tenants` tenants (one adapter each, every tenth
    behind a 90/10 canary alias) and heartbeats of `workers` workers; its callers."""
    d = Dispatcher(Settings(router_tenant_rate=HIGH, router_adapter_rate=HIGH,
                            router_cold_load_rate=HIGH), clock=time.monotonic)

    def event(payload: Any, stream: str, tenant: TenantRef | None) -> Envelope:
        return Envelope.new(payload, stream=stream, seq=1, actor="bench", tenant=tenant)

    d.fold(event(BaseModelRegistered(name="base", digest=BASE_DIGEST, config={}),
                 "base-model/base", None), 0.0)
    callers, shas = [], []
    for i in range(tenants):
        tenant = TenantRef(org=f"org{i % 500}", team=f"team{i}", project="p")
        adapter = f"a{i}"
        for version in (1, 2):
            sha = hashlib.sha256(f"{adapter}@{version}".encode()).hexdigest()
            shas.append(sha)
            d.fold(event(AdapterVersionPublished(
                adapter_id=adapter, version=version, label=f"v{version}", base_model="base",
                base_model_digest=BASE_DIGEST, sha256=sha, config_sha256="c" * 64,
                size_bytes=1, rank=8, lora_alpha=16, target_modules=["q_proj"],
                dtype="float16", owner="o", qos_tier=rnd.choice(["gold", "silver"])),
                adapter_stream(adapter), tenant), 0.0)
        d.fold(event(AdapterVersionSwitched(adapter_id=adapter, from_version=None,
                                            to_version=1), adapter_stream(adapter), tenant),
               0.0)
        name = adapter
        if i % 10 == 0:
            name = f"alias{i}"
            d.fold(event(TrafficSplitChanged(alias=name, split=[
                SplitEntry(adapter_id=adapter, version=1, weight=90),
                SplitEntry(adapter_id=adapter, version=2, weight=10)]), alias_stream(name),
                tenant), 0.0)
        callers.append((Principal(f"t{i}", "inference", (tenant.org, tenant.team, "p"),
                                  "gold"), name))
    now = time.monotonic()
    for w in range(workers):
        held = [LoadedAdapter(adapter_id="x", version=1, sha256=sha,
                              tier=rnd.choice(["device", "host", "disk"]))
                for sha in rnd.sample(shas, 300)]
        d.fold(event(WorkerHeartbeat(worker_id=f"w{w}", address=f"127.0.0.1:{9000 + w}",
                                     base_model="base", base_model_digest=BASE_DIGEST,
                                     loaded=held), f"worker/w{w}", None), now)
        d.membership.in_flight[f"w{w}"] = rnd.randrange(0, 8)
    return d, callers, now


Ask = tuple[Principal, Asked]


def timed_decisions(d: Dispatcher, asks: list[Ask], now: float, *,
                    between: Any = None) -> dict[str, Any]:
    """Wall and thread-CPU time of `Dispatcher.decide` (what both fronts call) per ask, and
    the collector's passes meanwhile; `between(i)` runs untimed before ask i."""
    timings, cpu, pauses = [], [], []
    started_gc: list[float] = []

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started_gc.append(time.perf_counter())
        elif started_gc:
            pauses.append((info["generation"], (time.perf_counter() - started_gc.pop()) * 1e6))

    clock, thread_clock = time.perf_counter_ns, time.thread_time_ns
    gc.callbacks.append(watch)
    try:
        for i, (principal, asked) in enumerate(asks):
            if between is not None:
                between(i)
            started, started_cpu = clock(), thread_clock()
            d.decide(principal, asked, now)
            cpu.append((thread_clock() - started_cpu) / 1000)
            timings.append((clock() - started) / 1000)
    finally:
        gc.callbacks.remove(watch)
    return {"decisions": len(asks),
            "p50_us": round(pct(timings, 0.5), 2), "p99_us": round(pct(timings, 0.99), 2),
            "p999_us": round(pct(timings, 0.999), 2),
            "mean_us": round(statistics.fmean(timings), 2),
            "cpu_p50_us": round(pct(cpu, 0.5), 2), "cpu_p99_us": round(pct(cpu, 0.99), 2),
            "gc_passes": {f"gen{g}": sum(1 for gen, _ in pauses if gen == g) for g in range(3)},
            "gc_max_pause_us": round(max((us for _, us in pauses), default=0.0), 1),
            "loadavg": load()}


def _fixed_work(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def noise_floor(median_us: float, count: int) -> dict[str, Any]:
    """The machine's own tail: a fixed pure-Python loop, sized to the decision's median and
    timed the same way. Its p99/p50 is what preemption and cache pollution by other
    processes add to any work of that size here; the decision's ratio is compared to it."""
    clock = time.perf_counter_ns

    def median_of(n: int) -> float:
        samples = []
        for _ in range(2000):
            started = clock()
            _fixed_work(n)
            samples.append((clock() - started) / 1000)
        return pct(samples, 0.5)

    n = max(1, round(400 * median_us / median_of(400)))
    timings = []
    for _ in range(count):
        started = clock()
        _fixed_work(n)
        timings.append((clock() - started) / 1000)
    return {"loop_iterations": n, "samples": count, "p50_us": round(pct(timings, 0.5), 2),
            "p99_us": round(pct(timings, 0.99), 2),
            "p99_over_p50": round(pct(timings, 0.99) / pct(timings, 0.5), 2),
            "loadavg": load()}


def decisions(count: int, tenants: int = 10_000, workers: int = 64) -> dict[str, Any]:
    """The router as it is once the log is replayed (`start_serving`, as the server calls
    it), then: every tenant's first request; `count` requests from tenants that have asked
    before; the same with the catalog changing under them."""
    rnd = random.Random(7)
    d, callers, now = decision_router(rnd, tenants, workers)
    started = time.perf_counter()
    gc.collect()  # the full collection that, unfrozen, would come round now and then
    full_gc_ms = (time.perf_counter() - started) * 1000
    d.start_serving()
    started = time.perf_counter()
    gc.collect()
    frozen_gc_ms = (time.perf_counter() - started) * 1000

    def ask(principal: Principal, name: str) -> Ask:
        return principal, asked_of(pb.TenantSignature(user_id=f"u{rnd.randrange(10**6)}"),
                                  pb.AdapterRef(alias=name))

    firsts = [ask(principal, name) for principal, name in callers]
    rnd.shuffle(firsts)
    first = timed_decisions(d, firsts, now)
    steady = timed_decisions(d, [ask(*rnd.choice(callers)) for _ in range(count)], now)
    steady["p99_over_p50"] = round(steady["p99_us"] / steady["p50_us"], 2)
    floor = noise_floor(steady["p50_us"], count)
    aliases = [name for _, name in callers if name.startswith("alias")]
    every = 1000

    def change(i: int) -> None:  # a canary moves: every cached resolution is dropped
        if i % every == 0:
            name = aliases[(i // every) % len(aliases)]
            split = d.catalog.aliases[name].split
            d.fold(Envelope.new(TrafficSplitChanged(alias=name, split=list(split)),
                                stream=alias_stream(name), seq=2 + i // every, actor="bench",
                                tenant=d.catalog.aliases[name].tenant), now)

    churn = timed_decisions(d, [ask(*rnd.choice(callers)) for _ in range(count // 5)], now,
                            between=change)
    return {"tenants": tenants, "workers": workers, **steady, "target_p99_us": 50,
            "noise_floor": floor,
            "first_request_of_each_tenant": first,
            "catalog_change_every_1000": churn,
            "full_gc_ms": {"replayed_state": round(full_gc_ms, 1),
                           "after_gc_freeze": round(frozen_gc_ms, 1)},
            "note": "the headline (top level) is tenants that have asked before (a router "
                    "in service); first_request_of_each_tenant: every cache cold (token, "
                    "resolution, ring walk, buckets); catalog_change_every_1000: a split "
                    "change folded (untimed) every 1,000 decisions, which drops every cached "
                    "resolution. p50/p99 are wall clock (include preemption by other "
                    "processes on a loaded machine); cpu_* are this thread's CPU time",
            "settings": {"epsilon": d.settings.router_load_epsilon,
                         "affinity_window": d.settings.router_affinity_window,
                         "vnodes": d.settings.router_ring_vnodes,
                         "gc_freeze": d.settings.router_gc_freeze,
                         "canary_share_of_tenants": 0.1}}


# --- 2. key movement --------------------------------------------------------------------------


def movement(keys: int = 100_000) -> dict[str, Any]:
    ring = Ring([f"w{i}" for i in range(16)])
    names = [ring_key(f"org{i}", "t", "p") for i in range(keys)]
    before = [ring.home(k) for k in names]
    ring.add("w16")
    after = [ring.home(k) for k in names]
    moved = sum(a != b for a, b in zip(before, after, strict=True))
    wrong = sum(a != b and a != "w16" for a, b in zip(after, before, strict=True))
    fractions = []  # the share a joiner takes depends on where its points land: average it
    sample = names[:20_000]
    ring.remove("w16")
    base = [ring.home(k) for k in sample]
    for j in range(20):
        ring.add(f"joiner-{j}")
        fractions.append(sum(ring.home(k) != b for k, b in zip(sample, base, strict=True))
                         / len(sample))
        ring.remove(f"joiner-{j}")
    return {"keys": keys, "workers_before": 16, "moved_fraction": round(moved / keys, 4),
            "expected_fraction": round(1 / 17, 4), "moved_between_old_workers": wrong,
            "moved_fraction_mean_over_20_joiners": round(statistics.fmean(fractions), 4),
            "moved_fraction_range_over_20_joiners": [round(min(fractions), 4),
                                                      round(max(fractions), 4)],
            "vnodes": ring.vnodes}


# --- 3 and 4: over the network ------------------------------------------------------------------


def stream_once(stub: pb_grpc.InferenceStub, req: pb.GenerateRequest,
                metadata: Any) -> float:
    started = time.perf_counter()
    for _ in stub.Generate(req, metadata=metadata, timeout=30):
        pass
    return (time.perf_counter() - started) * 1000


def added_latency(base: Settings, streams: int) -> dict[str, Any]:
    settings = router_settings(base)
    loop = ServerLoop()
    catalog = CatalogWriter(settings)
    catalog.base()
    catalog.publish("acme-support", 1)
    worker = StandInWorker(settings, "w1", loop, catalog=catalog.catalog).start()
    worker.behaviour.tokens = 8
    router = RunningRouter(settings).start()
    try:
        router.wait_ring({"w1"})
        req = pb.GenerateRequest(
            tenant=pb.TenantSignature(org_id="acme", team_id="search", project_id="prod"),
            adapter=pb.AdapterRef(pinned=pb.PinnedVersion(adapter_id="acme-support",
                                                          version=1)),
            text="hello", sampling=pb.SamplingParams(max_tokens=8))
        direct = pb_grpc.InferenceStub(grpc.insecure_channel(worker.address))
        routed = router.stub()
        for _ in range(50):
            stream_once(direct, req, ())
            stream_once(routed, req, bearer("acme"))
        d_ms, r_ms = [], []
        for _ in range(streams):
            d_ms.append(stream_once(direct, req, ()))
            r_ms.append(stream_once(routed, req, bearer("acme")))
        return {
            "streams": streams, "tokens_per_stream": 8,
            "direct_p50_ms": round(pct(d_ms, 0.5), 3), "direct_p99_ms": round(pct(d_ms, 0.99), 3),
            "routed_p50_ms": round(pct(r_ms, 0.5), 3), "routed_p99_ms": round(pct(r_ms, 0.99), 3),
            "added_p50_ms": round(pct(r_ms, 0.5) - pct(d_ms, 0.5), 3),
            "added_p99_ms": round(pct(r_ms, 0.99) - pct(d_ms, 0.99), 3),
            "note": "router, stand-in worker, Kafka broker and client share this machine",
            "loadavg": load()}
    finally:
        router.stop()
        worker.close()
        catalog.close()
        loop.close()


def join(base: Settings, *, prewarm: bool, tenants: int, cold_ms: float, promote_ms: float,
         settle_s: float) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    settings = router_settings(base.model_copy(update={
        "adapter_events_topic": f"join{tag}.adapter-events",
        "worker_events_topic": f"join{tag}.worker-events",
        "liveness_topic": f"join{tag}.liveness",
        "dead_letter_topic": f"join{tag}.dead-letter"}),
        router_prewarm=prewarm, router_affinity_window=3 if prewarm else 1)
    ensure_topics(settings)
    loop = ServerLoop()
    catalog = CatalogWriter(settings)
    catalog.base()
    people = [TenantRef(org=f"org{i}", team="t", project="p") for i in range(tenants)]
    for i, tenant in enumerate(people):
        catalog.publish(f"a{i}", 1, tenant=tenant)
    fleet = [StandInWorker(settings, f"w{i}", loop, catalog=catalog.catalog).start()
             for i in range(4)]
    for worker in fleet:
        worker.behaviour.cold_load_s = cold_ms / 1000
        worker.behaviour.promote_s = promote_ms / 1000
    router = RunningRouter(settings).start()
    try:
        router.wait_ring({w.worker_id for w in fleet})
        stub = router.stub()
        admin = bearer("admin")

        def ask(i: int) -> float:
            tenant = people[i]
            return stream_once(stub, pb.GenerateRequest(
                tenant=pb.TenantSignature(org_id=tenant.org, team_id="t", project_id="p"),
                adapter=pb.AdapterRef(alias=f"a{i}"), text="hi"), admin)

        for _ in range(3):  # traffic before the join: every tenant warm somewhere
            for i in range(tenants):
                ask(i)
            time.sleep(settings.heartbeat_interval_s * 2)
        old = router.dispatcher.ring.copy()
        newcomer = StandInWorker(settings, "w4", loop, catalog=catalog.catalog)
        newcomer.behaviour.cold_load_s = cold_ms / 1000
        newcomer.behaviour.promote_s = promote_ms / 1000
        fleet.append(newcomer.start())
        router.wait_ring({w.worker_id for w in fleet})
        time.sleep(settle_s)  # traffic arrives a moment after the join
        gained = [i for i in range(tenants)
                  if router.dispatcher.ring.home(ring_key(f"org{i}", "t", "p")) == "w4"
                  and old.home(ring_key(f"org{i}", "t", "p")) != "w4"]
        first = [ask(i) for i in gained]
        at_newcomer = list(newcomer.served_tiers)
        return {"prewarm": prewarm, "affinity_window": 3 if prewarm else 1,
                "tenants": tenants, "gained_by_joiner": len(gained),
                "first_request_ms_p50": round(pct(first, 0.5), 2) if first else None,
                "first_request_ms_max": round(max(first), 2) if first else None,
                "served_by_joiner": len(at_newcomer),
                "joiner_found_adapter": {t or "none": at_newcomer.count(t)
                                         for t in set(at_newcomer)},
                "settle_s": settle_s, "loadavg": load()}
    finally:
        router.stop()
        for worker in fleet:
            worker.close()
        catalog.close()
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="20,000 decisions, 100 streams, 20 joining tenants")
    parser.add_argument("--decisions", type=int, default=None, help="default 100,000")
    parser.add_argument("--streams", type=int, default=None, help="default 400")
    parser.add_argument("--join-tenants", type=int, default=None, help="default 40")
    parser.add_argument("--cold-load-ms", type=float, default=80.0)
    parser.add_argument("--promote-ms", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "router.json")
    args = parser.parse_args()
    record = BenchRun("router", quick=args.quick)
    args.decisions = args.decisions or (20_000 if args.quick else 100_000)
    args.streams = args.streams or (100 if args.quick else 400)
    args.join_tenants = args.join_tenants or (20 if args.quick else 40)
    result: dict[str, Any] = {}
    result["decision"] = decisions(args.decisions)
    print(json.dumps(result["decision"]), flush=True)
    result["key_movement"] = movement()
    print(json.dumps(result["key_movement"]), flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="router-bench-"))
    tag = f"rbench{os.getpid()}"
    base = Settings(cache_dir=ROOT / ".loraplane" / "cache", topic_partitions=3,
                    adapter_events_topic=f"{tag}.adapter-events",
                    worker_events_topic=f"{tag}.worker-events",
                    liveness_topic=f"{tag}.liveness",
                    dead_letter_topic=f"{tag}.dead-letter", log_level="WARNING")
    broker = None
    if not base.kafka_bootstrap:
        broker = ApacheKafka(base, scratch / "kafka")
        broker.start()
        base = base.model_copy(update={"kafka_bootstrap": broker.bootstrap})
    try:
        ensure_topics(base)
        result["added_latency"] = added_latency(base, args.streams)
        print(json.dumps(result["added_latency"]), flush=True)
        result["join"] = {
            "cold_load_ms": args.cold_load_ms, "promote_ms": args.promote_ms,
            "with_prewarm": join(base, prewarm=True, tenants=args.join_tenants,
                                 cold_ms=args.cold_load_ms, promote_ms=args.promote_ms,
                                 settle_s=1.5),
            "without_prewarm": join(base, prewarm=False, tenants=args.join_tenants,
                                    cold_ms=args.cold_load_ms, promote_ms=args.promote_ms,
                                    settle_s=1.5)}
        print(json.dumps(result["join"]), flush=True)
    finally:
        if broker is not None:
            broker.stop()
    record.save(args.out, result, figures(result))


def figures(result: dict[str, Any]) -> list[Figure]:
    d, k, a, j = (result[key] for key in ("decision", "key_movement", "added_latency", "join"))
    ds = d["settings"]
    decision = (f"{d['decisions']:,} decisions, {d['tenants']:,} tenants on {d['workers']} "
                f"workers, {ds['canary_share_of_tenants']:.0%} on a canary split, "
                f"{ds['vnodes']} vnodes, epsilon {ds['epsilon']}, wall clock, tenants that "
                "have asked before")
    first = d["first_request_of_each_tenant"]
    stream = (f"{a['streams']} streams of {a['tokens_per_stream']} tokens, stand-in worker, "
              "loopback, turn about with direct calls")
    joined = (f"{j['with_prewarm']['tenants']} tenants, a worker joins; stand-in loads "
              f"{j['cold_load_ms']:g} ms from disk, {j['promote_ms']:g} ms from host memory")
    with_, without = j["with_prewarm"], j["without_prewarm"]
    return [
        Figure("routing decision, p99", d["p99_us"], "us", better="lower",
               target="p99 < 50 us", meets_target=d["p99_us"] < 50, settings=decision,
               load_average=d.get("loadavg")),
        Figure("routing decision, p99 / p50", d["p99_over_p50"], "ratio", better="lower",
               baseline="p99 / p50 of a fixed pure-Python loop of about the same median (the "
               "machine's own tail)", baseline_value=d["noise_floor"]["p99_over_p50"],
               settings=decision, load_average=d["noise_floor"].get("loadavg")),
        Figure("routing decision, a tenant's first request, p99", first["p99_us"], "us",
               better="lower", settings=f"{first['decisions']:,} tenants once each on a "
               "router just replayed: token, resolution, ring walk and buckets all cold",
               load_average=first.get("loadavg")),
        Figure("keys moved when a 17th worker joins 16", k["moved_fraction"], "fraction",
               baseline="the ideal 1/17", baseline_value=k["expected_fraction"],
               better="lower", settings=f"{k['keys']:,} tenant signatures, {k['vnodes']} vnodes"),
        Figure("streamed request through the router, p50", a["routed_p50_ms"], "ms",
               baseline="the same worker called directly, p50",
               baseline_value=a["direct_p50_ms"], better="lower", settings=stream,
               load_average=a.get("loadavg")),
        Figure("streamed request through the router, p99", a["routed_p99_ms"], "ms",
               baseline="the same worker called directly, p99",
               baseline_value=a["direct_p99_ms"], better="lower", settings=stream,
               load_average=a.get("loadavg")),
        Figure("first request on a joining worker with pre-warming, p50",
               with_["first_request_ms_p50"], "ms",
               baseline="the plain ring, no pre-warming, p50",
               baseline_value=without["first_request_ms_p50"], better="lower",
               settings=joined, load_average=with_.get("loadavg")),
    ]


if __name__ == "__main__":
    main()
