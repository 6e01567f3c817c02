"""`CatalogState` survives its snapshot document: dump, JSON, load gives the same state."""

from __future__ import annotations

import json

from hypothesis import given, settings

from services.catalog.snapshot import FOLD_VERSION, CatalogFold, dump_state, load_state
from services.catalog.state import FOLDED_TYPES, CatalogState
from services.contracts.events import PAYLOAD_TYPES
from tests.catalog.logs import catalog_logs, interleave
from tests.catalog.test_fold_order import fold


@settings(max_examples=100, deadline=None)
@given(catalog_logs())
def test_round_trip_through_json(partitions: dict) -> None:
    state = fold(interleave(partitions, []))
    document = json.loads(json.dumps(dump_state(state)))
    restored = load_state(document)
    assert restored == state
    assert dump_state(restored) == document
    for (actor, key), answer in state.idempotency.items():  # answers rebuilt on demand
        assert restored.idempotency[(actor, key)].envelope == answer.envelope


def test_the_fold_takes_exactly_the_catalog_event_types() -> None:
    assert set(PAYLOAD_TYPES) >= FOLDED_TYPES
    assert CatalogFold.wanted_types == FOLDED_TYPES
    assert "RequestServed" not in FOLDED_TYPES and "ReplayBarrier" not in FOLDED_TYPES
    assert FOLD_VERSION.startswith("catalog/")


def test_load_of_nothing_is_the_empty_state() -> None:
    fold_ = CatalogFold(stale_after_s=12.0)
    fold_.load(dump_state(CatalogState(stale_after_s=99.0)))
    assert fold_.state.stale_after_s == 12.0  # the setting wins over the snapshot's
    fold_.load(None)
    assert fold_.state == CatalogState(stale_after_s=12.0)
