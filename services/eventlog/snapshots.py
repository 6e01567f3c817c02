"""Snapshots of a reader's fold: one JSON file per reader, replaced atomically.

A snapshot says what it covers, so a reader never trusts one taken from another log:

- `format`: the layout of this file (`FORMAT`);
- `fold_version`: the fold's own schema version: a fold whose state or rules changed
  bumps it, and older snapshots are then ignored;
- `cluster_id`: the broker cluster the log lived on;
- `topics`: each topic's partition count, and per partition the `anchor`, the last record
  folded (offset, broker timestamp, checksum). The reader resumes at the anchor and
  checks that record first (`services/eventlog/consumer.py`), which catches a recreated
  topic or a broker that lost its log even where the cluster id does not change (Tansu's
  is fixed);
- `state`: the fold's document, whatever its `dump()` returned (JSON).

Writing is atomic: a temporary file in the same folder, fsync, rename over the old one,
fsync of the folder. A crash leaves the previous snapshot or the new one, never half of
one; an unreadable file is treated as no snapshot (the log is replayed in full).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pydantic_core

from services.eventlog.consumer import Anchor, TopicPartitionKey

log = logging.getLogger(__name__)

FORMAT = 1


@dataclass(frozen=True)
class Snapshot:
    """A fold's state and the log prefix it covers."""

    fold_version: str
    cluster_id: str | None
    partitions: dict[str, int]
    """Topic → partition count when the snapshot was taken."""
    anchors: dict[TopicPartitionKey, Anchor]
    state: Any
    records: int = 0
    """Records the reader had read when it took the snapshot (for reports)."""
    written_at: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "fold_version": self.fold_version, "cluster_id": self.cluster_id,
            "written_at": self.written_at or datetime.now(UTC).isoformat(),
            "records": self.records,
            "topics": {topic: {"partitions": count, "anchors": {
                str(p): a.to_json() for (t, p), a in sorted(self.anchors.items()) if t == topic}}
                for topic, count in sorted(self.partitions.items())},
            "state": self.state,
        }

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> Snapshot:
        if document.get("format") != FORMAT:
            raise ValueError(f"snapshot format {document.get('format')!r}, not {FORMAT}")
        topics = document["topics"]
        return cls(
            fold_version=str(document["fold_version"]), cluster_id=document.get("cluster_id"),
            partitions={t: int(v["partitions"]) for t, v in topics.items()},
            anchors={(t, int(p)): Anchor.from_json(a) for t, v in topics.items()
                     for p, a in v["anchors"].items()},
            state=document["state"], records=int(document.get("records", 0)),
            written_at=str(document.get("written_at", "")))


class SnapshotStore:
    """The snapshot file of one reader (`root/name.snapshot.json`)."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = Path(root)
        self.path = self.root / f"{name}.snapshot.json"

    def load(self) -> Snapshot | None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read snapshot %s (%s): replaying in full", self.path, exc)
            return None
        try:
            return Snapshot.from_json(pydantic_core.from_json(raw))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable snapshot %s (%s): replaying in full", self.path,
                        exc)
            return None

    def save(self, snapshot: Snapshot) -> int:
        """Replace the snapshot atomically; returns its size in bytes."""
        data = pydantic_core.to_json(snapshot.to_json())  # the Rust encoder: several x json
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        directory = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        return len(data)

    def discard(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
