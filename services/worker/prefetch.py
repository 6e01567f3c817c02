"""Router hints: versions brought into the host tier, or onto the device, ahead of traffic.

A router that placed a request cold, or moved traffic to a warm neighbour, asks the
worker to prefetch (`WorkerControl.Prefetch`). Each version is taken or declined with the
reason: another base model's, disabled, purged, failed on this worker, or (merged mode)
not the one adapter this worker serves. A servable version asked onto the device is
loaded (not urgently); any other goes to the host tier.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.catalog.serving import purged_reason
from services.catalog.state import CatalogState, Refusal
from services.worker.lifecycle import AdapterState
from services.worker.merged import MergedServing
from services.worker.residency import Residency, owner_choice, version_choice


@dataclass(frozen=True)
class PrefetchOutcome:
    key: tuple[str, int]
    accepted: bool
    tier: str
    detail: str


def prefetch(catalog: CatalogState, residency: Residency, base_digest: str,
             merge: MergedServing | None, wanted: list[tuple[str, int]], device: bool
             ) -> list[PrefetchOutcome]:
    """Take or decline each wanted version (in the loop's thread, under the fold's lock)."""
    return [_one(catalog, residency, base_digest, merge, key, device) for key in wanted]


def _one(catalog: CatalogState, residency: Residency, base_digest: str,
         merge: MergedServing | None, key: tuple[str, int], device: bool) -> PrefetchOutcome:
    def declined(why: str) -> PrefetchOutcome:
        return PrefetchOutcome(key, False, "", why)

    if merge is not None and not merge.serves(key[0]):
        return declined(f"merged mode: this worker serves only {merge.spec}")
    adapter = catalog.adapters.get(key[0])
    version = adapter.versions.get(key[1]) if adapter else None
    if adapter is None or version is None:
        return declined("unknown adapter version")
    p = version.published
    if p.base_model_digest != base_digest:
        return declined(f"built for base model {p.base_model!r}, not this one")
    if version.disabled:
        return declined("version is disabled")
    gone = purged_reason(adapter, key[1], version)
    if gone:
        return declined(gone)
    if residency.state(key) is AdapterState.FAILED:
        return declined(residency.failure(key))
    try:
        servable = owner_choice(catalog, key, base_digest)
    except Refusal:
        servable = None
    if device and servable is not None:
        residency.load(servable, urgent=False)
    else:
        residency.prefetch_host(version_choice(key, version, adapter.tenant))
    return PrefetchOutcome(key, True, residency.tier_of(key), "")
