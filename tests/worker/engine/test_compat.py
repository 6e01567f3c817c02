"""`decide` over its whole input grid, checked against an independently written table."""

from __future__ import annotations

import itertools

import pytest

from services.worker.engine import AdapterDigest, CacheScope, KvReuse, SharingPolicy, decide

BASES = ("base-1", "base-2")
ADAPTERS = (None, AdapterDigest("a1" * 32, "c" * 64), AdapterDigest("a2" * 32, "c" * 64))
TENANTS = ("acme", "globex")
SHARING = (None, "public-docs", "eu-health")

SCOPES = [CacheScope(*v) for v in itertools.product(BASES, ADAPTERS, TENANTS, SHARING)]
GRID = list(itertools.product(SCOPES, SCOPES, SharingPolicy))


def expected(block: CacheScope, req: CacheScope, policy: SharingPolicy) -> KvReuse:
    """The policy as stated in the architecture, one case per line."""
    same_base = block.base_digest == req.base_digest
    same_adapter = block.adapter_digest == req.adapter_digest
    same_tenant = block.tenant_key == req.tenant_key
    both_share = block.sharing_scope is not None and block.sharing_scope == req.sharing_scope
    if not same_base:
        return KvReuse.REJECT
    if same_adapter and same_tenant:
        return KvReuse.REUSE
    if (policy is SharingPolicy.SHARED_BASE_PREFIX and same_adapter
            and req.adapter_digest is None and both_share):
        return KvReuse.REUSE
    return KvReuse.RECOMPUTE


@pytest.mark.parametrize(("block", "req", "policy"), GRID)
def test_decide_grid(block, req, policy):
    assert decide(block, req, policy) is expected(block, req, policy)


def test_grid_is_complete():
    assert len(GRID) == (2 * 3 * 2 * 3) ** 2 * 2


def test_strict_never_crosses_tenants_or_adapters():
    for block, req, _ in GRID:
        if block.tenant_key != req.tenant_key or block.adapter_digest != req.adapter_digest:
            assert decide(block, req, SharingPolicy.STRICT) is not KvReuse.REUSE


def test_partition_key_separates_what_decide_separates():
    """Two scopes share a hash partition only if decide lets them reuse each other."""
    for block, req, policy in GRID:
        if block.partition_key(policy) == req.partition_key(policy):
            assert decide(block, req, policy) is KvReuse.REUSE
