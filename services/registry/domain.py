"""The registry aggregate: state folded from the log, and commands that each decide one event.

No I/O here. `RegistryState.apply` folds one event; every command function reads the
state, refuses with a `Refusal` or returns the one `Decision` (payload, stream, seq,
tenant) the caller then publishes. The same fold runs at start-up replay and for the
registry's own writes read back, so "state after a restart equals state before" is a
property of this module alone.

Streams and their sequence numbers (gap-free per stream, `seq` = events so far + 1):
  `base-model/{name}`, `adapter/{adapter_id}`, `alias/{alias}`,
  `tenant/{org}/{team}/{project}` (purges), `registry/lease`.
The If-Match "version" of an adapter or alias is its stream's last `seq` (the ETag).

Serving rules the router and workers share:
- Publishing stores a version; it does not serve it. An adapter's *active version* is set
  only by `AdapterVersionSwitched` (to_version) and `AdapterRolledBack` (to_version).
- An alias serves the versions of its latest `TrafficSplitChanged`, by weight.
- A disabled version is never served, whether active or in a split.

Rollback target ("previous stable version"), computed by `rollback_target`:
  1. if the current active version declared `rollback_to` at publish time, and that
     version exists and is not disabled, that version;
  2. otherwise the highest-numbered version below the current active version that is
     *stable*: it has been the adapter's active version at some point (switched to, or
     rolled back to) and it is not disabled now. Alias splits, canaries included, do not
     make a version stable: finishing a canary is an explicit switch.
  No such version → the rollback is refused (409). `rollback_candidates` lists rule 2's
  candidates, best first; the audit projection's SQL view of the same name must agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from services.contracts.events import (
    AdapterDisabled,
    AdapterEnabled,
    AdapterRolledBack,
    AdapterVersionPublished,
    AdapterVersionSwitched,
    BaseModelRegistered,
    Envelope,
    Payload,
    RegistryLease,
    SplitEntry,
    TenantPurged,
    TenantPurgeRequested,
    TenantRef,
    TrafficSplitChanged,
    WorkerHeartbeat,
)

LEASE_STREAM = "registry/lease"

RefusalKind = Literal["not_found", "conflict", "precondition", "invalid", "forbidden"]


class Refusal(Exception):
    """A command the state does not allow; `kind` maps to one HTTP status at the edge."""

    def __init__(self, kind: RefusalKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def adapter_stream(adapter_id: str) -> str:
    return f"adapter/{adapter_id}"


def alias_stream(alias: str) -> str:
    return f"alias/{alias}"


def base_model_stream(name: str) -> str:
    return f"base-model/{name}"


def tenant_stream(tenant: TenantRef) -> str:
    return f"tenant/{tenant.key}"


@dataclass(frozen=True)
class LogPosition:
    """Where an event sits in the log: returned to clients as the event offset."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class Decision:
    """The one event a command produces, before it has an envelope."""

    payload: Payload
    stream: str
    seq: int
    tenant: TenantRef | None = None


@dataclass
class BaseModel:
    name: str
    digest: str
    config: dict[str, Any]
    registered_at: datetime
    seq: int


@dataclass
class AdapterVersion:
    published: AdapterVersionPublished
    published_at: datetime
    event_id: str
    position: LogPosition | None
    disabled: bool = False
    disabled_reason: str = ""
    ever_active: bool = False
    """Was the active version or sole 100% entry of a split at some point (see module doc)."""
    seq: int = 0


@dataclass
class Adapter:
    adapter_id: str
    tenant: TenantRef | None
    seq: int = 0
    versions: dict[int, AdapterVersion] = field(default_factory=dict)
    active_version: int | None = None

    def label_taken(self, label: str) -> int | None:
        for number, version in self.versions.items():
            if version.published.label == label:
                return number
        return None

    @property
    def latest_version(self) -> int:
        return max(self.versions, default=0)


@dataclass
class Alias:
    alias: str
    tenant: TenantRef | None
    seq: int
    split: tuple[SplitEntry, ...]
    changed_at: datetime


@dataclass(frozen=True)
class PurgeAck:
    worker_id: str
    acked_at: datetime
    kv_blocks_freed: int
    adapters_unloaded: int
    sequences_aborted: int
    refcounts_zero: bool


