"""The pure fold from events to current-state and history rows. No SQL in here.

The projector keeps a `FoldState` for as long as it holds its consumer: the current rows
of every key (adapter, alias, worker) it has touched, loaded from PostgreSQL the first
time a batch touches a key and kept in memory after that. The projector is the only
writer of these tables (fenced by its advisory lock and offset check), so the cached
rows are the stored rows plus what is not yet committed; on any failure it drops the
state and loads again. `apply` changes rows in place and records which changed and
which history rows to append; `take_changes` hands those to one batch's transaction.
Folding in memory keeps a batch at a handful of statements however many events it
holds, and keeps the rules testable without a database.

Payloads are read by field name with defaults (`getattr`), because producers may add
optional fields at any time; a missing field is a NULL, never a crash.

Personal fields: request traces' `user_id` is stored as the sealed token of the stored
event (`services.audit.sealing`; the fold is handed the stored values). Labels, owners and
reasons are kept readable in the current-state and history tables, for the compliance
views, and replaced by `[erased]` for every row dated at or before a purge of its tenant
(`purged_at`): when the purge is folded (rows in memory, and an UPDATE of the stored
ones in the same transaction), and whenever a row is loaded or written later.

Activation rule (shared with the `rollback_candidates` view and the registry's default
rollback target): a version becomes an adapter's active version only through
AdapterVersionSwitched.to_version or AdapterRolledBack.to_version; the version that was
active before is deactivated. Traffic splits are recorded in the lineage but do not
change the active version.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from services.audit.sealing import ERASED
from services.catalog.purge import deadline_of
from services.contracts.events import PAYLOAD_TYPES, TenantRef
from services.contracts.structs import AnyEnvelope

Row = dict[str, Any]
VersionKey = tuple[str, int]


def _get(obj: Any, name: str, default: Any = None) -> Any:
    return getattr(obj, name, default)


@dataclass(frozen=True)
class TouchedKeys:
    """The keys whose current rows a batch must load before folding."""

    adapter_ids: frozenset[str]
    aliases: frozenset[str]
    worker_ids: frozenset[str]


def touched_keys(envelopes: Iterable[AnyEnvelope]) -> TouchedKeys:
    adapter_ids: set[str] = set()
    alias_names: set[str] = set()
    worker_ids: set[str] = set()
    for envelope in envelopes:
        p = envelope.payload
        kind = envelope.type
        if kind in ADAPTER_STATE_TYPES:
            adapter_ids.add(_get(p, "adapter_id"))
        elif kind == "TrafficSplitChanged":
            alias_names.add(_get(p, "alias"))
            for entry in [*(_get(p, "split") or ()), *(_get(p, "previous") or ())]:
                adapter_ids.add(_get(entry, "adapter_id"))
        elif kind in WORKER_ID_TYPES:
            worker_ids.add(p.worker_id)
    return TouchedKeys(frozenset(adapter_ids), frozenset(alias_names), frozenset(worker_ids))


ADAPTER_STATE_TYPES = frozenset({"AdapterVersionPublished", "AdapterVersionSwitched",
                                 "AdapterRolledBack", "AdapterDisabled", "AdapterEnabled"})
WORKER_ID_TYPES = frozenset(t for t, cls in PAYLOAD_TYPES.items()
                            if "worker_id" in cls.model_fields)
"""Event types whose payload names a worker (heartbeats, acks, traces, gate results)."""


@dataclass
class Changes:
    """What one batch changed: current rows to overwrite (copies, so folding the next batch
    cannot alter them) and history rows to append."""

    adapters: list[Row]
    versions: list[Row]
    aliases: list[Row]
    workers: list[Row]
    worker_adapters: dict[str, list[Row]]
    """worker_id → its complete set of rows (replaces what is stored)."""
    version_history: list[Row]
    split_history: list[Row]
    worker_heartbeats: list[Row]
    worker_acks: list[Row]
    purges: list[Row]
    purge_blobs: list[Row]
    """Blob erasures to record on their (already written) purge rows."""
    erasures: list[Row]
    """Tenants purged in this batch: their stored rows dated at or before `requested_at`
    get `[erased]` in place of labels, owners and reasons."""
    request_traces: list[tuple[Any, ...]]
    """Values in `TRACE_COLUMNS` order."""


@dataclass
class FoldState:
    """Current rows of the keys loaded so far, changed in place, plus rows to append."""

    adapters: dict[str, Row] = field(default_factory=dict)
    versions: dict[VersionKey, Row] = field(default_factory=dict)
    aliases: dict[str, Row] = field(default_factory=dict)
    workers: dict[str, Row] = field(default_factory=dict)
    worker_adapters: dict[str, dict[VersionKey, Row]] = field(default_factory=dict)
    loaded: TouchedKeys = field(default_factory=lambda: TouchedKeys(
        frozenset(), frozenset(), frozenset()))
    """Keys whose stored rows (if any) are in the dicts above."""
    dirty_adapters: set[str] = field(default_factory=set)
    dirty_versions: set[VersionKey] = field(default_factory=set)
    dirty_aliases: set[str] = field(default_factory=set)
    dirty_workers: set[str] = field(default_factory=set)
    dirty_worker_adapters: set[str] = field(default_factory=set)
    version_history: list[Row] = field(default_factory=list)
    split_history: list[Row] = field(default_factory=list)
    worker_heartbeats: list[Row] = field(default_factory=list)
    worker_acks: list[Row] = field(default_factory=list)
    purges: list[Row] = field(default_factory=list)
    purge_blobs: list[Row] = field(default_factory=list)
    erasures: list[Row] = field(default_factory=list)
    request_traces: list[tuple[Any, ...]] = field(default_factory=list)
    unloaded: dict[str, dict[VersionKey, Any]] = field(default_factory=dict)
    """worker_id → adapter versions it unloaded after its newest heartbeat, and when: a
    heartbeat read later but sent earlier must not bring them back. Memory only: lost on
    a reload, and then corrected by the worker's next heartbeat."""
    purged_at: dict[tuple[str, str, str], datetime] = field(default_factory=dict)
    """Tenant → its latest purge request (loaded once with the projector's state)."""
    heartbeat_lists: dict[str, tuple[Any, datetime]] = field(default_factory=dict)
    """worker_id → the list of held adapters of its newest heartbeat and when it was sent,
    not yet folded into `worker_adapters`. A worker sends many heartbeats between two
    acks, and each replaces the whole set, so only the last of a run is ever built into
    rows: when an ack reads the set, or when `take_changes` hands it over (`held`)."""

    def missing(self, keys: TouchedKeys) -> TouchedKeys:
        """The touched keys not loaded yet."""
        return TouchedKeys(keys.adapter_ids - self.loaded.adapter_ids,
                           keys.aliases - self.loaded.aliases,
                           keys.worker_ids - self.loaded.worker_ids)

    def mark_loaded(self, keys: TouchedKeys) -> None:
        self.loaded = TouchedKeys(self.loaded.adapter_ids | keys.adapter_ids,
                                  self.loaded.aliases | keys.aliases,
                                  self.loaded.worker_ids | keys.worker_ids)

    def take_changes(self) -> Changes:
        """Everything changed since the last call, in key order; resets the change log."""
        for worker_id in list(self.heartbeat_lists):
            self.held(worker_id)
        changes = Changes(
            adapters=[dict(self.adapters[k]) for k in sorted(self.dirty_adapters)],
            versions=[dict(self.versions[k]) for k in sorted(self.dirty_versions)],
            aliases=[dict(self.aliases[k]) for k in sorted(self.dirty_aliases)],
            workers=[dict(self.workers[k]) for k in sorted(self.dirty_workers)],
            # worker_adapters rows are never changed in place, only replaced
            worker_adapters={w: list(self.worker_adapters.get(w, {}).values())
                             for w in sorted(self.dirty_worker_adapters)},
            version_history=self.version_history, split_history=self.split_history,
            worker_heartbeats=self.worker_heartbeats, worker_acks=self.worker_acks,
            purges=self.purges, purge_blobs=self.purge_blobs, erasures=self.erasures,
            request_traces=self.request_traces)
        for dirty in (self.dirty_adapters, self.dirty_versions, self.dirty_aliases,
                      self.dirty_workers, self.dirty_worker_adapters):
            dirty.clear()
        self.version_history, self.split_history, self.worker_heartbeats = [], [], []
        self.worker_acks, self.purges, self.request_traces = [], [], []
        self.purge_blobs, self.erasures = [], []
        return changes

    def held(self, worker_id: str) -> dict[VersionKey, Row]:
        """The worker's current `worker_adapters` rows, its newest heartbeat folded in;
        the caller may change them."""
        self.dirty_worker_adapters.add(worker_id)
        rows = self.worker_adapters.setdefault(worker_id, {})
        pending = self.heartbeat_lists.pop(worker_id, None)
        if pending is not None:
            _replace_held(self, worker_id, rows, *pending)
        return rows

    # --- erasure ----------------------------------------------------------------------

    def erased_before(self, tenant: TenantRef | tuple[Any, Any, Any] | None) -> datetime | None:
        if tenant is None:
            return None
        key = tenant if isinstance(tenant, tuple) else (tenant.org, tenant.team, tenant.project)
        return self.purged_at.get(key)

    def scrub_version(self, row: Row) -> None:
        """`[erased]` for a version's free text dated at or before its tenant's purge."""
        purged = self.erased_before((row["tenant_org"], row["tenant_team"],
                                     row["tenant_project"]))
        if purged is None or row["published_at"] is None or row["published_at"] > purged:
            return
        for name in ("label", "owner"):
            row[name] = ERASED
        if row["disabled_reason"] is not None and (
                row["disabled_at"] is None or row["disabled_at"] <= purged):
            row["disabled_reason"] = ERASED

    # --- rows, created on first touch ---------------------------------------------------

    def adapter(self, adapter_id: str, envelope: AnyEnvelope) -> Row:
        row = self.adapters.get(adapter_id)
        if row is None:
            tenant = envelope.tenant
            row = self.adapters[adapter_id] = {
                "adapter_id": adapter_id, "tenant_org": tenant.org if tenant else None,
                "tenant_team": tenant.team if tenant else None,
                "tenant_project": tenant.project if tenant else None,
                "latest_version": None, "active_version": None,
                "previous_active_version": None}
        row["updated_at"] = envelope.occurred_at
        row["last_event_id"] = envelope.event_id
        self.dirty_adapters.add(adapter_id)
        return row

    def version(self, adapter_id: str, version: int, envelope: AnyEnvelope) -> Row:
        key = (adapter_id, version)
        row = self.versions.get(key)
        if row is None:  # an event about a version whose publish we have not seen
            row = self.versions[key] = {
                "adapter_id": adapter_id, "version": version, **dict.fromkeys(
                    ("label", "base_model", "base_model_digest", "sha256", "config_sha256",
                     "size_bytes", "rank", "qos_tier", "owner", "rollback_to", "tenant_org",
                     "tenant_team", "tenant_project", "published_at", "published_by",
                     "publish_event_id", "first_activated_at", "last_activated_at",
                     "deactivated_at", "disabled_at", "disabled_reason")),
                "status": "published", "is_active": False, "disabled": False}
        row["updated_at"] = envelope.occurred_at
        self.dirty_versions.add(key)
        return row

    def worker(self, worker_id: str, envelope: AnyEnvelope) -> Row:
        row = self.workers.get(worker_id)
        if row is None:
            row = self.workers[worker_id] = {
                "worker_id": worker_id, "address": None, "base_model": None,
                "base_model_digest": None, "first_seen_at": envelope.occurred_at,
                "last_heartbeat_at": None, "last_event_at": envelope.occurred_at,
                "free_slots": None, "free_kv_blocks": None, "lease_epoch": None,
                "base_weights": "dense"}
        if row["last_event_at"] is None or envelope.occurred_at > row["last_event_at"]:
            row["last_event_at"] = envelope.occurred_at
        if envelope.occurred_at < row["first_seen_at"]:
            row["first_seen_at"] = envelope.occurred_at  # topics are read at their own pace
        self.dirty_workers.add(worker_id)
        return row

    def history(self, envelope: AnyEnvelope, adapter_id: str, version: int, action: str,
                **extra: Any) -> None:
        reason = extra.get("reason")
        tenant = envelope.tenant
        purged = self.erased_before(tenant)
        if reason and purged is not None and envelope.occurred_at <= purged:
            reason = ERASED
        self.version_history.append({
            "event_id": envelope.event_id, "adapter_id": adapter_id, "version": version,
            "action": action, "at": envelope.occurred_at, "actor": envelope.actor,
            "alias": extra.get("alias"), "weight": extra.get("weight"),
            "reason": reason,
            "tenant": (tenant.org, tenant.team, tenant.project) if tenant else None})


