"""The serving rule on a folded catalog: references, pins, tenants, sticky canary moves."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.catalog.serving import (
    MergeSpec,
    entry_at,
    merge_target,
    resolve_pinned,
    resolve_reference,
    split_order,
    user_point,
)
from services.catalog.state import CatalogState, LogPosition, Refusal
from services.contracts.events import Envelope, SplitEntry, TenantPurgeRequested, TenantRef
from services.registry.domain import (
    ArtifactFacts,
    CommandEvent,
    PublishRequest,
    publish_version,
    register_base_model,
    roll_back,
    set_disabled,
    set_split,
    switch_active,
)

TENANT = TenantRef(org="acme", team="search", project="prod")
RIVAL = TenantRef(org="rival", team="x", project="y")
BASE = "b" * 64
_offsets = itertools.count()


def commit(state: CatalogState, decision: CommandEvent) -> None:
    state.apply(Envelope.new(decision.payload, stream=decision.stream, seq=decision.seq,
                             actor="admin:x", tenant=decision.tenant),
                LogPosition("t", 0, next(_offsets)))


def catalog(versions: int = 3) -> CatalogState:
    state = CatalogState()
    commit(state, register_base_model(state, "llama", BASE, {"hidden_size": 64}))
    for n in range(1, versions + 1):
        facts = ArtifactFacts(f"{n:064x}", "c" * 64, 10, 4, 8.0, ("q_proj",), "float16")
        commit(state, publish_version(state, PublishRequest("bot", TENANT, "o", "llama",
                                                            f"v{n}"), facts))
    return state


def split(state: CatalogState, *weights: tuple[int, int]) -> None:
    commit(state, set_split(state, "prod", [SplitEntry(adapter_id="bot", version=v, weight=w)
                                            for v, w in weights]))


def test_reference_by_adapter_id_serves_the_active_version() -> None:
    state = catalog()
    with pytest.raises(Refusal) as none:
        resolve_reference(state, TENANT, "bot", "u")
    assert none.value.kind == "precondition"
    commit(state, switch_active(state, "bot", 2))
    choice = resolve_reference(state, TENANT, "bot", "u", base_digest=BASE)
    assert (choice.version, choice.sha256, choice.alias) == (2, f"{2:064x}", None)
    with pytest.raises(Refusal) as other_base:
        resolve_reference(state, TENANT, "bot", "u", base_digest="d" * 64)
    assert other_base.value.kind == "precondition"


def test_other_tenants_are_refused_and_unknowns_not_found() -> None:
    state = catalog()
    commit(state, switch_active(state, "bot", 1))
    split(state, (1, 100))
    for call in (lambda: resolve_reference(state, RIVAL, "bot", "u"),
                 lambda: resolve_reference(state, RIVAL, "prod", "u"),
                 lambda: resolve_pinned(state, RIVAL, "bot", 1)):
        with pytest.raises(Refusal) as refused:
            call()
        assert refused.value.kind == "forbidden"
    for call in (lambda: resolve_reference(state, TENANT, "nope", "u"),
                 lambda: resolve_pinned(state, TENANT, "bot", 9)):
        with pytest.raises(Refusal) as missing:
            call()
        assert missing.value.kind == "not_found"


def test_pins_only_active_or_split_versions_never_disabled_or_rolled_back() -> None:
    state = catalog()
    commit(state, switch_active(state, "bot", 1))
    assert resolve_pinned(state, TENANT, "bot", 1).version == 1
    with pytest.raises(Refusal):
        resolve_pinned(state, TENANT, "bot", 2)
    split(state, (1, 90), (2, 10))
    assert resolve_pinned(state, TENANT, "bot", 2).version == 2
    commit(state, switch_active(state, "bot", 3))
    commit(state, roll_back(state, "bot", 1, "errors"))
    with pytest.raises(Refusal) as rolled:
        resolve_pinned(state, TENANT, "bot", 3)
    assert "rolled back" in rolled.value.message
    commit(state, set_disabled(state, "bot", 2, True, "bad"))
    with pytest.raises(Refusal) as disabled:
        resolve_pinned(state, TENANT, "bot", 2)
    assert "disabled" in disabled.value.message
    # a user whose split entry is disabled falls through to the next servable entry
    assert {resolve_reference(state, TENANT, "prod", f"u{i}").version
            for i in range(200)} == {1}


def test_merged_mode_follows_the_active_version_or_holds_its_pin() -> None:
    state = catalog()
    follow, pinned = MergeSpec.parse("bot"), MergeSpec.parse("bot@1")
    assert (follow, pinned) == (MergeSpec("bot"), MergeSpec("bot", 1))
    assert (str(follow), str(pinned)) == ("bot", "bot@1")
    for bad in ("", "Bot", "bot@0", "bot@x", "bot@1@2", "bot@"):
        with pytest.raises(ValueError, match="ADAPTER_ID@VERSION"):
            MergeSpec.parse(bad)
    with pytest.raises(Refusal) as unknown:
        merge_target(state, MergeSpec("nope"))
    assert unknown.value.kind == "not_found"
    with pytest.raises(Refusal, match="no active version"):
        merge_target(state, follow)
    commit(state, switch_active(state, "bot", 1))
    assert merge_target(state, follow, base_digest=BASE).pinned == "bot@1"
    assert merge_target(state, pinned).sha256 == f"{1:064x}"
    with pytest.raises(Refusal, match="base model"):
        merge_target(state, follow, base_digest="d" * 64)
    commit(state, switch_active(state, "bot", 2))  # follows; the pin is no longer served
    assert merge_target(state, follow).version == 2
    with pytest.raises(Refusal, match="neither the active version"):
        merge_target(state, pinned)
    split(state, (1, 10), (2, 90))  # ... unless a split still sends it traffic
    assert merge_target(state, pinned).version == 1
    commit(state, switch_active(state, "bot", 3))
    commit(state, roll_back(state, "bot", 2, "errors"))
    assert merge_target(state, follow).version == 2  # a rollback re-merges
    with pytest.raises(Refusal, match="rolled back"):
        merge_target(state, MergeSpec("bot", 3))
    commit(state, set_disabled(state, "bot", 2, True, "bad"))
    with pytest.raises(Refusal, match="disabled"):
        merge_target(state, follow)
    commit(state, set_disabled(state, "bot", 2, False, "fixed"))
    assert merge_target(state, follow).version == 2
    state.apply(Envelope.new(TenantPurgeRequested(purge_id="p1", deadline_s=60),
                             stream="tenant/acme/search/prod", seq=1, actor="admin:x",
                             tenant=TENANT))
    with pytest.raises(Refusal, match="tenant was purged"):  # never fetched back
        merge_target(state, follow)


def test_split_weights_hold_over_many_users() -> None:
    state = catalog()
    split(state, (1, 75), (2, 25))
    counts = Counter(resolve_reference(state, TENANT, "prod", f"user-{i}").version
                     for i in range(10_000))
    # binomial(10000, 0.25): sd ~ 43; 5 sd either side
    assert abs(counts[2] - 2500) < 220, counts


def test_raising_the_canary_only_moves_users_to_the_new_version() -> None:
    state = catalog()
    users = [f"user-{i}" for i in range(3000)]
    before = {}
    for weight in (5, 25, 50, 100):
        split(state, (1, 100 - weight), (2, weight))
        now = {u: resolve_reference(state, TENANT, "prod", u).version for u in users}
        assert now == {u: resolve_reference(state, TENANT, "prod", u).version for u in users}
        for user, version in before.items():
            assert not (version == 2 and now[user] == 1), user
        before = now
    assert set(before.values()) == {2}


@given(st.lists(st.integers(0, 100), min_size=1, max_size=5), st.integers(0, 9_999))
def test_the_line_is_laid_out_newest_first(raw: list[int], point: int) -> None:
    total = sum(raw)
    if total == 0:
        return
    weights = [w * 100 // total for w in raw]
    weights[0] += 100 - sum(weights)
    entries = [SplitEntry(adapter_id="bot", version=i + 1, weight=w)
               for i, w in enumerate(weights)]
    index = entry_at(entries, point)
    ordered = split_order(entries)
    below = sum(e.weight for e in ordered[:index]) * 100
    assert below <= point < below + ordered[index].weight * 100
    assert 0 <= user_point("prod", TENANT, str(point)) < 10_000