@dataclass
class Purge:
    purge_id: str
    tenant: TenantRef | None
    deadline_s: float
    hard: bool
    requested_at: datetime
    expected_workers: tuple[str, ...]
    """Workers with a heartbeat fresh at request time: the ones that must acknowledge."""
    acks: dict[str, PurgeAck] = field(default_factory=dict)

    @property
    def deadline(self) -> datetime:
        return self.requested_at + timedelta(seconds=self.deadline_s)

    def status(self, now: datetime) -> Literal["met", "missed", "pending"]:
        """met: every expected worker acked in time; missed: one did not; else pending."""
        on_time = {w for w, a in self.acks.items() if a.acked_at <= self.deadline}
        if set(self.expected_workers) <= on_time:
            return "met"
        if now > self.deadline:
            return "missed"
        return "pending"


@dataclass
class Lease:
    registry_id: str
    epoch: int
    expires_at: datetime
    seq: int


@dataclass(frozen=True)
class IdempotentAnswer:
    """The event a keyed command produced; the answer to a retry is rendered from it."""

    envelope: Envelope
    position: LogPosition | None


@dataclass
class RegistryState:
    """Everything the registry knows, folded from both topics."""

    base_models: dict[str, BaseModel] = field(default_factory=dict)
    adapters: dict[str, Adapter] = field(default_factory=dict)
    aliases: dict[str, Alias] = field(default_factory=dict)
    purges: dict[str, Purge] = field(default_factory=dict)
    tenant_seqs: dict[str, int] = field(default_factory=dict)
    idempotency: dict[tuple[str, str], IdempotentAnswer] = field(default_factory=dict)
    heartbeats: dict[str, datetime] = field(default_factory=dict)
    lease: Lease | None = None
    stale_after_s: float = 30.0
    """Heartbeat age after which a worker is no longer expected to ack a purge."""

    # --- fold --------------------------------------------------------------------------

    def apply(self, envelope: Envelope, position: LogPosition | None = None) -> None:
        """Fold one event. Total: an event about something unknown is still recorded."""
        p = envelope.payload
        at = envelope.occurred_at
        if isinstance(p, BaseModelRegistered):
            self.base_models[p.name] = BaseModel(p.name, p.digest, dict(p.config), at,
                                                 envelope.seq)
        elif isinstance(p, AdapterVersionPublished):
            adapter = self.adapters.get(p.adapter_id)
            if adapter is None:
                adapter = self.adapters[p.adapter_id] = Adapter(p.adapter_id, envelope.tenant)
            adapter.versions[p.version] = AdapterVersion(
                p, at, str(envelope.event_id), position, seq=envelope.seq)
            adapter.seq = envelope.seq
        elif isinstance(p, AdapterVersionSwitched | AdapterRolledBack):
            adapter = self._adapter_for(p.adapter_id, envelope)
            adapter.active_version = p.to_version
            if p.to_version in adapter.versions:
                adapter.versions[p.to_version].ever_active = True
        elif isinstance(p, AdapterDisabled | AdapterEnabled):
            adapter = self._adapter_for(p.adapter_id, envelope)
            version = adapter.versions.get(p.version)
            if version is not None:
                version.disabled = isinstance(p, AdapterDisabled)
                version.disabled_reason = p.reason if version.disabled else ""
        elif isinstance(p, TrafficSplitChanged):
            self.aliases[p.alias] = Alias(p.alias, envelope.tenant, envelope.seq,
                                          tuple(p.split), at)
        elif isinstance(p, TenantPurgeRequested):
            self.tenant_seqs[envelope.stream] = envelope.seq
            self.purges[p.purge_id] = Purge(p.purge_id, envelope.tenant, p.deadline_s, p.hard,
                                            at, self.live_workers(at))
        elif isinstance(p, RegistryLease):
            self.lease = Lease(p.registry_id, p.epoch, p.expires_at, envelope.seq)
        elif isinstance(p, WorkerHeartbeat):
            self.heartbeats[p.worker_id] = at
        elif isinstance(p, TenantPurged):
            purge = self.purges.get(p.purge_id)
            if purge is not None and p.worker_id not in purge.acks:
                purge.acks[p.worker_id] = PurgeAck(p.worker_id, at, p.kv_blocks_freed,
                                                   p.adapters_unloaded, p.sequences_aborted,
                                                   p.refcounts_zero)
        key = getattr(p, "idempotency_key", None)
        if key:
            self.idempotency[(envelope.actor, key)] = IdempotentAnswer(envelope, position)

    def _adapter_for(self, adapter_id: str, envelope: Envelope) -> Adapter:
        adapter = self.adapters.get(adapter_id)
        if adapter is None:
            adapter = self.adapters[adapter_id] = Adapter(adapter_id, envelope.tenant)
        adapter.seq = envelope.seq
        return adapter

    def live_workers(self, at: datetime) -> tuple[str, ...]:
        horizon = at - timedelta(seconds=self.stale_after_s)
        return tuple(sorted(w for w, seen in self.heartbeats.items() if seen >= horizon))

    # --- queries -----------------------------------------------------------------------

    def adapter(self, adapter_id: str) -> Adapter:
        adapter = self.adapters.get(adapter_id)
        if adapter is None or not adapter.versions:
            raise Refusal("not_found", f"adapter {adapter_id!r} does not exist")
        return adapter

    def version(self, adapter_id: str, version: int) -> AdapterVersion:
        found = self.adapter(adapter_id).versions.get(version)
        if found is None:
            raise Refusal("not_found", f"adapter {adapter_id!r} has no version {version}")
        return found

    def prior_answer(self, actor: str, key: str | None, event_type: str,
                     stream: str) -> IdempotentAnswer | None:
        """The first answer to a keyed command, or None; a key reused elsewhere is refused."""
        if not key:
            return None
        prior = self.idempotency.get((actor, key))
        if prior is None:
            return None
        if prior.envelope.type != event_type or prior.envelope.stream != stream:
            raise Refusal("invalid", f"Idempotency-Key {key!r} was already used for a "
                                     f"different request ({prior.envelope.type} on "
                                     f"{prior.envelope.stream})")
        return prior


