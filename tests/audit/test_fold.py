"""The fold without a database: what it builds must not depend on how events are batched."""

from __future__ import annotations

import random

import pytest

from services.audit.fold import FoldState, apply
from services.audit.keys import Kek, KeyRing
from services.audit.sealing import masked, seal
from services.contracts import structs
from services.contracts.codec import canonical_bytes
from services.contracts.codec import decode as decode_model
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


def test_fold_and_sealing_read_the_structs_as_they_read_the_models() -> None:
    """The projector decodes with `contracts.structs`; the rows, the stored bytes and the
    keys made must be those the models give (purges, erasure and sealing included)."""
    events = [*story(), *mixed(800, seed=11)]
    results = []
    for decode in (decode_model, structs.decode):
        state, ring = FoldState(), KeyRing(Kek(bytes(32)))
        stored = []
        for envelope in events:
            value = canonical_bytes(envelope.to_json())
            event = decode(value)
            if event.tenant is not None and event.type == "TenantPurgeRequested":
                ring.destroy(event.tenant, event.payload.purge_id, event.occurred_at)
            sealed = seal(event, value, ring.key_for)
            stored.append(sealed.stored)
            apply(state, event, sealed.values)
        changes = state.take_changes()
        results.append((stored, changes, state.purged_at, state.worker_adapters,
                        [(c["tenant_org"], c["tenant_project"]) for c in ring.created]))
    # the two rings make random keys: compare the stored form with the tokens masked
    (stored_m, *rest_m), (stored_s, *rest_s) = results
    assert [masked(e.type, s) for e, s in zip(events, stored_m, strict=True)] == \
        [masked(e.type, s) for e, s in zip(events, stored_s, strict=True)]
    changes_m, changes_s = rest_m[0], rest_s[0]
    for name in ("adapters", "versions", "aliases", "workers", "worker_adapters",
                 "version_history", "split_history", "worker_heartbeats", "worker_acks",
                 "purges", "purge_blobs", "erasures"):
        assert getattr(changes_m, name) == getattr(changes_s, name), name
    assert [_unsealed(r) for r in changes_m.request_traces] == \
        [_unsealed(r) for r in changes_s.request_traces]
    assert rest_m[1:] == rest_s[1:]


def _unsealed(row: tuple[object, ...]) -> tuple[object, ...]:
    user = row[8]
    return (*row[:8], "token" if isinstance(user, str) and user.startswith("sealed:") else user,
            *row[9:])