def _status(row: Row) -> str:
    if row["disabled"]:
        return "disabled"
    if row["is_active"]:
        return "active"
    return "inactive" if row["first_activated_at"] is not None else "published"


def _activate(state: FoldState, envelope: AnyEnvelope, adapter_id: str, to_version: int,
              from_hint: int | None) -> None:
    adapter = state.adapter(adapter_id, envelope)
    at = envelope.occurred_at
    previous = adapter["active_version"] if adapter["active_version"] is not None else from_hint
    if previous is not None and previous != to_version:
        old = state.version(adapter_id, previous, envelope)
        old["is_active"] = False
        old["deactivated_at"] = at
        old["status"] = _status(old)
        state.history(envelope, adapter_id, previous, "deactivated")
        adapter["previous_active_version"] = previous
    new = state.version(adapter_id, to_version, envelope)
    new["is_active"] = True
    new["first_activated_at"] = new["first_activated_at"] or at
    new["last_activated_at"] = at
    new["status"] = _status(new)
    adapter["active_version"] = to_version
    state.history(envelope, adapter_id, to_version, "activated")


def _on_published(state: FoldState, e: AnyEnvelope) -> None:
    p = e.payload
    adapter_id, version = _get(p, "adapter_id"), _get(p, "version")
    adapter = state.adapter(adapter_id, e)
    if adapter["latest_version"] is None or version > adapter["latest_version"]:
        adapter["latest_version"] = version
    row = state.version(adapter_id, version, e)
    tenant = e.tenant
    row.update({
        "label": _get(p, "label"), "base_model": _get(p, "base_model"),
        "base_model_digest": _get(p, "base_model_digest"), "sha256": _get(p, "sha256"),
        "config_sha256": _get(p, "config_sha256"), "size_bytes": _get(p, "size_bytes"),
        "rank": _get(p, "rank"), "qos_tier": _get(p, "qos_tier"), "owner": _get(p, "owner"),
        "rollback_to": _get(p, "rollback_to"),
        "tenant_org": tenant.org if tenant else None,
        "tenant_team": tenant.team if tenant else None,
        "tenant_project": tenant.project if tenant else None,
        "published_at": e.occurred_at, "published_by": e.actor, "publish_event_id": e.event_id})
    state.scrub_version(row)
    state.history(e, adapter_id, version, "published")


