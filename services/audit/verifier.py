"""Stand-alone verifier of loraplane audit evidence, for auditors and witnesses.

This file imports only the Python standard library and `cryptography` (for Ed25519), so
it can be copied out of the repository and run without the project or its database:

    python verifier.py checkpoint NOTE_FILE --key VKEY
    python verifier.py inclusion PROOF.json --key VKEY
    python verifier.py consistency PROOF.json --key VKEY

VKEY is the log's verifier key in signed-note form, `name+hash+base64` (what
`loraplane audit public-key` prints). Trust comes from that key alone: a proof carries
the signed checkpoint it relies on, but never a key, so it cannot vouch for itself.

What it checks, and the standards it follows:
- Checkpoints are C2SP tlog-checkpoint signed notes (c2sp.org/tlog-checkpoint,
  c2sp.org/signed-note): an origin line, the tree size, the base64 RFC 6962 root, then a
  blank line and signature lines `— <key name> base64(key hash || Ed25519 signature)`.
  The key hash is the first 4 bytes of SHA-256(name || "\\n" || 0x01 || public key).
  The same format is read by golang.org/x/mod/sumdb/note and transparency-log witnesses.
- Trees are RFC 6962 Merkle trees: leaf hash SHA-256(0x00 || leaf), node hash
  SHA-256(0x01 || left || right), split at the largest power of two below n.
- Inclusion proofs are verified as in RFC 9162 §2.1.3.2, consistency proofs as in
  RFC 9162 §2.1.4.2 (both compatible with golang.org/x/mod/sumdb/tlog).
- A leaf is one stored event: its bytes exactly as the audit store holds them (the log's
  bytes, with personal fields as sealed tokens; see the audit README).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

LEAF_PREFIX = b"\x00"
NODE_PREFIX = b"\x01"
ED25519 = b"\x01"
"""Signed-note signature type of Ed25519 keys."""
SIGNATURE_PREFIX = "\u2014 "
"""An em dash and a space start every signature line of a note."""
INCLUSION_FORMAT = "loraplane-inclusion-proof/v2"
CONSISTENCY_FORMAT = "loraplane-consistency-proof/v1"


class EvidenceError(ValueError):
    """The evidence does not hold, or is not well formed; the message says which part."""


# --- RFC 6962 hashing and proofs ---------------------------------------------------------


def leaf_hash(leaf: bytes) -> bytes:
    h = hashlib.sha256(LEAF_PREFIX)
    h.update(leaf)
    return h.digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(NODE_PREFIX + left + right).digest()


def root_from_inclusion(leaf_digest: bytes, index: int, size: int,
                        path: Sequence[bytes]) -> bytes:
    """The root `path` proves `leaf_digest` at `index` into (RFC 9162 §2.1.3.2).

    Raises EvidenceError when the path has the wrong length for (index, size), so a proof
    can never be stretched to another position.
    """
    if not 0 <= index < size:
        raise EvidenceError(f"index {index} outside a tree of size {size}")
    fn, sn = index, size - 1
    r = leaf_digest
    for p in path:
        if sn == 0:
            raise EvidenceError("inclusion path is too long")
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
        raise EvidenceError("inclusion path is too short")
    return r


def verify_inclusion(leaf: bytes, index: int, size: int, path: Sequence[bytes],
                     root: bytes) -> bool:
    try:
        return root_from_inclusion(leaf_hash(leaf), index, size, path) == root
    except EvidenceError:
        return False


def verify_consistency(old_size: int, new_size: int, old_root: bytes, new_root: bytes,
                       path: Sequence[bytes]) -> bool:
    """RFC 9162 §2.1.4.2: does the tree of `new_size` extend the one of `old_size`?

    Equal sizes need an empty proof and equal roots; every tree extends the empty one.
    """
    if not 0 <= old_size <= new_size:
        return False
    if old_size == new_size:
        return not path and old_root == new_root
    if old_size == 0:
        return not path
    if not path:
        return False
    hashes = list(path)
    if old_size & (old_size - 1) == 0:  # a power of two: the old root is a subtree
        hashes.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = hashes[0]
    for c in hashes[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while fn & 1 == 0 and fn != 0:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == old_root and sr == new_root


# --- signed notes (c2sp.org/signed-note) -------------------------------------------------


def valid_key_name(name: str) -> bool:
    return bool(name) and not any(c.isspace() for c in name) and "+" not in name


def key_hash(name: str, public_key: bytes) -> bytes:
    """The 4-byte id of an Ed25519 note key: SHA-256(name || "\\n" || 0x01 || key)[:4]."""
    return hashlib.sha256(name.encode() + b"\n" + ED25519 + public_key).digest()[:4]


def verifier_key(name: str, public_key: bytes) -> str:
    """`name+hash+base64(0x01 || key)`: how a note verifier key is written and pinned."""
    if not valid_key_name(name):
        raise EvidenceError(f"invalid key name {name!r}")
    return (f"{name}+{key_hash(name, public_key).hex()}+"
            f"{base64.b64encode(ED25519 + public_key).decode()}")


@dataclass(frozen=True)
class NoteKey:
    """A trusted Ed25519 note verifier key."""

    name: str
    hash: bytes
    public_key: bytes

    @property
    def vkey(self) -> str:
        return verifier_key(self.name, self.public_key)


def parse_verifier_key(vkey: str) -> NoteKey:
    try:
        name, _, rest = vkey.strip().partition("+")
        hash_hex, _, key64 = rest.partition("+")
        raw = base64.b64decode(key64, validate=True)
        declared = bytes.fromhex(hash_hex)
    except (ValueError, binascii.Error) as exc:
        raise EvidenceError(f"not a note verifier key (name+hash+base64): {vkey!r}") from exc
    if len(hash_hex) != 8 or not valid_key_name(name) or raw[:1] != ED25519 or len(raw) != 33:
        raise EvidenceError(f"not an Ed25519 note verifier key: {vkey!r}")
    if key_hash(name, raw[1:]) != declared:
        raise EvidenceError(f"verifier key hash does not match its name and key: {vkey!r}")
    return NoteKey(name, declared, raw[1:])


def sign_note(text: str, name: str, sign: Any, public_key: bytes) -> str:
    """`text` with one signature line; `sign(message) -> 64-byte Ed25519 signature`."""
    if not text.endswith("\n"):
        raise EvidenceError("note text must end with a newline")
    signature = sign(text.encode())
    blob = base64.b64encode(key_hash(name, public_key) + signature).decode()
    return f"{text}\n{SIGNATURE_PREFIX}{name} {blob}\n"


@dataclass(frozen=True)
class Signature:
    name: str
    hash: bytes
    signature: bytes


def split_note(note: str) -> tuple[str, list[Signature]]:
    """(text, signature lines) of a signed note, checking its shape only."""
    for ch in note:
        if ord(ch) < 0x20 and ch != "\n":
            raise EvidenceError("note contains a control character")
    split = note.rfind("\n\n")
    if split < 0:
        raise EvidenceError("note has no signature block")
    text, block = note[:split + 1], note[split + 2:]
    if not block.endswith("\n"):
        raise EvidenceError("note signature block must end with a newline")
    signatures = []
    for line in block[:-1].split("\n"):
        if not line.startswith(SIGNATURE_PREFIX):
            raise EvidenceError(f"not a signature line: {line!r}")
        name, _, b64 = line[len(SIGNATURE_PREFIX):].partition(" ")
        try:
            raw = base64.b64decode(b64, validate=True)
        except binascii.Error as exc:
            raise EvidenceError(f"signature of {name!r} is not base64") from exc
        if not valid_key_name(name) or len(raw) < 5:
            raise EvidenceError(f"malformed signature line: {line!r}")
        signatures.append(Signature(name, raw[:4], raw[4:]))
    return text, signatures


def open_note(note: str, trusted: Iterable[NoteKey]) -> tuple[str, list[NoteKey]]:
    """The note's text and the trusted keys that signed it. Raises EvidenceError when no
    trusted key signed it, or when a signature by a trusted key is invalid."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    text, signatures = split_note(note)
    keys = {(k.name, k.hash): k for k in trusted}
    good: list[NoteKey] = []
    for sig in signatures:
        key = keys.get((sig.name, sig.hash))
        if key is None or key in good:
            continue  # unknown signers (e.g. witness cosignatures) are ignored
        try:
            Ed25519PublicKey.from_public_bytes(key.public_key).verify(sig.signature,
                                                                      text.encode())
        except (InvalidSignature, ValueError):
            raise EvidenceError(f"signature by {key.name} is not valid") from None
        good.append(key)
    if not good:
        named = ", ".join(f"{s.name}+{s.hash.hex()}" for s in signatures)
        raise EvidenceError(f"note is not signed by a trusted key (signed by: {named})")
    return text, good