# --- rollback lineage ----------------------------------------------------------------------


def rollback_candidates(adapter: Adapter) -> list[int]:
    """Stable versions below the active one, best (highest) first; see the module doc."""
    current = adapter.active_version
    if current is None:
        return []
    return sorted((n for n, v in adapter.versions.items()
                   if n < current and v.ever_active and not v.disabled), reverse=True)


def rollback_target(adapter: Adapter) -> int | None:
    current = adapter.active_version
    if current is None:
        return None
    active = adapter.versions.get(current)
    declared = active.published.rollback_to if active is not None else None
    if declared is not None and declared != current:
        target = adapter.versions.get(declared)
        if target is not None and not target.disabled:
            return declared
    candidates = rollback_candidates(adapter)
    return candidates[0] if candidates else None


# --- commands ------------------------------------------------------------------------------


def _check_expected(kind: str, name: str, current_seq: int, expected: int | None) -> None:
    if expected is not None and expected != current_seq:
        raise Refusal("precondition", f"{kind} {name!r} is at version {current_seq}, "
                                      f"If-Match expected {expected}")


def register_base_model(state: RegistryState, name: str, digest: str, config: dict[str, Any],
                        idempotency_key: str | None = None) -> Decision:
    if name in state.base_models:
        raise Refusal("conflict", f"base model {name!r} is already registered")
    payload = BaseModelRegistered(name=name, digest=digest, config=config,
                                  idempotency_key=idempotency_key)
    return Decision(payload, base_model_stream(name), 1)


@dataclass(frozen=True)
class ArtifactFacts:
    """What validation learnt about an uploaded adapter: all a publish event needs of it."""

    sha256: str
    config_sha256: str
    size_bytes: int
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    dtype: str


@dataclass(frozen=True)
class PublishRequest:
    adapter_id: str
    tenant: TenantRef
    owner: str
    base_model: str
    label: str
    qos_tier: Literal["platinum", "gold", "silver", "bronze"] = "silver"
    rollback_to: int | None = None


