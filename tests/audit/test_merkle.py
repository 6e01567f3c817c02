"""RFC 6962 tree, proofs and compact range, checked against the RFC's definitions."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest

from services.audit import merkle
from services.audit.merkle import (
    CompactRange,
    inclusion_path,
    leaf_hash,
    node_hash,
    root_from_hashes,
    root_from_inclusion,
    tree_root,
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


def _signed_proof(tmp_index: int = 5, n: int = 12) -> tuple[dict, bytes]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    key = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    leaves = [json.dumps({"event_id": f"id-{i}"}).encode() for i in range(n)]
    hashes = [leaf_hash(leaf) for leaf in leaves]
    root = root_from_hashes(hashes)
    head = hashlib.sha256(b"head").digest()
    message = merkle.checkpoint_message("t.adapter-events", 1, n, root, head)
    document = {
        "format": merkle.PROOF_FORMAT, "event_id": f"id-{tmp_index}",
        "topic": "t.adapter-events", "partition": 1,
        "leaf": base64.b64encode(leaves[tmp_index]).decode(),
        "leaf_hash": hashes[tmp_index].hex(), "index": tmp_index, "tree_size": n,
        "audit_path": [h.hex() for h in inclusion_path(hashes, tmp_index)],
        "checkpoint": {"tree_size": n, "root": root.hex(), "chain_head": head.hex(),
                       "public_key": public.hex(), "signature": key.sign(message).hex()},
    }
    return document, public


def test_standalone_verifier_accepts_a_good_proof_and_names_each_tampering() -> None:
    document, public = _signed_proof()
    assert merkle.verify_proof(document, public) == []
    forged = json.loads(json.dumps(document))
    forged["leaf"] = base64.b64encode(b'{"event_id": "id-5", "x": 1}').decode()
    forged.pop("leaf_hash")
    assert any("audit path" in p for p in merkle.verify_proof(forged, public))
    moved = json.loads(json.dumps(document))
    moved["checkpoint"]["root"] = "00" * 32
    problems = merkle.verify_proof(moved, public)
    assert any("audit path" in p for p in problems) and any("signature" in p for p in problems)
    other_key = json.loads(json.dumps(document))
    assert any("trusted" in p for p in merkle.verify_proof(other_key, bytes(32)))


def test_standalone_verifier_runs_as_a_script(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    document, public = _signed_proof()
    path = tmp_path / "proof.json"
    path.write_text(json.dumps(document))
    script = merkle.__file__
    ok = subprocess.run([sys.executable, script, str(path), "--public-key", public.hex()],
                        capture_output=True, text=True, cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    document["index"] = 4
    path.write_text(json.dumps(document))
    bad = subprocess.run([sys.executable, script, str(path)], capture_output=True, text=True,
                         cwd=tmp_path)
    assert bad.returncode == 1 and "INVALID" in bad.stdout
