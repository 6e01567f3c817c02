"""The router's resolution cache only memoises the serving rule: over any log, after every
event, it answers exactly what `resolve_reference` / `resolve_pinned` answer on the same
fold, and an alias's precomputed line gives each user what walking the line would."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from services.catalog.serving import (
    ResolutionCache,
    ServingChoice,
    entry_at,
    resolve_pinned,
    resolve_reference,
    split_order,
    unservable_reason,
    user_point,
)
from services.catalog.state import CatalogState, LogPosition, Refusal
from services.contracts.events import Envelope, TrafficSplitChanged
from tests.catalog.logs import DIGEST, TENANTS, catalog_logs, interleave

NAMES = ["alias0", "alias1", "bot0", "bot1", "nothing"]
USERS = ["", "alice", "u1", "u2"]
BASES = [None, DIGEST, "cd" * 32]

Answer = tuple[str, object]
SERVING = ["base", "publish", "publish", "publish", "switch", "switch", "rollback", "disable",
           "enable", "split", "split", "gate", "gate_done", "gate_expired", "override",
           "rollout", "rollout_done", "halt", "heartbeat", "lease"]
"""What changes an answer, weighed so that most logs serve something and then change it."""


def answer(rule: Callable[..., ServingChoice], *args: object, **kwargs: object) -> Answer:
    try:
        choice = rule(*args, **kwargs)
    except Refusal as refusal:
        return ("refused", (refusal.kind, refusal.message))
    return ("served", (choice, choice.alias, choice.base_model_digest))


def walked(state: CatalogState, tenant: object, name: str, user: str,
           base: str | None) -> Answer:
    """The alias rule written plainly, user by user, as the module doc states it."""
    alias = state.aliases[name]
    if alias.tenant is not None and alias.tenant != tenant:
        # passed over as if it did not exist: the name would be an adapter id, and no
        # adapter is named like an alias in these logs
        assert name not in state.adapters
        return ("refused", ("forbidden", f"alias {name!r} belongs to another tenant "
                                         f"({alias.tenant.key})"))
    ordered = split_order(alias.split)
    start = entry_at(alias.split, user_point(name, tenant, user))  # type: ignore[arg-type]
    around = [e for e in ordered[start:] + ordered[:start] if e.weight > 0]

    def why_not(adapter_id: str, number: int) -> str | None:
        adapter = state.adapters.get(adapter_id)
        if adapter is None or number not in adapter.versions:
            return f"{adapter_id}@{number} does not exist"
        return unservable_reason(adapter, number, adapter.versions[number])

    reasons = [why_not(e.adapter_id, e.version) for e in around]
    if all(reasons):
        return ("refused", ("precondition", f"alias {name!r} has no servable version "
                                            f"({'; '.join(reasons)})"))  # type: ignore[arg-type]
    first = around[reasons.index(None)]
    published = state.adapters[first.adapter_id].versions[first.version].published
    if base is not None and published.base_model_digest != base:
        return ("refused", ("precondition", f"{first.adapter_id}@{first.version} was built "
                            f"for base model {published.base_model!r}, not this one"))
    return ("pinned", (f"{first.adapter_id}@{first.version}", published.sha256))


@settings(max_examples=100, deadline=None)
@given(catalog_logs(max_ops=30, kinds=SERVING, spread=2), st.lists(st.integers(0, 10), max_size=60))
def test_the_cache_answers_what_the_rule_answers_after_every_event(
        partitions: dict, order: list[int]) -> None:
    state = CatalogState()
    cache = ResolutionCache(state)
    for placed in interleave(partitions, order):
        state.apply(placed.envelope, LogPosition(placed.topic, placed.partition,
                                                 placed.offset))
        for tenant in TENANTS:
            for name, base, user in itertools.product(NAMES, BASES, USERS):
                got = answer(cache.reference, tenant, name, user, base_digest=base)
                assert got == answer(resolve_reference, state, tenant, name, user,
                                     base_digest=base)
                if name in state.aliases:
                    if got[0] == "served":
                        choice = got[1][0]  # type: ignore[index]
                        got = ("pinned", (choice.pinned, choice.sha256))
                    assert got == walked(state, tenant, name, user, base)
            for adapter, number, base in itertools.product(("bot0", "bot1"), (1, 2), BASES):
                assert answer(cache.pinned, tenant, adapter, number, base_digest=base) == \
                    answer(resolve_pinned, state, tenant, adapter, number, base_digest=base)


def test_heartbeats_keep_the_cache_and_a_split_change_drops_it() -> None:
    from services.contracts.events import SplitEntry, WorkerHeartbeat

    state = CatalogState()
    generation = state.serving_generation
    state.apply(Envelope.new(WorkerHeartbeat(worker_id="w", address="a", base_model="b",
                                             base_model_digest=DIGEST), stream="heartbeat/w",
                             seq=1, actor="w"))
    assert state.serving_generation == generation
    state.apply(Envelope.new(TrafficSplitChanged(alias="a", split=[
        SplitEntry(adapter_id="bot", version=1, weight=100)]), stream="alias/a", seq=1,
        actor="x"))
    assert state.serving_generation == generation + 1
