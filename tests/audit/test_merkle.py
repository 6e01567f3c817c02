"""RFC 6962 tree, inclusion and consistency proofs and the compact range, checked
against the RFC's definitions."""

from __future__ import annotations

import hashlib

import pytest

from services.audit.merkle import (
    CompactRange,
    consistency_path,
    inclusion_path,
    leaf_hash,
    node_hash,
    root_from_hashes,
    root_from_inclusion,
    tree_root,
    verify_consistency,
    verify_inclusion,
)


def reference_root(leaves: list[bytes]) -> bytes:
    """MTH straight from RFC 6962 §2.1, written independently of the module."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    if len(leaves) == 1:
        return hashlib.sha256(b"\x00" + leaves[0]).digest()
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    return hashlib.sha256(b"\x01" + reference_root(leaves[:k])
                          + reference_root(leaves[k:])).digest()


LEAVES = [f"event-{i}".encode() for i in range(40)]


def test_known_answer_for_the_empty_and_one_leaf_trees() -> None:
    assert tree_root([]).hex() == hashlib.sha256(b"").hexdigest()
    assert tree_root([b""]).hex() == (
        "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d")


@pytest.mark.parametrize("n", range(1, 41))
def test_root_matches_the_rfc_definition_for_every_size(n: int) -> None:
    assert tree_root(LEAVES[:n]) == reference_root(LEAVES[:n])


@pytest.mark.parametrize("n", range(0, 41))
def test_compact_range_root_equals_the_tree_root(n: int) -> None:
    compact = CompactRange()
    for leaf in LEAVES[:n]:
        compact.append(leaf_hash(leaf))
    assert compact.size == n
    assert compact.root() == tree_root(LEAVES[:n])
    again = CompactRange.from_bytes(n, compact.to_bytes())
    assert again.root() == compact.root()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 9, 16, 17, 31, 40])
def test_every_inclusion_path_verifies_and_only_at_its_own_index(n: int) -> None:
    hashes = [leaf_hash(leaf) for leaf in LEAVES[:n]]
    root = root_from_hashes(hashes)
    for i in range(n):
        path = inclusion_path(hashes, i)
        assert len(path) <= n.bit_length()
        assert verify_inclusion(LEAVES[i], i, n, path, root)
        assert not verify_inclusion(LEAVES[i] + b"x", i, n, path, root)
        if n > 1:
            assert not verify_inclusion(LEAVES[i], (i + 1) % n, n, path, root)
            assert not verify_inclusion(LEAVES[i], i, n, path[:-1], root)
            assert not verify_inclusion(LEAVES[i], i, n, [*path, root], root)


def test_prefixes_keep_leaves_and_nodes_apart() -> None:
    a, b = leaf_hash(b"a"), leaf_hash(b"b")
    assert tree_root([b"a", b"b"]) == node_hash(a, b)
    assert tree_root([a + b]) != tree_root([b"a", b"b"])  # second preimage is refused


def test_out_of_range_index_is_refused() -> None:
    with pytest.raises(ValueError):
        root_from_inclusion(leaf_hash(b"a"), 3, 3, [])
    with pytest.raises(ValueError):
        inclusion_path([leaf_hash(b"a")], 1)


def reference_consistency(m: int, leaves: list[bytes], complete: bool = True) -> list[bytes]:
    """SUBPROOF(m, D[n], b) of RFC 6962 §2.1.2 over raw leaves, written independently."""
    n = len(leaves)
    if m == n:
        return [] if complete else [reference_root(leaves)]
    k = 1
    while k * 2 < n:
        k *= 2
    if m <= k:
        return [*reference_consistency(m, leaves[:k], complete), reference_root(leaves[k:])]
    return [*reference_consistency(m - k, leaves[k:], False), reference_root(leaves[:k])]


@pytest.mark.parametrize("n", range(1, 41))
def test_every_consistency_proof_matches_the_rfc_and_verifies(n: int) -> None:
    hashes = [leaf_hash(leaf) for leaf in LEAVES[:n]]
    new_root = root_from_hashes(hashes)
    for m in range(0, n + 1):
        path = consistency_path(hashes, m)
        if 0 < m < n:
            assert path == reference_consistency(m, LEAVES[:n])
        old_root = root_from_hashes(hashes[:m])
        assert verify_consistency(m, n, old_root, new_root, path)
        if 0 < m < n:
            assert not verify_consistency(m, n, new_root, new_root, path)
            assert not verify_consistency(m, n, old_root, old_root, path)
            assert not verify_consistency(m, n, old_root, new_root, path[:-1])
            assert not verify_consistency(m, n, old_root, new_root, [*path, new_root])
            if m + 1 < n:  # the same path never proves another pair of sizes
                assert not verify_consistency(m + 1, n, old_root, new_root, path)


def test_a_rewritten_history_has_no_consistency_proof() -> None:
    hashes = [leaf_hash(leaf) for leaf in LEAVES[:20]]
    forked = [*hashes[:6], leaf_hash(b"forged"), *hashes[7:]]
    old_root = root_from_hashes(hashes[:10])
    path = consistency_path(forked, 10)
    assert not verify_consistency(10, 20, old_root, root_from_hashes(forked), path)


def test_consistency_edge_cases() -> None:
    root = tree_root(LEAVES[:4])
    assert verify_consistency(4, 4, root, root, [])
    assert not verify_consistency(4, 4, root, tree_root(LEAVES[:3]), [])
    assert not verify_consistency(4, 4, root, root, [root])
    assert verify_consistency(0, 4, tree_root([]), root, [])
    assert not verify_consistency(5, 4, root, root, [])
    with pytest.raises(ValueError):
        consistency_path([leaf_hash(b"a")], 2)
