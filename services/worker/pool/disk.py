"""The disk tier: adapter files kept under the state folder, by content digest.

Layout `ROOT/sha256/ab/abcdef…` (the registry's blob store layout), written atomically
(temporary file, fsync, rename), so a crash never leaves a half file under a digest
name. Nothing here trusts the bytes it returns: every read is checked against the
published digest by the loader (`AdapterFiles.verify`), and a file that fails is removed
(`discard`) and fetched again from the registry. Survives restarts: the index is rebuilt
from the folder at start.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
import time
from pathlib import Path

from services.worker.pool.tiers import AccessHistory, Candidate, eviction_order

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class DiskCache:
    """Files by sha256 with a byte budget and LRU-K eviction; thread-safe."""

    def __init__(self, root: Path, byte_budget: int) -> None:
        self.root = Path(root)
        self.byte_budget = byte_budget
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        self._tiers: dict[str, str] = {}
        self._history: dict[str, AccessHistory] = {}
        self.evictions = 0
        (self.root / "sha256").mkdir(parents=True, exist_ok=True)
        self._scan()

    def _scan(self) -> None:
        now = time.monotonic()
        for path in (self.root / "sha256").glob("*/*"):
            if _DIGEST.match(path.name) and path.is_file():
                self._sizes[path.name] = path.stat().st_size
                self._history.setdefault(path.name, AccessHistory()).touch(now)
        for stale in self.root.glob("tmp-*"):  # a crash mid-write
            with contextlib.suppress(OSError):
                stale.unlink()

    def path_of(self, digest: str) -> Path:
        if not _DIGEST.match(digest):
            raise ValueError(f"not a sha256 hex digest: {digest!r}")
        return self.root / "sha256" / digest[:2] / digest

    def holds(self, digest: str) -> bool:
        with self._lock:
            return digest in self._sizes

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def digests(self) -> set[str]:
        with self._lock:
            return set(self._sizes)

    def read(self, digest: str) -> bytes | None:
        """The stored bytes (unchecked: the caller verifies them), or None."""
        path = self.path_of(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            with self._lock:
                self._sizes.pop(digest, None)
            return None
        with self._lock:
            self._history.setdefault(digest, AccessHistory()).touch(time.monotonic())
        return data

    def write(self, digest: str, data: bytes, qos_tier: str = "silver") -> None:
        """Store verified bytes under their digest, then evict to the budget."""
        target = self.path_of(digest)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix="tmp-")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with self._lock:
            self._sizes[digest] = len(data)
            self._tiers[digest] = qos_tier
            self._history.setdefault(digest, AccessHistory()).touch(time.monotonic())
            victims = self._over_budget(keep=digest)
        for victim in victims:
            self._unlink(victim, scrub=False)
            self.evictions += 1

    def _over_budget(self, keep: str) -> list[str]:
        used = sum(self._sizes.values())
        if used <= self.byte_budget:
            return []
        now = time.monotonic()
        order = eviction_order([Candidate(d, self._tiers.get(d, "silver"), h)
                                for d, h in self._history.items()
                                if d != keep and d in self._sizes], now)
        victims = []
        for c in order:
            if used <= self.byte_budget:
                break
            digest = str(c.key)
            used -= self._sizes.pop(digest)
            self._history.pop(digest, None)
            self._tiers.pop(digest, None)
            victims.append(digest)
        return victims

    def discard(self, digest: str, *, scrub: bool = False) -> bool:
        """Remove a file (a corrupt one, or a purged tenant's with `scrub`): True if held.

        `scrub` overwrites the bytes with zeros before unlinking, so a purged tenant's
        weights do not linger in free disk blocks of a plain filesystem.
        """
        with self._lock:
            held = self._sizes.pop(digest, None) is not None
            self._history.pop(digest, None)
            self._tiers.pop(digest, None)
        return self._unlink(digest, scrub=scrub) or held

    def _unlink(self, digest: str, *, scrub: bool) -> bool:
        path = self.path_of(digest)
        try:
            if scrub:
                size = path.stat().st_size
                with path.open("r+b") as handle:
                    handle.write(b"\0" * size)
                    handle.flush()
                    os.fsync(handle.fileno())
            path.unlink()
            return True
        except FileNotFoundError:
            return False