def precheck_publish(state: RegistryState, request: PublishRequest,
                     expected: int | None) -> BaseModel:
    """The checks that need no upload: done before validation so a refused request stores
    nothing, and again (inside `publish_version`) when the event is decided."""
    adapter = state.adapters.get(request.adapter_id)
    if adapter is not None and adapter.tenant is not None and adapter.tenant != request.tenant:
        raise Refusal("conflict", f"adapter {request.adapter_id!r} belongs to tenant "
                                  f"{adapter.tenant.key}, not {request.tenant.key}")
    _check_expected("adapter", request.adapter_id, adapter.seq if adapter else 0, expected)
    if adapter is not None:
        taken = adapter.label_taken(request.label)
        if taken is not None:
            raise Refusal("conflict", f"adapter {request.adapter_id!r} already has label "
                                      f"{request.label!r} (version {taken})")
    base = state.base_models.get(request.base_model)
    if base is None:
        raise Refusal("invalid", f"base model {request.base_model!r} is not registered")
    if request.rollback_to is not None:
        target = adapter.versions.get(request.rollback_to) if adapter else None
        if target is None:
            raise Refusal("invalid", f"rollback_to {request.rollback_to} is not a version of "
                                     f"{request.adapter_id!r}")
        if target.disabled:
            raise Refusal("invalid", f"rollback_to {request.rollback_to} is disabled")
    return base


def publish_version(state: RegistryState, request: PublishRequest, facts: ArtifactFacts,
                    expected: int | None = None,
                    idempotency_key: str | None = None) -> Decision:
    base = precheck_publish(state, request, expected)
    adapter = state.adapters.get(request.adapter_id)
    payload = AdapterVersionPublished(
        adapter_id=request.adapter_id,
        version=(adapter.latest_version if adapter else 0) + 1,
        label=request.label,
        base_model=base.name,
        base_model_digest=base.digest,
        sha256=facts.sha256,
        config_sha256=facts.config_sha256,
        size_bytes=facts.size_bytes,
        rank=facts.rank,
        lora_alpha=facts.lora_alpha,
        target_modules=list(facts.target_modules),
        dtype=facts.dtype,
        qos_tier=request.qos_tier,
        owner=request.owner,
        rollback_to=request.rollback_to,
        idempotency_key=idempotency_key,
    )
    return Decision(payload, adapter_stream(request.adapter_id),
                    (adapter.seq if adapter else 0) + 1, request.tenant)


def _adapter_decision(adapter: Adapter, payload: Payload) -> Decision:
    return Decision(payload, adapter_stream(adapter.adapter_id), adapter.seq + 1, adapter.tenant)


def switch_active(state: RegistryState, adapter_id: str, to_version: int,
                  expected: int | None = None, idempotency_key: str | None = None) -> Decision:
    adapter = state.adapter(adapter_id)
    _check_expected("adapter", adapter_id, adapter.seq, expected)
    target = adapter.versions.get(to_version)
    if target is None:
        raise Refusal("invalid", f"adapter {adapter_id!r} has no version {to_version}")
    if target.disabled:
        raise Refusal("conflict", f"version {to_version} is disabled; enable it first")
    if adapter.active_version == to_version:
        raise Refusal("conflict", f"version {to_version} is already active")
    return _adapter_decision(adapter, AdapterVersionSwitched(
        adapter_id=adapter_id, from_version=adapter.active_version, to_version=to_version,
        idempotency_key=idempotency_key))


def roll_back(state: RegistryState, adapter_id: str, to_version: int | None, reason: str,
              expected: int | None = None, idempotency_key: str | None = None) -> Decision:
    adapter = state.adapter(adapter_id)
    _check_expected("adapter", adapter_id, adapter.seq, expected)
    current = adapter.active_version
    if current is None:
        raise Refusal("conflict", f"adapter {adapter_id!r} has no active version to roll back")
    if to_version is None:
        to_version = rollback_target(adapter)
        if to_version is None:
            raise Refusal("conflict", f"adapter {adapter_id!r} has no stable version before "
                                      f"version {current}")
    target = adapter.versions.get(to_version)
    if target is None:
        raise Refusal("invalid", f"adapter {adapter_id!r} has no version {to_version}")
    if target.disabled:
        raise Refusal("conflict", f"version {to_version} is disabled")
    if to_version == current:
        raise Refusal("conflict", f"version {to_version} is already active")
    return _adapter_decision(adapter, AdapterRolledBack(
        adapter_id=adapter_id, from_version=current, to_version=to_version, reason=reason,
        idempotency_key=idempotency_key))


