"""The registry's commands: each reads the folded catalog and decides one event.

No I/O here. Every command function reads a `CatalogState` (the one fold of the log, in
`services.catalog.state`), refuses with a `Refusal` or returns the one `CommandEvent`
(payload, stream, seq, tenant) the caller then publishes. The same fold runs at start-up
replay and for the registry's own writes read back, so "state after a restart equals
state before" is a property of the fold alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from services.catalog.release_rule import GateSpec, gate_baseline, gate_request, release_refusal
from services.catalog.serving import purged_reason
from services.catalog.state import (
    LEASE_STREAM,
    Adapter,
    BaseModel,
    CatalogState,
    Refusal,
    adapter_stream,
    alias_stream,
    base_model_stream,
    foreign,
    rollback_target,
    tenant_stream,
)
from services.contracts.events import (
    AdapterDisabled,
    AdapterEnabled,
    AdapterRolledBack,
    AdapterVersionPublished,
    AdapterVersionSwitched,
    BaseModelRegistered,
    Payload,
    RegistryLease,
    SplitEntry,
    TenantPurgeRequested,
    TenantRef,
    TrafficSplitChanged,
)


@dataclass(frozen=True)
class CommandEvent:
    """The one event a command produces, before it has an envelope."""

    payload: Payload
    stream: str
    seq: int
    tenant: TenantRef | None = None



# --- commands ------------------------------------------------------------------------------


def check_expected(kind: str, name: str, current_seq: int, expected: int | None) -> None:
    """Refuse a write whose If-Match names another version of the stream (every command
    that takes `expected` checks it here, so they all answer alike)."""
    if expected is not None and expected != current_seq:
        raise Refusal("precondition", f"{kind} {name!r} is at version {current_seq}, "
                                      f"If-Match expected {expected}")


def register_base_model(state: CatalogState, name: str, digest: str, config: dict[str, Any],
                        idempotency_key: str | None = None) -> CommandEvent:
    if name in state.base_models:
        raise Refusal("conflict", f"base model {name!r} is already registered")
    payload = BaseModelRegistered(name=name, digest=digest, config=config,
                                  idempotency_key=idempotency_key)
    return CommandEvent(payload, base_model_stream(name), 1)


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
    declared_base_model: str | None = None
    """The adapter's `base_model_name_or_path`, as its config declares it."""


@dataclass(frozen=True)
class PublishRequest:
    adapter_id: str
    tenant: TenantRef
    owner: str
    base_model: str
    label: str
    qos_tier: Literal["platinum", "gold", "silver", "bronze"] = "silver"
    rollback_to: int | None = None
    gate_required: bool = False
    """No traffic before a passed gate or an override (`services.catalog.release_rule`)."""
    gate: GateSpec | None = None
    """A regression set uploaded with the version: its gate is requested by the publish."""


def precheck_publish(state: CatalogState, request: PublishRequest,
                     expected: int | None) -> BaseModel:
    """The checks that need no upload: done before validation so a refused request stores
    nothing, and again (inside `publish_version`) when the event is decided."""
    adapter = state.adapters.get(request.adapter_id)
    if adapter is not None and adapter.tenant is not None and adapter.tenant != request.tenant:
        raise foreign("adapter", request.adapter_id, adapter.tenant, answer_kind="conflict",
                      answer=f"adapter id {request.adapter_id!r} is taken: adapter ids are "
                             "unique across tenants")
    check_expected("adapter", request.adapter_id, adapter.seq if adapter else 0, expected)
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


def publish_version(state: CatalogState, request: PublishRequest, facts: ArtifactFacts,
                    expected: int | None = None,
                    idempotency_key: str | None = None) -> CommandEvent:
    base = precheck_publish(state, request, expected)
    adapter = state.adapters.get(request.adapter_id)
    number = (adapter.latest_version if adapter else 0) + 1
    gate = None
    if request.gate is not None:
        gate = gate_request(state, request.gate, base.digest,
                            gate_baseline(adapter, number) if adapter else None,
                            datetime.now(UTC))
    payload = AdapterVersionPublished(
        adapter_id=request.adapter_id,
        version=number,
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
        declared_base_model=facts.declared_base_model,
        idempotency_key=idempotency_key,
        gate_required=request.gate_required or gate is not None,
        quality_gate=gate,
    )
    return CommandEvent(payload, adapter_stream(request.adapter_id),
                    (adapter.seq if adapter else 0) + 1, request.tenant)


def adapter_event(adapter: Adapter, payload: Payload) -> CommandEvent:
    """The next event on an existing adapter's stream (the release commands write there too)."""
    return CommandEvent(payload, adapter_stream(adapter.adapter_id), adapter.seq + 1,
                        adapter.tenant)


