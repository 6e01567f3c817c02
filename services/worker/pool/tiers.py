"""Tiers and the eviction rule every tier uses: LRU-K (K=2) weighted by QoS tier.

A tier holds adapter versions by content digest: `device` (the engine's slots), `host`
(parsed tensors in memory, pinned on CUDA), `disk` (a content-addressed cache under the
state folder) and `blob` (the registry's blob store, the source of truth; never evicted).

LRU-K (O'Neil, O'Neil and Weikum, 1993) ranks an entry by the time since its K-th most
recent access, so one burst of use does not make an adapter look hot the way plain LRU
does. Entries with fewer than K accesses go first (oldest last access first). The
distance is divided by a weight for the QoS tier the adapter was published with, so a
gold adapter idle for 4 s ranks like a bronze one idle for 1 s. Pinned entries (platinum
on the device tier) and entries in use are never candidates.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

K = 2
"""References remembered per entry."""

QOS_WEIGHT: dict[str, float] = {"platinum": 16.0, "gold": 4.0, "silver": 2.0, "bronze": 1.0}
QOS_RANK: dict[str, int] = {"platinum": 0, "gold": 1, "silver": 2, "bronze": 3}
"""Lower is more important (the engine's `QosTier` order)."""


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    BLOB = "blob"

    @property
    def rank(self) -> int:
        """Nearer the engine is lower."""
        return list(Tier).index(self)


@dataclass
class AccessHistory:
    """The last K access times of one entry (monotonic seconds), newest first."""

    times: list[float] = field(default_factory=list)

    def touch(self, now: float) -> None:
        self.times.insert(0, now)
        del self.times[K:]

    def backward_k_distance(self, now: float) -> float:
        """now minus the K-th most recent access; infinite with fewer than K accesses."""
        return now - self.times[K - 1] if len(self.times) >= K else math.inf

    def last(self) -> float:
        return self.times[0] if self.times else -math.inf


@dataclass(frozen=True)
class Candidate:
    """An entry that could be evicted: not pinned and not in use."""

    key: object
    qos_tier: str
    history: AccessHistory


def eviction_order(candidates: Iterable[Candidate], now: float) -> list[Candidate]:
    """Best victim first: fewer than K accesses, then the largest weighted K-distance.

    Ties (and entries without K accesses) go by the oldest last access, then by the less
    important QoS tier.
    """

    def key(c: Candidate) -> tuple[int, float, float, int]:
        distance = c.history.backward_k_distance(now)
        weight = QOS_WEIGHT.get(c.qos_tier, 1.0)
        young = 0 if math.isinf(distance) else 1
        weighted = 0.0 if young == 0 else distance / weight
        return (young, -weighted, c.history.last(), -QOS_RANK.get(c.qos_tier, 3))

    return sorted(candidates, key=key)


def may_evict(requester_tier: str, victim_tier: str, *, background: bool = False) -> bool:
    """Who may take whose slot when the pool is full.

    Gold and platinum requests evict any idle, unpinned adapter; silver and bronze only
    adapters of their own tier or below, and otherwise get RESOURCE_EXHAUSTED with a retry
    hint (so a burst of cheap traffic never pushes a paying tenant's adapter out). A load
    ahead of traffic (`background`: a switch to a gold adapter, a start-up) only takes the
    slot of a strictly less important adapter, so preloading never thrashes.
    """
    requester = QOS_RANK.get(requester_tier, 3)
    victim = QOS_RANK.get(victim_tier, 3)
    if background:
        return victim > requester
    if requester <= QOS_RANK["gold"]:
        return True
    return victim >= requester
