"""`audit proof EVENT_ID`: an inclusion proof a third party checks without the database.

The proof ties one event's exact bytes to the first signed checkpoint of its partition
that covers it. Check it with `loraplane audit verify-proof FILE` or, with nothing but
Python and `cryptography`, `python merkle.py FILE --public-key HEX`.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

from sqlalchemy import Engine, select

from services.audit.merkle import PROOF_FORMAT, inclusion_path, leaf_hash, root_from_hashes
from services.audit.tables import checkpoints, events


class ProofUnavailable(LookupError):
    """No such event, or no checkpoint covers it yet, or the stored rows no longer match."""


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
                                 checkpoints.c.tree_size > row.chain_index)
                          .order_by(checkpoints.c.tree_size).limit(1)).first()
        if cp is None:
            raise ProofUnavailable(
                f"event {event_id} is not covered by a signed checkpoint yet; "
                "`loraplane audit checkpoint` signs the current heads")
        hashes = [leaf_hash(bytes(c)) for c in conn.execute(
            select(events.c.canonical)
            .where(events.c.topic == row.topic, events.c.partition == row.partition,
                   events.c.chain_index < cp.tree_size)
            .order_by(events.c.chain_index)).scalars()]
    if len(hashes) != cp.tree_size or root_from_hashes(hashes) != bytes(cp.root):
        raise ProofUnavailable("the stored rows no longer match their checkpoint; "
                               "run `loraplane audit verify`")
    canonical = bytes(row.canonical)
    return {
        "format": PROOF_FORMAT,
        "event_id": str(event_id),
        "topic": row.topic,
        "partition": row.partition,
        "offset": row.offset,
        "leaf": base64.b64encode(canonical).decode(),
        "leaf_hash": leaf_hash(canonical).hex(),
        "index": row.chain_index,
        "tree_size": cp.tree_size,
        "audit_path": [h.hex() for h in inclusion_path(hashes, row.chain_index)],
        "checkpoint": {
            "tree_size": cp.tree_size,
            "root": bytes(cp.root).hex(),
            "chain_head": bytes(cp.chain_head).hex(),
            "public_key": bytes(cp.public_key).hex(),
            "signature": bytes(cp.signature).hex(),
            "signed_at": cp.signed_at.isoformat(),
        },
    }
