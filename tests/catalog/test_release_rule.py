"""The release rule on the shared fold: gate outcomes by timestamp, overrides, canary
rollbacks, and the registry's switch/split and the serving rule agreeing on it."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest

from services.catalog.release_rule import GateSpec, gate_request, overdue_gates, release_refusal
from services.catalog.serving import resolve_pinned, resolve_reference
from services.catalog.state import CatalogState, Refusal
from services.contracts.events import (
    AdapterVersionPublished,
    AdapterVersionSwitched,
    Envelope,
    GateCaseResult,
    GateCheckResult,
    GateOutput,
    GateRequest,
    MergedMode,
    Payload,
    QualityGateCompleted,
    QualityGateExpired,
    QualityGateRequested,
    ReleaseOverridden,
    SplitEntry,
    TenantRef,
    TrafficSplitChanged,
    WorkerHeartbeat,
)
from services.registry.domain import set_split, switch_active

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
SHA = "ab" * 32
TENANT = TenantRef(org="acme", team="search", project="prod")
SET = "cd" * 32
_seq = itertools.count(1)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def event(payload: Payload, when: datetime, stream: str = "adapter/bot",
          actor: str = "admin:t") -> Envelope:
    return Envelope.new(payload, stream=stream, seq=next(_seq), actor=actor, tenant=TENANT,
                        occurred_at=when)


def request(gate_id: str = "g1", worker: str | None = "w1", timeout_s: float = 60,
            baseline: int | None = 1) -> GateRequest:
    return GateRequest(gate_id=gate_id, regression_set_sha256=SET, cases=1, worker_id=worker,
                       baseline_version=baseline, timeout_s=timeout_s)


def published(version: int, gate: GateRequest | None = None,
              required: bool = True) -> AdapterVersionPublished:
    return AdapterVersionPublished(
        adapter_id="bot", version=version, label=f"v{version}", base_model="tiny",
        base_model_digest=SHA, sha256=f"{version:064x}", config_sha256=SHA, size_bytes=1,
        rank=4, lora_alpha=8, target_modules=["q_proj"], dtype="float16", owner="o",
        gate_required=required, quality_gate=gate)


def completed(gate_id: str = "g1", worker: str = "w1", ok: bool = True,
              baseline: int | None = 1) -> QualityGateCompleted:
    output = GateOutput(role="new", version=2, tokens=1, tokens_sha256=SHA, text_sha256=SHA,
                        text="4", finish_reason="length")
    check = GateCheckResult(kind="json_schema", verdict="pass" if ok else "fail",
                            detail="" if ok else "schema violated at (root): 4 is not one of [1]")
    case = GateCaseResult(case_id="label", line=1, prompt_sha256=SHA, outputs=[output],
                          checks=[check], passed=ok)
    return QualityGateCompleted(worker_id=worker, gate_id=gate_id, adapter_id="bot", version=2,
                                baseline_version=baseline, base_model_digest=SHA,
                                regression_set_sha256=SET, adapter_sha256=f"{2:064x}",
                                passed=ok, cases=[case])


def state_with_gate(*events: Envelope) -> CatalogState:
    state = CatalogState()
    for e in (event(published(1, required=False), at(-100)),
              event(AdapterVersionSwitched(adapter_id="bot", from_version=None, to_version=1),
                    at(-90)),
              event(published(2, request()), at(0)), *events):
        state.apply(e)
    return state


def refusal(state: CatalogState, version: int = 2) -> str | None:
    adapter = state.adapters["bot"]
    return release_refusal(adapter, version, adapter.versions[version])


def test_pending_then_passed() -> None:
    state = state_with_gate()
    assert "quality gate g1 is pending (assigned to w1)" in (refusal(state) or "")
    state.apply(event(completed(), at(10), stream="worker/w1", actor="w1"))
    assert state.adapters["bot"].versions[2].gate.status == "passed"  # type: ignore[union-attr]
    assert refusal(state) is None
    assert refusal(state, 1) is None  # published before gates: never gated


def test_a_failed_gate_names_the_case_and_check() -> None:
    state = state_with_gate(event(completed(ok=False), at(10)))
    assert refusal(state) == ("bot@2: quality gate g1 failed: case label (line 1): json_schema: "
                              "schema violated at (root): 4 is not one of [1]")


@pytest.mark.parametrize(("result", "when", "status"), [
    (completed(worker="w2"), 10, "pending"),  # not the assigned worker
    (completed(), 61, "pending"),  # after the deadline
    (completed(baseline=None), 10, "failed"),  # compared with the wrong version
    (completed(gate_id="g0"), 10, "pending"),  # another gate
])
def test_results_that_do_not_count(result: QualityGateCompleted, when: float,
                                   status: str) -> None:
    state = state_with_gate(event(result, at(when)))
    assert state.adapters["bot"].versions[2].gate.status == status  # type: ignore[union-attr]


def test_a_flag_is_not_trusted_over_the_cases() -> None:
    lying = completed(ok=False).model_copy(update={"passed": True})
    state = state_with_gate(event(lying, at(10)))
    assert state.adapters["bot"].versions[2].gate.status == "failed"  # type: ignore[union-attr]


def expiry(when: float) -> Envelope:
    return event(QualityGateExpired(adapter_id="bot", version=2, gate_id="g1",
                                    cause="worker_lost", reason="w1 stopped heartbeating"),
                 at(when))


@pytest.mark.parametrize("expiry_first", [True, False])
def test_outcome_does_not_depend_on_the_order_topics_were_read(expiry_first: bool) -> None:
    early = event(completed(), at(10))
    late = event(completed(), at(30))
    for result, status in ((early, "passed"), (late, "expired")):
        pair = [expiry(20), result] if expiry_first else [result, expiry(20)]
        state = state_with_gate(*pair)
        assert state.adapters["bot"].versions[2].gate.status == status  # type: ignore[union-attr]
    state = state_with_gate(expiry(20))
    assert "quality gate g1 expired: expired (worker_lost): w1 stopped" in (refusal(state) or "")


def test_a_result_read_before_its_request_counts() -> None:
    state = CatalogState()
    state.apply(event(completed(), at(10)))
    state.apply(event(published(1, required=False), at(-100)))
    state.apply(event(published(2, request()), at(0)))
    assert refusal(state) is None


def test_override_lifts_a_failure_until_the_next_gate_request() -> None:
    state = state_with_gate(event(completed(ok=False), at(10)))
    state.apply(event(ReleaseOverridden(adapter_id="bot", version=2, reason="known flaky case"),
                      at(20)))
    assert refusal(state) is None
    state.apply(event(QualityGateRequested(adapter_id="bot", version=2,
                                           gate=request(gate_id="g2")), at(30)))
    assert "quality gate g2 is pending" in (refusal(state) or "")


def test_a_gate_requested_later_gates_a_version_published_ungated() -> None:
    state = CatalogState()
    state.apply(event(published(1, required=False), at(0)))
    assert refusal(state, 1) is None
    state.apply(event(QualityGateRequested(adapter_id="bot", version=1,
                                           gate=request(baseline=None)), at(1)))
    assert "quality gate g1 is pending" in (refusal(state, 1) or "")


def test_gate_required_without_a_gate() -> None:
    state = CatalogState()
    state.apply(event(published(1), at(0)))
    assert "has no quality gate (published without a regression set)" in (refusal(state, 1)
                                                                            or "")


def test_switch_split_and_serving_all_refuse_an_ungated_version() -> None:
    state = state_with_gate(event(completed(ok=False), at(10)))
    with pytest.raises(Refusal) as raised:
        switch_active(state, "bot", 2)
    assert raised.value.kind == "conflict" and "quality gate g1 failed" in raised.value.message
    split = [SplitEntry(adapter_id="bot", version=2, weight=5),
             SplitEntry(adapter_id="bot", version=1, weight=95)]
    with pytest.raises(Refusal, match="quality gate g1 failed"):
        set_split(state, "bot-prod", split)
    set_split(state, "bot-prod", [split[0].model_copy(update={"weight": 0}),
                                  split[1].model_copy(update={"weight": 100})])
    # a split written before the rule (or by hand into the log) still never serves it
    state.apply(event(TrafficSplitChanged(alias="bot-prod", split=split), at(20),
                      stream="alias/bot-prod"))
    for user in range(200):
        assert resolve_reference(state, TENANT, "bot-prod", f"u{user}").version == 1
    with pytest.raises(Refusal, match="quality gate g1 failed"):
        resolve_pinned(state, TENANT, "bot", 2)


def heartbeat(worker: str, when: float, digest: str = SHA) -> Envelope:
    return event(WorkerHeartbeat(worker_id=worker, address="x:1", base_model="tiny",
                                 base_model_digest=digest), at(when), stream=f"worker/{worker}")


def test_gate_goes_to_a_live_worker_on_the_right_base() -> None:
    state = CatalogState(stale_after_s=30)
    for e in (heartbeat("w1", 0), heartbeat("w2", 0, digest="ef" * 32), heartbeat("w3", -60)):
        state.apply(e)
    spec = GateSpec(SET, 1, "g9", 60)
    assert gate_request(state, spec, SHA, None, at(1)).worker_id == "w1"
    assert gate_request(state, spec, "00" * 32, None, at(1)).worker_id is None
    picks = {gate_request(state.__class__(stale_after_s=30, heartbeats={
        w: at(0) for w in ("a", "b", "c")}, worker_bases=dict.fromkeys("abc", SHA)),
        GateSpec(SET, 1, f"g{i}", 60), SHA, None, at(1)).worker_id for i in range(30)}
    assert picks == {"a", "b", "c"}  # gates spread over the base's workers
    merged = event(WorkerHeartbeat(worker_id="w1", address="x:1", base_model="tiny",
                                   base_model_digest=SHA,
                                   merged_mode=MergedMode(adapter_id="bot")),
                   at(2), stream="worker/w1")
    state.apply(merged)  # merged mode: its weights are not the base model's
    assert gate_request(state, spec, SHA, None, at(3)).worker_id is None
    state.apply(heartbeat("w1", 4))  # restarted without --merge
    assert gate_request(state, spec, SHA, None, at(5)).worker_id == "w1"


def test_overdue_gates() -> None:
    state = state_with_gate(heartbeat("w1", 0))
    assert overdue_gates(state, at(5)) == []
    [lost] = overdue_gates(state, at(40))  # heartbeat 40 s old > 30 s
    assert lost.cause == "worker_lost"
    state.apply(heartbeat("w1", 59))
    [late] = overdue_gates(state, at(61))
    assert late.cause == "timeout"
    nobody = CatalogState()
    nobody.apply(event(published(1, request(worker=None, baseline=None)), at(0)))
    assert [o.cause for o in overdue_gates(nobody, at(0))] == ["no_worker"]
    state.apply(event(completed(), at(10)))
    assert overdue_gates(state, at(100)) == []


def test_the_resolution_cache_follows_a_gate_from_pending_to_passed_and_overridden() -> None:
    from services.catalog.serving import ResolutionCache

    state = state_with_gate(event(TrafficSplitChanged(alias="bot-prod", split=[
        SplitEntry(adapter_id="bot", version=2, weight=100)]), at(5), stream="alias/bot-prod"))
    cache = ResolutionCache(state)
    for ask in (lambda: cache.pinned(TENANT, "bot", 2),
                lambda: cache.reference(TENANT, "bot-prod", "u")):
        with pytest.raises(Refusal, match="pending"):
            ask()
    state.apply(event(completed(), at(10), stream="worker/w1", actor="w1"))
    assert cache.pinned(TENANT, "bot", 2).version == 2
    assert cache.reference(TENANT, "bot-prod", "u").version == 2
    state.apply(event(QualityGateRequested(adapter_id="bot", version=2, gate=request("g2")),
                      at(20)))
    with pytest.raises(Refusal, match="g2 is pending"):
        cache.pinned(TENANT, "bot", 2)
    state.apply(event(ReleaseOverridden(adapter_id="bot", version=2, reason="ok"), at(30)))
    assert cache.pinned(TENANT, "bot", 2).version == 2
