"""The blob store contract, run once per implementation (only the local one exists yet)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from services.registry.blobstore import BlobCorrupted, BlobNotFound, LocalBlobStore


@pytest.fixture(params=["local"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> LocalBlobStore:
    return LocalBlobStore(tmp_path / "blobs")


def test_content_addressed_and_idempotent(store: LocalBlobStore) -> None:
    data = b"weights" * 1000
    digest = store.put(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert store.put(data) == digest and store.exists(digest) and store.size(digest) == len(data)
    assert b"".join(store.read(digest)) == data
    assert store.path_of(digest).relative_to(store.root) == Path("sha256", digest[:2], digest)


def test_discarded_upload_leaves_nothing(store: LocalBlobStore) -> None:
    writer = store.writer()
    writer.write(b"half an upload")
    writer.discard()
    assert [p for p in store.root.rglob("*") if p.is_file()] == []


def test_missing_and_corrupt_blobs(store: LocalBlobStore) -> None:
    with pytest.raises(BlobNotFound):
        store.read("0" * 64)
    digest = store.put(b"good bytes")
    store.path_of(digest).write_bytes(b"evil bytes")
    with pytest.raises(BlobCorrupted):
        b"".join(store.read(digest))
    with pytest.raises(ValueError):
        store.path_of("../../etc/passwd")