def _split_rows(split: Any) -> list[Row]:
    return [{"adapter_id": _get(s, "adapter_id"), "version": _get(s, "version"),
             "weight": _get(s, "weight")} for s in (split or ())]


def _on_split(state: FoldState, e: AnyEnvelope) -> None:
    p = e.payload
    alias = _get(p, "alias")
    new = _split_rows(_get(p, "split"))
    current = state.aliases.get(alias)
    previous = current["split"] if current else _split_rows(_get(p, "previous"))
    state.aliases[alias] = {"alias": alias, "split": new, "changed_at": e.occurred_at,
                            "changed_by": e.actor, "event_id": e.event_id}
    state.dirty_aliases.add(alias)
    for position, entry in enumerate(new):
        state.split_history.append({"event_id": e.event_id, "alias": alias,
                                    "position": position, **entry,
                                    "changed_at": e.occurred_at, "actor": e.actor})
        state.history(e, entry["adapter_id"], entry["version"], "split", alias=alias,
                      weight=entry["weight"])
    kept = {(s["adapter_id"], s["version"]) for s in new}
    for entry in previous:
        if (entry["adapter_id"], entry["version"]) not in kept:
            state.history(e, entry["adapter_id"], entry["version"], "split", alias=alias,
                          weight=0)


def _on_switched(state: FoldState, e: AnyEnvelope) -> None:
    p = e.payload
    _activate(state, e, _get(p, "adapter_id"), _get(p, "to_version"), _get(p, "from_version"))


