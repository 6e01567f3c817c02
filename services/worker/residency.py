"""Which adapter versions sit in the engine's device slots, driven by the state machine.

Runs only in the engine loop thread (it calls the engine between steps). It owns the
`AdapterStates`, decides loads, evictions, switch-outs and purges, fires the matching
transitions and performs each transition's KV action on the engine, and writes the
worker events that say what happened (`AdapterLoaded`, `AdapterLoadFailed`,
`AdapterUnloaded`, `KVInvalidated`, `TenantPurged`). Requests waiting for a version are
the engine loop's business: it is told through `Waiters` when a digest became usable or
will not be.

Several versions may share one digest (the same files published twice); the slot is the
digest's and is freed when its last holder leaves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from services.catalog.serving import ServingChoice, purged_reason, resolve_as_owner
from services.catalog.state import AdapterVersion, CatalogState, Purge, Refusal
from services.contracts.events import (
    AdapterLoaded,
    AdapterLoadFailed,
    AdapterUnloaded,
    KVInvalidated,
    LoadedAdapter,
    TenantPurged,
    TenantRef,
)
from services.worker.engine import (
    AdapterDigest,
    AdapterError,
    AdapterPoolFullError,
    Engine,
    LoraAdapter,
)
from services.worker.events import WorkerEvents
from services.worker.lifecycle import (
    HOLDS_SLOT,
    AdapterState,
    AdapterStates,
    Transition,
    VersionKey,
)
from services.worker.metrics import WorkerMetrics
from services.worker.pool.disk import DiskCache
from services.worker.pool.host import HostCache
from services.worker.pool.loader import AdapterLoader, FetchResult
from services.worker.pool.tiers import (
    QOS_RANK,
    AccessHistory,
    Candidate,
    Tier,
    eviction_order,
    may_evict,
)

log = logging.getLogger("loraplane.worker.residency")

S, T = AdapterState, Transition
LEAVING_REASON = {T.SWITCH: "switch", T.ROLLBACK: "rollback", T.DISABLE: "disable"}
PREFETCH_TIERS = ("gold", "platinum")
"""Published or switched adapters of these tiers are fetched ahead of traffic."""


class Waiters(Protocol):
    """The engine loop's side: requests parked on a digest."""

    def adapter_ready(self, digest: AdapterDigest) -> None: ...

    def adapter_unavailable(self, digest: AdapterDigest, code: str, message: str,
                            retry_after_s: float | None = None) -> None: ...

    def has_waiters(self, digest: AdapterDigest) -> bool: ...


@dataclass
class _Version:
    """What residency needs to know about a version it touched."""

    choice: ServingChoice
    load_started: float = 0.0
    failure: str = ""

    @property
    def digest(self) -> AdapterDigest:
        return AdapterDigest(self.choice.sha256, self.choice.config_sha256)


def owner_choice(catalog: CatalogState, key: VersionKey, base_digest: str) -> ServingChoice:
    """The version as its own tenant would be served it now; raises Refusal when it may
    not be served at all (the serving rule of `services.catalog.serving`)."""
    return resolve_as_owner(catalog, key[0], key[1], base_digest=base_digest)


def version_choice(key: VersionKey, version: AdapterVersion,
                   tenant: TenantRef | None) -> ServingChoice:
    """A version's identity and load facts, whether or not it may be served now."""
    p = version.published
    return ServingChoice(key[0], key[1], p.sha256, p.config_sha256, p.qos_tier, tenant,
                         base_model_digest=p.base_model_digest)