# --- checkpoints (c2sp.org/tlog-checkpoint) ----------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()

    def text(self) -> str:
        if not valid_key_name(self.origin):
            raise EvidenceError(f"origin {self.origin!r} contains a space or '+'")
        if len(self.root) != 32 or self.size < 0:
            raise EvidenceError("a checkpoint needs a 32-byte root and a size >= 0")
        lines = [self.origin, str(self.size), base64.b64encode(self.root).decode(),
                 *self.extensions]
        if any(not line or "\n" in line for line in lines):
            raise EvidenceError("checkpoint lines must be non-empty single lines")
        return "".join(f"{line}\n" for line in lines)


def parse_checkpoint(text: str) -> Checkpoint:
    lines = text.split("\n")
    if len(lines) < 4 or lines[-1] != "" or any(not line for line in lines[:-1]):
        raise EvidenceError("a checkpoint is at least three non-empty lines")
    origin, size, root64, *extensions = lines[:-1]
    if not size.isdigit() or (size != "0" and size.startswith("0")):
        raise EvidenceError(f"tree size {size!r} is not a decimal number")
    try:
        root = base64.b64decode(root64, validate=True)
    except binascii.Error as exc:
        raise EvidenceError("root hash is not base64") from exc
    if len(root) != 32:
        raise EvidenceError("root hash is not 32 bytes")
    return Checkpoint(origin, int(size), root, tuple(extensions))


