"""RFC 6962 Merkle trees over one partition's chain, and a standalone proof verifier.

Why a Merkle tree on top of the hash chain: the chain proves order and integrity to
someone who holds the whole log; a signed tree head (a *checkpoint*) lets a third party
check that one event is in the log from a proof of log2(n) hashes, without the database
and without trusting the server (the RFC 6962 / Trillian model).

- leaf hash = SHA-256(0x00 || leaf), node hash = SHA-256(0x01 || left || right); the
  prefixes keep a leaf from ever being passed off as an inner node.
- the tree over n leaves splits at the largest power of two below n (RFC 6962 §2.1), so
  trees of any size are defined and the tree of the first k leaves never changes.
- a leaf is one event's canonical bytes exactly as they were on the log.
- a checkpoint signs (topic, partition, tree size, root, chain head) with Ed25519, so it
  also pins the per-partition hash chain at that size.

This module imports only the standard library (and `cryptography`, lazily, for the
signature), so it can be copied out and run on its own:

    python merkle.py proof.json [--public-key HEX]
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

LEAF_PREFIX = b"\x00"
NODE_PREFIX = b"\x01"
CHECKPOINT_DOMAIN = b"loraplane-audit-checkpoint/v1\n"
PROOF_FORMAT = "loraplane-inclusion-proof/v1"


def leaf_hash(leaf: bytes) -> bytes:
    return hashlib.sha256(LEAF_PREFIX + leaf).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(NODE_PREFIX + left + right).digest()


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


def root_from_inclusion(leaf_digest: bytes, index: int, size: int,
                        path: Sequence[bytes]) -> bytes:
    """The root that `path` proves `leaf_digest` at `index` into (RFC 9162 §2.1.3.2).

    Raises ValueError when the path has the wrong length for (index, size), so a proof
    can never be stretched to a different position.
    """
    if not 0 <= index < size:
        raise ValueError(f"index {index} outside a tree of size {size}")
    fn, sn = index, size - 1
    r = leaf_digest
    for p in path:
        if sn == 0:
            raise ValueError("audit path is too long")
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn & 1 == 0 and fn != 0:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ValueError("audit path is too short")
    return r


def verify_inclusion(leaf: bytes, index: int, size: int, path: Sequence[bytes],
                     root: bytes) -> bool:
    try:
        return root_from_inclusion(leaf_hash(leaf), index, size, path) == root
    except ValueError:
        return False


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


def checkpoint_message(topic: str, partition: int, tree_size: int, root: bytes,
                       chain_head: bytes) -> bytes:
    """The exact bytes a checkpoint signature covers (one field per line, after a domain tag)."""
    if "\n" in topic:
        raise ValueError("topic names cannot contain a newline")
    return CHECKPOINT_DOMAIN + (f"{topic}\n{partition}\n{tree_size}\n{root.hex()}\n"
                                f"{chain_head.hex()}\n").encode()


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def verify_proof(document: dict[str, Any], trusted_public_key: bytes | None = None
                 ) -> list[str]:
    """Check an inclusion proof document; returns the problems found (empty: valid).

    The proof is only as good as the key: pass the log's published public key as
    `trusted_public_key`, otherwise the key inside the document is taken on trust.
    """
    problems: list[str] = []
    try:
        if document.get("format") != PROOF_FORMAT:
            return [f"unknown proof format {document.get('format')!r}"]
        leaf = base64.b64decode(document["leaf"], validate=True)
        index, size = int(document["index"]), int(document["tree_size"])
        path = [bytes.fromhex(h) for h in document["audit_path"]]
        cp = document["checkpoint"]
        root = bytes.fromhex(cp["root"])
        public_key = bytes.fromhex(cp["public_key"])
        signature = bytes.fromhex(cp["signature"])
        chain_head = bytes.fromhex(cp["chain_head"])
        topic, partition = str(document["topic"]), int(document["partition"])
        cp_size = int(cp["tree_size"])
    except (KeyError, TypeError, ValueError) as exc:
        return [f"malformed proof: {exc!r}"]
    if document.get("leaf_hash") not in (None, leaf_hash(leaf).hex()):
        problems.append("leaf_hash does not match the leaf bytes")
    if cp_size != size:
        problems.append(f"proof is for tree size {size}, checkpoint signs {cp_size}")
    if not verify_inclusion(leaf, index, size, path, root):
        problems.append("audit path does not lead from the leaf to the checkpoint root")
    if trusted_public_key is not None and public_key != trusted_public_key:
        problems.append("checkpoint is signed by a key other than the trusted one")
    message = checkpoint_message(topic, partition, cp_size, root, chain_head)
    if not verify_signature(public_key, signature, message):
        problems.append("checkpoint signature is not valid")
    try:
        event = json.loads(leaf)
        if "event_id" in document and str(event.get("event_id")) != document["event_id"]:
            problems.append("leaf is not the event the proof names")
    except (ValueError, AttributeError):
        problems.append("leaf is not a JSON event")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """`python merkle.py PROOF.json [--public-key HEX]`: exit 0 when the proof holds."""
    args = list(sys.argv[1:] if argv is None else argv)
    trusted = None
    if "--public-key" in args:
        i = args.index("--public-key")
        trusted = bytes.fromhex(args[i + 1])
        del args[i:i + 2]
    if len(args) != 1:
        print("usage: merkle.py PROOF.json [--public-key HEX]", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        problems = verify_proof(json.load(f), trusted)
    for problem in problems:
        print(f"INVALID: {problem}")
    if not problems:
        print("OK: the event is included in the signed checkpoint")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