class Residency:
    def __init__(self, engine: Engine, host: HostCache, disk: DiskCache, loader: AdapterLoader,
                 events: WorkerEvents, metrics: WorkerMetrics, worker_id: str,
                 waiters: Waiters, only_adapter: str | None = None) -> None:
        self.engine = engine
        self.host = host
        self.disk = disk
        self.loader = loader
        self.events = events
        self.metrics = metrics
        self.worker_id = worker_id
        self.waiters = waiters
        self.states = AdapterStates(on_illegal=lambda exc: metrics.illegal_transitions.labels(
            exc.transition.value).inc())
        self.base_digest = engine.base_digest
        self._versions: dict[VersionKey, _Version] = {}
        self._holders: dict[AdapterDigest, set[VersionKey]] = {}
        self._loading: dict[AdapterDigest, set[VersionKey]] = {}
        self._prefetching: dict[AdapterDigest, set[VersionKey]] = {}
        self._slot_wait: dict[AdapterDigest, tuple[LoraAdapter, Tier, float]] = {}
        self._leaving: dict[VersionKey, Transition] = {}
        self._history: dict[AdapterDigest, AccessHistory] = {}
        self._handled_purges: set[str] = set()
        self._gate_holds: dict[AdapterDigest, int] = {}
        self.only_adapter = only_adapter
        """Merged mode: the one adapter this worker serves; no other is loaded ahead of
        traffic (its versions are refused anyway)."""

    # --- queries ---------------------------------------------------------------------------

    def state(self, key: VersionKey) -> AdapterState:
        return self.states.get(key)

    def failure(self, key: VersionKey) -> str:
        known = self._versions.get(key)
        return known.failure if known else ""

    def tier_of(self, key: VersionKey) -> str:
        """The nearest tier holding a version: device, host, disk, or "" (none)."""
        if self.states.get(key) in HOLDS_SLOT:
            return "device"
        known = self._versions.get(key)
        if known is None:
            return ""
        tier = self.source_tier(known.digest)
        return "" if tier is Tier.BLOB else tier.value

    def touch(self, digest: AdapterDigest) -> None:
        self._history.setdefault(digest, AccessHistory()).touch(time.monotonic())

    def source_tier(self, digest: AdapterDigest) -> Tier:
        """Where a load of this digest would come from now (for the page-in timeout)."""
        if self.engine.adapters.is_loaded(digest):
            return Tier.DEVICE
        if self.host.holds(digest):
            return Tier.HOST
        if self.disk.holds(digest.sha256) and self.disk.holds(digest.config_sha256):
            return Tier.DISK
        return Tier.BLOB

    # --- loading ---------------------------------------------------------------------------

    def _remember(self, choice: ServingChoice) -> _Version:
        key = (choice.adapter_id, choice.version)
        known = self._versions.get(key)
        if known is None or known.choice != choice:
            known = self._versions[key] = _Version(choice)
        return known

    def load(self, choice: ServingChoice, *, urgent: bool) -> AdapterState:
        """Start bringing a version to a slot (UNLOADED → LOADING); returns its state."""
        key = (choice.adapter_id, choice.version)
        known = self._remember(choice)
        state = self.states.get(key)
        if state is S.LOADING and urgent and known.digest in self._loading:
            self.loader.request(known.digest, choice.qos_tier, urgent=True)  # move it up
        if state is not S.UNLOADED:
            return state
        self.states.fire(key, T.LOAD)
        known.load_started = time.monotonic()
        digest = known.digest
        if self.engine.adapters.is_loaded(digest):  # another version holds the same bytes
            self._loaded({key}, digest, Tier.DEVICE)
            return self.states.get(key)
        self._loading.setdefault(digest, set()).add(key)
        held = self.host.get(digest)
        if held is not None:
            self._place(digest, held, Tier.HOST)
        else:
            self.loader.request(digest, choice.qos_tier, urgent=urgent)
        return self.states.get(key)

    def prefetch_host(self, choice: ServingChoice) -> None:
        """Fetch into the host tier only (publish of a gold/platinum version, a hint)."""
        known = self._remember(choice)
        digest = known.digest
        key = (choice.adapter_id, choice.version)
        if self.states.get(key) is S.FAILED or self.host.holds(digest):
            return
        known.load_started = time.monotonic()
        self._prefetching.setdefault(digest, set()).add(key)
        self.loader.request(digest, choice.qos_tier, urgent=False)

    def fetched(self, result: FetchResult) -> None:
        """A loader job finished (posted to the engine loop by the loader thread)."""
        digest = result.digest
        keys = {k for k in self._loading.pop(digest, set())
                if self.states.get(k) is S.LOADING}
        hosted = self._prefetching.pop(digest, set()) - keys
        if result.adapter is None:
            self._failed(digest, keys | hosted, result.error or "load failed",
                         retryable=result.retryable, refusal=result.refusal)
            return
        for key in hosted:
            known = self._versions[key]
            self.events.emit(AdapterLoaded(
                worker_id=self.worker_id, adapter_id=key[0], version=key[1],
                sha256=digest.sha256, load_ms=(time.monotonic() - known.load_started) * 1e3,
                tier="host"), tenant=known.choice.tenant)
        if keys:
            self._loading[digest] = keys
            self._place(digest, result.adapter, result.source)

    def _failed(self, digest: AdapterDigest, keys: Iterable[VersionKey], error: str, *,
                retryable: bool, refusal: str | None = None) -> None:
        for key in keys:
            known = self._versions[key]
            state = self.states.get(key)
            if not retryable and state in (S.UNLOADED, S.LOADING):
                if state is S.UNLOADED:  # a prefetch found the bytes bad: the load failed
                    self.states.fire(key, T.LOAD)
                self.states.fire(key, T.FAIL)
                known.failure = error
            elif state is S.LOADING:
                self.states.fire(key, T.ABANDON)
            self.events.emit(AdapterLoadFailed(worker_id=self.worker_id, adapter_id=key[0],
                                               version=key[1], error=error[:4096],
                                               retryable=retryable),
                             tenant=known.choice.tenant)
        if retryable:
            code = refusal or "UNAVAILABLE"
            self.waiters.adapter_unavailable(digest, code,
                                             f"adapter could not be loaded: {error}",
                                             1.0 if code == "UNAVAILABLE" else None)
        else:
            self.waiters.adapter_unavailable(
                digest, "FAILED_PRECONDITION",
                f"adapter version failed to load on this worker and is never served: {error}")

    def _place(self, digest: AdapterDigest, adapter: LoraAdapter, source: Tier) -> None:
        keys = {k for k in self._loading.get(digest, set()) if self.states.get(k) is S.LOADING}
        if not keys:
            self._loading.pop(digest, None)
            return
        tiers = [self._versions[k].choice.qos_tier for k in keys]
        best = min(tiers, key=lambda t: QOS_RANK.get(t, 3))
        pools = self.engine.adapters
        urgent = self.waiters.has_waiters(digest)
        if not pools.is_loaded(digest) and not self.room_for(
                adapter, lambda: self._make_room(best, background=not urgent)):
            if not urgent:  # ahead of traffic: only a free or a less important slot
                self._loading.pop(digest, None)
                for key in keys:
                    self.states.fire(key, T.ABANDON)
                log.info("not preloading %s: no slot it may take", digest)
                return
            if QOS_RANK.get(best, 3) <= QOS_RANK["gold"]:
                # gold and platinum wait for a slot to come free (a request finishing)
                self._slot_wait[digest] = (adapter, source, time.monotonic())
                return
            self._loading.pop(digest, None)
            for key in keys:
                self.states.fire(key, T.ABANDON)
            self.waiters.adapter_unavailable(
                digest, "RESOURCE_EXHAUSTED",
                f"the adapter pool ({pools.byte_budget} bytes) is held by adapters in use, "
                f"pinned, or more important than this {best}-tier request may evict; "
                "retry shortly", 1.0)
            return
        self._slot_wait.pop(digest, None)
        try:
            pools.place(adapter, pin=any(t == "platinum" for t in tiers))
        except (AdapterError, AdapterPoolFullError) as exc:
            self._loading.pop(digest, None)
            self._failed(digest, keys, f"invalid adapter: {exc}", retryable=False)
            return
        self._loading.pop(digest, None)
        self._loaded(keys, digest, source)

    def _loaded(self, keys: set[VersionKey], digest: AdapterDigest, source: Tier) -> None:
        now = time.monotonic()
        self.touch(digest)
        for key in keys:
            if self.states.fire(key, T.LOADED) is None:
                continue
            known = self._versions[key]
            self._holders.setdefault(digest, set()).add(key)
            seconds = now - known.load_started
            self.metrics.load_seconds.labels(source.value, key[0]).observe(seconds)
            self.events.emit(AdapterLoaded(worker_id=self.worker_id, adapter_id=key[0],
                                           version=key[1], sha256=digest.sha256,
                                           load_ms=seconds * 1e3, tier="device"),
                             tenant=known.choice.tenant)
        self.waiters.adapter_ready(digest)

    def retry_slot_waits(self, deadline_s: float) -> None:
        """Gold/platinum loads waiting for a slot: place them once one can be made."""
        for digest, (adapter, source, since) in list(self._slot_wait.items()):
            waited = time.monotonic() - since
            if self.room_for(adapter, lambda: self._make_room("gold")):
                self._place(digest, adapter, source)
            elif waited > deadline_s and not self.waiters.has_waiters(digest):
                self._slot_wait.pop(digest, None)
                keys = self._loading.pop(digest, set())
                for key in keys:
                    self.states.fire(key, T.ABANDON)
                log.warning("gave up loading %s: no adapter slot came free in %.0f s",
                            digest, waited)

    def room_for(self, adapter: LoraAdapter, evict_one: Callable[[], bool]) -> bool:
        """Evict (by this policy, one victim at a time) until the adapter fits the pool.

        The engine's pool evicts by plain LRU when an adapter does not fit; placing only
        what fits keeps every eviction a decision of the state machine."""
        pools = self.engine.adapters
        while not pools.fits(adapter):
            if not evict_one():
                return False
        return True

    def _make_room(self, requester_tier: str, *, background: bool = False) -> bool:
        """Evict the best idle, unpinned victim this tier may evict; False if none."""
        pools = self.engine.adapters
        candidates = []
        for digest, holders in self._holders.items():
            if not holders or not pools.is_loaded(digest):
                continue
            info = pools.info(digest)
            if (info.pinned or info.active_sequences or self.waiters.has_waiters(digest)
                    or self._gate_holds.get(digest)):
                continue
            if any(self.states.get(k) is not S.LOADED for k in holders):
                continue
            tier = min((self._versions[k].choice.qos_tier for k in holders),
                       key=lambda t: QOS_RANK.get(t, 3))
            if may_evict(requester_tier, tier, background=background):
                candidates.append(Candidate(digest, tier,
                                            self._history.setdefault(digest, AccessHistory())))
        order = eviction_order(candidates, time.monotonic())
        if not order:
            return False
        victim = order[0].key
        assert isinstance(victim, AdapterDigest)
        self._free_slot(victim, T.EVICT, "evicted: the slot went to another adapter")
        return True

    def _unload(self, digest: AdapterDigest) -> None:
        """Free a drained digest's slot; merged into the base weights, it leaves them first
        (restored from the pristine copies), so no stale delta stays behind."""
        if self.engine.merged_adapter == digest:
            self.engine.unmerge()
        self.engine.adapters.unload(digest)

    def _free_slot(self, digest: AdapterDigest, transition: Transition, reason: str,
                   kv_reason: str = "unload") -> int:
        """Transition every holder out (FREE_NOW) and unload the digest; blocks freed."""
        holders = self._holders.pop(digest, set())
        for key in holders:
            self.states.fire(key, transition)
        freed = 0
        aborted = 0
        if self.engine.adapters.is_loaded(digest):
            result = self.engine.unload_adapter(digest)
            freed, aborted = result.blocks_freed, result.sequences_aborted
            if freed or aborted:
                self.events.emit(KVInvalidated(worker_id=self.worker_id, reason=kv_reason,
                                               adapter_sha256=digest.sha256,
                                               blocks_freed=freed, sequences_aborted=aborted))
        for key in holders:
            self.states.fire(key, T.SWAPPED_OUT)
            self.events.emit(AdapterUnloaded(worker_id=self.worker_id, adapter_id=key[0],
                                             version=key[1], sha256=digest.sha256,
                                             reason=reason),
                             tenant=self._versions[key].choice.tenant)
        return freed

    # --- slots lent to quality-gate runs ------------------------------------------------

    def hold(self, digest: AdapterDigest) -> None:
        """A gate run uses this slot: it is not evicted until `release`."""
        self._gate_holds[digest] = self._gate_holds.get(digest, 0) + 1

    def release(self, digest: AdapterDigest) -> None:
        left = self._gate_holds.get(digest, 0) - 1
        if left > 0:
            self._gate_holds[digest] = left
        else:
            self._gate_holds.pop(digest, None)

    def drop_if_unheld(self, digest: AdapterDigest) -> None:
        """Unload (and zero) a slot a gate placed, unless a version or a gate holds it."""
        pools = self.engine.adapters
        if (self._holders.get(digest) or self._gate_holds.get(digest)
                or not pools.is_loaded(digest) or pools.info(digest).active_sequences):
            return
        result = self.engine.invalidate_adapter(digest)
        self._unload(digest)
        if result.blocks_freed:
            self.events.emit(KVInvalidated(worker_id=self.worker_id, reason="unload",
                                           adapter_sha256=digest.sha256,
                                           blocks_freed=result.blocks_freed))

    def room_for_gate(self, adapter: LoraAdapter) -> bool:
        """A gate is a short batch job: it may take the room of idle silver or bronze
        adapters (reloaded from the host tier when next asked for), never gold or platinum."""
        return self.room_for(adapter, lambda: self._make_room("silver"))

    # --- following the catalog -------------------------------------------------------------

    def reconcile(self, catalog: CatalogState, touched: set[str] | None = None) -> None:
        """Bring device states in line with the folded log.

        LOADED versions that may no longer be served start leaving (switch, rollback or
        disable: in-flight sequences finish first); leaving versions that are servable
        again come back; servable gold and platinum versions of this base model load
        ahead of traffic (platinum pinned).
        """
        for key, state in self.states:
            if state not in (S.LOADED, S.PENDING_SWITCH):
                continue
            if touched is not None and key[0] not in touched:
                continue
            leaving = self._leaving_transition(catalog, key)
            if state is S.LOADED and leaving is not None:
                if self.states.fire(key, leaving) is not None:
                    self._leaving[key] = leaving
            elif (state is S.PENDING_SWITCH and leaving is None
                  and self.states.fire(key, T.REACTIVATE) is not None):
                self._leaving.pop(key, None)
        if self.only_adapter is not None:
            return  # merged mode loads only its target (`services.worker.merged`)
        for adapter_id, adapter in catalog.adapters.items():
            if touched is not None and adapter_id not in touched:
                continue
            for number, version in adapter.versions.items():
                p = version.published
                if p.qos_tier not in PREFETCH_TIERS or p.base_model_digest != self.base_digest:
                    continue
                key = (adapter_id, number)
                if self.states.get(key) is not S.UNLOADED:
                    continue
                if self._leaving_transition(catalog, key) is None:
                    self.load(version_choice((adapter_id, number), version, adapter.tenant),
                              urgent=False)

    def _leaving_transition(self, catalog: CatalogState, key: VersionKey) -> Transition | None:
        """None while the version may be served; else the transition that takes it away."""
        adapter = catalog.adapters.get(key[0])
        version = adapter.versions.get(key[1]) if adapter else None
        if adapter is None or version is None:
            return T.SWITCH
        try:
            owner_choice(catalog, key, self.base_digest)
        except Refusal:
            if version.disabled:
                return T.DISABLE
            if version.rolled_back:
                return T.ROLLBACK
            return T.SWITCH
        return None

    def published(self, catalog: CatalogState, adapter_id: str, number: int) -> None:
        """Prefetch a just-published gold/platinum version of this base model to host."""
        adapter = catalog.adapters.get(adapter_id)
        version = adapter.versions.get(number) if adapter else None
        if adapter is None or version is None:
            return
        p = version.published
        if self.only_adapter not in (None, adapter_id):
            return
        if purged_reason(adapter, number, version):  # a purge read before the version
            return
        if p.qos_tier in PREFETCH_TIERS and p.base_model_digest == self.base_digest:
            self.prefetch_host(version_choice((adapter_id, number), version, adapter.tenant))

    def finish_switches(self) -> None:
        """Leaving versions whose in-flight sequences finished: invalidate, free, unload."""
        pools = self.engine.adapters
        for key in self.states.in_state(S.PENDING_SWITCH):
            digest = self._versions[key].digest
            if pools.is_loaded(digest) and pools.info(digest).active_sequences:
                continue
            transition = self._leaving.pop(key, T.SWITCH)
            reason = LEAVING_REASON[transition]
            self.states.fire(key, T.DRAINED)
            holders = self._holders.get(digest, set())
            holders.discard(key)
            still_served = any(self.states.get(k) in HOLDS_SLOT for k in holders)
            if not still_served and pools.is_loaded(digest):
                result = self.engine.invalidate_adapter(digest)
                self.events.emit(KVInvalidated(
                    worker_id=self.worker_id, reason=reason, adapter_sha256=digest.sha256,
                    blocks_freed=result.blocks_freed, sequences_aborted=0))
            self.states.fire(key, T.RELEASE)
            if not still_served and pools.is_loaded(digest):
                self._unload(digest)
                self._holders.pop(digest, None)
            self.states.fire(key, T.SWAPPED_OUT)
            self.events.emit(AdapterUnloaded(worker_id=self.worker_id, adapter_id=key[0],
                                             version=key[1], sha256=digest.sha256,
                                             reason=f"{reason}: no longer served"),
                             tenant=self._versions[key].choice.tenant)

    # --- purge -----------------------------------------------------------------------------

    def purge(self, catalog: CatalogState, purge: Purge) -> TenantPurged | None:
        """Free everything of a tenant in every tier and say so; once per purge id.

        The engine aborts the tenant's sequences and frees and zeroes its KV blocks;
        its versions leave the device (slots zeroed), the host tier (tensors zeroed) and
        the disk tier (files overwritten, then removed); queued fetches are cancelled.
        The ack says whether every reference the engine held for the tenant is gone.
        """
        if purge.purge_id in self._handled_purges or purge.tenant is None:
            return None
        self._handled_purges.add(purge.purge_id)
        tenant = purge.tenant
        result = self.engine.purge_tenant(tenant.key)
        blocks = result.blocks_freed
        digests: dict[AdapterDigest, list[VersionKey]] = {}
        for adapter_id, adapter in catalog.adapters.items():
            if adapter.tenant != tenant:
                continue
            for number, version in adapter.versions.items():
                p = version.published
                digests.setdefault(AdapterDigest(p.sha256, p.config_sha256), []).append(
                    (adapter_id, number))
        self.loader.cancel(set(digests))
        removed: set[VersionKey] = set()
        for digest, keys in digests.items():
            self._slot_wait.pop(digest, None)
            for key in keys:
                if self.states.get(key) is S.LOADING:
                    self.states.fire(key, T.PURGE)
                    removed.add(key)
            self._loading.pop(digest, None)
            self._prefetching.pop(digest, None)
            holders = self._holders.get(digest, set())
            ours = {k for k in holders if k in set(keys)}
            others = holders - ours
            if ours and not others:
                blocks += self._free_slot(digest, T.PURGE, "purge: tenant purged", "purge")
                removed |= ours
            elif ours:  # same bytes still serve another tenant's version: leave the slot
                for key in ours:
                    self.states.fire(key, T.PURGE)
                    self.states.fire(key, T.SWAPPED_OUT)
                holders -= ours
                removed |= ours
            if self.host.discard(digest, scrub=True):
                removed.update(keys)
            if self.disk.discard(digest.sha256, scrub=True):
                removed.update(keys)
            self.disk.discard(digest.config_sha256, scrub=True)
            self.waiters.adapter_unavailable(digest, "UNAVAILABLE",
                                             f"tenant {tenant.key} was purged", 1.0)
        active = sum(self.engine.adapters.info(d).active_sequences for d in digests
                     if self.engine.adapters.is_loaded(d))
        refcounts_zero = self.engine.tenant_references(tenant.key) == 0 and active == 0
        self.events.emit(KVInvalidated(worker_id=self.worker_id, reason="purge",
                                       tenant_key=tenant.key, blocks_freed=blocks,
                                       sequences_aborted=result.sequences_aborted),
                         tenant=tenant)
        ack = TenantPurged(worker_id=self.worker_id, purge_id=purge.purge_id,
                           kv_blocks_freed=blocks, adapters_unloaded=len(removed),
                           sequences_aborted=result.sequences_aborted,
                           refcounts_zero=refcounts_zero)
        self.events.emit(ack, tenant=tenant)
        log.info("purged tenant %s (purge %s): %d KV blocks, %d adapter versions, %d "
                 "sequences aborted, refcounts zero: %s", tenant.key, purge.purge_id, blocks,
                 len(removed), result.sequences_aborted, refcounts_zero)
        return ack

    def mark_purge_handled(self, purge_id: str) -> None:
        self._handled_purges.add(purge_id)

    def replay_purge(self, catalog: CatalogState, purge: Purge, *, expected: bool) -> None:
        """A purge this worker never acknowledged (it was down, or died mid-purge).

        A fresh process holds nothing in memory; the disk tier may still hold the
        tenant's files from before the purge: those are scrubbed (files written after the
        purge was requested are later, legitimate fetches and stay). Acknowledged only if
        the purge waited for this worker.
        """
        if purge.tenant is None or purge.purge_id in self._handled_purges:
            return
        self._handled_purges.add(purge.purge_id)
        cutoff = purge.requested_at.timestamp()
        removed = 0
        for adapter in catalog.adapters.values():
            if adapter.tenant != purge.tenant:
                continue
            for version in adapter.versions.values():
                p = version.published
                for digest in (p.sha256, p.config_sha256):
                    path = self.disk.path_of(digest)
                    try:
                        old = path.stat().st_mtime <= cutoff
                    except FileNotFoundError:
                        continue
                    if old and self.disk.discard(digest, scrub=True) and digest == p.sha256:
                        removed += 1
        if expected:
            self.events.emit(TenantPurged(
                worker_id=self.worker_id, purge_id=purge.purge_id, kv_blocks_freed=0,
                adapters_unloaded=removed, sequences_aborted=0,
                refcounts_zero=self.engine.tenant_references(purge.tenant.key) == 0),
                tenant=purge.tenant)

    # --- reporting ---------------------------------------------------------------------------

    def restore_failed(self, catalog: CatalogState, failed: dict[VersionKey, str]) -> None:
        """Versions this worker found bad before a restart stay FAILED (not fetched again)."""
        for key, error in failed.items():
            adapter = catalog.adapters.get(key[0])
            version = adapter.versions.get(key[1]) if adapter else None
            if version is None or self.states.get(key) is not S.UNLOADED:
                continue
            known = self._remember(version_choice(key, version, adapter.tenant))
            known.failure = error
            self.states.restore(key, S.FAILED)

    def loaded_report(self, catalog: CatalogState) -> list[LoadedAdapter]:
        """Every version of this base model this worker holds, at its nearest tier."""
        out: dict[VersionKey, LoadedAdapter] = {}
        host = self.host.digests()
        disk = self.disk.digests()
        for key, state in self.states:
            if state in HOLDS_SLOT:
                known = self._versions[key]
                out[key] = LoadedAdapter(adapter_id=key[0], version=key[1],
                                         sha256=known.choice.sha256, tier="device")
        for adapter_id, adapter in catalog.adapters.items():
            for number, version in adapter.versions.items():
                p = version.published
                key = (adapter_id, number)
                if key in out or p.base_model_digest != self.base_digest:
                    continue
                digest = AdapterDigest(p.sha256, p.config_sha256)
                if digest in host:
                    tier = "host"
                elif p.sha256 in disk and p.config_sha256 in disk:
                    tier = "disk"
                else:
                    continue
                out[key] = LoadedAdapter(adapter_id=adapter_id, version=number,
                                         sha256=p.sha256, tier=tier)
        counts = {"device": 0, "host": 0, "disk": 0}
        for item in out.values():
            counts[item.tier] += 1
        for tier, n in counts.items():
            self.metrics.adapters.labels(tier).set(n)
        by_state: dict[str, int] = {s.value: 0 for s in AdapterState}
        for _, state in self.states:
            by_state[state.value] += 1
        for name, n in by_state.items():
            self.metrics.adapter_states.labels(name).set(n)
        return sorted(out.values(), key=lambda a: (a.adapter_id, a.version))


def utc_now() -> datetime:
    return datetime.now(UTC)
