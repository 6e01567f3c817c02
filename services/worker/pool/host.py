"""The host tier: parsed, validated adapters in memory (pinned on CUDA), by digest.

What the loader puts here has already passed `AdapterFiles.verify` and `parse_adapter`,
and is laid out as the engine's pool stores it, in the dtype it was published in, so
moving it to a device slot is one contiguous copy that converts on the fly (the host
tier's target is under 20 ms for a 30 MB adapter). A byte budget bounds it; LRU-K
weighted by QoS tier picks what leaves. Removing an entry for a purge zeroes its tensors
first, so the weights do not stay readable in freed memory.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from services.worker.engine import AdapterDigest, LoraAdapter
from services.worker.pool.tiers import AccessHistory, Candidate, eviction_order


def adapter_bytes(adapter: LoraAdapter) -> int:
    """Host memory the adapter's weights take (its packed buffer, padding included)."""
    if adapter.packed is not None:
        return adapter.packed.numel() * adapter.packed.element_size()
    return sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size()
               for w in adapter.weights.values())


def slot_ready(adapter: LoraAdapter, *, pin: bool = False) -> LoraAdapter:
    """The adapter with its weights in one buffer laid out as the engine's pool stores
    them (`LoraAdapter.packed`; `parse_adapter` already made it), so moving it to a slot
    is one copy. `pin`: page-locked memory, so the device copy can run asynchronously."""
    adapter = adapter.pack()
    assert adapter.packed is not None
    return adapter.moved_to(adapter.packed.pin_memory()) if pin else adapter


def zero_adapter(adapter: LoraAdapter) -> None:
    with torch.no_grad():
        if adapter.packed is not None:
            adapter.packed.zero_()  # the weights are views into it
            return
        for w in adapter.weights.values():
            w.a.zero_()
            w.b.zero_()


@dataclass
class _Entry:
    adapter: LoraAdapter
    size: int
    qos_tier: str
    history: AccessHistory


class HostCache:
    """Parsed adapters under a byte budget; thread-safe."""

    def __init__(self, byte_budget: int, *, pin: bool = False) -> None:
        self.byte_budget = byte_budget
        self.pin = pin
        self._lock = threading.Lock()
        self._entries: dict[AdapterDigest, _Entry] = {}
        self.evictions = 0

    def get(self, digest: AdapterDigest) -> LoraAdapter | None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return None
            entry.history.touch(time.monotonic())
            return entry.adapter

    def holds(self, digest: AdapterDigest) -> bool:
        with self._lock:
            return digest in self._entries

    def digests(self) -> set[AdapterDigest]:
        with self._lock:
            return set(self._entries)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(e.size for e in self._entries.values())

    def put(self, adapter: LoraAdapter, qos_tier: str = "silver") -> LoraAdapter:
        """Keep an adapter (pinned when configured); evicts to the budget. Returns the
        copy held, which is what the device tier should copy from."""
        held = slot_ready(adapter, pin=self.pin)
        size = adapter_bytes(held)
        with self._lock:
            entry = self._entries.get(adapter.digest)
            if entry is None:
                entry = self._entries[adapter.digest] = _Entry(held, size, qos_tier,
                                                               AccessHistory())
            entry.history.touch(time.monotonic())
            used = sum(e.size for e in self._entries.values())
            if used > self.byte_budget:
                order = eviction_order([Candidate(d, e.qos_tier, e.history)
                                        for d, e in self._entries.items()
                                        if d != adapter.digest], time.monotonic())
                for c in order:
                    if used <= self.byte_budget:
                        break
                    victim = self._entries.pop(c.key)  # type: ignore[call-overload]
                    used -= victim.size
                    self.evictions += 1
            return entry.adapter

    def discard(self, digest: AdapterDigest, *, scrub: bool = False) -> bool:
        """Drop an entry; `scrub` zeroes its tensors first (purge). True if it was held."""
        with self._lock:
            entry = self._entries.pop(digest, None)
        if entry is None:
            return False
        if scrub:
            zero_adapter(entry.adapter)
        return True