def _on_rolled_back(state: FoldState, e: AnyEnvelope) -> None:
    p = e.payload
    adapter_id, reason = _get(p, "adapter_id"), _get(p, "reason")
    from_version, to_version = _get(p, "from_version"), _get(p, "to_version")
    if from_version is not None:
        state.version(adapter_id, from_version, e)
        state.history(e, adapter_id, from_version, "rolled_back", reason=reason)
    state.version(adapter_id, to_version, e)
    state.history(e, adapter_id, to_version, "rollback_target", reason=reason)
    _activate(state, e, adapter_id, to_version, from_version)


def _on_disabled(state: FoldState, e: AnyEnvelope) -> None:
    p = e.payload
    row = state.version(_get(p, "adapter_id"), _get(p, "version"), e)
    row.update(disabled=True, disabled_at=e.occurred_at, disabled_reason=_get(p, "reason"))
    state.scrub_version(row)
    row["status"] = _status(row)
    state.history(e, row["adapter_id"], row["version"], "disabled", reason=_get(p, "reason"))


def _on_enabled(state: FoldState, e: AnyEnvelope) -> None:
    p = e.payload
    row = state.version(_get(p, "adapter_id"), _get(p, "version"), e)
    row["disabled"] = False
    row["status"] = _status(row)
    state.history(e, row["adapter_id"], row["version"], "enabled", reason=_get(p, "reason"))