def switch_active(state: CatalogState, adapter_id: str, to_version: int,
                  expected: int | None = None, idempotency_key: str | None = None) -> CommandEvent:
    adapter = state.adapter(adapter_id)
    check_expected("adapter", adapter_id, adapter.seq, expected)
    target = adapter.versions.get(to_version)
    if target is None:
        raise Refusal("invalid", f"adapter {adapter_id!r} has no version {to_version}")
    gone = purged_reason(adapter, to_version, target)
    if gone:
        raise Refusal("conflict", gone)
    if target.disabled:
        raise Refusal("conflict", f"version {to_version} is disabled; enable it first")
    if adapter.active_version == to_version:
        raise Refusal("conflict", f"version {to_version} is already active")
    refused = release_refusal(adapter, to_version, target)
    if refused:
        raise Refusal("conflict", refused)
    return adapter_event(adapter, AdapterVersionSwitched(
        adapter_id=adapter_id, from_version=adapter.active_version, to_version=to_version,
        idempotency_key=idempotency_key))


def roll_back(state: CatalogState, adapter_id: str, to_version: int | None, reason: str,
              expected: int | None = None, idempotency_key: str | None = None) -> CommandEvent:
    adapter = state.adapter(adapter_id)
    check_expected("adapter", adapter_id, adapter.seq, expected)
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
    gone = purged_reason(adapter, to_version, target)
    if gone:
        raise Refusal("conflict", gone)
    if target.disabled:
        raise Refusal("conflict", f"version {to_version} is disabled")
    if to_version == current:
        raise Refusal("conflict", f"version {to_version} is already active")
    return adapter_event(adapter, AdapterRolledBack(
        adapter_id=adapter_id, from_version=current, to_version=to_version, reason=reason,
        idempotency_key=idempotency_key))


def set_disabled(state: CatalogState, adapter_id: str, version: int, disabled: bool,
                 reason: str, expected: int | None = None,
                 idempotency_key: str | None = None) -> CommandEvent:
    adapter = state.adapter(adapter_id)
    check_expected("adapter", adapter_id, adapter.seq, expected)
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
    return adapter_event(adapter, payload)


def set_split(state: CatalogState, alias: str, split: Iterable[SplitEntry],
              expected: int | None = None, idempotency_key: str | None = None, *,
              usable: Callable[[TenantRef | None], bool] | None = None) -> CommandEvent:
    """A traffic split: weights sum to 100, every version exists and is enabled, one tenant.

    `usable` says whose adapters the caller may put in a split: another tenant's entry is
    refused exactly as a missing one (`foreign`), at the same point of the checks."""
    entries = tuple(split)
    current = state.aliases.get(alias)
    check_expected("alias", alias, current.seq if current else 0, expected)
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
        absent = f"{entry.adapter_id} version {entry.version} does not exist"
        if adapter is None or version is None:
            raise Refusal("invalid", absent)
        if usable is not None and not usable(adapter.tenant):
            raise foreign("adapter", entry.adapter_id, adapter.tenant, answer=absent,
                          answer_kind="invalid")
        gone = purged_reason(adapter, entry.version, version) if entry.weight else None
        if gone:
            raise Refusal("conflict", gone)
        if version.disabled and entry.weight > 0:
            raise Refusal("conflict", f"{entry.adapter_id} version {entry.version} is disabled")
        refused = release_refusal(adapter, entry.version, version) if entry.weight else None
        if refused:
            raise Refusal("conflict", refused)
        if adapter.tenant is not None:
            tenants.add(adapter.tenant.key)
            tenant = adapter.tenant
    if len(tenants) > 1:
        raise Refusal("invalid", f"a split may not span tenants ({sorted(tenants)})")
    if current is not None and current.tenant is not None and tenant != current.tenant:
        raise Refusal("conflict", f"alias {alias!r} belongs to tenant {current.tenant.key}")
    rollout = state.rollouts.get(alias)
    if rollout is not None and rollout.status in ("running", "halted"):
        raise Refusal("conflict", f"alias {alias!r} is in canary rollout {rollout.rollout_id} "
                                  f"({rollout.status} at {rollout.weight}%): roll it back first")
    payload = TrafficSplitChanged(alias=alias, split=list(entries),
                                  previous=list(current.split) if current else [],
                                  idempotency_key=idempotency_key)
    return CommandEvent(payload, alias_stream(alias), (current.seq if current else 0) + 1, tenant)


def request_purge(state: CatalogState, tenant: TenantRef, purge_id: str, deadline_s: float,
                  hard: bool = True, idempotency_key: str | None = None,
                  now: datetime | None = None) -> CommandEvent:
    """The workers live `now` are written into the event: they are the ones that must ack."""
    if purge_id in state.purges:
        raise Refusal("conflict", f"purge {purge_id!r} already exists")
    stream = tenant_stream(tenant)
    expected = state.live_workers(now or datetime.now(UTC))
    payload = TenantPurgeRequested(purge_id=purge_id, deadline_s=deadline_s, hard=hard,
                                   expected_workers=list(expected),
                                   idempotency_key=idempotency_key)
    return CommandEvent(payload, stream, state.tenant_seqs.get(stream, 0) + 1, tenant)


def renew_lease(state: CatalogState, registry_id: str, epoch: int,
                expires_at: datetime) -> CommandEvent:
    payload = RegistryLease(registry_id=registry_id, epoch=epoch, expires_at=expires_at)
    return CommandEvent(payload, LEASE_STREAM, (state.lease.seq if state.lease else 0) + 1)


def next_epoch(state: CatalogState) -> int:
    """A starting instance leases at one past the newest epoch it folded."""
    return (state.lease.epoch + 1) if state.lease else 1
