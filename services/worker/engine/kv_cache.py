"""Paged KV cache: physical block storage, block refcounts and the tenant-safe prefix cache.

Blocks hold `block_size` tokens of K and V for every layer. A full block can be published
in the prefix cache under a hash that chains the parent block's hash, the block's tokens
and the partition key of its `CacheScope`, so a lookup can only ever land on blocks of
the same base, adapter digest and tenant (or sharing scope); `compat.decide` is still
asked on every hit as a second, independently tested gate.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .compat import CacheScope, KvReuse, SharingPolicy, decide

ROOT_HASH = b"\x00" * 32


def block_hash(parent: bytes, tokens: Sequence[int], scope_key: bytes) -> bytes:
    """Content hash of one full block: parent hash + token ids + cache-scope partition."""
    h = hashlib.sha256(parent)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens))
    h.update(scope_key)
    return h.digest()


class KVStorage:
    """Physical K/V tensors, flat over (block, offset) so a token's slot is one index.

    Layout per layer is [kv_heads, slots, head_dim]: gathering a batch's slots yields
    [kv_heads, B, L, head_dim] directly, which batched matmuls consume without the
    permute-and-copy a slot-major layout would need on every layer of every step.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def bytes_per_block(self) -> int:
        per_token = self.k.shape[1] * self.k.shape[3] * self.k.element_size() * 2 * self.k.shape[0]
        return per_token * self.block_size

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Overwrite blocks' K and V with zeros in every layer (a purged tenant's KV must
        not stay readable in free blocks until they happen to be reused)."""
        if not block_ids:
            return
        ids = torch.tensor(sorted(block_ids), dtype=torch.long)
        slots = (ids[:, None] * self.block_size + torch.arange(self.block_size)).flatten()
        slots = slots.to(self.k.device)
        self.k.index_fill_(2, slots, 0)
        self.v.index_fill_(2, slots, 0)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V [T, kv_heads, head_dim] at flat slots [T]."""
        self.k[layer].index_copy_(1, slots, k.transpose(0, 1))
        self.v[layer].index_copy_(1, slots, v.transpose(0, 1))


@dataclass
class BlockInfo:
    """Bookkeeping for one physical block."""

    ref_count: int = 0
    hash: bytes | None = None
    scope: CacheScope | None = None
    doomed: bool = False
    """Invalidated while held: freed (not cached) when the last holder releases it."""


@dataclass
class InvalidationResult:
    """Counts reported back in KVInvalidated / TenantPurged acknowledgements."""

    blocks_freed: int = 0
    """Blocks returned to the free list now."""
    blocks_deferred: int = 0
    """Blocks still held by running sequences; freed when those finish (soft invalidation)."""
    sequences_aborted: int = 0
    """Running or waiting sequences aborted (hard purge / unload)."""
    aborted_request_ids: list[str] = field(default_factory=list)

    def merge(self, other: InvalidationResult) -> InvalidationResult:
        return InvalidationResult(
            self.blocks_freed + other.blocks_freed,
            self.blocks_deferred + other.blocks_deferred,
            self.sequences_aborted + other.sequences_aborted,
            self.aborted_request_ids + other.aborted_request_ids,
        )


class BlockPool:
    """Allocation, refcounting and prefix-cache index over the physical blocks.

    A block is in exactly one of: free list, held (ref_count > 0), or cached-idle (ref 0,
    published in the prefix cache, evictable in LRU order).
    """

    def __init__(self, num_blocks: int, policy: SharingPolicy = SharingPolicy.STRICT) -> None:
        self.num_blocks = num_blocks
        self.policy = policy
        self.blocks = [BlockInfo() for _ in range(num_blocks)]
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.idle: OrderedDict[int, None] = OrderedDict()
        self.index: dict[bytes, int] = {}
        self.hits = 0
        self.queries = 0
        self.hits_by_tenant: Counter[str] = Counter()
        self.cross_tenant_hits = 0
        """Hits on a block another tenant computed: only ever non-zero under
        `shared-base-prefix`, for adapter-free requests in one sharing scope."""

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached)."""
        return len(self.free) + len(self.idle)

    def allocate(self) -> int | None:
        """Take a free block, else evict the least recently used cached-idle block."""
        if self.free:
            bid = self.free.pop()
        elif self.idle:
            bid, _ = self.idle.popitem(last=False)
            self._unpublish(bid)
        else:
            return None
        info = self.blocks[bid]
        info.ref_count, info.doomed = 1, False
        return bid

    def retain(self, bid: int) -> None:
        info = self.blocks[bid]
        if info.ref_count == 0:
            self.idle.pop(bid, None)
        info.ref_count += 1

    def release(self, bid: int) -> None:
        """Drop one reference; cached blocks become evictable, others free."""
        info = self.blocks[bid]
        info.ref_count -= 1
        if info.ref_count > 0:
            return
        if info.hash is not None and not info.doomed:
            self.idle[bid] = None
        else:
            self._unpublish(bid)
            info.doomed = False
            self.free.append(bid)

    def _unpublish(self, bid: int) -> None:
        info = self.blocks[bid]
        if info.hash is not None and self.index.get(info.hash) == bid:
            del self.index[info.hash]
        info.hash, info.scope = None, None

    def publish(self, bid: int, h: bytes, scope: CacheScope) -> None:
        """Make a full, computed block findable by later requests (first writer wins)."""
        info = self.blocks[bid]
        if info.hash is not None or info.doomed or h in self.index:
            return
        info.hash, info.scope = h, scope
        self.index[h] = bid

    def lookup(self, h: bytes, request_scope: CacheScope) -> int | None:
        """Find a reusable block for a hash; `decide` must say REUSE."""
        self.queries += 1
        bid = self.index.get(h)
        if bid is None:
            return None
        scope = self.blocks[bid].scope
        assert scope is not None
        if decide(scope, request_scope, self.policy) is not KvReuse.REUSE:
            return None
        self.hits += 1
        self.hits_by_tenant[request_scope.tenant_key] += 1
        if scope.tenant_key != request_scope.tenant_key:
            self.cross_tenant_hits += 1
        return bid

    def peek(self, h: bytes, request_scope: CacheScope) -> int | None:
        """`lookup` without counting a query or a hit (a match weighing its options)."""
        bid = self.index.get(h)
        if bid is None:
            return None
        scope = self.blocks[bid].scope
        assert scope is not None
        return bid if decide(scope, request_scope, self.policy) is KvReuse.REUSE else None

    def forget_hits(self, request_scope: CacheScope, hits: int) -> None:
        """Take back the hits of a match that was undone (a deferred admission re-matches
        later, and each block must count once)."""
        self.hits -= hits
        self.hits_by_tenant[request_scope.tenant_key] -= hits
        if not self.hits_by_tenant[request_scope.tenant_key]:
            del self.hits_by_tenant[request_scope.tenant_key]

    def invalidate(self, predicate: Callable[[CacheScope], bool]) -> tuple[int, list[int]]:
        """Unpublish every block whose scope matches; free idle ones now.

        Returns (blocks freed now, ids of matching blocks still held by sequences). Held
        blocks are marked doomed so they are freed, not re-cached, on release.
        """
        freed = 0
        held: list[int] = []
        for bid, info in enumerate(self.blocks):
            if info.scope is None or not predicate(info.scope):
                continue
            if info.ref_count == 0:
                self.idle.pop(bid, None)
                self._unpublish(bid)
                self.free.append(bid)
                freed += 1
            else:
                self._unpublish(bid)
                info.doomed = True
                held.append(bid)
        return freed, held
