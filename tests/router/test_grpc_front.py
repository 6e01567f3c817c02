"""The router over real gRPC and real Kafka: stand-in workers serve the proto and send
heartbeats; the router folds the log and forwards."""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.catalog.serving import resolve_reference
from services.contracts.grpc import inference_pb2 as pb
from services.router.ring import ring_key
from tests.router.conftest import (
    ACME,
    RIVAL,
    TOKENS,
    CatalogWriter,
    Fleet,
    RunningRouter,
    bearer,
    collect,
    request,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

ACME_KEY = ring_key(ACME.org, ACME.team, ACME.project)


def three_workers(catalog: CatalogWriter, fleet: Fleet, make_router):
    """One adapter, workers w1-w3, and a router that has them all in its ring."""
    catalog.publish("acme-support", 1)
    for w in ("w1", "w2", "w3"):
        fleet.add(w)
    router = make_router()
    router.wait_ring({"w1", "w2", "w3"})
    return router


def served(responses: list[pb.GenerateResponse]) -> pb.FinalUsage:
    assert responses and responses[-1].HasField("final")
    return responses[-1].final


def test_canary_resolution_reaches_workers_pinned_sticky_and_only_forward(
        catalog: CatalogWriter, fleet: Fleet, make_router) -> None:
    catalog.publish("acme-support", 1)
    catalog.publish("acme-support", 2, activate=False)
    catalog.split("support", {("acme-support", 1): 95, ("acme-support", 2): 5})
    for w in ("w1", "w2", "w3"):
        fleet.add(w)
    router = make_router()
    router.wait_ring({"w1", "w2", "w3"})
    stub = router.stub()
    users = [f"user-{i}" for i in range(200)]
    first = {u: served(collect(stub, request("support", user=u))).served_adapter.version
             for u in users}
    state = router.dispatcher.catalog  # the router's own fold: what it should have decided
    assert all(resolve_reference(state, ACME, "support", u).version == v
               for u, v in first.items())
    seen = [s.request for w in fleet.workers.values() for s in w.seen]
    assert len(seen) == 200
    assert all(r.adapter.WhichOneof("ref") == "pinned" for r in seen)  # never the alias
    assert all(r.tenant.org_id == "acme" and r.request_id and len(r.trace_id) == 32
               for r in seen)
    assert all(r.tenant.qos_tier == pb.QOS_TIER_GOLD for r in seen)  # the token's tier
    again = {u: served(collect(stub, request("support", user=u))).served_adapter.version
             for u in users[:50]}
    assert again == {u: first[u] for u in users[:50]}  # sticky
    catalog.split("support", {("acme-support", 1): 75, ("acme-support", 2): 25})
    wait_for(lambda: state.aliases["support"].split[1].weight == 25, 10, message="split folded")
    later = {u: served(collect(stub, request("support", user=u))).served_adapter.version
             for u in users}
    assert all(later[u] == 2 for u in users if first[u] == 2)  # 5 -> 25 only moves forward
    share = sum(v == 2 for v in later.values()) / len(users)
    assert abs(share - 0.25) < 4 * math.sqrt(0.25 * 0.75 / len(users))
    catalog.disable("acme-support", 2)
    wait_for(lambda: state.adapters["acme-support"].versions[2].disabled, 10, message="disable")
    assert {served(collect(stub, request("support", user=u))).served_adapter.version
            for u in users[:60]} == {1}
    health = health_pb2_grpc.HealthStub(router.channel)
    assert health.Check(health_pb2.HealthCheckRequest(
        service="loraplane.v1.Inference")).status == health_pb2.HealthCheckResponse.SERVING
    assert httpx.get(f"{router.http_url}/readyz").json()["ring"] == ["w1", "w2", "w3"]


def test_a_worker_that_misses_three_heartbeats_leaves_the_ring_and_returns(
        catalog: CatalogWriter, fleet: Fleet, make_router) -> None:
    router = three_workers(catalog, fleet, make_router)
    home = router.dispatcher.ring.home(ACME_KEY)
    assert served(collect(router.stub(), request("acme-support"))).worker_id == home
    fleet[home].beating.clear()
    silent_since = time.monotonic()
    rest = {"w1", "w2", "w3"} - {home}
    router.wait_ring(rest)
    assert time.monotonic() - silent_since >= 2 * 0.2  # not before heartbeats were missed
    assert served(collect(router.stub(), request("acme-support"))).worker_id in rest
    text = httpx.get(f"{router.http_url}/metrics").text
    assert "loraplane_router_ring_size 2.0" in text
    fleet[home].beating.set()
    router.wait_ring({"w1", "w2", "w3"})
    assert served(collect(router.stub(), request("acme-support"))).worker_id == home


def test_bounded_load_spreads_one_hot_tenant(catalog: CatalogWriter, fleet: Fleet,
                                            make_router, server_loop) -> None:
    catalog.publish("acme-support", 1)
    gate = server_loop.call(_event())
    for w in ("w1", "w2", "w3", "w4"):
        fleet.add(w).behaviour.gate = gate
    router = make_router()
    router.wait_ring({"w1", "w2", "w3", "w4"})
    stub = router.stub()
    total = 20
    with ThreadPoolExecutor(total) as pool:
        futures = [pool.submit(collect, stub, request("acme-support", user=f"u{i}"))
                   for i in range(total)]
        wait_for(lambda: sum(len(w.seen) for w in fleet.workers.values()) == total, 20,
                 message="all requests at workers")
        loads = {w: worker.in_flight for w, worker in fleet.workers.items()}
        server_loop.loop.call_soon_threadsafe(gate.set)
        results = [f.result(timeout=20) for f in futures]
    assert all(served(r).completion_tokens == 3 for r in results)
    bound = math.ceil(1.25 * total / 4)
    assert max(loads.values()) <= bound, loads
    home = router.dispatcher.ring.home(ACME_KEY)
    assert loads[home] == bound  # the home takes its share, the rest spills along the ring
    assert sum(1 for v in loads.values() if v) >= 3


async def _event() -> asyncio.Event:  # created on the stand-ins' loop, which waits on it
    return asyncio.Event()


def test_rate_limits_answer_resource_exhausted_with_retry_after(
        rsettings, catalog: CatalogWriter, fleet: Fleet, make_router) -> None:
    catalog.publish("acme-support", 1)
    catalog.publish("acme-other", 1)
    fleet.add("w1")
    router = make_router(router_rate_overrides={"tenant:acme/search/prod": 1.0},
                         router_burst_s=2.0,
                         router_cold_load_rate={"gold": 0.1, "silver": 0.1})
    router.wait_ring({"w1"})
    stub = router.stub()
    collect(stub, request("acme-support"))  # cold: the tenant's one cold load
    with pytest.raises(grpc.RpcError) as err:  # another cold adapter: over the cold cap
        collect(stub, request("acme-other"))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "cold" in err.value.details()
    collect(stub, request("acme-support"))  # warm (loading) and within the tenant's burst
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, request("acme-support"))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailing = dict(err.value.trailing_metadata())
    assert trailing["retry-after"] == "1" and 0 < int(trailing["retry-after-ms"]) <= 1000
    time.sleep(int(trailing["retry-after-ms"]) / 1000 + 0.05)
    collect(stub, request("acme-support"))
    assert len(fleet["w1"].seen) == 3  # refused requests never reached a worker
    text = httpx.get(f"{router.http_url}/metrics").text
    assert 'loraplane_router_rejections_total{reason="tenant_rate"} 1.0' in text
    assert 'loraplane_router_rejections_total{reason="cold_load_cap"} 1.0' in text