def _on_purge_requested(state: FoldState, e: AnyEnvelope) -> None:
    p = e.payload
    tenant = e.tenant
    deadline_s = float(_get(p, "deadline_s", 60.0))
    state.purges.append({
        "purge_id": _get(p, "purge_id"), "tenant_org": tenant.org if tenant else None,
        "tenant_team": tenant.team if tenant else None,
        "tenant_project": tenant.project if tenant else None,
        "requested_at": e.occurred_at, "requested_by": e.actor, "deadline_s": deadline_s,
        "deadline_at": deadline_of(e.occurred_at, deadline_s),
        "hard": bool(_get(p, "hard", True)), "event_id": e.event_id,
        "expected_workers": list(_get(p, "expected_workers") or ())})
    if tenant is None:
        return
    key = (tenant.org, tenant.team, tenant.project)
    prior = state.purged_at.get(key)
    if prior is not None and e.occurred_at <= prior:
        return  # an older purge read late: the newer one erased as much already
    state.purged_at[key] = e.occurred_at
    state.erasures.append({"tenant_org": tenant.org, "tenant_team": tenant.team,
                           "tenant_project": tenant.project, "requested_at": e.occurred_at})
    for vkey, row in state.versions.items():
        if (row["tenant_org"], row["tenant_team"], row["tenant_project"]) == key:
            before = (row["label"], row["owner"], row["disabled_reason"])
            state.scrub_version(row)
            if (row["label"], row["owner"], row["disabled_reason"]) != before:
                state.dirty_versions.add(vkey)
    for h in state.version_history:  # this batch's rows (the UPDATE covers stored ones)
        if h["reason"] and h["tenant"] == key and h["at"] <= e.occurred_at:
            h["reason"] = ERASED


def _on_blobs_deleted(state: FoldState, e: AnyEnvelope) -> None:
    p = e.payload
    state.purge_blobs.append({"purge_id": _get(p, "purge_id"),
                              "blobs_deleted": list(_get(p, "deleted") or ()),
                              "blobs_kept": list(_get(p, "kept") or ()),
                              "blobs_event_id": e.event_id})


def _newer_than_heartbeat(state: FoldState, worker_id: str, e: AnyEnvelope) -> bool:
    last = state.workers[worker_id]["last_heartbeat_at"]
    return last is None or e.occurred_at > last


