"""Pre-warming ring changes. Pure: what each worker should prefetch when the ring moves.

The router remembers, per ring key (tenant signature), the few adapter versions it most
recently served. When a worker joins or leaves, every remembered key whose home changed
is a key range the new home gains; that worker is asked to prefetch the key's recent
adapter versions into host memory. Traffic itself moves only once the new home holds
the adapter (placement prefers a warm neighbour over a cold home, `services.router.ring`),
so the first request a new home serves is a host-to-device promote, not a load from disk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from services.router.ring import Ring


class RecentAdapter(NamedTuple):
    """Touched on every request: a tuple hashes and compares in C."""

    adapter_id: str
    version: int
    sha256: str
    base_digest: str


class RecentUse:
    """Per ring key, the last `per_key` adapter versions served; at most `max_keys` keys."""

    def __init__(self, per_key: int = 4, max_keys: int = 100_000) -> None:
        self.per_key = per_key
        self.max_keys = max_keys
        self._by_key: OrderedDict[str, OrderedDict[RecentAdapter, None]] = OrderedDict()

    def touch(self, key: str, adapter: RecentAdapter) -> None:
        if self.per_key <= 0:
            return
        recent = self._by_key.get(key)
        if recent is None:
            recent = self._by_key[key] = OrderedDict()
            if len(self._by_key) > self.max_keys:
                self._by_key.popitem(last=False)
        else:
            self._by_key.move_to_end(key)
            if adapter in recent:
                recent.move_to_end(adapter)
                return
        recent[adapter] = None
        if len(recent) > self.per_key:
            recent.popitem(last=False)

    def tenant_keys(self) -> list[str]:
        return list(self._by_key)

    def of(self, key: str) -> list[RecentAdapter]:
        """Most recent first."""
        return list(reversed(self._by_key.get(key, {})))


def plan(old: Ring, new: Ring, recent: RecentUse,
         serves_base: Callable[[str, str], bool]) -> dict[str, list[RecentAdapter]]:
    """Worker → adapter versions to prefetch: the recent adapters of the keys it gains."""
    wanted: dict[str, dict[RecentAdapter, None]] = {}
    for key in recent.tenant_keys():
        before, after = old.home(key), new.home(key)
        if after is None or after == before:
            continue
        for adapter in recent.of(key):
            if serves_base(after, adapter.base_digest):
                wanted.setdefault(after, {})[adapter] = None
    return {worker: list(adapters) for worker, adapters in wanted.items()}
