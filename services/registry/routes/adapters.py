"""Adapters and their versions: publish, list, read, switch, roll back, disable, enable."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import IO, Annotated, Literal

from fastapi import APIRouter, File, Form, Path, Query, Response, UploadFile
from pydantic import BaseModel, Field

from services.catalog.state import CatalogState, adapter_stream
from services.contracts.capacity import AdapterLimits
from services.contracts.events import ID_PATTERN, SLUG_PATTERN, AdapterVersionPublished, TenantRef
from services.contracts.problems import problem_responses
from services.registry.deps import (
    Blobs,
    ExpectedVersion,
    IdempotencyKey,
    Node,
    Reader,
    Replayed,
    TraceId,
    WriteDeadline,
    Writer,
    ensure_write_scope,
    request_fingerprint,
    visible,
    writable_adapter,
)
from services.registry.domain import (
    CommandEvent,
    PublishRequest,
    precheck_publish,
    publish_version,
    roll_back,
    set_disabled,
    switch_active,
)
from services.registry.erasure import restore_upload
from services.registry.node import Committed, Deadline
from services.registry.routes.gates_rollouts import fits_context, gate_spec, read_regression_set
from services.registry.validation import (
    MAX_CONFIG_BYTES,
    UnpackedAdapter,
    UploadRejected,
    too_large_config,
    unpack_archive,
    validate_adapter,
)
from services.registry.views import (
    AdapterChange,
    AdapterView,
    Page,
    VersionView,
    adapter_view,
    answer_headers,
    change_view,
    page_of,
    published_view,
    version_view,
)

router = APIRouter(prefix="/v1/adapters", tags=["adapters"], dependencies=[Replayed])

AdapterIdPath = Annotated[str, Path(pattern=ID_PATTERN)]
VersionPath = Annotated[int, Path(ge=1, le=2**31)]

ERRORS = problem_responses(401, 403, 404, 409, 412, 422, 503)


def _read_upload(upload: UploadFile, limit: int, what: str) -> tuple[IO[bytes], int]:
    handle = upload.file
    handle.seek(0, 2)
    size = handle.tell()
    handle.seek(0)
    if what == "adapter_config" and size > MAX_CONFIG_BYTES:
        raise too_large_config(size)
    if size > limit:
        raise UploadRejected(f"{what} is {size} bytes, over the {limit}-byte limit", status=413,
                             field=what)
    return handle, size


def _adapter_files(adapter_config: UploadFile | None, adapter_model: UploadFile | None,
                   archive: UploadFile | None, limit: int) -> UnpackedAdapter:
    if archive is not None:
        if adapter_config is not None or adapter_model is not None:
            raise UploadRejected("send either archive or adapter_config + adapter_model",
                                 field="archive")
        handle, _ = _read_upload(archive, limit, "archive")
        return unpack_archive(handle, limit)
    if adapter_config is None or adapter_model is None:
        raise UploadRejected("adapter_config and adapter_model (or one archive) are required",
                             field="adapter_model" if adapter_config else "adapter_config")
    config, _ = _read_upload(adapter_config, limit, "adapter_config")
    weights, size = _read_upload(adapter_model, limit, "adapter_model")
    return UnpackedAdapter(config.read(), weights, size)


def _publish_fingerprint(request: PublishRequest, expected: int | None, sha256: str,
                         config_sha256: str, regression_set_sha256: str | None) -> str:
    """What makes two publish requests the same request: the form, If-Match and the
    files' digests (however they were sent: two files or one archive)."""
    return request_fingerprint("publish", request.adapter_id, request.tenant.key,
                               request.owner, request.base_model, request.label,
                               request.qos_tier, request.rollback_to, expected, sha256,
                               config_sha256, regression_set_sha256)


def _digests(files: UnpackedAdapter) -> tuple[str, str]:
    weights = hashlib.sha256()
    while chunk := files.weights.read(1 << 20):
        weights.update(chunk)
    return weights.hexdigest(), hashlib.sha256(files.config).hexdigest()


@router.post("/{adapter_id}/versions", status_code=201, response_model=VersionView,
             responses={**ERRORS, **problem_responses(413)})