def test_failover_before_the_first_token_and_none_after_it(
        catalog: CatalogWriter, fleet: Fleet, make_router) -> None:
    router = three_workers(catalog, fleet, make_router)
    stub = router.stub()
    walk = list(router.dispatcher.ring.walk(ACME_KEY))
    home, second = fleet[walk[0]], fleet[walk[1]]
    home.behaviour.fail_before_first = 1
    final = served(collect(stub, request("acme-support")))
    assert final.worker_id == second.worker_id
    assert home.seen[0].request.request_id == second.seen[0].request.request_id
    text = httpx.get(f"{router.http_url}/metrics").text
    assert 'loraplane_router_retries_total{code="UNAVAILABLE"} 1.0' in text

    home.behaviour.fail_before_first = 1  # both fail: one retry only, then the error
    second.behaviour.fail_before_first = 1
    before = sum(len(w.seen) for w in fleet.workers.values())
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, request("acme-support"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert sum(len(w.seen) for w in fleet.workers.values()) == before + 2

    # the adapter is now on device at `second` and loading nowhere else; make `home` the
    # only sensible place again, then break it after the first token
    home.held[("acme-support", 1)] = "device"
    home.heartbeat()
    wait_for(lambda: router.dispatcher.membership.tier(
        home.worker_id, catalog.catalog[("acme-support", 1)], time.monotonic()) == "device",
        10, message="home warm")
    home.behaviour.fail_after_tokens = 1
    counts = {w: len(x.seen) for w, x in fleet.workers.items()}
    tokens = []
    with pytest.raises(grpc.RpcError) as err:
        for response in router.stub().Generate(request("acme-support"),
                                               metadata=bearer("acme"), timeout=10):
            tokens.append(response)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details() == "stand-in: worker lost mid-stream"  # as the worker said
    assert len(tokens) == 1
    assert {w: len(x.seen) for w, x in fleet.workers.items()} == {
        **counts, home.worker_id: counts[home.worker_id] + 1}  # nobody else was asked
    trace_id = home.seen[-1].request.trace_id
    traces = httpx.get(f"{router.http_url}/debug/traces", params={"trace_id": trace_id},
                       headers={"Authorization": f"Bearer {TOKENS['acme'][0]}"}).json()
    assert "traces" in traces, traces
    [trace] = traces["traces"]
    assert trace["status"] == "worker_error"
    assert [a["outcome"] for a in trace["attempts"]] == ["failed_after_first_token"]
    assert trace["attempts"][0]["code"] == "UNAVAILABLE" and trace["attempts"][0]["responses"]


def test_deadlines_propagate_to_the_worker(catalog: CatalogWriter, fleet: Fleet,
                                           make_router) -> None:
    catalog.publish("acme-support", 1)
    worker = fleet.add("w1")
    router = make_router()
    router.wait_ring({"w1"})
    collect(router.stub(), request("acme-support"), timeout=2.0)
    remaining = worker.seen[-1].time_remaining
    assert remaining is not None and 1.0 < remaining <= 2.0
    worker.behaviour.token_delay_s = 0.5
    with pytest.raises(grpc.RpcError) as err:
        collect(router.stub(), request("acme-support"), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_tokens_decide_the_tenant_and_cross_tenant_requests_are_refused(
        catalog: CatalogWriter, fleet: Fleet, make_router) -> None:
    catalog.publish("acme-support", 1)
    catalog.split("support", {("acme-support", 1): 100})
    catalog.publish("rival-bot", 1, tenant=RIVAL)
    worker = fleet.add("w1")
    router = make_router()
    router.wait_ring({"w1"})
    stub = router.stub()
    cases = [
        ("rival", request("support", tenant=None), grpc.StatusCode.NOT_FOUND),
        ("rival", request("acme-support", tenant=None), grpc.StatusCode.NOT_FOUND),
        ("rival", request(pinned=("acme-support", 1), tenant=None),
         grpc.StatusCode.NOT_FOUND),
        ("rival", request("support", tenant=ACME), grpc.StatusCode.PERMISSION_DENIED),
        ("acme", request("rival-bot"), grpc.StatusCode.NOT_FOUND),
        ("reader", request("support"), grpc.StatusCode.PERMISSION_DENIED),
        ("acme-any", request("support", tenant=None), grpc.StatusCode.INVALID_ARGUMENT),
        ("acme", request("nope"), grpc.StatusCode.NOT_FOUND),
    ]
    for who, req, code in cases:
        with pytest.raises(grpc.RpcError) as err:
            collect(stub, req, who=who)
        assert err.value.code() == code, (who, req)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request("support")))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert worker.seen == []
    assert served(collect(stub, request("rival-bot", tenant=None), who="rival")).served_adapter \
        .adapter_id == "rival-bot"
    assert served(collect(stub, request("support", tenant=None))).served_adapter.version == 1
    assert worker.seen[-1].request.tenant.org_id == "acme"  # filled from the token


