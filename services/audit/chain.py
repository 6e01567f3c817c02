"""The per-partition hash chain: each row's hash covers the previous hash and the
event's stored bytes (`events.canonical`), so changing, removing or reordering any row
breaks every hash after it. Pure functions; the projector, `audit verify` and
`audit replay-to-kafka` share them.

The stored bytes are the record value exactly as it was on the log (the producer writes
canonical JSON) with only its personal fields' string literals replaced by sealed tokens
(`services.audit.sealing`), never a re-serialisation of the model: a model that later
gains a defaulted field must not change the hash of an event written before it existed.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from services.config import Settings

GENESIS = bytes(32)


def chained_topics(settings: Settings) -> tuple[str, ...]:
    """The topics whose events are stored and chained one by one: all but the liveness
    topic (leases, heartbeats), which the projector only summarises."""
    return tuple(t for t in settings.topics if t != settings.liveness_topic)


def link(prev_hash: bytes, canonical: bytes) -> bytes:
    h = hashlib.sha256(prev_hash)
    h.update(canonical)
    return h.digest()


@dataclass(frozen=True)
class RowProblem:
    """Why one stored row is not what the log says it should be."""

    topic: str
    partition: int
    offset: int | None
    event_id: str | None
    chain_index: int | None
    reason: str

    def describe(self) -> str:
        return (f"{self.topic}[{self.partition}]@{self.offset} event_id={self.event_id} "
                f"(chain index {self.chain_index}): {self.reason}")


def _tenant_field(document: Mapping[str, Any], name: str) -> Any:
    tenant = document.get("tenant")
    return tenant.get(name) if isinstance(tenant, Mapping) else None


def _same_time(stored: Any, claimed: Any) -> bool:
    if not isinstance(stored, datetime) or not isinstance(claimed, str):
        return False
    try:
        return stored == datetime.fromisoformat(claimed.replace("Z", "+00:00"))
    except ValueError:
        return False


# column → how to read its expected value from the canonical document
DERIVED_COLUMNS: dict[str, Any] = {
    "event_id": lambda d: uuid.UUID(str(d.get("event_id"))),
    "type": lambda d: d.get("type"),
    "schema_version": lambda d: d.get("schema_version"),
    "stream": lambda d: d.get("stream"),
    "seq": lambda d: d.get("seq"),
    "actor": lambda d: d.get("actor"),
    "tenant_org": lambda d: _tenant_field(d, "org"),
    "tenant_team": lambda d: _tenant_field(d, "team"),
    "tenant_project": lambda d: _tenant_field(d, "project"),
    "trace_id": lambda d: d.get("trace_id"),
}


def derived_mismatch(row: Mapping[str, Any], canonical: bytes) -> str | None:
    """The first column of `row` that disagrees with its own canonical bytes, if any.

    The hash covers only the canonical bytes; this check extends the evidence to the
    queryable columns, so editing `payload` or `type` with SQL is caught as well.
    """
    try:
        document = json.loads(canonical)
        if not isinstance(document, dict):
            return "canonical bytes are not a JSON object"
        for column, expected in DERIVED_COLUMNS.items():
            if column in row and row[column] != expected(document):
                return f"column {column} does not match the event's canonical bytes"
    except ValueError as exc:
        return f"canonical bytes unreadable: {exc}"
    if "occurred_at" in row and not _same_time(row["occurred_at"], document.get("occurred_at")):
        return "column occurred_at does not match the event's canonical bytes"
    return None