def publish(
    adapter_id: AdapterIdPath,
    response: Response,
    principal: Writer,
    node: Node,
    blobs: Blobs,
    expected: ExpectedVersion,
    key: IdempotencyKey,
    trace: TraceId,
    deadline: WriteDeadline,
    org: Annotated[str, Form(pattern=SLUG_PATTERN)],
    team: Annotated[str, Form(pattern=SLUG_PATTERN)],
    project: Annotated[str, Form(pattern=SLUG_PATTERN)],
    owner: Annotated[str, Form(min_length=1, max_length=256)],
    base_model: Annotated[str, Form(pattern=ID_PATTERN)],
    label: Annotated[str, Form(min_length=1, max_length=128)],
    qos_tier: Annotated[Literal["platinum", "gold", "silver", "bronze"], Form()] = "silver",
    rollback_to: Annotated[int | None, Form(ge=1, le=2**31)] = None,
    adapter_config: Annotated[UploadFile | None, File(description="adapter_config.json")] = None,
    adapter_model: Annotated[UploadFile | None, File(
        description="adapter_model.safetensors")] = None,
    archive: Annotated[UploadFile | None, File(
        description="a .tar.gz of the adapter directory, instead of the two files")] = None,
    regression_set: Annotated[UploadFile | None, File(
        description="JSONL regression set: the version gets traffic only once it passes "
                    "(services/catalog/regression.py)")] = None,
) -> VersionView:
    """Validate a PEFT LoRA adapter, store it by digest, emit AdapterVersionPublished.

    A retry with the same Idempotency-Key and the same request (form, If-Match, file
    digests) answers the first 201 again; with another request, 422 `key_reused`.
    `warnings` says when the adapter declares another base model than the registered
    one (its shapes fit it nonetheless)."""
    tenant = TenantRef(org=org, team=team, project=project)
    ensure_write_scope(principal, tenant)
    settings = node.settings
    checked_set = (read_regression_set(regression_set, settings)
                   if regression_set is not None else None)
    set_sha256 = checked_set[1].sha256 if checked_set is not None else None
    request = PublishRequest(adapter_id=adapter_id, tenant=tenant, owner=owner,
                             base_model=base_model, label=label, qos_tier=qos_tier,
                             rollback_to=rollback_to,
                             gate_required=settings.release_ungated == "block")
    expect = (AdapterVersionPublished.event_type(), adapter_stream(adapter_id))
    with node.state_lock:
        prior = node.state.prior_answer(principal.actor, key, *expect)
        if prior is None:
            base = precheck_publish(node.state, request, expected)
    if prior is not None:
        files = _adapter_files(adapter_config, adapter_model, archive, settings.max_upload_bytes)
        fingerprint = _publish_fingerprint(request, expected, *_digests(files), set_sha256)
        with node.state_lock:
            prior = node.state.prior_answer(principal.actor, key, *expect,
                                            request_sha256=fingerprint)
            base_config = node.state.base_models[prior.envelope.payload.base_model].config \
                if prior is not None else {}
        assert prior is not None
        answer_headers(response, Committed(prior.envelope, prior.position, replayed=True))
        return published_view(prior.envelope, prior.position, base_config)

    base_config = dict(base.config)
    if checked_set is not None:
        fits_context(checked_set[1], base_config, settings)
    try:
        files = _adapter_files(adapter_config, adapter_model, archive, settings.max_upload_bytes)
        writer = blobs.writer()
        try:
            facts = validate_adapter(files.config, files.weights, files.weights_size,
                                     base_config, limits=AdapterLimits.of(settings),
                                     sink=writer, base_name=base.name)
            writer.commit()
        finally:
            writer.discard()
    except UploadRejected as exc:
        node.metrics.uploads_rejected.labels(str(exc.status)).inc()
        raise
    blobs.put(files.config)
    if checked_set is not None:
        request = replace(request, gate=gate_spec(*checked_set, blobs, settings))
    node.metrics.upload_bytes.inc(facts.size_bytes)

    def decide(state: CatalogState) -> CommandEvent:
        restore_upload(blobs, facts, files.config, files.weights)  # a purge erased them?
        return publish_version(state, request, facts, expected, key)

    committed = node.execute(
        "publish", decide,
        actor=principal.actor, idempotency_key=key, expect=expect, trace_id=trace,
        request_sha256=_publish_fingerprint(request, expected, facts.sha256,
                                            facts.config_sha256, set_sha256),
        deadline=deadline)
    answer_headers(response, committed)
    return published_view(committed.envelope, committed.position, base_config)


@router.get("", response_model=Page[AdapterView], responses=ERRORS)
def list_adapters(
    principal: Reader, node: Node,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=128)] = None,
) -> Page[AdapterView]:
    """Adapters the caller may read, by id; `next_cursor` pages on."""
    with node.state_lock:
        adapters = sorted((a for a in node.state.adapters.values()
                           if a.versions and principal.may_read_for(a.tenant)
                           and (cursor is None or a.adapter_id > cursor)),
                          key=lambda a: a.adapter_id)
        return page_of(adapters, limit, adapter_view, lambda a: a.adapter_id)


@router.get("/{adapter_id}", response_model=AdapterView, responses=ERRORS)
def get_adapter(adapter_id: AdapterIdPath, principal: Reader, node: Node,
                response: Response) -> AdapterView:
    with node.state_lock:
        adapter = node.state.adapter(adapter_id)
        visible(principal, adapter.tenant, "adapter", adapter_id)
        view = adapter_view(adapter)
    response.headers["ETag"] = f'"{view.etag}"'
    return view


