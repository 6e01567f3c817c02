"""The catalog fold does not depend on how a reader interleaves topics and partitions.

Readers consume the adapter log, the worker log and the liveness topic at their own pace,
so the same log reaches two readers in different orders; only the order within one
partition is fixed. Folding any such order must give the same state, or the registry,
the workers and the router would each believe something else.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.catalog.state import CatalogState, LogPosition
from tests.catalog.logs import Placed, catalog_logs, interleave


def fold(events: list[Placed]) -> CatalogState:
    state = CatalogState()
    for placed in events:
        state.apply(placed.envelope, LogPosition(placed.topic, placed.partition, placed.offset))
    return state


@settings(max_examples=150, deadline=None)
@given(catalog_logs(), st.lists(st.integers(0, 10), max_size=200),
       st.lists(st.integers(0, 10), max_size=200))
def test_any_interleaving_of_the_topics_folds_to_the_same_state(
        partitions: dict, one: list[int], other: list[int]) -> None:
    assert fold(interleave(partitions, one)) == fold(interleave(partitions, other))


def test_an_ack_read_before_its_purge_request_still_counts() -> None:
    from datetime import UTC, datetime, timedelta

    from services.contracts.events import (
        Envelope,
        TenantBlobsDeleted,
        TenantPurged,
        TenantPurgeRequested,
        TenantRef,
    )

    tenant = TenantRef(org="acme", team="a", project="p")
    at = datetime(2026, 1, 1, tzinfo=UTC)
    request = Envelope.new(TenantPurgeRequested(purge_id="p1", deadline_s=60,
                                                expected_workers=["w1"]),
                           stream="tenant/acme/a/p", seq=1, actor="op", tenant=tenant,
                           occurred_at=at)
    ack = Envelope.new(TenantPurged(worker_id="w1", purge_id="p1", kv_blocks_freed=1,
                                    adapters_unloaded=0, refcounts_zero=True),
                       stream="worker/w1", seq=1, actor="w1", occurred_at=at + timedelta(seconds=1))
    state = CatalogState()
    state.apply(ack)  # the worker topic was read first
    state.apply(request)
    assert state.purges["p1"].status(at) == "pending" and not state.early_acks  # blobs kept
    state.apply(Envelope.new(TenantBlobsDeleted(purge_id="p1"), stream="tenant/acme/a/p",
                             seq=2, actor="registry/erasure", tenant=tenant,
                             occurred_at=at + timedelta(seconds=2)))
    assert state.purges["p1"].status(at) == "met"


def test_a_rollout_completion_read_before_its_steps_still_completes_it() -> None:
    from datetime import UTC, datetime, timedelta

    from services.contracts.events import (
        AdapterVersionSwitched,
        Envelope,
        QualityGateCompleted,
        QualityGateRequested,
        RolloutStep,
        SplitEntry,
        TrafficSplitChanged,
    )
    from tests.catalog.logs import DIGEST, PLAN

    at = datetime(2026, 1, 1, tzinfo=UTC)

    def step(action: str, stage: int) -> RolloutStep:
        return RolloutStep(rollout_id="ro1", action=action, alias="prod", adapter_id="bot",
                           canary_version=2, baseline_version=1, stage=stage,
                           weight=PLAN.stages[stage], plan=PLAN)

    alias_stream = [Envelope.new(TrafficSplitChanged(alias="prod", split=[
        SplitEntry(adapter_id="bot", version=2, weight=PLAN.stages[n])], rollout=step(a, n)),
        stream="alias/prod", seq=n + 1, actor="c", occurred_at=at + timedelta(seconds=n))
        for n, a in enumerate(("started", "advanced", "advanced"))]
    completion = Envelope.new(AdapterVersionSwitched(adapter_id="bot", from_version=1,
                                                     to_version=2, rollout=step("completed", 2)),
                              stream="adapter/bot", seq=9, actor="c",
                              occurred_at=at + timedelta(seconds=10))
    gate = QualityGateRequested.model_validate({
        "adapter_id": "bot", "version": 2, "gate": {
            "gate_id": "g1", "regression_set_sha256": DIGEST, "cases": 1, "worker_id": "w1",
            "timeout_s": 60}})
    requested = Envelope.new(gate, stream="adapter/bot", seq=8, actor="a", occurred_at=at)
    results = [Envelope.new(QualityGateCompleted(  # two workers: two partitions
        worker_id=worker, gate_id="g1", adapter_id="bot", version=2, base_model_digest=DIGEST,
        regression_set_sha256=DIGEST, adapter_sha256=DIGEST, passed=passed),
        stream=f"worker/{worker}", seq=1, actor=worker, occurred_at=at + timedelta(seconds=n))
        for n, (worker, passed) in enumerate((("w1", True), ("w2", False)))]

    in_order, reordered = CatalogState(), CatalogState()
    for event in [requested, *results, *alias_stream, completion]:
        in_order.apply(event)
    for event in [*reversed(results), requested, completion, *alias_stream]:
        reordered.apply(event)  # each stream's own order kept, the streams interleaved
    assert in_order.rollouts["prod"].status == "completed"
    assert reordered == in_order
