"""RFC 6962 Merkle trees over one partition's chain: the builder side.

Why a Merkle tree on top of the hash chain: the chain proves order and integrity to
someone who holds the whole log; a signed tree head (a *checkpoint*) lets a third party
check that one event is in the log from a proof of log2(n) hashes, and that today's log
extends the one they saw last month (a consistency proof), without the database and
without trusting the server (the RFC 6962 / Trillian model).

- leaf hash = SHA-256(0x00 || leaf), node hash = SHA-256(0x01 || left || right); the
  prefixes keep a leaf from ever being passed off as an inner node.
- the tree over n leaves splits at the largest power of two below n (RFC 6962 §2.1), so
  trees of any size are defined and the tree of the first k leaves never changes.
- a leaf is one event's stored bytes (see `services.audit.sealing`).

The hashing and the proof *checks* live in `services.audit.verifier`, the stand-alone
file auditors run; this module builds roots and proofs from leaf hashes and keeps the
compact range the projector extends.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from services.audit.verifier import (
    leaf_hash,
    node_hash,
    root_from_inclusion,
    verify_consistency,
    verify_inclusion,
)

__all__ = ["CompactRange", "consistency_path", "empty_root", "inclusion_path", "leaf_hash",
           "node_hash", "root_from_hashes", "root_from_inclusion", "tree_root",
           "verify_consistency", "verify_inclusion"]


def empty_root() -> bytes:
    """MTH({}) = SHA-256() (RFC 6962 §2.1)."""
    return hashlib.sha256(b"").digest()


def _split(n: int) -> int:
    """Largest power of two strictly smaller than n (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def root_from_hashes(hashes: Sequence[bytes]) -> bytes:
    """MTH over already leaf-hashed entries, by the RFC's recursive definition."""
    n = len(hashes)
    if n == 0:
        return empty_root()
    if n == 1:
        return hashes[0]
    k = _split(n)
    return node_hash(root_from_hashes(hashes[:k]), root_from_hashes(hashes[k:]))


def tree_root(leaves: Iterable[bytes]) -> bytes:
    return root_from_hashes([leaf_hash(leaf) for leaf in leaves])


def inclusion_path(hashes: Sequence[bytes], index: int) -> list[bytes]:
    """PATH(m, D[n]) of RFC 6962 §2.1.1 over leaf hashes; bottom-up sibling hashes."""
    n = len(hashes)
    if not 0 <= index < n:
        raise ValueError(f"index {index} outside a tree of size {n}")
    if n == 1:
        return []
    k = _split(n)
    if index < k:
        return [*inclusion_path(hashes[:k], index), root_from_hashes(hashes[k:])]
    return [*inclusion_path(hashes[k:], index - k), root_from_hashes(hashes[:k])]


def consistency_path(hashes: Sequence[bytes], old_size: int) -> list[bytes]:
    """PROOF(m, D[n]) of RFC 6962 §2.1.2 over leaf hashes: that the first `old_size`
    leaves' tree is a prefix of the tree over all of `hashes`."""
    n = len(hashes)
    if not 0 <= old_size <= n:
        raise ValueError(f"no tree of size {old_size} inside a tree of size {n}")
    if old_size in (0, n):
        return []

    def subproof(m: int, leaves: Sequence[bytes], complete: bool) -> list[bytes]:
        if m == len(leaves):
            return [] if complete else [root_from_hashes(leaves)]
        k = _split(len(leaves))
        if m <= k:
            return [*subproof(m, leaves[:k], complete), root_from_hashes(leaves[k:])]
        return [*subproof(m - k, leaves[k:], False), root_from_hashes(leaves[:k])]

    return subproof(old_size, hashes, True)


class CompactRange:
    """Roots of the perfect subtrees covering the first `size` leaves (largest first).

    Appending is O(log n) amortised and the root of the current size folds these from the
    right, which equals the RFC's MTH. The projector keeps one per partition in
    PostgreSQL, so a checkpoint never rereads the log.
    """

    def __init__(self, size: int = 0, frontier: Sequence[bytes] = ()) -> None:
        if len(frontier) != bin(size).count("1"):
            raise ValueError(f"a tree of size {size} needs {bin(size).count('1')} subtree roots")
        self.size = size
        self.frontier = list(frontier)

    def append(self, digest: bytes) -> None:
        """Add one leaf hash."""
        self.frontier.append(digest)
        self.size += 1
        merges = (self.size & -self.size).bit_length() - 1  # trailing zeros of the new size
        for _ in range(merges):
            right = self.frontier.pop()
            left = self.frontier.pop()
            self.frontier.append(node_hash(left, right))

    def root(self) -> bytes:
        if not self.frontier:
            return empty_root()
        r = self.frontier[-1]
        for left in reversed(self.frontier[:-1]):
            r = node_hash(left, r)
        return r

    def to_bytes(self) -> bytes:
        return b"".join(self.frontier)

    @classmethod
    def from_bytes(cls, size: int, blob: bytes) -> CompactRange:
        return cls(size, [blob[i:i + 32] for i in range(0, len(blob), 32)])
