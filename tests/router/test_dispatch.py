"""The request path's decisions without the network: tenant from the token, resolution,
the canary over 10,000 users, refusals. (The same `decide` runs under both fronts; the
gRPC tests check that what it decides is what workers receive.)"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.catalog.auth import Principal
from services.catalog.serving import resolve_reference
from services.catalog.state import adapter_stream, alias_stream
from services.config import Settings
from services.contracts.events import (
    AdapterDisabled,
    AdapterRolledBack,
    AdapterVersionPublished,
    AdapterVersionSwitched,
    BaseModelRegistered,
    Envelope,
    LoadedAdapter,
    MergedMode,
    SplitEntry,
    TenantRef,
    TrafficSplitChanged,
    WorkerHeartbeat,
)
from services.contracts.grpc import inference_pb2 as pb
from services.router.dispatch import Dispatcher, RouteError, asked_of, authorize
from services.router.routing import Asked

ACME = TenantRef(org="acme", team="search", project="prod")
RIVAL = TenantRef(org="rival", team="x", project="y")
CALLER = Principal("t1", "inference", ("acme", "search", "prod"), "gold")
RIVAL_CALLER = Principal("t2", "inference", ("rival", "x", "y"))
BASE = "b" * 64
HIGH = {t: 1e9 for t in ("platinum", "gold", "silver", "bronze")}


def sig(tenant: TenantRef | None = None, user: str = "", tier: int = 0) -> pb.TenantSignature:
    s = pb.TenantSignature(user_id=user, qos_tier=tier)
    if tenant:
        s.org_id, s.team_id, s.project_id = tenant.org, tenant.team, tenant.project
    return s


def test_the_tenant_comes_from_the_token_scope() -> None:
    assert authorize(CALLER, sig()) == ACME
    assert authorize(CALLER, sig(ACME)) == ACME
    with pytest.raises(RouteError) as err:
        authorize(CALLER, sig(RIVAL))
    assert err.value.code == "PERMISSION_DENIED"
    wildcard = Principal("t3", "inference", ("acme", "*", "*"))
    assert authorize(wildcard, sig(ACME)) == ACME
    with pytest.raises(RouteError) as err:
        authorize(wildcard, sig())
    assert err.value.code == "INVALID_ARGUMENT"
    with pytest.raises(RouteError):
        authorize(wildcard, sig(RIVAL))
    admin = Principal("t4", "admin")
    assert authorize(admin, sig(RIVAL)) == RIVAL
    with pytest.raises(RouteError):
        authorize(admin, sig())
    for role in ("reader", "worker"):
        with pytest.raises(RouteError) as err:
            authorize(Principal("t5", role), sig(ACME))  # type: ignore[arg-type]
        assert err.value.code == "PERMISSION_DENIED"
    with pytest.raises(RouteError):
        authorize(wildcard, pb.TenantSignature(org_id="acme", team_id="Bad!", project_id="x"))


def _event(payload: Any, stream: str, tenant: TenantRef | None = ACME) -> Envelope:
    return Envelope.new(payload, stream=stream, seq=1, actor="test", tenant=tenant)


def publish(d: Dispatcher, adapter_id: str, version: int, *, tenant: TenantRef = ACME,
            activate: bool = True, base: str = BASE) -> None:
    d.fold(_event(AdapterVersionPublished(
        adapter_id=adapter_id, version=version, label=f"v{version}", base_model="tiny",
        base_model_digest=base, sha256=sha(adapter_id, version), config_sha256="c" * 64,
        size_bytes=1, rank=8, lora_alpha=16, target_modules=["q_proj"], dtype="float16",
        owner="o"), adapter_stream(adapter_id), tenant), 0.0)
    if activate:
        d.fold(_event(AdapterVersionSwitched(adapter_id=adapter_id, from_version=None,
                                             to_version=version), adapter_stream(adapter_id),
                      tenant), 0.0)


def sha(adapter_id: str, version: int) -> str:
    return hashlib.sha256(f"{adapter_id}@{version}".encode()).hexdigest()


def split(d: Dispatcher, alias: str, weights: dict[int, int], adapter_id: str = "sup") -> None:
    d.fold(_event(TrafficSplitChanged(alias=alias, split=[
        SplitEntry(adapter_id=adapter_id, version=v, weight=w) for v, w in weights.items()]),
        alias_stream(alias)), 0.0)


@pytest.fixture
def d() -> Dispatcher:
    disp = Dispatcher(Settings(router_tenant_rate=HIGH, router_adapter_rate=HIGH,
                               router_cold_load_rate=HIGH), clock=lambda: 0.0)
    disp.fold(_event(BaseModelRegistered(name="tiny", digest=BASE, config={}), "base-model/t",
                     None), 0.0)
    for w in ("w1", "w2", "w3"):
        disp.fold(_event(WorkerHeartbeat(worker_id=w, address=f"{w}:1", base_model="tiny",
                                         base_model_digest=BASE, loaded=[]), f"worker/{w}",
                         None), 0.0)
    publish(disp, "sup", 1)
    publish(disp, "sup", 2, activate=False)
    disp.ready = True
    return disp


def decide(d: Dispatcher, alias: str | None = None, *, user: str = "u",
           pinned: tuple[str, int] | None = None, caller: Principal = CALLER,
           base: str | None = None) -> Any:
    ref = pb.AdapterRef()
    if alias:
        ref.alias = alias
    if pinned:
        ref.pinned.adapter_id, ref.pinned.version = pinned
    return d.decide(caller, asked_of(sig(user=user), ref, base), 0.0)


def test_not_ready_is_unavailable_with_a_retry_hint(d: Dispatcher) -> None:
    d.ready = False
    with pytest.raises(RouteError) as err:
        decide(d, "sup")
    assert err.value.code == "UNAVAILABLE" and err.value.retry_after == "1"


def test_split_weights_hold_over_10000_users_and_users_stick(d: Dispatcher) -> None:
    split(d, "support", {1: 95, 2: 5})
    users = [f"user-{i}" for i in range(10_000)]
    first = {u: decide(d, "support", user=u).choice.version for u in users}
    share = sum(v == 2 for v in first.values()) / len(users)
    sigma = math.sqrt(0.05 * 0.95 / len(users))
    assert abs(share - 0.05) < 4 * sigma
    assert all(decide(d, "support", user=u).choice.version == first[u] for u in users[:2000])
    split(d, "support", {1: 75, 2: 25})  # 5 -> 25: users only move toward v2
    second = {u: decide(d, "support", user=u).choice.version for u in users}
    assert all(second[u] == 2 for u in users if first[u] == 2)
    share = sum(v == 2 for v in second.values()) / len(users)
    assert abs(share - 0.25) < 4 * math.sqrt(0.25 * 0.75 / len(users))


def test_disabled_and_rolled_back_versions_are_never_chosen(d: Dispatcher) -> None:
    split(d, "support", {1: 50, 2: 50})
    d.fold(_event(AdapterDisabled(adapter_id="sup", version=2, reason="bad"), "adapter/sup"),
           0.0)
    assert {decide(d, "support", user=f"u{i}").choice.version for i in range(300)} == {1}
    with pytest.raises(RouteError) as err:
        decide(d, pinned=("sup", 2))
    assert err.value.code == "FAILED_PRECONDITION"
    publish(d, "sup", 3)
    d.fold(_event(AdapterRolledBack(adapter_id="sup", from_version=3, to_version=1,
                                    reason="r"), "adapter/sup"), 0.0)
    assert decide(d, "sup").choice.version == 1
    with pytest.raises(RouteError):
        decide(d, pinned=("sup", 3))


def test_pinned_versions_and_base_models(d: Dispatcher) -> None:
    split(d, "support", {1: 90, 2: 10})
    assert decide(d, pinned=("sup", 2)).choice.pinned == "sup@2"
    assert decide(d, "sup", base="tiny").base_digest == BASE
    with pytest.raises(RouteError) as err:
        decide(d, "sup", base="nope")
    assert err.value.code == "NOT_FOUND"
    d.fold(_event(BaseModelRegistered(name="big", digest="e" * 64, config={}),
                  "base-model/b", None), 0.0)
    with pytest.raises(RouteError) as err:
        decide(d, "sup", base="big")
    assert err.value.code == "FAILED_PRECONDITION"
    with pytest.raises(RouteError) as err:  # no live worker runs that base
        decide(d, None, base="big")
    assert err.value.code == "UNAVAILABLE" and err.value.reason == "no_worker"
    assert decide(d, None).choice is None  # the base model alone


def test_another_tenants_adapter_or_alias_is_refused(d: Dispatcher) -> None:
    split(d, "support", {1: 100})
    publish(d, "rival-bot", 1, tenant=RIVAL)
    for kwargs in ({"alias": "support"}, {"alias": "sup"}, {"pinned": ("sup", 1)}):
        with pytest.raises(RouteError) as err:
            decide(d, caller=RIVAL_CALLER, **kwargs)  # type: ignore[arg-type]
        assert err.value.code == "NOT_FOUND"  # answered as a missing one
        assert err.value.message.endswith("does not exist")
        assert "another tenant" in (err.value.audit or "")
    with pytest.raises(RouteError):
        decide(d, "rival-bot")
    assert decide(d, "rival-bot", caller=RIVAL_CALLER).tenant == RIVAL


def test_placement_prefers_the_holder_and_remembers_a_cold_send(d: Dispatcher) -> None:
    key_home = decide(d, "sup").placement.home
    holder = next(w for w in ("w1", "w2", "w3") if w != key_home)
    d.fold(_event(WorkerHeartbeat(worker_id=holder, address="h:1", base_model="tiny",
                                  base_model_digest=BASE, loaded=[LoadedAdapter(
                                      adapter_id="sup", version=1, sha256=sha("sup", 1),
                                      tier="device")]), f"worker/{holder}", None), 0.0)
    p = decide(d, "sup").placement  # three workers: the holder is within the window
    assert p.home == key_home and p.worker == holder and p.diverted and not p.cold
    publish(d, "other", 1)
    first = decide(d, "other").placement
    assert first.cold
    d._after_placement(decide(d, "other"))  # a cold send marks the worker as loading it
    assert d.membership.tier(first.worker, sha("other", 1), 0.0) == "loading"
    assert not decide(d, "other").placement.cold


def test_merged_mode_workers_get_their_version_and_nothing_else(d: Dispatcher) -> None:
    def join(worker: str, mode: MergedMode) -> None:
        d.fold(_event(WorkerHeartbeat(worker_id=worker, address=f"{worker}:1",
                                      base_model="tiny", base_model_digest=BASE,
                                      merged_mode=mode), f"worker/{worker}", None), 0.0)

    join("m1", MergedMode(adapter_id="sup", version=1, sha256=sha("sup", 1)))  # follows
    join("m2", MergedMode(adapter_id="sup", pinned_version=1))
    general = {"w1", "w2", "w3"}
    for _ in range(3):  # the adapter's traffic to its merged workers, a general fallback
        p = decide(d, "sup").placement
        assert p.worker in {"m1", "m2"} and not p.cold and p.fallback is not None
    publish(d, "other", 1)
    assert decide(d, "other").placement.worker in general
    assert decide(d, None).placement.worker in general  # nor the bare base model
    split(d, "support", {1: 50, 2: 50})
    versions = {decide(d, "support", user=f"u{i}").choice.version: decide(
        d, "support", user=f"u{i}").placement.worker for i in range(40)}
    assert versions[1] in {"m1", "m2"} and versions[2] in general
    d.fold(_event(AdapterVersionSwitched(adapter_id="sup", from_version=1, to_version=2),
                  adapter_stream("sup")), 0.0)
    # by the router's own fold m1 now serves v2 (no heartbeat needed); m2 keeps v1 while
    # the split still sends it traffic
    assert decide(d, "sup").placement.worker == "m1"
    assert decide(d, pinned=("sup", 1)).placement.worker == "m2"
    d.fold(_event(AdapterDisabled(adapter_id="sup", version=2, reason="bad"), "adapter/sup"),
           0.0)
    assert decide(d, pinned=("sup", 1)).placement.worker == "m2"
    d.membership.expire(100.0)  # every worker gone quiet ...
    join("m2", MergedMode(adapter_id="sup", pinned_version=1))  # ... but the merged one
    p = decide(d, pinned=("sup", 1)).placement
    assert (p.worker, p.fallback) == ("m2", None)
    with pytest.raises(RouteError) as err:
        decide(d, "other")
    assert err.value.code == "UNAVAILABLE" and err.value.reason == "no_worker"


# --- the per-caller route cache ------------------------------------------------------------

OPS = st.one_of(
    st.tuples(st.just("publish"), st.sampled_from(["sup", "bot"]), st.integers(1, 3)),
    st.tuples(st.just("switch"), st.sampled_from(["sup", "bot"]), st.integers(1, 3)),
    st.tuples(st.just("disable"), st.sampled_from(["sup", "bot"]), st.integers(1, 3)),
    st.tuples(st.just("split"), st.integers(0, 100), st.sampled_from(["sup", "bot"])),
    st.tuples(st.just("heartbeat"), st.sampled_from(["w1", "w2", "w3", "w4", "m1"]),
              st.lists(st.tuples(st.sampled_from(["sup", "bot"]), st.integers(1, 3),
                                 st.sampled_from(["device", "host", "disk"])), max_size=3)),
    st.tuples(st.just("quiet"), st.floats(0.0, 5.0)),
    st.tuples(st.just("ask"), st.sampled_from(["support", "sup", "bot", "nothing", None,
                                               ("sup", 1), ("sup", 2), ("bot", 3)]),
              st.sampled_from(["", "alice", "bob", "u7"]),
              st.sampled_from([CALLER, RIVAL_CALLER, Principal("t1", "inference",
                                                               ("acme", "search", "prod"))]),
              st.sampled_from([None, "tiny"]), st.integers(0, 2)),
)


def _outcome(d: Dispatcher, principal: Principal, asked: Asked, now: float) -> object:
    try:
        return d.decide(principal, asked, now)
    except RouteError as error:
        return (error.code, error.reason, error.message, error.retry_after)


@settings(max_examples=60, deadline=None)
@given(st.lists(OPS, max_size=50))
def test_kept_routes_decide_what_building_each_afresh_decides(ops: list[Any]) -> None:
    """A router that keeps callers' routes and one that rebuilds the route for every request
    (low rate limits, so admission refuses too) decide the same over any event sequence,
    and the version is the serving rule's own."""
    low = {"platinum": 4.0, "gold": 3.0, "silver": 2.0, "bronze": 1.0}
    kept, fresh = (Dispatcher(Settings(router_tenant_rate=low, router_adapter_rate=low,
                                       router_cold_load_rate={"gold": 1.0}, router_burst_s=1.0),
                              clock=lambda: 0.0) for _ in range(2))
    now = 0.0
    for d in (kept, fresh):
        d.fold(_event(BaseModelRegistered(name="tiny", digest=BASE, config={}),
                      "base-model/t", None), 0.0)
        d.limits.max_buckets = 4  # buckets are forgotten now and then
        d.ready = True
    for op in ops:
        if op[0] == "ask":
            _, ref_of, user, principal, base, tier = op
            ref = pb.AdapterRef()
            if isinstance(ref_of, str):
                ref.alias = ref_of
            elif ref_of is not None:
                ref.pinned.adapter_id, ref.pinned.version = ref_of
            asked = asked_of(sig(user=user, tier=tier), ref, base)
            fresh.routing._routes.clear()
            got = _outcome(kept, principal, asked, now)
            assert got == _outcome(fresh, principal, asked, now)
            if isinstance(ref_of, str) and not isinstance(got, tuple):
                assert got.choice == resolve_reference(  # type: ignore[attr-defined]
                    kept.catalog, got.tenant, ref_of, user,  # type: ignore[attr-defined]
                    base_digest=BASE if base else None)
            continue
        for d in (kept, fresh):
            if op[0] == "publish":
                adapter = d.catalog.adapters.get(op[1])
                if adapter is None or op[2] not in adapter.versions:
                    publish(d, op[1], op[2], activate=False)
            elif op[0] == "switch":
                d.fold(_event(AdapterVersionSwitched(adapter_id=op[1], from_version=None,
                                                     to_version=op[2]),
                              adapter_stream(op[1])), 0.0)
            elif op[0] == "disable":
                d.fold(_event(AdapterDisabled(adapter_id=op[1], version=op[2], reason="x"),
                              adapter_stream(op[1])), 0.0)
            elif op[0] == "split":
                weights = {1: op[1], 2: 100 - op[1]}
                split(d, "support", {v: w for v, w in weights.items() if w}, op[2])
            elif op[0] == "heartbeat":
                worker, held = op[1], op[2]
                d.fold(_event(WorkerHeartbeat(
                    worker_id=worker, address=f"{worker}:1", base_model="tiny",
                    base_model_digest=BASE, loaded=[LoadedAdapter(
                        adapter_id=a, version=v, sha256=sha(a, v), tier=t) for a, v, t in held],
                    merged_mode=MergedMode(adapter_id="sup", pinned_version=1)
                    if worker == "m1" else None), f"worker/{worker}", None), now)
            elif op[0] == "quiet":
                d.tick(now + op[1])
        if op[0] == "quiet":
            now += op[1]


