"""The fold without a database: what it builds must not depend on how events are batched."""

from __future__ import annotations

import random

import pytest

from services.audit.fold import FoldState, apply
from tests.audit.scenario import mixed, story


@pytest.mark.parametrize("shuffled", [False, True])
def test_worker_sets_do_not_depend_on_batching(shuffled: bool) -> None:
    """A heartbeat's list is folded only when its worker's set is next read; taking the
    changes after every event (every heartbeat folded at once) gives the same rows, also
    when the two topics are read at different paces."""
    events = [*mixed(1500, seed=3), *story()]
    if shuffled:
        rng = random.Random(5)
        for i in range(0, len(events), 40):
            window = events[i:i + 40]
            rng.shuffle(window)
            events[i:i + 40] = window
    each, once = FoldState(), FoldState()
    rows_each = []
    for envelope in events:
        apply(each, envelope)
        apply(once, envelope)
        rows_each += [row for rows in each.take_changes().worker_adapters.values()
                      for row in rows]
    changes = once.take_changes()
    assert changes.worker_adapters == {w: list(rows.values())
                                       for w, rows in sorted(each.worker_adapters.items())}
    assert once.worker_adapters == each.worker_adapters
    assert once.unloaded == each.unloaded
    assert rows_each  # the sets were written along the way too
