"""LRU-K (K=2) weighted by QoS tier, and who may evict whom."""

from __future__ import annotations

import math

from services.worker.pool.tiers import (
    AccessHistory,
    Candidate,
    eviction_order,
    may_evict,
)


def history(*times: float) -> AccessHistory:
    h = AccessHistory()
    for t in times:
        h.touch(t)
    return h


def order(*candidates: Candidate, now: float = 100.0) -> list[object]:
    return [c.key for c in eviction_order(candidates, now)]


def test_k_distance_is_time_since_the_second_last_access() -> None:
    h = history(10, 50, 90)
    assert h.backward_k_distance(100) == 50  # second most recent: 50
    assert math.isinf(history(99).backward_k_distance(100))


def test_entries_seen_once_go_first_oldest_first() -> None:
    assert order(Candidate("hot", "bronze", history(80, 90)),
                 Candidate("once-new", "bronze", history(95)),
                 Candidate("once-old", "gold", history(20))) == ["once-old", "once-new", "hot"]


def test_one_burst_does_not_look_hot_the_way_lru_would() -> None:
    # "burst" was used twice just now after a long pause; "steady" every 10 s
    steady = Candidate("steady", "bronze", history(70, 80, 90))
    burst = Candidate("burst", "bronze", history(1, 99))
    assert order(steady, burst) == ["burst", "steady"]  # LRU would evict "steady"


def test_qos_weight_divides_the_distance() -> None:
    # at t=100: K-distance = 100 - second most recent access, divided by the weight
    gold = Candidate("gold", "gold", history(20, 30))        # 80 s / 4 = 20
    bronze = Candidate("bronze", "bronze", history(70, 80))  # 30 s / 1 = 30
    assert order(gold, bronze) == ["bronze", "gold"]
    older_gold = Candidate("gold", "gold", history(1, 2))    # 99 s / 4 = 24.75
    recent_bronze = Candidate("bronze", "bronze", history(80, 90))  # 20 s / 1 = 20
    assert order(older_gold, recent_bronze) == ["gold", "bronze"]


def test_who_may_evict_whom() -> None:
    for requester in ("gold", "platinum"):
        assert all(may_evict(requester, v) for v in ("platinum", "gold", "silver", "bronze"))
    assert may_evict("silver", "silver") and may_evict("silver", "bronze")
    assert not may_evict("silver", "gold") and not may_evict("bronze", "silver")
    # ahead of traffic, only strictly less important slots are taken
    assert may_evict("gold", "silver", background=True)
    assert not may_evict("gold", "gold", background=True)
    assert not may_evict("silver", "silver", background=True)