@router.get("/{adapter_id}/versions", response_model=Page[VersionView], responses=ERRORS)
def list_versions(
    adapter_id: AdapterIdPath, principal: Reader, node: Node,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[int | None, Query(ge=0, le=2**31,
                                        description="Last version of the previous page")] = None,
) -> Page[VersionView]:
    with node.state_lock:
        adapter = node.state.adapter(adapter_id)
        visible(principal, adapter.tenant, "adapter", adapter_id)
        numbers = sorted(n for n in adapter.versions if cursor is None or n > cursor)
        return page_of(numbers, limit, lambda n: version_view(adapter, adapter.versions[n]),
                       lambda n: n)


@router.get("/{adapter_id}/versions/{version}", response_model=VersionView, responses=ERRORS)
def get_version(adapter_id: AdapterIdPath, version: VersionPath, principal: Reader,
                node: Node) -> VersionView:
    with node.state_lock:
        adapter = node.state.adapter(adapter_id)
        visible(principal, adapter.tenant, "adapter", adapter_id)
        return version_view(adapter, node.state.version(adapter_id, version))


class SwitchBody(BaseModel):
    version: int = Field(ge=1, le=2**31)


class RollbackBody(BaseModel):
    to_version: int | None = Field(None, ge=1, le=2**31,
                                   description="Default: the previous stable version")
    reason: str = Field(min_length=1, max_length=1024)


class ReasonBody(BaseModel):
    reason: str = Field("", max_length=1024)


def _change(response: Response, committed: Committed) -> AdapterChange:
    answer_headers(response, committed)
    return change_view(committed.envelope, committed.position)


@router.put("/{adapter_id}/active", response_model=AdapterChange, responses=ERRORS)
def switch(adapter_id: AdapterIdPath, body: SwitchBody, principal: Writer, node: Node,
           response: Response, expected: ExpectedVersion, key: IdempotencyKey,
           trace: TraceId, deadline: WriteDeadline) -> AdapterChange:
    """Make a version the adapter's active one (AdapterVersionSwitched)."""
    writable_adapter(node, principal, adapter_id)
    committed = node.execute(
        "switch", lambda s: switch_active(s, adapter_id, body.version, expected, key),
        actor=principal.actor, idempotency_key=key,
        expect=("AdapterVersionSwitched", adapter_stream(adapter_id)), trace_id=trace,
        request_sha256=request_fingerprint("switch", adapter_id, body, expected),
        deadline=deadline)
    return _change(response, committed)


@router.post("/{adapter_id}/rollback", response_model=AdapterChange, responses=ERRORS)
def rollback(adapter_id: AdapterIdPath, body: RollbackBody, principal: Writer, node: Node,
             response: Response, expected: ExpectedVersion, key: IdempotencyKey,
             trace: TraceId, deadline: WriteDeadline) -> AdapterChange:
    """Roll the active version back (AdapterRolledBack); default target in domain.py."""
    writable_adapter(node, principal, adapter_id)
    committed = node.execute(
        "rollback", lambda s: roll_back(s, adapter_id, body.to_version, body.reason, expected,
                                        key),
        actor=principal.actor, idempotency_key=key,
        expect=("AdapterRolledBack", adapter_stream(adapter_id)), trace_id=trace,
        request_sha256=request_fingerprint("rollback", adapter_id, body, expected),
        deadline=deadline)
    return _change(response, committed)


def _toggle(disabled: bool, adapter_id: str, version: int, body: ReasonBody,
            principal: Writer, node: Node, response: Response, expected: int | None,
            key: str | None, trace: str, deadline: Deadline) -> AdapterChange:
    writable_adapter(node, principal, adapter_id)
    event_type = "AdapterDisabled" if disabled else "AdapterEnabled"
    committed = node.execute(
        "disable" if disabled else "enable",
        lambda s: set_disabled(s, adapter_id, version, disabled, body.reason, expected, key),
        actor=principal.actor, idempotency_key=key,
        expect=(event_type, adapter_stream(adapter_id)), trace_id=trace,
        request_sha256=request_fingerprint(event_type, adapter_id, version, body, expected),
        deadline=deadline)
    return _change(response, committed)


@router.post("/{adapter_id}/versions/{version}/disable", response_model=AdapterChange,
             responses=ERRORS)
def disable(adapter_id: AdapterIdPath, version: VersionPath, body: ReasonBody,
            principal: Writer, node: Node, response: Response, expected: ExpectedVersion,
            key: IdempotencyKey, trace: TraceId, deadline: WriteDeadline) -> AdapterChange:
    """A disabled version is never served, active or in a split."""
    return _toggle(True, adapter_id, version, body, principal, node, response, expected, key,
                   trace, deadline)


@router.post("/{adapter_id}/versions/{version}/enable", response_model=AdapterChange,
             responses=ERRORS)
def enable(adapter_id: AdapterIdPath, version: VersionPath, body: ReasonBody,
           principal: Writer, node: Node, response: Response, expected: ExpectedVersion,
           key: IdempotencyKey, trace: TraceId, deadline: WriteDeadline) -> AdapterChange:
    return _toggle(False, adapter_id, version, body, principal, node, response, expected, key,
                   trace, deadline)
