"""Merged mode: a worker dedicated to one hot adapter, merged into its base weights.

`loraplane serve worker --merge ADAPTER[@VERSION]` (`LORAPLANE_WORKER_MERGE`). The engine
folds the adapter's delta into the base projections (`Engine.merge_adapter`), so its
requests do no LoRA work at all; this module decides *which* version is merged, from the
log, and *when* the weights may change. It runs in the engine loop thread only.

Which version (`services.catalog.serving.merge_target`, the rule the router applies too):
with `@VERSION` that version while the serving rule allows it; with a bare adapter id the
adapter's active version, so a switch or a rollback re-merges. Nothing is merged while no
version may be served (not published yet, disabled, rolled back or switched away from a
pinned version, its tenant purged, built for another base model, gated).

When: a new target is loaded into a slot through the adapter state machine like any
version (fetched and checked against its digest), then merged once no request admitted
for other weights is still running (the previous version's requests finish on the
weights they were admitted for). Every merge starts from pristine copies of the base
weights, so a re-merge never accumulates rounding. A version that stops being servable
leaves through its usual transition (switch, rollback, disable: in-flight requests
finish, then its KV is invalidated; purge: aborted now), and its slot is freed only after
the base weights are restored (`Residency._unload`, `Engine.unload_adapter`).

What it serves, decided here and documented in docs/worker.md: only its target, merged. A
request for another adapter, another version of this one, or the bare base model is
refused with FAILED_PRECONDITION naming what this worker serves: merged weights would
give wrong output, and the router, which applies the same rule to the heartbeat's
`merged_mode`, never sends them. When nothing is merged (say, the version was disabled)
the worker stays dedicated and serves nothing rather than becoming a general worker:
re-merging later would then have to drain other tenants' traffic first, and an operator
who dedicated a machine to an adapter expects it back as soon as the adapter is. Requests
for the target that arrive before the merge wait for it, like a page-in.
"""

from __future__ import annotations

import logging
import time

from services.catalog.serving import MergeSpec, ServingChoice, merge_target
from services.catalog.state import CatalogState, Refusal
from services.contracts.events import MergedMode
from services.worker.engine import AdapterDigest, Engine
from services.worker.lifecycle import AdapterState, VersionKey
from services.worker.metrics import WorkerMetrics
from services.worker.residency import Residency

log = logging.getLogger("loraplane.worker.merged")


def digest_of(choice: ServingChoice) -> AdapterDigest:
    return AdapterDigest(choice.sha256, choice.config_sha256)


def key_of(choice: ServingChoice) -> VersionKey:
    return (choice.adapter_id, choice.version)


