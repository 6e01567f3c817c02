"""What the API answers: response models, rendered from folded state or from an event.

A command's answer is rendered from its event (and where it landed), never from the state
at answer time, so the answer to a retried Idempotency-Key is byte-for-byte the first one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from fastapi import Response
from pydantic import BaseModel, Field

from services.catalog.state import (
    Adapter,
    AdapterVersion,
    Alias,
    CatalogState,
    LogPosition,
    Purge,
    rollback_target,
)
from services.catalog.state import BaseModel as BaseModelState
from services.contracts.events import (
    AdapterVersionPublished,
    BaseModelRegistered,
    Envelope,
    SplitEntry,
    TenantRef,
    TrafficSplitChanged,
)
from services.registry.validation import declared_base_matches

if TYPE_CHECKING:
    from services.registry.node import Committed

T = TypeVar("T")


class EventRef(BaseModel):
    """The event a change produced and where it sits in the log."""

    event_id: str
    type: str
    stream: str
    seq: int
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None


def event_ref(envelope: Envelope, position: LogPosition | None) -> EventRef:
    return EventRef(event_id=str(envelope.event_id), type=envelope.type, stream=envelope.stream,
                    seq=envelope.seq, topic=position.topic if position else None,
                    partition=position.partition if position else None,
                    offset=position.offset if position else None)


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = Field(None, description="Pass as `cursor` for the next page.")


S = TypeVar("S")


def page_of(ordered: Sequence[S], limit: int, view: Callable[[S], T],
            cursor: Callable[[S], object]) -> Page[T]:
    """The first `limit` of `ordered` (already past the caller's cursor) as views, and the
    cursor that continues after them when more remain."""
    more = len(ordered) > limit
    return Page(items=[view(s) for s in ordered[:limit]],
                next_cursor=str(cursor(ordered[limit - 1])) if more else None)


def answer_headers(response: Response, committed: Committed, *, etag: bool = True) -> None:
    """Headers of a write's answer: whether it replays an idempotent first answer, and the
    stream's version for the next If-Match."""
    if committed.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    if etag:
        response.headers["ETag"] = f'"{committed.envelope.seq}"'



class VersionView(BaseModel):
    adapter_id: str
    version: int
    label: str
    tenant: TenantRef | None
    owner: str
    base_model: str
    base_model_digest: str
    sha256: str = Field(description="Digest of adapter_model.safetensors (blob name)")
    config_sha256: str = Field(description="Digest of adapter_config.json (blob name)")
    size_bytes: int
    rank: int
    lora_alpha: float
    target_modules: list[str]
    dtype: str
    qos_tier: str
    rollback_to: int | None
    declared_base_model: str | None = Field(
        None, description="base_model_name_or_path from adapter_config.json")
    published_at: datetime
    disabled: bool = False
    disabled_reason: str = ""
    active: bool = Field(False, description="The adapter's active version (never a purged one)")
    purged: bool = Field(False, description="A purge of its tenant, requested at or after it was "
                                            "published, erased it: never served or fetched again")
    purged_by: str | None = Field(None, description="The purge that erased it")
    warnings: list[str] = Field(default_factory=list,
                                description="Things a publisher should check (in the 201)")
    event: EventRef | None = None


def _version_fields(p: AdapterVersionPublished) -> dict[str, Any]:
    return p.model_dump(exclude={"idempotency_key", "request_sha256"})


def published_view(envelope: Envelope, position: LogPosition | None,
                   base_config: Mapping[str, Any]) -> VersionView:
    """The 201 answer to a publish, as it was at publish time (`base_config`: the
    registered base model's config.json, which never changes)."""
    p = envelope.payload
    assert isinstance(p, AdapterVersionPublished)
    warnings = []
    if p.declared_base_model and not declared_base_matches(p.declared_base_model, p.base_model,
                                                           base_config):
        warnings.append(
            f"adapter_config.json declares base_model_name_or_path "
            f"{p.declared_base_model!r}, not the registered base model {p.base_model!r}; its "
            "shapes fit, but check that it was trained on this model before serving it")
    return VersionView(**_version_fields(p), tenant=envelope.tenant,
                       published_at=envelope.occurred_at, warnings=warnings,
                       event=event_ref(envelope, position))


def version_view(adapter: Adapter, version: AdapterVersion) -> VersionView:
    p = version.published
    return VersionView(
        **_version_fields(p), tenant=adapter.tenant, published_at=version.published_at,
        disabled=version.disabled, disabled_reason=version.disabled_reason,
        active=adapter.active_version == p.version and version.purged_by is None,
        purged=version.purged_by is not None, purged_by=version.purged_by,
        event=EventRef(event_id=version.event_id, type=AdapterVersionPublished.event_type(),
                       stream=f"adapter/{adapter.adapter_id}", seq=version.seq,
                       topic=version.position.topic if version.position else None,
                       partition=version.position.partition if version.position else None,
                       offset=version.position.offset if version.position else None))


class AdapterView(BaseModel):
    adapter_id: str
    tenant: TenantRef | None
    etag: int = Field(description="Stream version; send as If-Match for optimistic concurrency")
    active_version: int | None
    latest_version: int
    versions: int
    disabled_versions: list[int]
    purged_versions: list[int] = Field(description="Versions a purge of the tenant erased")
    rollback_target: int | None = Field(description="Where a rollback without to_version goes")


def adapter_view(adapter: Adapter) -> AdapterView:
    return AdapterView(
        adapter_id=adapter.adapter_id, tenant=adapter.tenant, etag=adapter.seq,
        active_version=adapter.active_version, latest_version=adapter.latest_version,
        versions=len(adapter.versions),
        disabled_versions=sorted(n for n, v in adapter.versions.items() if v.disabled),
        purged_versions=sorted(n for n, v in adapter.versions.items() if v.purged_by),
        rollback_target=rollback_target(adapter))


class AdapterChange(BaseModel):
    """Answer to switch, rollback, disable and enable: the event's fields and position."""

    adapter_id: str
    type: str
    version: int | None = None
    from_version: int | None = None
    to_version: int | None = None
    reason: str = ""
    event: EventRef


def change_view(envelope: Envelope, position: LogPosition | None) -> AdapterChange:
    fields = envelope.payload.model_dump(exclude={"idempotency_key", "request_sha256", "alias"})
    return AdapterChange(**fields, type=envelope.type, event=event_ref(envelope, position))


class ServingWorker(BaseModel):
    worker_id: str
    base_weights: str = Field(description="How it computes this base: dense (in its serving "
                                          "dtype) or int8 weights (LORAPLANE_WORKER_WEIGHTS)")


class BaseModelView(BaseModel):
    name: str
    digest: str
    config: dict[str, Any]
    registered_at: datetime
    event: EventRef | None = None
    workers: list[ServingWorker] = Field(
        default_factory=list, description="Live workers serving this digest (by heartbeat), "
                                          "each with its base weights format")


def base_model_view(model: BaseModelState, state: CatalogState,
                    now: datetime) -> BaseModelView:
    workers = [ServingWorker(worker_id=w, base_weights=state.worker_weights.get(w, "dense"))
               for w in sorted(state.live_workers(now))
               if state.worker_bases.get(w) == model.digest]
    return BaseModelView(name=model.name, digest=model.digest, config=model.config,
                         registered_at=model.registered_at, workers=workers)


def base_model_registered_view(envelope: Envelope,
                               position: LogPosition | None) -> BaseModelView:
    assert isinstance(envelope.payload, BaseModelRegistered)
    p = envelope.payload
    return BaseModelView(name=p.name, digest=p.digest, config=p.config,
                         registered_at=envelope.occurred_at, event=event_ref(envelope, position))


class AliasView(BaseModel):
    alias: str
    tenant: TenantRef | None
    etag: int = Field(description="Stream version; send as If-Match")
    split: list[SplitEntry]
    changed_at: datetime
    event: EventRef | None = None


def alias_view(alias: Alias) -> AliasView:
    return AliasView(alias=alias.alias, tenant=alias.tenant, etag=alias.seq,
                     split=list(alias.split), changed_at=alias.changed_at)


def split_changed_view(envelope: Envelope, position: LogPosition | None) -> AliasView:
    assert isinstance(envelope.payload, TrafficSplitChanged)
    return AliasView(alias=envelope.payload.alias, tenant=envelope.tenant, etag=envelope.seq,
                     split=list(envelope.payload.split), changed_at=envelope.occurred_at,
                     event=event_ref(envelope, position))


class PurgeAckView(BaseModel):
    worker_id: str
    acked_at: datetime
    on_time: bool
    kv_blocks_freed: int
    adapters_unloaded: int
    sequences_aborted: int
    refcounts_zero: bool


class PurgeView(BaseModel):
    purge_id: str
    tenant: TenantRef | None
    requested_at: datetime
    deadline: datetime
    deadline_s: float
    hard: bool
    status: str = Field(description="met (every expected worker acknowledged and the blobs "
                                    "were erased, both by the deadline) | missed | pending")
    expected_workers: list[str] = Field(
        description="Workers with a fresh heartbeat when the purge was requested (listed in "
                    "the request event); each must acknowledge")
    acks: list[PurgeAckView]
    blobs_deleted: list[str] | None = Field(
        None, description="The tenant's adapter blobs erased from the blob store (null until "
                          "the erasure is recorded)")
    blobs_kept: list[str] | None = Field(
        None, description="The tenant's blobs left in place: a version the purge did not "
                          "erase holds the same bytes (another tenant's, or one published "
                          "after the purge)")
    blobs_erased_at: datetime | None = Field(
        None, description="When the erasure was recorded (null until it is)")
    event: EventRef | None = None


def purge_view(purge: Purge, now: datetime, event: EventRef | None = None) -> PurgeView:
    return PurgeView(
        purge_id=purge.purge_id, tenant=purge.tenant, requested_at=purge.requested_at,
        deadline=purge.deadline, deadline_s=purge.deadline_s, hard=purge.hard,
        status=purge.status(now), expected_workers=list(purge.expected_workers),
        acks=[PurgeAckView(worker_id=a.worker_id, acked_at=a.acked_at,
                           on_time=a.acked_at <= purge.deadline,
                           kv_blocks_freed=a.kv_blocks_freed,
                           adapters_unloaded=a.adapters_unloaded,
                           sequences_aborted=a.sequences_aborted,
                           refcounts_zero=a.refcounts_zero)
              for a in sorted(purge.acks, key=lambda a: a.acked_at)],
        blobs_deleted=list(purge.blobs.deleted) if purge.blobs else None,
        blobs_kept=list(purge.blobs.kept) if purge.blobs else None,
        blobs_erased_at=purge.erased_at, event=event)