def test_a_route_is_kept_until_one_of_its_inputs_moves(d: Dispatcher) -> None:
    split(d, "support", {1: 90, 2: 10})
    decide(d, "support")
    (route,) = d.routing._routes.values()
    decide(d, "support", user="someone else")
    assert list(d.routing._routes.values()) == [route]  # the user is not part of the route
    targets = route.targets
    split(d, "support", {1: 50, 2: 50})  # the serving generation: resolved again in place
    decide(d, "support")
    assert list(d.routing._routes.values()) == [route] and route.targets is targets
    assert route.resolution is not None and route.resolution.edges == (5000, 10000)
    d.fold(_event(AdapterDisabled(adapter_id="sup", version=2, reason="bad"), "adapter/sup"),
           0.0)  # ... and the outcomes changed: the targets go
    decide(d, "support")
    assert route.targets is not targets and route.serving == d.catalog.serving_generation
    changes = [
        lambda: d.fold(_event(WorkerHeartbeat(worker_id="w9", address="w9:1", base_model="tiny",
                                              base_model_digest=BASE), "worker/w9", None),
                       0.0),  # a worker joins: the ring and the pools
        lambda: d.ring.add("w8"),  # the ring alone (its walk)
        lambda: d.membership.expire(100.0),  # workers leave the pools
    ]
    for change in changes:
        before = d.routing._routes[next(iter(d.routing._routes))]
        change()
        with contextlib.suppress(RouteError):
            decide(d, "support")
        assert d.routing._routes[next(iter(d.routing._routes))] is not before
    other = Principal("t1", "inference", ("acme", "search", "prod"), "bronze")
    route = next(iter(d.routing._routes.values()))
    with contextlib.suppress(RouteError):
        decide(d, "support", caller=other)  # the same token id, another principal
    assert next(iter(d.routing._routes.values())) is not route


def test_another_principal_under_the_same_token_id_gets_its_own_admission() -> None:
    d = Dispatcher(Settings(router_tenant_rate={"gold": 3.0, "bronze": 1.0},
                            router_adapter_rate=HIGH, router_cold_load_rate=HIGH,
                            router_burst_s=1.0), clock=lambda: 0.0)
    d.fold(_event(BaseModelRegistered(name="tiny", digest=BASE, config={}), "base-model/t",
                  None), 0.0)
    d.fold(_event(WorkerHeartbeat(worker_id="w1", address="w1:1", base_model="tiny",
                                  base_model_digest=BASE), "worker/w1", None), 0.0)
    publish(d, "sup", 1)
    d.ready = True
    decide(d, "sup")  # gold: 3 a second
    bronze = Principal("t1", "inference", ("acme", "search", "prod"), "bronze")
    decide(d, "sup", caller=bronze)  # the tenant's bucket, re-rated to 1 a second
    with pytest.raises(RouteError) as err:
        decide(d, "sup", caller=bronze)
    assert err.value.reason == "tenant_rate"
