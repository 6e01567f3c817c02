"""Content-addressed blob store: `sha256/ab/abcdef…`, written atomically, verified on read.

Content addressing is what makes publishing safe without a distributed transaction: a blob
is stored before its event is emitted, and if the emit fails (broker down, fenced) the blob
is an orphan nobody references. It is harmless: the same bytes published later map to the
same path, and a sweep may delete unreferenced blobs at any time.

`BlobStore` is the interface; `LocalBlobStore` is the directory implementation. An
S3-compatible store implements the same methods (multipart upload to a temporary key,
then copy to the digest key; `modified_at` is the object's Last-Modified) and runs the
same contract tests. `delete` exists for tenant purges (`services.registry.erasure`).

Bytes that do not hash to their name are never handed out whole. `verify` hashes a blob
before anyone sends it (a corrupt one is refused with a clear error, nothing sent), and
`read` holds back the last chunk until the digest of everything before it checked out,
so a blob that rots between the two never reaches a reader complete: its stream ends
short of the declared length, an error on every HTTP client. A verified blob is not
hashed again before each read while its file is unchanged (size, mtime, inode); `read`
still checks every byte it sends.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Protocol

from services.contracts.events import SHA256_PATTERN

_DIGEST = re.compile(SHA256_PATTERN)
CHUNK_BYTES = 1 << 20


class BlobNotFound(KeyError):
    pass


class BlobCorrupted(RuntimeError):
    """Stored bytes no longer hash to their name: never hand them out."""


def check_digest(digest: str) -> str:
    if not _DIGEST.match(digest):
        raise ValueError(f"not a sha256 hex digest: {digest!r}")
    return digest


class BlobWriter(Protocol):
    """An upload in progress: bytes go to a temporary place until `commit`."""

    def write(self, data: bytes) -> int: ...

    def commit(self) -> str:
        """Move the bytes under their digest (atomic, idempotent); returns the digest."""
        ...

    def discard(self) -> None: ...


class BlobStore(Protocol):
    def writer(self) -> BlobWriter: ...

    def exists(self, digest: str) -> bool: ...

    def size(self, digest: str) -> int: ...

    def verify(self, digest: str) -> int:
        """The blob's size once its bytes hash to its name; BlobCorrupted otherwise."""
        ...

    def read(self, digest: str) -> Iterator[bytes]:
        """Chunks of the blob; the last one only after the digest checked out, else
        BlobCorrupted instead of it (callers that forward bytes must then abort)."""
        ...

    def modified_at(self, digest: str) -> datetime | None:
        """When the blob was last (re)written, or None when it is not stored."""
        ...

    def delete(self, digest: str) -> bool:
        """Remove the blob; True if it was there. Durable when it returns."""
        ...


class LocalBlobWriter:
    def __init__(self, store: LocalBlobStore) -> None:
        self._store = store
        store.tmp_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=store.tmp_dir, prefix="upload-")
        self._path = Path(name)
        self._file: IO[bytes] = os.fdopen(fd, "wb")
        self._hash = hashlib.sha256()
        self._done = False

    def write(self, data: bytes) -> int:
        self._hash.update(data)
        return self._file.write(data)

    def commit(self) -> str:
        digest = self._hash.hexdigest()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        target = self._store.path_of(digest)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self._path, target)  # atomic; same bytes if it already existed
        self._done = True
        return digest

    def discard(self) -> None:
        if not self._done:
            self._file.close()
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()
            self._done = True


class LocalBlobStore:
    """Blobs under `root/sha256/ab/<digest>`; temporary files under `root/tmp`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.tmp_dir = self.root / "tmp"
        (self.root / "sha256").mkdir(parents=True, exist_ok=True)
        self._verified: dict[str, tuple[int, int, int]] = {}
        """digest → (size, mtime_ns, inode) of the file when it last hashed right."""

    def path_of(self, digest: str) -> Path:
        check_digest(digest)
        return self.root / "sha256" / digest[:2] / digest

    def writer(self) -> LocalBlobWriter:
        return LocalBlobWriter(self)

    def put(self, data: bytes) -> str:
        writer = self.writer()
        try:
            writer.write(data)
            return writer.commit()
        finally:
            writer.discard()

    def exists(self, digest: str) -> bool:
        return self.path_of(digest).is_file()

    def size(self, digest: str) -> int:
        try:
            return self.path_of(digest).stat().st_size
        except FileNotFoundError:
            raise BlobNotFound(digest) from None

    def verify(self, digest: str) -> int:
        path = self.path_of(digest)
        try:
            stat = path.stat()
        except FileNotFoundError:
            raise BlobNotFound(digest) from None
        mark = (stat.st_size, stat.st_mtime_ns, stat.st_ino)
        if self._verified.get(digest) == mark:
            return stat.st_size
        for _ in self.read(digest):
            pass
        if len(self._verified) > 100_000:
            self._verified.clear()
        self._verified[digest] = mark
        return stat.st_size

    def modified_at(self, digest: str) -> datetime | None:
        try:
            return datetime.fromtimestamp(self.path_of(digest).stat().st_mtime, UTC)
        except FileNotFoundError:
            return None

    def delete(self, digest: str) -> bool:
        path = self.path_of(digest)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # the unlink is on disk before the erasure is recorded
        finally:
            os.close(fd)
        return True

    def read(self, digest: str) -> Iterator[bytes]:
        try:
            handle = self.path_of(digest).open("rb")
        except FileNotFoundError:
            raise BlobNotFound(digest) from None
        return self._checked(handle, digest)

    def _checked(self, handle: IO[bytes], digest: str) -> Iterator[bytes]:
        hasher = hashlib.sha256()
        held: bytes | None = None
        with handle:
            while chunk := handle.read(CHUNK_BYTES):
                hasher.update(chunk)
                if held is not None:
                    yield held
                held = chunk
        if hasher.hexdigest() != digest:
            self._verified.pop(digest, None)
            raise BlobCorrupted(f"blob {digest} is corrupted on disk: its bytes hash to "
                                f"{hasher.hexdigest()}")
        if held is not None:
            yield held
