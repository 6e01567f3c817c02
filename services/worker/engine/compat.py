"""KV-cache compatibility: may a cached block be served to a request?

This is the one place that answers the question, as a pure function with no state, so it
can be tested over its whole input grid and audited. Everything that reuses KV (the prefix
cache, future cross-instance transfer) asks `decide` first.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .adapter import AdapterDigest


class KvReuse(enum.Enum):
    """What to do with a cached block for a given request."""

    REUSE = "reuse"
    """The block was computed under an equivalent scope: serve it."""
    RECOMPUTE = "recompute"
    """Same base model but the scope forbids sharing: compute the request's own KV."""
    REJECT = "reject"
    """The block belongs to another base model: it can never be valid for this request."""


class SharingPolicy(enum.Enum):
    """How far KV blocks may be shared."""

    STRICT = "strict"
    """Never across tenants or adapters (the default)."""
    SHARED_BASE_PREFIX = "shared-base-prefix"
    """Cross-tenant reuse only for adapter-free requests whose tenants both opted in to the
    same sharing (compliance) scope."""


@dataclass(frozen=True, slots=True)
class CacheScope:
    """The scope a KV block was computed under, or a request runs under.

    `adapter_digest` is the content digest of the adapter version (None = base model only);
    it is never an adapter name, because names get reused by new versions. `tenant_key` is
    the tenant isolation key. `sharing_scope` is the tenant's compliance scope for
    cross-tenant base-prefix sharing; None means the tenant shares with nobody.
    """

    base_digest: str
    adapter_digest: AdapterDigest | None
    tenant_key: str
    sharing_scope: str | None = None

    def partition_key(self, policy: SharingPolicy) -> bytes:
        """The scope part of a prefix-cache block hash.

        Blocks in different partitions can never be found by each other's lookups. Under
        `shared-base-prefix`, adapter-free requests of tenants in one sharing scope land in
        one partition; everything else is partitioned per tenant and adapter.
        """
        adapter = self.adapter_digest.key if self.adapter_digest is not None else "base"
        if (
            policy is SharingPolicy.SHARED_BASE_PREFIX
            and self.adapter_digest is None
            and self.sharing_scope is not None
        ):
            owner = "share:" + self.sharing_scope
        else:
            owner = "tenant:" + self.tenant_key
        return "\x1f".join((self.base_digest, adapter, owner)).encode()


def decide(block_scope: CacheScope, request_scope: CacheScope, policy: SharingPolicy) -> KvReuse:
    """Decide whether a block computed under `block_scope` may serve `request_scope`.

    Rules, in order:
    1. A different base model's KV is meaningless for this request: REJECT.
    2. A different adapter (or adapter vs. base) changes every layer's KV: RECOMPUTE.
    3. Same tenant (and same adapter): REUSE.
    4. Different tenants: REUSE only under `shared-base-prefix`, only without an adapter,
       and only if both tenants declared the same non-empty sharing scope; else RECOMPUTE.
    """
    if block_scope.base_digest != request_scope.base_digest:
        return KvReuse.REJECT
    if block_scope.adapter_digest != request_scope.adapter_digest:
        return KvReuse.RECOMPUTE
    if block_scope.tenant_key == request_scope.tenant_key:
        return KvReuse.REUSE
    if (
        policy is SharingPolicy.SHARED_BASE_PREFIX
        and request_scope.adapter_digest is None
        and block_scope.sharing_scope is not None
        and block_scope.sharing_scope == request_scope.sharing_scope
    ):
        return KvReuse.REUSE
    return KvReuse.RECOMPUTE