def open_checkpoint(note: str, trusted: Iterable[NoteKey]) -> Checkpoint:
    """A checkpoint whose note a trusted key signed, the key named like the origin when
    one of the trusted keys is (C2SP: the log's key name SHOULD match the origin)."""
    text, signers = open_note(note, trusted)
    checkpoint = parse_checkpoint(text)
    if not any(k.name == checkpoint.origin for k in signers):
        raise EvidenceError(f"checkpoint of {checkpoint.origin} is signed by "
                            f"{', '.join(k.name for k in signers)}, not by the log's key")
    return checkpoint


# --- proof documents ---------------------------------------------------------------------


def _hashes(values: Sequence[str]) -> list[bytes]:
    hashes = [base64.b64decode(v, validate=True) for v in values]
    if any(len(h) != 32 for h in hashes):
        raise EvidenceError("every proof hash must be 32 bytes")
    return hashes


def check_inclusion(document: dict[str, Any], trusted: Iterable[NoteKey]) -> Checkpoint:
    """Check an inclusion proof; returns its checkpoint. Raises EvidenceError."""
    if document.get("format") != INCLUSION_FORMAT:
        raise EvidenceError(f"unknown proof format {document.get('format')!r}")
    try:
        leaf = base64.b64decode(document["leaf"], validate=True)
        index = int(document["leaf_index"])
        path = _hashes(document["inclusion_path"])
        note = str(document["checkpoint"])
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise EvidenceError(f"malformed proof: {exc!r}") from exc
    checkpoint = open_checkpoint(note, trusted)
    if not verify_inclusion(leaf, index, checkpoint.size, path, checkpoint.root):
        raise EvidenceError("inclusion path does not lead from the leaf to the checkpoint root")
    try:
        event = json.loads(leaf)
    except ValueError:
        raise EvidenceError("leaf is not a JSON event") from None
    if "event_id" in document and str(event.get("event_id")) != document["event_id"]:
        raise EvidenceError("leaf is not the event the proof names")
    return checkpoint


def check_consistency(document: dict[str, Any],
                      trusted: Iterable[NoteKey]) -> tuple[Checkpoint, Checkpoint]:
    """Check a consistency proof; returns (old, new) checkpoints. Raises EvidenceError."""
    if document.get("format") != CONSISTENCY_FORMAT:
        raise EvidenceError(f"unknown proof format {document.get('format')!r}")
    trusted = list(trusted)
    try:
        old = open_checkpoint(str(document["old_checkpoint"]), trusted)
        new = open_checkpoint(str(document["new_checkpoint"]), trusted)
        path = _hashes(document["consistency_path"])
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise EvidenceError(f"malformed proof: {exc!r}") from exc
    if old.origin != new.origin:
        raise EvidenceError(f"checkpoints of two logs: {old.origin} and {new.origin}")
    if not verify_consistency(old.size, new.size, old.root, new.root, path):
        raise EvidenceError(f"the tree of size {new.size} does not extend the tree of size "
                            f"{old.size}")
    return old, new


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 when the evidence holds, 1 when it does not, 2 on usage errors."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("checkpoint", "inclusion", "consistency"))
    parser.add_argument("file", help="a checkpoint note, or a proof JSON")
    parser.add_argument("--key", action="append", required=True,
                        help="trusted verifier key, name+hash+base64 (repeatable)")
    args = parser.parse_args(argv)
    try:
        trusted = [parse_verifier_key(k) for k in args.key]
        with open(args.file, encoding="utf-8") as f:
            content = f.read()
        if args.kind == "checkpoint":
            cp = open_checkpoint(content, trusted)
            print(f"OK: {cp.origin} has {cp.size} entries, root "
                  f"{base64.b64encode(cp.root).decode()}")
        elif args.kind == "inclusion":
            document = json.loads(content)
            cp = check_inclusion(document, trusted)
            print(f"OK: event {document.get('event_id')} is entry {document['leaf_index']} of "
                  f"{cp.origin} (checkpoint of size {cp.size})")
        else:
            old, new = check_consistency(json.loads(content), trusted)
            print(f"OK: {new.origin} at size {new.size} extends its checkpoint of size "
                  f"{old.size}")
    except (EvidenceError, ValueError, OSError) as exc:
        print(f"INVALID: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
