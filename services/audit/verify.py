"""`audit verify`: recompute every partition's chain and Merkle checkpoints from the rows.

What it catches and where it points:
- a row whose columns disagree with its own canonical bytes (an edited `payload`,
  `type`, `stream`, …): that row;
- a row whose hash is not SHA-256(prev_hash || canonical) (edited bytes or hash): that
  row;
- a row whose prev_hash is not the previous row's hash, or a gap in chain_index
  (a row removed, inserted or reordered): the first row after the break;
- a checkpoint whose root, chain head or signature does not match what the rows
  recompute (the chain was rewritten consistently, e.g. every later hash recomputed):
  the first row after the last checkpoint that still matched, which bounds the edit;
- a checkpoint that signs more rows than are stored (the tail was cut).
Rows after the first problem of a partition are not reported: every later hash
depends on the broken one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sqlalchemy import Engine, select

from services.audit.chain import GENESIS, RowProblem, derived_mismatch, link
from services.audit.merkle import CompactRange, checkpoint_message, leaf_hash, verify_signature
from services.audit.tables import chain_heads, checkpoints, events

ROW_COLUMNS = [events.c[name] for name in (
    "topic", "partition", "offset", "event_id", "type", "schema_version", "stream", "seq",
    "actor", "tenant_org", "tenant_team", "tenant_project", "trace_id", "payload",
    "canonical", "occurred_at", "prev_hash", "hash", "chain_index")]


@dataclass
class VerifyReport:
    rows: int = 0
    checkpoints: int = 0
    partitions: int = 0
    problems: list[RowProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _partitions(engine: Engine) -> list[tuple[str, int]]:
    with engine.connect() as conn:
        keys = {(r.topic, r.partition) for r in conn.execute(
            select(events.c.topic, events.c.partition).distinct())}
        keys |= {(r.topic, r.partition) for r in conn.execute(
            select(checkpoints.c.topic, checkpoints.c.partition).distinct())}
    return sorted(keys)


def verify_store(engine: Engine, trusted_keys: Iterable[bytes] | None = None) -> VerifyReport:
    """Check every partition; `trusted_keys` pins the checkpoint signers (else any key)."""
    trusted = set(trusted_keys) if trusted_keys is not None else None
    report = VerifyReport()
    for topic, partition in _partitions(engine):
        report.partitions += 1
        problem = _verify_partition(engine, topic, partition, trusted, report)
        if problem is not None:
            report.problems.append(problem)
    return report


def _verify_partition(engine: Engine, topic: str, partition: int,
                      trusted: set[bytes] | None, report: VerifyReport) -> RowProblem | None:
    with engine.connect() as conn:
        signed = {r.tree_size: r for r in conn.execute(
            select(checkpoints).where(checkpoints.c.topic == topic,
                                      checkpoints.c.partition == partition))}
        stored_head = conn.execute(select(chain_heads).where(
            chain_heads.c.topic == topic, chain_heads.c.partition == partition)).first()
        rows = conn.execute(select(*ROW_COLUMNS)
                            .where(events.c.topic == topic, events.c.partition == partition)
                            .order_by(events.c.chain_index)).yield_per(1000)
        prev, tree = GENESIS, CompactRange()
        trusted_until = 0  # rows [0, trusted_until) are covered by a matching checkpoint

        def bad(row: object | None, reason: str) -> RowProblem:
            if row is None:
                return RowProblem(topic, partition, None, None, None, reason)
            r = row._mapping  # type: ignore[attr-defined]
            return RowProblem(topic, partition, r["offset"], str(r["event_id"]),
                              r["chain_index"], reason)

        first_unsigned = None
        for row in rows:
            report.rows += 1
            m = row._mapping
            canonical = bytes(m["canonical"])
            if m["chain_index"] != tree.size:
                return bad(row, f"chain index {m['chain_index']} where {tree.size} was expected "
                                "(a row is missing, inserted or reordered)")
            if bytes(m["prev_hash"]) != prev:
                return bad(row, "prev_hash is not the previous row's hash")
            if bytes(m["hash"]) != link(prev, canonical):
                return bad(row, "hash is not SHA-256(prev_hash || canonical bytes)")
            mismatch = derived_mismatch(m, canonical)
            if mismatch:
                return bad(row, mismatch)
            if first_unsigned is None:
                first_unsigned = row
            prev = bytes(m["hash"])
            tree.append(leaf_hash(canonical))
            checkpoint = signed.get(tree.size)
            if checkpoint is not None:
                report.checkpoints += 1
                reason = _checkpoint_problem(checkpoint, topic, partition, tree, prev, trusted)
                if reason:
                    return bad(first_unsigned, f"{reason} (checkpoint at tree size {tree.size} "
                                               f"covers rows {trusted_until}..{tree.size - 1}; "
                                               "the first of them is named)")
                trusted_until, first_unsigned = tree.size, None
    beyond = sorted(size for size in signed if size > tree.size)
    if beyond:
        return bad(None, f"checkpoint signs {beyond[0]} events but only {tree.size} rows are "
                         "stored (rows were removed from the end)")
    if stored_head is not None and (stored_head.size != tree.size
                                    or bytes(stored_head.head_hash) != prev):
        return bad(None, f"chain head says {stored_head.size} events, rows give {tree.size}")
    return None


def _checkpoint_problem(checkpoint: object, topic: str, partition: int, tree: CompactRange,
                        head: bytes, trusted: set[bytes] | None) -> str | None:
    cp = checkpoint._mapping  # type: ignore[attr-defined]
    if bytes(cp["root"]) != tree.root():
        return "Merkle root of the stored rows differs from the signed checkpoint"
    if bytes(cp["chain_head"]) != head:
        return "chain head of the stored rows differs from the signed checkpoint"
    public_key = bytes(cp["public_key"])
    if trusted is not None and public_key not in trusted:
        return "checkpoint is signed by an untrusted key"
    message = checkpoint_message(topic, partition, tree.size, tree.root(), head)
    if not verify_signature(public_key, bytes(cp["signature"]), message):
        return "checkpoint signature is not valid"
    return None
