"""The purge rule: a version of a tenant purged at or after it was published is gone, and
every path that could serve or fetch it asks the same fold and gets no.

Paths asked here: the serving rule (adapter id, pin, alias), merged mode, quality gates
(which gates a worker runs, what a new gate compares with), the blob route's rule, the
registry's switch / rollback / split, the router's decision and its pre-warm hints, and
the snapshot a restarted reader starts from. A worker's loads, prefetches and pre-warming
are in `tests/worker/test_engine_loop.py`.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest

from services.catalog.auth import Principal
from services.catalog.release_rule import gate_baseline
from services.catalog.serving import (
    MergeSpec,
    erased_blob_reason,
    merge_target,
    purged_reason,
    resolve_as_owner,
    resolve_pinned,
    resolve_reference,
)
from services.catalog.snapshot import dump_state, load_state
from services.catalog.state import CatalogState, Refusal, tenant_stream
from services.config import Settings
from services.contracts.events import (
    AdapterVersionPublished,
    AdapterVersionSwitched,
    BaseModelRegistered,
    Envelope,
    GateRequest,
    Payload,
    SplitEntry,
    TenantBlobsDeleted,
    TenantPurgeRequested,
    TenantRef,
    TrafficSplitChanged,
    WorkerHeartbeat,
)
from services.contracts.grpc import inference_pb2 as pb
from services.registry.domain import roll_back, set_split, switch_active
from services.router.dispatch import Dispatcher, RouteError, asked_of
from services.router.prewarm import RecentAdapter
from services.worker.gate_runner import gates_to_run

ACME = TenantRef(org="acme", team="search", project="prod")
RIVAL = TenantRef(org="rival", team="x", project="y")
BASE = "b" * 64
T0 = datetime(2026, 3, 1, tzinfo=UTC)
PURGED_AT = T0 + timedelta(seconds=10)


class Log:
    """Events with chosen timestamps, folded into one state (and kept for other readers)."""

    def __init__(self) -> None:
        self.state = CatalogState()
        self.events: list[Envelope] = []
        self.seqs: dict[str, itertools.count[int]] = {}

    def add(self, payload: Payload, stream: str, tenant: TenantRef | None,
            at: datetime) -> Envelope:
        seq = next(self.seqs.setdefault(stream, itertools.count(1)))
        envelope = Envelope.new(payload, stream=stream, seq=seq, actor="t", tenant=tenant,
                                occurred_at=at)
        self.events.append(envelope)
        self.state.apply(envelope)
        return envelope

    def publish(self, adapter_id: str, version: int, at: datetime, *, tenant: TenantRef = ACME,
                weights: str | None = None, activate: bool = True,
                gate: GateRequest | None = None) -> None:
        self.add(AdapterVersionPublished(
            adapter_id=adapter_id, version=version, label=f"v{version}", base_model="tiny",
            base_model_digest=BASE, sha256=weights or digest(adapter_id, version),
            config_sha256=digest(adapter_id, version, "config"), size_bytes=1, rank=4,
            lora_alpha=8, target_modules=["q_proj"], dtype="float16", owner="o",
            quality_gate=gate), f"adapter/{adapter_id}", tenant, at)
        if activate:
            self.add(AdapterVersionSwitched(adapter_id=adapter_id, from_version=None,
                                            to_version=version), f"adapter/{adapter_id}",
                     tenant, at)

    def purge(self, purge_id: str, at: datetime, tenant: TenantRef = ACME) -> None:
        self.add(TenantPurgeRequested(purge_id=purge_id, deadline_s=60),
                 tenant_stream(tenant), tenant, at)


def digest(adapter_id: str, version: int, kind: str = "weights") -> str:
    import hashlib

    return hashlib.sha256(f"{adapter_id}@{version}/{kind}".encode()).hexdigest()


def purged_log() -> Log:
    """acme's bot@1 (active) and bot@2 (in a split) before the purge, bot@3 after it;
    rival's bot-r@1 holds the same weights as bot@1."""
    log = Log()
    log.add(BaseModelRegistered(name="tiny", digest=BASE, config={}), "base-model/tiny", None, T0)
    log.publish("bot", 1, T0)
    log.publish("bot", 2, T0 + timedelta(seconds=1), activate=False)
    log.add(TrafficSplitChanged(alias="prod", split=[
        SplitEntry(adapter_id="bot", version=1, weight=50),
        SplitEntry(adapter_id="bot", version=2, weight=50)]), "alias/prod", ACME, T0)
    log.publish("bot-r", 1, T0, tenant=RIVAL, weights=digest("bot", 1))
    log.purge("p1", PURGED_AT)
    return log


