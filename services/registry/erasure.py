"""A tenant purge erases the tenant's adapter files from the blob store.

After `TenantPurgeRequested` is committed, the registry (the single writer) deletes every
blob that only the purged tenant's versions reference and records what it did as one
`TenantBlobsDeleted` event on the tenant's stream. The deletion runs inside that event's
command, under the registry's command lock, so no publish can commit in between: a blob
is kept when

- a *live* version references it: a version of another tenant, or of this tenant
  published after the purge, whose tenant has no purge requested after the version was
  published (content addressing means two tenants may hold the same bytes), or
- it was (re)written less than `blob_erasure_grace_s` before the purge: an upload stores
  its blob before its publish command runs, so a recent write may belong to a publish
  that is waiting for the command lock and will reference it.

Crash safety: deleting is idempotent and the event is only decided once (a purge that
already has its `TenantBlobsDeleted` is skipped), so an erasure interrupted by a crash
or a broker outage is simply run again: after the purge request and at start-up
(`resume_erasures`). `deleted` lists the tenant's blobs that are gone from the store
when the event is written, including ones an interrupted earlier attempt removed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from datetime import datetime, timedelta

from services.catalog.state import CatalogState, Purge, Refusal, tenant_stream
from services.contracts.events import TenantBlobsDeleted
from services.registry.blobstore import BlobStore
from services.registry.domain import Decision
from services.registry.node import Committed, RegistryNode, WritesUnavailable

log = logging.getLogger("loraplane.registry")

ERASER = "registry/erasure"
"""The actor of `TenantBlobsDeleted` events: the registry itself, not the caller."""


def _last_purges(state: CatalogState) -> dict[str, datetime]:
    """Tenant key → when its latest purge was requested."""
    last: dict[str, datetime] = {}
    for purge in state.purges.values():
        if purge.tenant is not None:
            key = purge.tenant.key
            last[key] = max(last.get(key, purge.requested_at), purge.requested_at)
    return last


def erasure_candidates(state: CatalogState, purge: Purge) -> tuple[set[str], set[str]]:
    """(digests of the tenant's versions published by the purge, those a live version
    also references). Pure: the plan, before looking at the blob store."""
    assert purge.tenant is not None
    last_purge = _last_purges(state)
    mine: set[str] = set()
    live: set[str] = set()
    for adapter in state.adapters.values():
        if adapter.tenant is None:
            continue
        purged_at = last_purge.get(adapter.tenant.key)
        for version in adapter.versions.values():
            digests = {version.published.sha256, version.published.config_sha256}
            if adapter.tenant == purge.tenant and version.published_at <= purge.requested_at:
                mine |= digests
            if purged_at is None or version.published_at > purged_at:
                live |= digests
    return mine, mine & live


def _erase(state: CatalogState, blobs: BlobStore, purge_id: str,
           grace: timedelta) -> Decision:
    purge = state.purges.get(purge_id)
    if purge is None or purge.tenant is None:
        raise Refusal("not_found", f"purge {purge_id!r} does not exist")
    if purge.blobs is not None:
        raise Refusal("conflict", f"the blobs of purge {purge_id!r} were already erased")
    mine, shared = erasure_candidates(state, purge)
    kept = set(shared)
    for digest in sorted(mine - shared):
        written = blobs.modified_at(digest)
        if written is not None and written >= purge.requested_at - grace:
            kept.add(digest)  # an upload in flight may be about to reference it
            continue
        blobs.delete(digest)
    deleted = sorted(d for d in mine - kept if blobs.modified_at(d) is None)
    payload = TenantBlobsDeleted(purge_id=purge_id, deleted=deleted, kept=sorted(kept))
    stream = tenant_stream(purge.tenant)
    return Decision(payload, stream, state.tenant_seqs.get(stream, 0) + 1, purge.tenant)


def erase_tenant_blobs(node: RegistryNode, blobs: BlobStore, purge_id: str) -> Committed | None:
    """Erase one purge's blobs and record it; None when it was done before."""
    with node.state_lock:
        purge = node.state.purges.get(purge_id)
        if purge is None or purge.blobs is not None:
            return None
    grace = timedelta(seconds=node.settings.blob_erasure_grace_s)
    try:
        return node.execute("erase_blobs", lambda s: _erase(s, blobs, purge_id, grace),
                            actor=ERASER)
    except Refusal as exc:
        if exc.kind == "conflict":  # erased by a concurrent call
            return None
        raise


def pending_erasures(state: CatalogState) -> list[str]:
    return sorted(p.purge_id for p in state.purges.values()
                  if p.blobs is None and p.tenant is not None)


def resume_erasures(node: RegistryNode, blobs: BlobStore, stop: threading.Event) -> None:
    """Once the registry is ready, erase what purges interrupted earlier left behind."""
    while not node.ready.wait(0.5):
        if stop.is_set():
            return
    with node.state_lock:
        pending: Iterable[str] = pending_erasures(node.state)
    for purge_id in pending:
        if stop.is_set():
            return
        try:
            erase_tenant_blobs(node, blobs, purge_id)
        except (WritesUnavailable, Refusal) as exc:
            log.warning("blob erasure of purge %s left for the next start: %s", purge_id, exc)
