"""The per-partition hash chain: each row's hash covers the previous hash and the
event's canonical bytes, so changing, removing or reordering any row breaks every hash
after it. Pure functions; the projector and `audit verify` share them."""

from __future__ import annotations

import hashlib

GENESIS = bytes(32)


def link(prev_hash: bytes, canonical: bytes) -> bytes:
    return hashlib.sha256(prev_hash + canonical).digest()