def test_the_fold_marks_what_a_purge_ends_whatever_order_it_is_read_in() -> None:
    log = purged_log()
    log.publish("bot", 3, PURGED_AT + timedelta(seconds=1), activate=False)
    log.publish("tie", 1, PURGED_AT)  # published at the very instant of the purge: ended
    log.purge("p0", T0 + timedelta(milliseconds=500))  # an earlier purge, read later
    versions = log.state.adapters["bot"].versions
    assert [versions[n].purged_by for n in (1, 2, 3)] == ["p0", "p1", None]
    assert log.state.adapters["tie"].versions[1].purged_by == "p1"
    assert log.state.adapters["bot-r"].versions[1].purged_by is None
    # the tenant's stream read before the adapters' (another partition): the same state
    reversed_order = CatalogState()
    for envelope in sorted(log.events, key=lambda e: not e.stream.startswith("tenant/")):
        reversed_order.apply(envelope)
    assert reversed_order == log.state
    # and a restarted reader's snapshot carries it
    assert load_state(dump_state(log.state)) == log.state


def test_every_way_of_asking_for_a_purged_version_is_not_found_naming_the_purge() -> None:
    state = purged_log().state
    asks = [lambda: resolve_reference(state, ACME, "bot", "u"),  # adapter id: active v1
            lambda: resolve_reference(state, ACME, "prod", "u"),  # alias: v1 and v2
            lambda: resolve_pinned(state, ACME, "bot", 1),
            lambda: resolve_pinned(state, ACME, "bot", 2),
            lambda: resolve_as_owner(state, "bot", 1),  # what a worker asks before a load
            lambda: merge_target(state, MergeSpec("bot")),
            lambda: merge_target(state, MergeSpec("bot", 2))]
    for ask in asks:
        with pytest.raises(Refusal) as refused:
            ask()
        assert refused.value.kind == "not_found", refused.value.message
        assert "purge p1" in refused.value.message
    assert resolve_reference(state, RIVAL, "bot-r", "u").version == 1  # another tenant


def test_a_version_published_after_the_purge_is_served_as_usual() -> None:
    log = purged_log()
    log.publish("bot", 3, PURGED_AT + timedelta(seconds=1))
    log.add(TrafficSplitChanged(alias="prod", split=[
        SplitEntry(adapter_id="bot", version=1, weight=50),
        SplitEntry(adapter_id="bot", version=3, weight=50)]), "alias/prod", ACME,
        PURGED_AT + timedelta(seconds=2))
    state = log.state
    assert resolve_reference(state, ACME, "bot", "u").version == 3
    assert {resolve_reference(state, ACME, "prod", f"u{i}").version for i in range(100)} == {3}
    assert merge_target(state, MergeSpec("bot")).version == 3
    assert purged_reason(state.adapters["bot"], 3, state.adapters["bot"].versions[3]) is None


