"""Placement: which worker serves a request. Pure: no clock, no I/O, no gRPC.

Keys are tenant signatures (org, team, project, compliance scope, region hint) on a
consistent-hash ring of worker ids (`uhashring`, 160 points per worker by default), so
adding or removing one of N workers moves about 1/N of the keys and a tenant otherwise
stays where its KV cache and adapters are.

`place` walks the ring from the key and applies, in order:
1. Eligibility: only workers the caller lists (live, and built on the request's base
   model) are considered.
2. Bounded load (Mirrokni, Thorup, Zadimoghaddam 2016): with `m` requests in flight over
   `n` eligible workers, the new one counted, a worker may take it only while its load is
   below `ceil((1 + eps) * (m + 1) / n)`. Some worker always is, so no worker ever goes
   above (1 + eps) x the mean. The *home* is the first worker on the walk under the bound.
3. Adapter awareness: a home that holds the adapter on device or in host memory (or is
   loading it because the router just sent it there) serves: a host-to-device promote
   costs milliseconds and keeps the tenant's prefix cache where it is. A cold home gives
   way to the first worker within `window` workers of the walk (under the bound) that holds
   the adapter on device, else to the first that holds it in host memory; the caller then
   hints the home to prefetch, so traffic moves back once the home is warm. This is also
   how a ring change is pre-warmed: the new home takes a key's traffic only once it holds
   the key's adapter. `window=1` is the plain ring (a cold home serves at once).
4. Otherwise the home serves cold: the caller counts it against the cold-load cap and
   sends the home a prefetch hint.

`fallback` is the next worker of the walk (under the bound when one is): where a request
that failed before its first token is retried.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Literal, NamedTuple

from uhashring import HashRing

Tier = Literal["device", "host", "loading", "disk"]
"""Where a worker holds an adapter: `loading` = the router sent it there moments ago."""
WARM: frozenset[str] = frozenset({"device", "host", "loading"})

DEFAULT_SCOPE = "default"


def ring_key(org: str, team: str, project: str, compliance_scope: str = "",
             region_hint: str = "") -> str:
    """The ring key of a tenant signature; an empty compliance scope is `default`."""
    return "\x1f".join((org, team, project, compliance_scope or DEFAULT_SCOPE, region_hint))


class Ring:
    """The consistent-hash ring of worker ids, and the walk from a key around it."""

    def __init__(self, workers: Iterable[str] = (), *, vnodes: int = 160) -> None:
        self.vnodes = vnodes
        self._hash = HashRing(nodes=sorted(set(workers)), vnodes=vnodes)
        self._points: list[str] = []
        self.version = 0
        """Moves with every change of the members: a walk (`order`) kept since is stale."""
        self._reindex()

    def _reindex(self) -> None:
        self._points = [name for _, name in self._hash.get_points()]
        self._members = frozenset(self._hash.get_nodes())
        self._around = self._points + self._points  # the ring unrolled twice: no modulo
        self._orders: dict[str, tuple[str, ...]] = {}
        self._by_position: dict[int, tuple[str, ...]] = {}
        self.version += 1

    def order(self, key: str) -> tuple[str, ...]:
        """Every worker once, in ring order from `key`'s position. Remembered per key and per
        position until the ring changes: the same tenants ask again and again, and hashing
        plus de-duplicating the walk is most of a placement's cost. Memory stays bounded by
        the ring's points (one tuple per position), the key map by a cap."""
        order = self._orders.get(key)
        if order is None:
            if len(self._orders) >= 262_144:
                self._orders.clear()
            order = self._orders[key] = self._order_at(self._hash.get_node_pos(key))
        return order

    def _order_at(self, start: int) -> tuple[str, ...]:
        order = self._by_position.get(start)
        if order is None:
            total, count = len(self._members), len(self._points)
            # Seeing every one of n workers takes about n ln n points of the walk: look at a
            # short stretch first (de-duplicated in C by dict.fromkeys), the whole ring if not.
            distinct = dict.fromkeys(self._around[start:start + 16 * total])
            if len(distinct) < total:
                distinct = dict.fromkeys(self._around[start:start + count])
            order = self._by_position[start] = tuple(distinct)
        return order

    @property
    def members(self) -> frozenset[str]:
        return self._members

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, worker: object) -> bool:
        return worker in self._members

    def add(self, worker: str) -> None:
        if worker not in self:
            self._hash.add_node(worker)
            self._reindex()

    def remove(self, worker: str) -> None:
        if worker in self:
            self._hash.remove_node(worker)
            self._reindex()

    def copy(self) -> Ring:
        return Ring(self.members, vnodes=self.vnodes)

    def walk(self, key: str) -> Iterator[str]:
        """Distinct workers in ring order from `key`'s position."""
        if self._points:
            yield from self.order(key)

    def home(self, key: str) -> str | None:
        """The key's owner when load is ignored (what a ring change moves)."""
        return next(self.walk(key), None)