def _on_heartbeat(state: FoldState, e: AnyEnvelope) -> None:
    """Heartbeats come from the liveness topic, read at another pace than the worker's
    acks, so everything here goes by timestamp: only the newest heartbeat updates the
    summary, and its list of what the worker holds gives way to loads and unloads acked
    after it was sent. Any order of reading gives the same rows."""
    p = e.payload
    worker_id = _get(p, "worker_id")
    row = state.worker(worker_id, e)
    state.worker_heartbeats.append({"event_id": e.event_id, "worker_id": worker_id,
                                    "at": e.occurred_at})
    if not _newer_than_heartbeat(state, worker_id, e):
        return
    at = e.occurred_at
    row.update({"address": _get(p, "address"), "base_model": _get(p, "base_model"),
                "base_model_digest": _get(p, "base_model_digest"),
                "free_slots": _get(p, "free_slots"), "free_kv_blocks": _get(p, "free_kv_blocks"),
                "lease_epoch": _get(p, "lease_epoch"), "last_heartbeat_at": at,
                "base_weights": _get(p, "base_weights", "dense")})
    # Built when the set is next read (`FoldState.held`): a newer heartbeat replaces this
    # one first. Nothing else changes the set or `unloaded` in between, so the rows come
    # out as if each heartbeat had been folded in turn.
    state.dirty_worker_adapters.add(worker_id)
    state.heartbeat_lists[worker_id] = (_get(p, "loaded") or (), at)


def _replace_held(state: FoldState, worker_id: str, held: dict[VersionKey, Row],
                  loaded: Iterable[Any], at: datetime) -> None:
    """Fold one heartbeat's list into the worker's set. A heartbeat is the worker's own
    full list: it replaces what older acks implied. Each row's `since` is the time of the
    fact it comes from (this heartbeat, or a load acked after it): "first seen" would
    depend on which topic a reader happened to read first."""
    unloaded = state.unloaded.get(worker_id, {})
    snapshot: dict[VersionKey, Row] = {}
    for entry in loaded:  # the hottest loop: getattr without a call
        key = (getattr(entry, "adapter_id", None), getattr(entry, "version", None))
        if key in unloaded and unloaded[key] > at:
            continue
        snapshot[key] = {"worker_id": worker_id, "adapter_id": key[0], "version": key[1],
                         "sha256": getattr(entry, "sha256", None),
                         "tier": getattr(entry, "tier", None), "since": at,
                         "source": "heartbeat"}
    for key, before in held.items():  # loaded after this heartbeat was sent
        if before["source"] == "loaded" and before["since"] > at:
            snapshot.setdefault(key, before)
    if unloaded:
        state.unloaded[worker_id] = {k: t for k, t in unloaded.items() if t > at}
    held.clear()
    held.update(snapshot)


def _ack(state: FoldState, e: AnyEnvelope, **columns: Any) -> None:
    p = e.payload
    state.worker(_get(p, "worker_id"), e)
    row = dict.fromkeys(("adapter_id", "version", "adapter_sha256", "purge_id", "tenant_key",
                         "reason", "error", "load_ms", "kv_blocks_freed", "adapters_unloaded",
                         "sequences_aborted", "refcounts_zero"))
    row.update(event_id=e.event_id, worker_id=_get(p, "worker_id"), type=e.type,
               at=e.occurred_at, **columns)
    state.worker_acks.append(row)


def _on_loaded(state: FoldState, e: AnyEnvelope) -> None:
    p = e.payload
    worker_id, key = _get(p, "worker_id"), (_get(p, "adapter_id"), _get(p, "version"))
    _ack(state, e, adapter_id=key[0], version=key[1], adapter_sha256=_get(p, "sha256"),
         load_ms=_get(p, "load_ms"))
    if not _newer_than_heartbeat(state, worker_id, e):
        return  # the newest heartbeat, sent after this, says what the worker holds
    held = state.held(worker_id)
    state.unloaded.get(worker_id, {}).pop(key, None)
    held[key] = {
        "worker_id": worker_id, "adapter_id": key[0], "version": key[1],
        "sha256": _get(p, "sha256"), "tier": _get(p, "tier"), "since": e.occurred_at,
        "source": "loaded"}


def _on_load_failed(state: FoldState, e: AnyEnvelope) -> None:
    p = e.payload
    _ack(state, e, adapter_id=_get(p, "adapter_id"), version=_get(p, "version"),
         error=_get(p, "error"))