def test_cold_placements_hint_and_ring_joins_are_prewarmed(
        catalog: CatalogWriter, fleet: Fleet, make_router) -> None:
    catalog.publish("acme-support", 1)
    sha = catalog.catalog[("acme-support", 1)]
    for w in ("w1", "w2", "w3"):
        fleet.add(w)
    router = make_router()
    router.wait_ring({"w1", "w2", "w3"})
    stub = router.stub()
    regions = [f"r{i}" for i in range(60)]  # 60 tenant signatures: keys all over the ring
    for region in regions:
        req = request("acme-support")
        req.tenant.region_hint = region
        collect(stub, req)
    hints = {(p.reason, p.tier) for w in fleet.workers.values() for p in w.prefetches}
    # the first cold placement hints its worker to load to device; the other homes, passed
    # over while a warm neighbour serves their keys, are hinted into host memory
    assert ("cold placement", pb.PREFETCH_TIER_DEVICE) in hints
    assert hints <= {("cold placement", pb.PREFETCH_TIER_DEVICE),
                     ("warm neighbour serving", pb.PREFETCH_TIER_HOST)}
    wait_for(lambda: all(sha in router.dispatcher.membership.workers[w].held
                         for w in ("w1", "w2", "w3")
                         if fleet[w].held), 10, message="holdings reported")
    old_ring = router.dispatcher.ring.copy()
    newcomer = fleet.add("w4")
    newcomer.behaviour.cold_load_s = 0.3
    router.wait_ring({"w1", "w2", "w3", "w4"})
    wait_for(lambda: any(p.reason == "ring join" for p in newcomer.prefetches), 10,
             message="ring-join prefetch")
    join = [p for p in newcomer.prefetches if p.reason == "ring join"]
    assert join[0].tier == pb.PREFETCH_TIER_HOST
    assert [(a.adapter_id, a.version) for a in join[0].adapters] == [("acme-support", 1)]
    gained = [r for r in regions
              if router.dispatcher.ring.home(ring_key("acme", "search", "prod", "", r)) == "w4"]
    assert gained and all(old_ring.home(ring_key("acme", "search", "prod", "", r)) != "w4"
                          for r in gained)
    wait_for(lambda: router.dispatcher.membership.tier("w4", sha, time.monotonic()) == "host",
             10, message="newcomer warm")
    req = request("acme-support")
    req.tenant.region_hint = gained[0]
    assert served(collect(stub, req)).worker_id == "w4"
    assert newcomer.served_tiers == ["host"]  # its first request found the adapter warm


