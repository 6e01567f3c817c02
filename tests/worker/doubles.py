"""Stand-ins for the two edges the in-process tests do not exercise: the registry's blob
route (HTTP is covered by the service tests) and the event sender (Kafka likewise)."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from services.contracts.events import Payload, ServedRequest
from services.worker.pool.blobs import BlobUnavailable


class DictBlobs:
    """Blobs by digest, in memory; `down` makes every fetch fail like a dead registry."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.fetches = 0
        self.down = False

    def add(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        return digest

    def fetch(self, digest: str) -> bytes:
        self.fetches += 1
        if self.down:
            raise BlobUnavailable("registry unreachable")
        return self.blobs[digest]

    def close(self) -> None:
        pass


class RecordedEvents:
    """What the worker would send, kept in order (same surface as `WorkerEvents`)."""

    def __init__(self) -> None:
        self.sent: list[Payload] = []
        self.traces: list[ServedRequest] = []
        self._lock = threading.Lock()

    def emit(self, payload: Payload, **_: Any) -> None:
        with self._lock:
            self.sent.append(payload)

    def trace(self, served: ServedRequest) -> None:
        with self._lock:
            self.traces.append(served)

    @property
    def unsent(self) -> int:
        return 0

    def of(self, kind: type) -> list[Any]:
        with self._lock:
            return [p for p in self.sent if isinstance(p, kind)]