def _on_unloaded(state: FoldState, e: AnyEnvelope) -> None:
    p = e.payload
    worker_id, key = _get(p, "worker_id"), (_get(p, "adapter_id"), _get(p, "version"))
    _ack(state, e, adapter_id=key[0], version=key[1], adapter_sha256=_get(p, "sha256"),
         reason=_get(p, "reason"))
    if not _newer_than_heartbeat(state, worker_id, e):
        return
    held = state.held(worker_id)
    state.unloaded.setdefault(worker_id, {})[key] = e.occurred_at
    held.pop(key, None)


def _on_kv_invalidated(state: FoldState, e: AnyEnvelope) -> None:
    p = e.payload
    _ack(state, e, adapter_sha256=_get(p, "adapter_sha256"), tenant_key=_get(p, "tenant_key"),
         reason=_get(p, "reason"), kv_blocks_freed=_get(p, "blocks_freed"),
         sequences_aborted=_get(p, "sequences_aborted"))


def _on_tenant_purged(state: FoldState, e: AnyEnvelope) -> None:
    p = e.payload
    _ack(state, e, purge_id=_get(p, "purge_id"), kv_blocks_freed=_get(p, "kv_blocks_freed"),
         adapters_unloaded=_get(p, "adapters_unloaded"),
         sequences_aborted=_get(p, "sequences_aborted"),
         refcounts_zero=_get(p, "refcounts_zero"))


TRACE_COLUMNS = ("event_id", "ordinal", "request_id", "trace_id", "worker_id", "tenant_org",
                 "tenant_team", "tenant_project", "user_id", "adapter_id", "version",
                 "adapter_sha256", "base_model_digest", "prompt_tokens", "completion_tokens",
                 "started_at", "finished_at", "status", "witness", "base_weights")
"""The order of the values of a `request_traces` row (the most numerous rows: tuples)."""


def _on_request_served(state: FoldState, e: AnyEnvelope, stored: Mapping[Any, str]) -> None:
    """Every witness's traces are stored as they were written; `served_by` keeps one row
    per request (the worker's where a router witnessed it too). A router's witness says
    nothing about the worker being alive, so it leaves the worker's row alone."""
    p: Any = e.payload
    worker_id = p.worker_id
    witness = p.witness
    if witness == "worker":
        state.worker(worker_id, e)
    event_id, append = e.event_id, state.request_traces.append
    for ordinal, r in enumerate(p.requests):  # typed requests: plain attribute reads
        tenant = r.tenant
        append((event_id, ordinal, r.request_id, r.trace_id, worker_id, tenant.org,
                tenant.team, tenant.project, stored.get(("user_id", ordinal), r.user_id),
                r.adapter_id, r.version, r.adapter_sha256, r.base_model_digest,
                r.prompt_tokens, r.completion_tokens, r.started_at, r.finished_at, r.status,
                witness, r.base_weights))


HANDLERS = {
    "AdapterVersionPublished": _on_published,
    "TrafficSplitChanged": _on_split,
    "AdapterVersionSwitched": _on_switched,
    "AdapterRolledBack": _on_rolled_back,
    "AdapterDisabled": _on_disabled,
    "AdapterEnabled": _on_enabled,
    "TenantPurgeRequested": _on_purge_requested,
    "WorkerHeartbeat": _on_heartbeat,
    "AdapterLoaded": _on_loaded,
    "AdapterLoadFailed": _on_load_failed,
    "AdapterUnloaded": _on_unloaded,
    "KVInvalidated": _on_kv_invalidated,
    "TenantPurged": _on_tenant_purged,
    "TenantBlobsDeleted": _on_blobs_deleted,
}
"""Event type → fold step. Types not listed live in the events table only
(BaseModelRegistered), or nowhere (RegistryLease: liveness, see the projector);
`RequestServed` also takes the stored personal values (`apply`)."""


def apply(state: FoldState, envelope: AnyEnvelope,
          stored: Mapping[tuple[str, int], str] | None = None) -> None:
    """Fold one event; `stored` maps (field, occurrence) to the value the store holds for
    each personal field (`services.audit.sealing.Sealed.values`)."""
    if envelope.type == "RequestServed":
        _on_request_served(state, envelope, stored or {})
        return
    handler = HANDLERS.get(envelope.type)
    if handler is not None:
        handler(state, envelope)