def test_the_registry_refuses_to_send_traffic_to_a_purged_version() -> None:
    log = purged_log()
    log.publish("bot", 3, PURGED_AT + timedelta(seconds=1))
    state = log.state
    for command in (lambda: switch_active(state, "bot", 2), lambda: roll_back(state, "bot", 1,
                                                                               "back"),
                    lambda: set_split(state, "prod", [
                        SplitEntry(adapter_id="bot", version=2, weight=100)])):
        with pytest.raises(Refusal) as refused:
            command()
        assert refused.value.kind == "conflict" and "purge p1" in refused.value.message
    set_split(state, "prod", [SplitEntry(adapter_id="bot", version=3, weight=100),
                              SplitEntry(adapter_id="bot", version=2, weight=0)])


def test_gates_of_purged_versions_are_not_run_and_never_compare_with_one() -> None:
    log = purged_log()
    request = GateRequest(gate_id="g1", regression_set_sha256="e" * 64, cases=2,
                          worker_id="w1", timeout_s=600)
    log.publish("gated", 1, T0, gate=request, activate=False, tenant=RIVAL)
    assert [g.gate_id for g in gates_to_run(log.state, "w1")] == ["g1"]
    log.purge("p2", PURGED_AT + timedelta(seconds=1), tenant=RIVAL)
    assert gates_to_run(log.state, "w1") == []
    # bot's active version is the purged v1: a new version's gate compares with the base
    log.publish("bot", 3, PURGED_AT + timedelta(seconds=2), activate=False)
    assert gate_baseline(log.state.adapters["bot"], 3) is None


def test_the_blob_route_refuses_files_only_purged_versions_reference() -> None:
    log = purged_log()
    state = log.state
    only_purged = digest("bot", 2)
    reason = erased_blob_reason(state, only_purged)
    assert reason is not None and "purge p1" in reason and "bot@2" in reason
    assert erased_blob_reason(state, digest("bot", 1)) is None  # rival's bot-r@1 holds it
    assert erased_blob_reason(state, "f" * 64) is None  # no version: a regression set, say
    log.publish("bot", 3, PURGED_AT + timedelta(seconds=1), weights=only_purged)
    assert erased_blob_reason(state, only_purged) is None  # published again: live


def test_a_purge_is_met_only_once_its_blobs_are_erased() -> None:
    log = purged_log()
    purge = log.state.purges["p1"]
    assert purge.expected_workers == () and purge.status(PURGED_AT) == "pending"
    log.add(TenantBlobsDeleted(purge_id="p1", deleted=[digest("bot", 2)]),
            tenant_stream(ACME), ACME, PURGED_AT + timedelta(seconds=1))
    assert purge.erased_at == PURGED_AT + timedelta(seconds=1)
    assert purge.status(PURGED_AT + timedelta(seconds=2)) == "met"


def test_the_router_refuses_and_never_prewarms_a_purged_version() -> None:
    log = purged_log()
    d = Dispatcher(Settings(router_gc_freeze=False), clock=lambda: 0.0)
    heartbeat = Envelope.new(WorkerHeartbeat(worker_id="w1", address="w1:1", base_model="tiny",
                                             base_model_digest=BASE), stream="worker/w1",
                             seq=1, actor="w1")
    for envelope in [*log.events, heartbeat]:
        d.fold(envelope, 0.0)
    d.ready = True
    caller = Principal("t1", "inference", ("acme", "search", "prod"))
    for ref in (pb.AdapterRef(alias="bot"), pb.AdapterRef(alias="prod"),
                pb.AdapterRef(pinned=pb.PinnedVersion(adapter_id="bot", version=2))):
        with pytest.raises(RouteError) as refused:
            d.decide(caller, asked_of(pb.TenantSignature(user_id="u"), ref, None), 0.0)
        assert refused.value.code == "NOT_FOUND"
        assert refused.value.reason == "model_not_found" and "purge p1" in refused.value.message
    recent = [RecentAdapter("bot", 2, digest("bot", 2), BASE),  # served before the purge
              RecentAdapter("bot-r", 1, digest("bot", 1), BASE)]
    d._hint("w1", recent, pb.PREFETCH_TIER_HOST, "ring join")
    assert [key[1] for key in d._hinted] == [digest("bot", 1)]  # bot-r's only
