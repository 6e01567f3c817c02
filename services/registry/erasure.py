"""A tenant purge erases the tenant's adapter files from the blob store.

After `TenantPurgeRequested` is committed, the registry (the single writer) deletes every
blob that only versions the purge ended reference (`AdapterVersion.purged_by`: the
tenant's versions published at or before the purge) and records what it did as one
`TenantBlobsDeleted` event on the tenant's stream. The deletion runs inside that event's
command, under the registry's command lock, so no publish can commit in between. A blob
is kept only when a *live* version references it: one no purge ended (another tenant's,
or this tenant's published after the purge; content addressing means two versions may
hold the same bytes). A purged version's files are never kept, however recently written:
until they are gone, the blob route refuses them anyway
(`services.catalog.serving.erased_blob_reason`).

An upload in flight is safe without a grace period: it stores its files before its
publish command runs, and if a purge erased the same bytes in between, the publish
command stores them again from its own request (`restore_upload`, under the command
lock) before it writes the version that references them.

Crash safety: deleting is idempotent and the event is only decided once (a purge that
already has its `TenantBlobsDeleted` is skipped), so an erasure interrupted by a crash
or a broker outage is simply run again: after the purge request and at start-up
(`ErasureResumer`). `deleted` lists the tenant's blobs that are gone from the store
when the event is written, including ones an interrupted earlier attempt removed. A
purge is `met` only once this event is written (`services.catalog.purge`).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import IO

from services.catalog.state import CatalogState, Purge, Refusal, tenant_stream
from services.contracts.events import TenantBlobsDeleted
from services.registry.blobstore import BlobStore
from services.registry.domain import ArtifactFacts, CommandEvent
from services.registry.node import Committed, RegistryNode, WritesUnavailable

log = logging.getLogger("loraplane.registry")

ERASER = "registry/erasure"
"""The actor of `TenantBlobsDeleted` events: the registry itself, not the caller."""


def erasure_candidates(state: CatalogState, purge: Purge) -> tuple[set[str], set[str]]:
    """(digests of the versions this purge ended, those a live version also references).
    Pure: the plan, before looking at the blob store."""
    assert purge.tenant is not None
    mine: set[str] = set()
    live: set[str] = set()
    for adapter in state.adapters.values():
        for version in adapter.versions.values():
            digests = set(version.digests())
            if purge.covers(adapter.tenant, version.published_at):
                mine |= digests
            if version.purged_by is None:
                live |= digests
    return mine, mine & live


def _erase(state: CatalogState, blobs: BlobStore, purge_id: str) -> CommandEvent:
    purge = state.purges.get(purge_id)
    if purge is None or purge.tenant is None:
        raise Refusal("not_found", f"purge {purge_id!r} does not exist")
    if purge.blobs is not None:
        raise Refusal("conflict", f"the blobs of purge {purge_id!r} were already erased")
    mine, kept = erasure_candidates(state, purge)
    for digest in sorted(mine - kept):
        blobs.delete(digest)
    deleted = sorted(d for d in mine - kept if not blobs.exists(d))
    payload = TenantBlobsDeleted(purge_id=purge_id, deleted=deleted, kept=sorted(kept))
    stream = tenant_stream(purge.tenant)
    return CommandEvent(payload, stream, state.tenant_seqs.get(stream, 0) + 1, purge.tenant)


def restore_upload(blobs: BlobStore, facts: ArtifactFacts, config: bytes,
                   weights: IO[bytes]) -> None:
    """Store an upload's files again if a purge erased the same bytes while its publish
    waited for the command lock. Called inside the publish command (under that lock), so
    no erasure can run between this and the event that references the files."""
    if not blobs.exists(facts.config_sha256):
        blobs.put(config)
    if blobs.exists(facts.sha256):
        return
    weights.seek(0)
    writer = blobs.writer()
    try:
        while chunk := weights.read(1 << 20):
            writer.write(chunk)
        stored = writer.commit()
    finally:
        writer.discard()
    if stored != facts.sha256:  # the request's own bytes changed under it: never publish
        raise RuntimeError(f"re-stored adapter weights hash to {stored}, not {facts.sha256}")


def erase_tenant_blobs(node: RegistryNode, blobs: BlobStore, purge_id: str) -> Committed | None:
    """Erase one purge's blobs and record it; None when it was done before."""
    with node.state_lock:
        purge = node.state.purges.get(purge_id)
        if purge is None or purge.blobs is not None:
            return None
    try:
        return node.execute("erase_blobs", lambda s: _erase(s, blobs, purge_id), actor=ERASER)
    except Refusal as exc:
        if exc.kind == "conflict":  # erased by a concurrent call
            return None
        raise


def pending_erasures(state: CatalogState) -> list[str]:
    return sorted(p.purge_id for p in state.purges.values()
                  if p.blobs is None and p.tenant is not None)


class ErasureResumer:
    """Each time this instance takes the writer role (at start, or taking over from
    another), erase what purges interrupted earlier left behind: the purges pending in
    the state folded when it took the role, noted by `RegistryNode.on_activate` (a thread
    polling `active` would also pick up purges committed after it, and those are erased by
    their own request). Build it before `node.start()`, so the first activation is seen."""

    def __init__(self, node: RegistryNode, blobs: BlobStore) -> None:
        self.node = node
        self.blobs = blobs
        self._taken: queue.Queue[list[str]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        node.on_activate.append(lambda state: self._taken.put(pending_erasures(state)))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="blob-erasure", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pending = self._taken.get(timeout=0.5)
            except queue.Empty:
                continue
            for purge_id in pending:
                if self._stop.is_set():
                    return
                try:
                    erase_tenant_blobs(self.node, self.blobs, purge_id)
                except (WritesUnavailable, Refusal) as exc:
                    log.warning("blob erasure of purge %s left for the next start: %s",
                                purge_id, exc)
