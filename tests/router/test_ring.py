"""Placement, pure: the ring, bounded load, adapter awareness; checked against a plain
restatement of the rule over every small case, and by properties over random ones."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.ring import WARM, Ring, load_bound, place, ring_key

TIERS = (None, "disk", "host", "loading", "device")


def test_ring_key_spells_the_signature_and_defaults_the_scope() -> None:
    assert ring_key("a", "b", "c") == ring_key("a", "b", "c", "default", "")
    assert ring_key("a", "b", "c", "hipaa") != ring_key("a", "b", "c")
    assert ring_key("a", "b", "c", "", "eu") != ring_key("a", "b", "c")
    assert ring_key("a", "bc", "") != ring_key("ab", "c", "")


def test_walk_visits_every_worker_once_and_is_deterministic() -> None:
    ring = Ring([f"w{i}" for i in range(20)])
    for key in ("k1", "k2", "tenant/x"):
        order = list(ring.walk(key))
        assert sorted(order) == sorted(ring.members)
        assert order == list(Ring(ring.members).walk(key))
        assert ring.home(key) == order[0]
    assert list(Ring().walk("k")) == [] and Ring().home("k") is None


def test_homes_spread_evenly() -> None:
    ring = Ring([f"w{i}" for i in range(16)])
    counts = Counter(ring.home(f"tenant-{i}") for i in range(16_000))
    assert set(counts) == ring.members
    assert max(counts.values()) < 1.35 * 1000 and min(counts.values()) > 0.65 * 1000


def test_a_17th_worker_takes_about_one_seventeenth_of_the_keys_and_only_those() -> None:
    keys = [f"tenant-{i}" for i in range(20_000)]
    ring = Ring([f"w{i}" for i in range(16)])
    before = {k: ring.home(k) for k in keys}
    ring.add("w16")
    after = {k: ring.home(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "w16" for k in moved)  # nothing moves between old workers
    assert abs(len(moved) / len(keys) - 1 / 17) < 0.02
    ring.remove("w16")
    assert {k: ring.home(k) for k in keys} == before  # leaving gives the same keys back


def test_load_bound_is_ceil_of_one_plus_eps_times_the_mean_with_the_new_request() -> None:
    assert load_bound(0, 4, 0.25) == 1
    assert load_bound(7, 4, 0.25) == math.ceil(1.25 * 8 / 4) == 3
    assert load_bound(99, 64, 0.25) == 2


def _reference(order: list[str], eligible: set[str], loads: dict[str, int],
               held: dict[str, str | None], eps: float, window: int) -> tuple[str, str | None]:
    """The placement rule as the module doc states it, written plainly."""
    candidates = [w for w in order if w in eligible]
    bound = math.ceil((1 + eps) * (sum(loads[w] for w in candidates) + 1) / len(candidates))
    under = [w for w in candidates if loads[w] < bound]
    home = under[0]
    if held[home] in WARM:
        return home, held[home]
    near = under[:window]
    for tier in ("device",):
        for w in near:
            if held[w] == tier:
                return w, tier
    for w in near:
        if held[w] in ("host", "loading"):
            return w, held[w]
    return home, held[home]


@pytest.mark.parametrize("window", [1, 2, 3])
def test_place_agrees_with_the_rule_on_every_small_case(window: int) -> None:
    workers = ["a", "b", "c"]
    ring = Ring(workers, vnodes=8)
    key = "k"
    order = list(ring.walk(key))
    checked = 0
    for tiers in itertools.product(TIERS, repeat=3):
        held = dict(zip(workers, tiers, strict=True))
        for loads_tuple in itertools.product(range(3), repeat=3):
            loads = dict(zip(workers, loads_tuple, strict=True))
            for mask in range(1, 8):
                eligible = {w for i, w in enumerate(workers) if mask >> i & 1}
                got = place(ring, key, eligible=eligible.__contains__, loads=loads,
                            holding=held.__getitem__, epsilon=0.25, window=window)
                assert got is not None
                want = _reference(order, eligible, loads, held, 0.25, window)
                assert (got.worker, got.tier) == want, (held, loads, eligible)
                assert got.cold == (want[1] not in WARM)
                assert got.fallback != got.worker
                assert (got.fallback is None) == (len(eligible) == 1)
                checked += 1
    assert checked == 125 * 27 * 7


def test_no_eligible_worker_means_no_placement() -> None:
    ring = Ring(["a", "b"])
    assert place(ring, "k", eligible=lambda w: False, loads={}, holding=lambda w: None) is None
    assert place(Ring(), "k", eligible=lambda w: True, loads={}, holding=lambda w: None) is None


def test_a_cold_home_gives_way_to_a_device_holder_before_a_host_holder() -> None:
    ring = Ring([f"w{i}" for i in range(8)])
    order = list(ring.walk("k"))
    held = {w: None for w in order}
    held[order[1]] = "host"
    held[order[2]] = "device"
    p = place(ring, "k", eligible=lambda w: True, loads={}, holding=held.__getitem__)
    assert p is not None and p.worker == order[2] and p.diverted and p.home == order[0]
    held[order[0]] = "host"  # a warm home keeps its key
    p = place(ring, "k", eligible=lambda w: True, loads={}, holding=held.__getitem__)
    assert p is not None and p.worker == order[0] and not p.diverted and not p.cold
    held[order[0]] = None
    held[order[2]] = None
    p = place(ring, "k", eligible=lambda w: True, loads={}, holding=held.__getitem__)
    assert p is not None and p.worker == order[1] and p.tier == "host"
    held[order[1]] = None
    held[order[5]] = "device"  # beyond the window: the home loads it
    p = place(ring, "k", eligible=lambda w: True, loads={}, holding=held.__getitem__)
    assert p is not None and p.worker == order[0] and p.cold and p.fallback == order[1]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 12), st.floats(0.05, 1.0), st.integers(0, 2**31), st.integers(1, 4))
def test_bounded_load_holds_under_any_sequence(n: int, eps: float, seed: int,
                                               window: int) -> None:
    rnd = random.Random(seed)
    workers = [f"w{i}" for i in range(n)]
    ring = Ring(workers, vnodes=20)
    loads = dict.fromkeys(workers, 0)
    held = {w: rnd.choice(TIERS) for w in workers}
    hot = rnd.sample(range(1000), 3)  # a few hot keys: the worst case for a plain ring
    for _ in range(200):
        if rnd.random() < 0.3 and any(loads.values()):
            loads[rnd.choice([w for w in workers if loads[w]])] -= 1
            continue
        key = f"t{rnd.choice(hot) if rnd.random() < 0.8 else rnd.randrange(1000)}"
        p = place(ring, key, eligible=lambda w: True, loads=loads, holding=held.__getitem__,
                  epsilon=eps, window=window)
        assert p is not None
        loads[p.worker] += 1
        total = sum(loads.values())
        assert loads[p.worker] <= math.ceil((1 + eps) * total / n)