def _witnessed(settings) -> list:
    """Every RequestServed a router wrote to the worker-events topic, in log order."""
    from services.eventlog import EventConsumer

    found: list = []
    consumer = EventConsumer(settings, [settings.worker_events_topic],
                             reader_id="test-witness-check")
    try:
        consumer.catch_up(lambda r: found.append(r.envelope), timeout_s=30)
    finally:
        consumer.close()
    return sorted((e for e in found if e.type == "RequestServed"
                   and e.payload.witness == "router"), key=lambda e: e.seq)


def _cut_through_a_new_router(settings, attempt: int) -> None:
    router = RunningRouter(settings).start()
    try:
        router.wait_ring({"w1"})
        cut = request("acme-support", user=f"u-{attempt}")
        cut.request_id, cut.trace_id = f"cut-{attempt}", f"{attempt:032x}"
        with pytest.raises(grpc.RpcError) as err:
            collect(router.stub(), cut)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        witness = router.app.witness
        wait_for(lambda: witness.written == 1, 10, message="the cut traced")
    finally:
        router.stop()


def test_a_stream_cut_mid_answer_is_traced_by_the_router(catalog: CatalogWriter, fleet: Fleet,
                                                         rsettings) -> None:
    """The worker that breaks a stream after the first token cannot trace the request (it
    died): the router does, with outcome `cut`, the tokens the client got and the version
    it pinned, on its own stream, which a router restarted with the same id continues."""
    sha = catalog.publish("acme-support", 1)
    worker = fleet.add("w1")
    worker.behaviour.fail_after_tokens = 2
    settings = rsettings.model_copy(update={"router_id": "router-witness"})
    for attempt in (1, 2):
        _cut_through_a_new_router(settings, attempt)
    events = _witnessed(settings)
    assert [(e.stream, e.seq, e.actor) for e in events] == [
        ("router/router-witness", 1, "router-witness"),
        ("router/router-witness", 2, "router-witness")]
    traces = [(e.payload.worker_id, r) for e in events for r in e.payload.requests]
    assert [(w, r.request_id, r.trace_id, r.status, r.completion_tokens, r.user_id)
            for w, r in traces] == [("w1", "cut-1", f"{1:032x}", "cut", 2, "u-1"),
                                    ("w1", "cut-2", f"{2:032x}", "cut", 2, "u-2")]
    for _, r in traces:
        assert (r.adapter_id, r.version, r.adapter_sha256) == ("acme-support", 1, sha)
        assert r.tenant == ACME and r.base_model_digest == worker.base_digest