class Placement(NamedTuple):
    """One per request: a tuple, the cheapest immutable object Python builds."""

    worker: str
    tier: Tier | None
    """Where `worker` holds the adapter; None = not at all (a cold load)."""
    home: str
    """The first worker of the walk under the load bound."""
    fallback: str | None
    """Where a request that fails before its first token is retried."""

    @property
    def cold(self) -> bool:
        return self.tier not in WARM

    @property
    def diverted(self) -> bool:
        """Served by a warm neighbour because the home is cold (the home gets a hint)."""
        return self.worker != self.home


@functools.lru_cache(maxsize=4096)
def load_bound(total_in_flight: int, workers: int, epsilon: float) -> int:
    """A worker may take the next request only while its in-flight count is below this.
    Remembered: every placement asks, and the answer moves only with the in-flight total."""
    return math.ceil((1.0 + epsilon) * (total_in_flight + 1) / workers)


_TIER_RANK = {"device": 0, "host": 1, "loading": 1}


def place(ring: Ring, key: str, *, eligible: Callable[[str], bool],
          loads: Mapping[str, int], holding: Callable[[str], Tier | None],
          epsilon: float = 0.25, window: int = 3, eligible_count: int | None = None,
          total_in_flight: int | None = None) -> Placement | None:
    """Choose a worker for `key` (see the module doc); None when no worker is eligible.

    `eligible_count` and `total_in_flight` over the eligible workers may be passed when the
    caller keeps them; otherwise they are counted here.
    """
    if eligible_count is None or total_in_flight is None:
        members = [w for w in ring.members if eligible(w)]
        eligible_count = len(members)
        total_in_flight = sum(loads.get(w, 0) for w in members)
    return place_on(ring.order(key) if ring.members else (), eligible=eligible, loads=loads,
                    holding=holding, epsilon=epsilon, window=window,
                    eligible_count=eligible_count, total_in_flight=total_in_flight)


def place_on(order: tuple[str, ...], *, eligible: Callable[[str], bool],
             loads: Mapping[str, int], holding: Callable[[str], Tier | None],
             epsilon: float, window: int, eligible_count: int, total_in_flight: int
             ) -> Placement | None:
    """`place` on the key's walk (`Ring.order`) as a caller keeps it between requests."""
    if eligible_count == 0:
        return None
    bound = load_bound(total_in_flight, eligible_count, epsilon)
    first: str | None = None  # the first eligible worker of the walk
    under: list[str] = []  # eligible workers under the bound, in ring order
    home_tier: Tier | None = None
    best: tuple[int, str, Tier] | None = None
    load = loads.get
    for worker in order:
        if not eligible(worker):
            continue
        if first is None:
            first = worker
        if load(worker, 0) >= bound:
            continue
        under.append(worker)
        if len(under) == 1:
            home_tier = holding(worker)
            if home_tier in WARM or window == 1:
                break
        else:
            tier = holding(worker)
            rank = _TIER_RANK.get(tier or "", 9)
            if rank < 9 and (best is None or rank < best[0]):
                best = (rank, worker, tier)  # type: ignore[arg-type]
            if rank == 0 or len(under) >= window:
                break
    if first is None:  # the caller's counts include workers the ring does not have
        return None
    if not under:  # unreachable while loads are counted over the same workers
        under = [first]
        home_tier = holding(first)
    home = under[0]
    if home_tier in WARM or best is None:
        worker, tier = home, home_tier
    else:
        worker, tier = best[1], best[2]
    # `under` is every eligible worker under the bound up to where the walk stopped, in ring
    # order: the fallback is its first other worker; only short of one is the walk resumed.
    for other in under:
        if other != worker:
            return Placement(worker, tier, home, other)
    return Placement(worker, tier, home, _fallback(worker, order, eligible, loads, bound))


def _fallback(chosen: str, order: tuple[str, ...], eligible: Callable[[str], bool],
              loads: Mapping[str, int], bound: int) -> str | None:
    """The first other eligible worker of the walk under the bound, else any other one."""
    spare = None
    load = loads.get
    for worker in order:
        if worker == chosen or not eligible(worker):
            continue
        if load(worker, 0) < bound:
            return worker
        if spare is None:
            spare = worker
    return spare
