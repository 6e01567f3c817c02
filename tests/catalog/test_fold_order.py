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

    from services.contracts.events import Envelope, TenantPurged, TenantPurgeRequested, TenantRef

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
    assert state.purges["p1"].status(at) == "met" and not state.early_acks
