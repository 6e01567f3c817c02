"""Proofs a third party checks without the database: `audit proof EVENT_ID` (inclusion
of one event in a signed checkpoint) and `audit consistency OLD NEW` (the log at NEW
extends the log an auditor kept at OLD).

A proof carries the signed checkpoint note it relies on, so what was signed travels with
it, but never a key: the verifier (`services/audit/verifier.py`, or the Go reference
libraries) checks the note against the verifier key the auditor pinned. Proofs read the
stored leaf hashes (32 bytes per event), never the events themselves.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

from sqlalchemy import Connection, Engine, select

from services.audit.merkle import consistency_path, inclusion_path, leaf_hash, root_from_hashes
from services.audit.tables import checkpoints, events
from services.audit.verifier import (
    CONSISTENCY_FORMAT,
    INCLUSION_FORMAT,
    Checkpoint,
    EvidenceError,
    parse_checkpoint,
    split_note,
)
from services.audit.verify import partition_of


class ProofUnavailable(LookupError):
    """No such event or log, no checkpoint covers it yet, or the rows no longer match."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _leaf_hashes(conn: Connection, topic: str, partition: int, size: int) -> list[bytes]:
    hashes = [bytes(h) for h in conn.execute(
        select(events.c.leaf_hash)
        .where(events.c.topic == topic, events.c.partition == partition,
               events.c.chain_index < size)
        .order_by(events.c.chain_index)).scalars()]
    if len(hashes) != size:
        raise ProofUnavailable(f"{topic}[{partition}] holds {len(hashes)} of the {size} events "
                               "its checkpoint signs; run `loraplane audit verify`")
    return hashes


def build_proof(engine: Engine, event_id: uuid.UUID) -> dict[str, Any]:
    with engine.connect() as conn:
        row = conn.execute(select(events.c.topic, events.c.partition, events.c.offset,
                                  events.c.chain_index, events.c.canonical)
                           .where(events.c.event_id == event_id)).first()
        if row is None:
            raise ProofUnavailable(f"event {event_id} is not in the audit store")
        cp = conn.execute(select(checkpoints)
                          .where(checkpoints.c.topic == row.topic,
                                 checkpoints.c.partition == row.partition,
                                 checkpoints.c.tree_size > row.chain_index,
                                 checkpoints.c.note.is_not(None))
                          .order_by(checkpoints.c.tree_size).limit(1)).first()
        if cp is None:
            raise ProofUnavailable(
                f"event {event_id} is not covered by a signed checkpoint yet; "
                "`loraplane audit checkpoint` signs the current heads")
        hashes = _leaf_hashes(conn, row.topic, row.partition, cp.tree_size)
    canonical = bytes(row.canonical)
    if (root_from_hashes(hashes) != bytes(cp.root)
            or hashes[row.chain_index] != leaf_hash(canonical)):
        raise ProofUnavailable("the stored rows no longer match their checkpoint; "
                               "run `loraplane audit verify`")
    return {
        "format": INCLUSION_FORMAT,
        "event_id": str(event_id),
        "origin": cp.origin,
        "topic": row.topic,
        "partition": row.partition,
        "offset": row.offset,
        "leaf": _b64(canonical),
        "leaf_index": row.chain_index,
        "tree_size": cp.tree_size,
        "inclusion_path": [_b64(h) for h in inclusion_path(hashes, row.chain_index)],
        "checkpoint": cp.note,
        "key": {"name": cp.key_name, "hash": bytes(cp.key_hash).hex()},
    }


def _checkpoint_of(note: str, source: str) -> Checkpoint:
    try:
        return parse_checkpoint(split_note(note)[0])
    except EvidenceError as exc:
        raise ProofUnavailable(f"{source} is not a checkpoint note: {exc}") from None


def build_consistency(engine: Engine, origin_prefix: str, old_note: str,
                      new_note: str | None = None) -> dict[str, Any]:
    """A consistency proof from the checkpoint `old_note` to `new_note` (default: the
    newest stored checkpoint of the same log)."""
    old = _checkpoint_of(old_note, "OLD")
    where = partition_of(old.origin, origin_prefix)
    if where is None:
        raise ProofUnavailable(f"{old.origin} is not a log of this store "
                               f"(origins start with {origin_prefix}/)")
    topic, partition = where
    with engine.connect() as conn:
        if new_note is None:
            new_note = conn.execute(
                select(checkpoints.c.note)
                .where(checkpoints.c.topic == topic, checkpoints.c.partition == partition,
                       checkpoints.c.note.is_not(None))
                .order_by(checkpoints.c.tree_size.desc()).limit(1)).scalar()
            if new_note is None:
                raise ProofUnavailable(f"{old.origin} has no signed checkpoint")
        new = _checkpoint_of(new_note, "NEW")
        if new.origin != old.origin:
            raise ProofUnavailable(f"OLD is of {old.origin}, NEW of {new.origin}")
        if new.size < old.size:
            raise ProofUnavailable(f"NEW ({new.size}) is older than OLD ({old.size})")
        hashes = _leaf_hashes(conn, topic, partition, new.size)
    if root_from_hashes(hashes[:old.size]) != old.root:
        raise ProofUnavailable(f"the store's first {old.size} events of {old.origin} do not "
                               "hash to OLD's root: the log was rewritten since OLD was signed")
    if root_from_hashes(hashes) != new.root:
        raise ProofUnavailable("the stored events no longer match NEW; run `audit verify`")
    return {
        "format": CONSISTENCY_FORMAT,
        "origin": old.origin,
        "old_size": old.size,
        "new_size": new.size,
        "old_checkpoint": old_note,
        "new_checkpoint": new_note,
        "consistency_path": [_b64(h) for h in consistency_path(hashes, old.size)],
    }