class MergedServing:
    """The merged-mode state of one worker: target, merged version, and the steps between."""

    def __init__(self, spec: MergeSpec, engine: Engine, residency: Residency,
                 metrics: WorkerMetrics) -> None:
        self.spec = spec
        self.engine = engine
        self.residency = residency
        self.metrics = metrics
        self.target: ServingChoice | None = None
        """The version to serve merged, by the log (None: none may be served now)."""
        self.why_none = "the adapter log has not been read yet"
        """Why there is no target, when there is none."""
        self.merged: ServingChoice | None = None
        """The version in the base weights now."""

    # --- what this worker serves ---------------------------------------------------------

    @property
    def serving(self) -> bool:
        """The target is merged: its requests run now."""
        return self.target is not None and self.merged == self.target

    def describe(self) -> str:
        if self.target is None:
            return f"nothing merged now ({self.why_none})"
        if self.why_none:
            return f"{self.target.pinned} ({self.why_none})"
        state = "merged" if self.serving else "being merged"
        return f"{self.target.pinned} ({state})"

    def serves(self, adapter_id: str) -> bool:
        """Is `adapter_id` the one adapter this worker serves (any of its versions)?"""
        return adapter_id == self.spec.adapter_id

    def ready(self) -> AdapterDigest | None:
        """The digest whose waiting requests may start now: the target's, once merged."""
        return digest_of(self.target) if self.serving and self.target is not None else None

    def gate_refusal(self, worker_id: str) -> str:
        """Why this worker runs no quality gate."""
        return (f"worker {worker_id} is in merged mode for {self.spec}: its weights hold "
                "that adapter, so it cannot run the base model or other versions")

    def refusal(self, choice: ServingChoice | None) -> str | None:
        """Why this worker does not serve a request resolved to `choice`; None when it
        does (now, or once the target is merged)."""
        what = (f"this worker serves only adapter {self.spec} merged into its base weights "
                f"(--merge): {self.describe()}")
        if choice is None:
            return f"{what}; send base model requests to another worker"
        if choice.adapter_id != self.spec.adapter_id:
            return f"{what}; {choice.pinned} is served by other workers"
        if self.target is None or key_of(choice) != key_of(self.target):
            return f"{what}; {choice.pinned} is not that version"
        return None

    def report(self) -> MergedMode:
        """The heartbeat's `merged_mode`."""
        merged = self.merged
        return MergedMode(adapter_id=self.spec.adapter_id, pinned_version=self.spec.version,
                          version=merged.version if merged else None,
                          sha256=merged.sha256 if merged else None)

    # --- following the log ---------------------------------------------------------------

    def follow(self, catalog: CatalogState) -> None:
        """Recompute the target from the fold and start loading a new one."""
        try:
            target: ServingChoice | None = merge_target(catalog, self.spec,
                                                        base_digest=self.engine.base_digest)
        except Refusal as refusal:
            target, why = None, refusal.message
        else:
            why = ""
        if target != self.target or (target is None and why != self.why_none):
            if target is None:
                log.warning("merged mode %s: nothing to serve: %s", self.spec, why)
            else:
                log.info("merged mode %s: serving %s (sha256 %s) once merged", self.spec,
                         target.pinned, target.sha256[:16])
        self.target, self.why_none = target, why
        if target is None:
            return
        state = self.residency.state(key_of(target))
        if state is AdapterState.FAILED:
            self.why_none = (f"{target.pinned} failed to load on this worker: "
                             f"{self.residency.failure(key_of(target))}")
        elif state is AdapterState.UNLOADED:
            self.residency.load(target, urgent=True)

    def advance(self) -> bool:
        """Bring the base weights in line with the target as far as the engine allows
        now; True when the target has just been merged (its waiting requests may start)."""
        engine = self.engine
        if self.merged is not None and engine.merged_adapter != digest_of(self.merged):
            self._unmerged("its slot was freed")  # residency restored the weights
        target = self.target
        if self.merged is not None and (target is None or key_of(self.merged) != key_of(target)):
            digest = digest_of(self.merged)
            pools = engine.adapters
            busy = pools.is_loaded(digest) and pools.info(digest).active_sequences
            if not busy:  # its requests finished on the weights they were admitted for
                engine.unmerge()
                self._unmerged("no longer the version to serve")
        if target is None or self.serving:
            return False
        digest = digest_of(target)
        if (self.residency.state(key_of(target)) is not AdapterState.LOADED
                or engine.merge_blockers(digest)):
            return False
        started = time.perf_counter()
        engine.merge_adapter(digest)
        self.merged = target
        self.metrics.merged_version.labels(target.adapter_id).set(target.version)
        self.metrics.merges.inc()
        log.info("merged mode %s: merged %s (sha256 %s) into the base weights in %.1f ms",
                 self.spec, target.pinned, target.sha256[:16],
                 (time.perf_counter() - started) * 1e3)
        return True

    def _unmerged(self, why: str) -> None:
        assert self.merged is not None
        log.info("merged mode %s: unmerged %s (%s): base weights restored", self.spec,
                 self.merged.pinned, why)
        self.metrics.merged_version.labels(self.merged.adapter_id).set(0)
        self.merged = None