def set_disabled(state: RegistryState, adapter_id: str, version: int, disabled: bool,
                 reason: str, expected: int | None = None,
                 idempotency_key: str | None = None) -> Decision:
    adapter = state.adapter(adapter_id)
    _check_expected("adapter", adapter_id, adapter.seq, expected)
    found = state.version(adapter_id, version)
    if found.disabled == disabled:
        raise Refusal("conflict", f"version {version} is already "
                                  f"{'disabled' if disabled else 'enabled'}")
    payload: Payload = (
        AdapterDisabled(adapter_id=adapter_id, version=version, reason=reason,
                        idempotency_key=idempotency_key)
        if disabled else
        AdapterEnabled(adapter_id=adapter_id, version=version, reason=reason,
                       idempotency_key=idempotency_key))
    return _adapter_decision(adapter, payload)


def set_split(state: RegistryState, alias: str, split: Iterable[SplitEntry],
              expected: int | None = None, idempotency_key: str | None = None) -> Decision:
    """A traffic split: weights sum to 100, every version exists and is enabled, one tenant."""
    entries = tuple(split)
    current = state.aliases.get(alias)
    _check_expected("alias", alias, current.seq if current else 0, expected)
    if not entries:
        raise Refusal("invalid", "a split needs at least one entry")
    total = sum(e.weight for e in entries)
    if total != 100:
        raise Refusal("invalid", f"split weights sum to {total}, not 100")
    seen: set[tuple[str, int]] = set()
    tenants: set[str] = set()
    tenant: TenantRef | None = None
    for entry in entries:
        key = (entry.adapter_id, entry.version)
        if key in seen:
            raise Refusal("invalid", f"{entry.adapter_id} version {entry.version} is listed twice")
        seen.add(key)
        adapter = state.adapters.get(entry.adapter_id)
        version = adapter.versions.get(entry.version) if adapter else None
        if adapter is None or version is None:
            raise Refusal("invalid", f"{entry.adapter_id} version {entry.version} does not exist")
        if version.disabled and entry.weight > 0:
            raise Refusal("conflict", f"{entry.adapter_id} version {entry.version} is disabled")
        if adapter.tenant is not None:
            tenants.add(adapter.tenant.key)
            tenant = adapter.tenant
    if len(tenants) > 1:
        raise Refusal("invalid", f"a split may not span tenants ({sorted(tenants)})")
    if current is not None and current.tenant is not None and tenant != current.tenant:
        raise Refusal("conflict", f"alias {alias!r} belongs to tenant {current.tenant.key}")
    payload = TrafficSplitChanged(alias=alias, split=list(entries),
                                  previous=list(current.split) if current else [],
                                  idempotency_key=idempotency_key)
    return Decision(payload, alias_stream(alias), (current.seq if current else 0) + 1, tenant)


def request_purge(state: RegistryState, tenant: TenantRef, purge_id: str, deadline_s: float,
                  hard: bool = True, idempotency_key: str | None = None) -> Decision:
    if purge_id in state.purges:
        raise Refusal("conflict", f"purge {purge_id!r} already exists")
    stream = tenant_stream(tenant)
    payload = TenantPurgeRequested(purge_id=purge_id, deadline_s=deadline_s, hard=hard,
                                   idempotency_key=idempotency_key)
    return Decision(payload, stream, state.tenant_seqs.get(stream, 0) + 1, tenant)


def renew_lease(state: RegistryState, registry_id: str, epoch: int,
                expires_at: datetime) -> Decision:
    payload = RegistryLease(registry_id=registry_id, epoch=epoch, expires_at=expires_at)
    return Decision(payload, LEASE_STREAM, (state.lease.seq if state.lease else 0) + 1)


def next_epoch(state: RegistryState) -> int:
    """A starting instance leases at one past the newest epoch it folded."""
    return (state.lease.epoch + 1) if state.lease else 1
