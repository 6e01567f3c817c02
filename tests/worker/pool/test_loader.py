"""The loader over the disk and host tiers: every fetch checked against the published
digests, a corrupt disk file replaced from the blob tier, a bad blob refused for good,
purged digests never cached."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from services.worker.engine import AdapterDigest, ModelConfig, parse_adapter
from services.worker.pool.disk import DiskCache
from services.worker.pool.host import HostCache, adapter_bytes
from services.worker.pool.loader import AdapterLoader, FetchResult
from services.worker.pool.tiers import Tier
from tests.registry.artifacts import LLAMA_CONFIG, build_adapter
from tests.waiting import wait_for
from tests.worker.doubles import DictBlobs

CFG = ModelConfig.from_dict(LLAMA_CONFIG)


def make(tmp_path: Path, *, host_bytes: int = 1 << 30) -> tuple[AdapterLoader, DictBlobs]:
    blobs = DictBlobs()
    done: list[FetchResult] = []
    loader = AdapterLoader(HostCache(host_bytes), DiskCache(tmp_path / "disk", 1 << 30),
                           blobs,  # type: ignore[arg-type]
                           lambda files, d: parse_adapter(files, CFG, d), done.append)
    return loader, blobs


def published(blobs: DictBlobs, seed: int) -> AdapterDigest:
    files = build_adapter(seed=seed)
    return AdapterDigest(blobs.add(files.weights), blobs.add(files.config))


def test_blob_then_disk_then_host(tmp_path: Path) -> None:
    loader, blobs = make(tmp_path)
    digest = published(blobs, 1)
    first = loader.load(digest)
    assert first.source is Tier.BLOB and first.adapter is not None and first.error is None
    assert loader.disk.holds(digest.sha256) and loader.host.holds(digest)
    assert loader.load(digest).source is Tier.HOST
    loader.host.discard(digest)
    again = loader.load(digest)
    assert again.source is Tier.DISK and blobs.fetches == 2  # weights + config, once


def test_a_blob_that_does_not_match_its_digest_fails_for_good(tmp_path: Path) -> None:
    loader, blobs = make(tmp_path)
    digest = published(blobs, 2)
    blobs.blobs[digest.sha256] = blobs.blobs[digest.sha256][:-1] + b"!"
    result = loader.load(digest)
    assert result.adapter is None and not result.retryable
    assert "digest mismatch" in (result.error or "")
    assert not loader.disk.holds(digest.sha256) and not loader.host.holds(digest)


def test_a_corrupt_disk_file_is_removed_and_fetched_again(tmp_path: Path) -> None:
    loader, blobs = make(tmp_path)
    digest = published(blobs, 3)
    loader.load(digest)
    loader.host.discard(digest)
    path = loader.disk.path_of(digest.sha256)
    path.write_bytes(path.read_bytes()[:-1] + b"?")
    result = loader.load(digest)
    assert result.source is Tier.BLOB and result.adapter is not None
    assert loader.corrupt_on_disk == 1
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest.sha256


def test_a_disk_file_that_neither_matches_nor_parses_is_fetched_again(tmp_path: Path) -> None:
    """The parse runs while the digest is checked; a mismatch outranks the parse error, so
    a truncated file is a corrupt copy (fetched again), not an invalid adapter (FAILED)."""
    loader, blobs = make(tmp_path)
    digest = published(blobs, 12)
    loader.load(digest)
    loader.host.discard(digest)
    path = loader.disk.path_of(digest.sha256)
    path.write_bytes(path.read_bytes()[:100])
    result = loader.load(digest)
    assert result.source is Tier.BLOB and result.adapter is not None and result.error is None
    assert loader.corrupt_on_disk == 1 and blobs.fetches == 4


def test_registry_down_is_retryable_not_failed(tmp_path: Path) -> None:
    loader, blobs = make(tmp_path)
    digest = published(blobs, 4)
    blobs.down = True
    result = loader.load(digest)
    assert result.adapter is None and result.retryable and "unreachable" in (result.error or "")


def test_invalid_adapter_fails_for_good(tmp_path: Path) -> None:
    loader, blobs = make(tmp_path)
    files = build_adapter(seed=5, config_edit=lambda c: c.update(use_dora=True))
    digest = AdapterDigest(blobs.add(files.weights), blobs.add(files.config))
    result = loader.load(digest)
    assert not result.retryable and "DoRA" in (result.error or "")


def test_a_purge_during_the_fetch_keeps_nothing(tmp_path: Path) -> None:
    loader, blobs = make(tmp_path)
    digest = published(blobs, 6)
    real_fetch = blobs.fetch

    def fetch_then_purge(d: str) -> bytes:
        data = real_fetch(d)
        loader.cancel({digest})  # the purge lands while the bytes are in flight
        return data

    blobs.fetch = fetch_then_purge  # type: ignore[method-assign]
    result = loader.load(digest)
    assert result.adapter is None and "purge" in (result.error or "")
    assert not loader.disk.holds(digest.sha256) and not loader.host.holds(digest)
    assert not loader.disk.path_of(digest.sha256).exists()


def test_host_tier_budget_and_scrub(tmp_path: Path) -> None:
    loader, blobs = make(tmp_path)
    one = loader.load(published(blobs, 7)).adapter
    assert one is not None
    small = HostCache(adapter_bytes(one) * 2 + 1)
    for seed in (8, 9, 10):
        adapter = loader.load(published(blobs, seed)).adapter
        assert adapter is not None
        small.put(adapter, "bronze")
    assert len(small.digests()) == 2 and small.evictions == 1
    kept = next(iter(small.digests()))
    held = small.get(kept)
    assert held is not None
    assert small.discard(kept, scrub=True)
    assert all(not w.a.any() and not w.b.any() for w in held.weights.values())


def test_disk_tier_budget_scrub_and_restart(tmp_path: Path) -> None:
    disk = DiskCache(tmp_path / "d", byte_budget=25)
    for n in range(3):
        data = bytes([n]) * 10
        disk.write(hashlib.sha256(data).hexdigest(), data)
    assert len(disk.digests()) == 2 and disk.used_bytes == 20 and disk.evictions == 1
    again = DiskCache(tmp_path / "d", byte_budget=25)  # a restarted worker
    assert again.digests() == disk.digests()
    victim = next(iter(again.digests()))
    assert again.discard(victim, scrub=True) and not again.path_of(victim).exists()
    with pytest.raises(ValueError):
        again.path_of("../etc/passwd")


def test_queue_dedupes_and_reports(tmp_path: Path) -> None:
    loader, blobs = make(tmp_path)
    digest = published(blobs, 11)
    done: list[FetchResult] = []
    loader.on_done = done.append
    loader.start()
    try:
        loader.request(digest, "bronze", urgent=False)
        loader.request(digest, "bronze", urgent=True)  # moved up, not fetched twice
        wait_for(lambda: done, 10, interval_s=0.01, message="the fetch done")
    finally:
        loader.stop()
    assert len(done) == 1 and done[0].adapter is not None and blobs.fetches == 2
