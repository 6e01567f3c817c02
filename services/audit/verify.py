"""`audit verify`: recompute every partition's chain and Merkle checkpoints from the rows.

What it catches and where it points:
- a row whose columns disagree with its own stored bytes (an edited `type`, `stream`,
  `actor`, time, …) or whose `leaf_hash` is not the hash of its bytes: that row;
- a row whose hash is not SHA-256(prev_hash || stored bytes) (edited bytes or hash): that
  row;
- a row whose prev_hash is not the previous row's hash, or a gap in chain_index
  (a row removed, inserted or reordered): the first row after the break, with the
  offsets between which rows are missing (`--against-kafka` names their event ids);
- a checkpoint whose root or signature does not match what the rows recompute (the chain
  was rewritten consistently, e.g. every later hash recomputed): the first row after the
  last checkpoint that still matched, which bounds the edit;
- a checkpoint that signs more rows than are stored (the tail was cut);
- with `--checkpoint FILE`, the same two checks against a signed note kept outside the
  database: a cut tail is caught even when `checkpoints` and `chain_heads` were edited
  to match it.
Rows after the first problem of a partition are not reported: every later hash
depends on the broken one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, select

from services.audit.chain import GENESIS, RowProblem, derived_mismatch, link
from services.audit.merkle import CompactRange, leaf_hash
from services.audit.tables import chain_heads, checkpoints, events
from services.audit.verifier import (
    Checkpoint,
    EvidenceError,
    NoteKey,
    key_hash,
    open_checkpoint,
    parse_checkpoint,
    split_note,
)

ROW_COLUMNS = [events.c[name] for name in (
    "topic", "partition", "offset", "event_id", "type", "schema_version", "stream", "seq",
    "actor", "tenant_org", "tenant_team", "tenant_project", "trace_id", "canonical",
    "occurred_at", "prev_hash", "hash", "chain_index", "leaf_hash")]


@dataclass
class VerifyReport:
    rows: int = 0
    checkpoints: int = 0
    partitions: int = 0
    external: int = 0
    """Checkpoints given from outside the database that were checked."""
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


@dataclass(frozen=True)
class ExternalCheckpoint:
    """A checkpoint note kept outside the store, already opened with a trusted key."""

    source: str
    checkpoint: Checkpoint


def partition_of(origin: str, prefix: str) -> tuple[str, int] | None:
    """(topic, partition) of a log origin `<prefix>/<topic>/<partition>`."""
    if not origin.startswith(prefix + "/"):
        return None
    topic, _, partition = origin[len(prefix) + 1:].rpartition("/")
    return (topic, int(partition)) if topic and partition.isdigit() else None


def open_external(notes: Iterable[tuple[str, str]], trusted: Sequence[NoteKey]
                  ) -> list[ExternalCheckpoint]:
    """(source, note text) pairs opened with the trusted keys; raises EvidenceError."""
    opened = []
    for source, note in notes:
        try:
            opened.append(ExternalCheckpoint(source, open_checkpoint(note, trusted)))
        except EvidenceError as exc:
            raise EvidenceError(f"{source}: {exc}") from None
    return opened


def verify_store(engine: Engine, trusted_keys: Iterable[NoteKey] | None = None, *,
                 external: Sequence[ExternalCheckpoint] = (),
                 origin_prefix: str | None = None) -> VerifyReport:
    """Check every partition. `trusted_keys` pins the checkpoint signers (else each
    stored checkpoint is checked against the key stored with it); `external` checkpoints
    (with the store's `origin_prefix`) are checked against the rows too."""
    trusted = list(trusted_keys) if trusted_keys is not None else None
    report = VerifyReport()
    outside: dict[tuple[str, int], list[ExternalCheckpoint]] = {}
    for ext in external:
        key = partition_of(ext.checkpoint.origin, origin_prefix or "")
        if key is None:
            report.problems.append(RowProblem("?", -1, None, None, None,
                                              f"{ext.source}: origin {ext.checkpoint.origin} "
                                              "is not a log of this store"))
            continue
        outside.setdefault(key, []).append(ext)
    for topic, partition in sorted(set(_partitions(engine)) | set(outside)):
        report.partitions += 1
        problem = _verify_partition(engine, topic, partition, trusted,
                                    outside.get((topic, partition), []), report)
        if problem is not None:
            report.problems.append(problem)
    return report


def _verify_partition(engine: Engine, topic: str, partition: int,
                      trusted: list[NoteKey] | None, outside: list[ExternalCheckpoint],
                      report: VerifyReport) -> RowProblem | None:
    external = {e.checkpoint.size: e for e in outside}
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
        last_offset: int | None = None

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
                after = f" after offset {last_offset}" if last_offset is not None else ""
                return bad(row, f"chain index {m['chain_index']} where {tree.size} was expected: "
                                f"{m['chain_index'] - tree.size} row(s) missing{after}, or a "
                                "row inserted or reordered (--against-kafka names them)")
            if bytes(m["prev_hash"]) != prev:
                return bad(row, "prev_hash is not the previous row's hash")
            if bytes(m["hash"]) != link(prev, canonical):
                return bad(row, "hash is not SHA-256(prev_hash || stored bytes)")
            leaf = leaf_hash(canonical)
            if bytes(m["leaf_hash"]) != leaf:
                return bad(row, "leaf_hash is not the RFC 6962 leaf hash of the stored bytes")
            mismatch = derived_mismatch(m, canonical)
            if mismatch:
                return bad(row, mismatch)
            if first_unsigned is None:
                first_unsigned = row
            prev = bytes(m["hash"])
            last_offset = m["offset"]
            tree.append(leaf)
            for reason in (_stored_problem(signed.get(tree.size), topic, partition, tree,
                                           trusted, report),
                           _external_problem(external.get(tree.size), tree, report)):
                if reason:
                    return bad(first_unsigned, f"{reason} (checkpoint at tree size {tree.size} "
                                               f"covers rows {trusted_until}..{tree.size - 1}; "
                                               "the first of them is named)")
            if tree.size in signed or tree.size in external:
                trusted_until, first_unsigned = tree.size, None
    for size, ext in sorted(external.items()):
        if size > tree.size:
            report.external += 1
            return bad(None, f"{ext.source} signs {size} events of {ext.checkpoint.origin} but "
                             f"only {tree.size} rows are stored: events {tree.size}..{size - 1} "
                             "were removed from the end")
    beyond = sorted(size for size in signed if size > tree.size)
    if beyond:
        return bad(None, f"checkpoint signs {beyond[0]} events but only {tree.size} rows are "
                         "stored (rows were removed from the end)")
    if stored_head is not None and (stored_head.size != tree.size
                                    or bytes(stored_head.head_hash) != prev):
        return bad(None, f"chain head says {stored_head.size} events, rows give {tree.size}")
    return None


def _external_problem(ext: ExternalCheckpoint | None, tree: CompactRange,
                      report: VerifyReport) -> str | None:
    if ext is None:
        return None
    report.external += 1
    if ext.checkpoint.root != tree.root():
        return f"Merkle root of the stored rows differs from {ext.source}"
    return None


def _stored_problem(checkpoint: Any, topic: str, partition: int, tree: CompactRange,
                    trusted: list[NoteKey] | None, report: VerifyReport) -> str | None:
    if checkpoint is None:
        return None
    report.checkpoints += 1
    cp = checkpoint._mapping
    if bytes(cp["root"]) != tree.root():
        return "Merkle root of the stored rows differs from the signed checkpoint"
    public_key = bytes(cp["public_key"])
    if cp["note"] is None:
        return _legacy_problem(cp, topic, partition, tree, trusted)
    keys = trusted if trusted is not None else [
        NoteKey(cp["key_name"], key_hash(cp["key_name"], public_key), public_key)]
    try:
        opened = open_checkpoint(cp["note"], keys)
    except EvidenceError as exc:
        return f"checkpoint note: {exc}"
    if (opened.size, opened.root) != (tree.size, tree.root()) or opened.origin != cp["origin"]:
        return "checkpoint note signs another tree than its row says"
    return None


def _legacy_problem(cp: Any, topic: str, partition: int, tree: CompactRange,
                    trusted: list[NoteKey] | None) -> str | None:
    """Checkpoints written before revision 0006 signed this message (and no note)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    public_key = bytes(cp["public_key"])
    if trusted is not None and public_key not in {k.public_key for k in trusted}:
        return "checkpoint is signed by an untrusted key"
    message = (b"loraplane-audit-checkpoint/v1\n" + f"{topic}\n{partition}\n{tree.size}\n"
               f"{tree.root().hex()}\n{bytes(cp['chain_head']).hex()}\n".encode())
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(bytes(cp["signature"]), message)
    except (InvalidSignature, ValueError):
        return "checkpoint signature is not valid"
    return None


def read_notes(paths: Iterable[str]) -> list[tuple[str, str]]:
    """(path, note text) of checkpoint files; a file may hold one note."""
    notes = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        split_note(text)  # shape errors name the file early
        parse_checkpoint(split_note(text)[0])
        notes.append((path, text))
    return notes
