"""Tenant purges: request one, then watch worker acknowledgements arrive against a deadline."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Path
from pydantic import BaseModel, Field

from services.catalog.state import Refusal, missing, tenant_stream
from services.contracts.events import SLUG_PATTERN, TenantPurgeRequested, TenantRef, uuid7
from services.contracts.problems import problem_responses
from services.contracts.roles import Permission
from services.registry.deps import (
    Blobs,
    IdempotencyKey,
    Node,
    Purger,
    Reader,
    Replayed,
    TraceId,
    WriteDeadline,
    ensure_write_scope,
    request_fingerprint,
    visible,
)
from services.registry.domain import request_purge
from services.registry.erasure import erase_tenant_blobs
from services.registry.node import WritesUnavailable
from services.registry.views import PurgeView, event_ref, purge_view

log = logging.getLogger("loraplane.registry")
router = APIRouter(prefix="/v1", tags=["purges"], dependencies=[Replayed])
ERRORS = problem_responses(401, 403, 404, 409, 422, 503)
Slug = Annotated[str, Path(pattern=SLUG_PATTERN)]


class PurgeBody(BaseModel):
    deadline_s: float = Field(60.0, gt=0, le=86400,
                              description="Workers must acknowledge within this many seconds")
    hard: bool = Field(True, description="Abort the tenant's running sequences")


@router.post("/tenants/{org}/{team}/{project}/purge", status_code=202,
             response_model=PurgeView, responses=ERRORS)
def purge_tenant(org: Slug, team: Slug, project: Slug, principal: Purger, node: Node,
                 blobs: Blobs, key: IdempotencyKey, trace: TraceId, deadline: WriteDeadline,
                 body: PurgeBody | None = None) -> PurgeView:
    """Emit TenantPurgeRequested; workers free the tenant's KV and adapters and ack; the
    tenant's adapter files are erased from the blob store (TenantBlobsDeleted)."""
    body = body or PurgeBody()
    tenant = TenantRef(org=org, team=team, project=project)
    ensure_write_scope(principal, tenant, Permission.PURGE)
    purge_id = uuid7().hex
    committed = node.execute(
        "purge", lambda s: request_purge(s, tenant, purge_id, body.deadline_s, body.hard, key),
        actor=principal.actor, idempotency_key=key,
        expect=(TenantPurgeRequested.event_type(), tenant_stream(tenant)), trace_id=trace,
        request_sha256=request_fingerprint("purge", tenant.key, body), deadline=deadline)
    payload = committed.envelope.payload
    assert isinstance(payload, TenantPurgeRequested)
    try:
        erase_tenant_blobs(node, blobs, payload.purge_id)
    except WritesUnavailable as exc:  # the purge stands; the erasure resumes at start-up
        log.warning("purge %s: blob erasure deferred: %s", payload.purge_id, exc.message)
    with node.state_lock:
        purge = node.state.purges[payload.purge_id]
        return purge_view(purge, datetime.now(UTC),
                          event_ref(committed.envelope, committed.position))


@router.get("/purges/{purge_id}", response_model=PurgeView, responses=ERRORS)
def get_purge(purge_id: Annotated[str, Path(max_length=64)], principal: Reader,
              node: Node) -> PurgeView:
    """Acks folded from worker-events (TenantPurged), and whether the deadline was met."""
    with node.state_lock:
        purge = node.state.purges.get(purge_id)
        if purge is None:
            raise Refusal("not_found", missing("purge", purge_id))
        visible(principal, purge.tenant, "purge", purge_id)
        return purge_view(purge, datetime.now(UTC))
