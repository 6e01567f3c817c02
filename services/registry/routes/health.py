"""Liveness, readiness (replayed, writable, or why not) and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from services.registry.deps import Node

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process answers; says nothing about the log."""
    return {"status": "ok"}


@router.get("/readyz", responses={
    503: {"description": "replaying, halted on an event it cannot fold, fenced, a standby "
                         "(`role`), or the event log does not take writes: nothing "
                         "committed for 2 lease intervals (`reason` says which)"}})
def readyz(node: Node) -> JSONResponse:
    """200 while this instance is replayed, holds the writer role and its writes commit;
    otherwise 503 and why. A standby (`role`) answers reads but not writes."""
    ready, reason = node.readiness()
    follower = node.follower.status()
    with node.state_lock:
        lease = node.state.lease
    body = {"ready": ready, "reason": reason, "replayed": node.ready.is_set(),
            "writable": ready, "fenced": node.fenced, "halted": follower["halt"],
            "role": node.role, "registry_id": node.registry_id, "epoch": node.epoch,
            "leaseholder": None if lease is None else {"registry_id": lease.registry_id,
                                                       "epoch": lease.epoch},
            "commit_age_s": None if node.commit_age_s is None else round(node.commit_age_s, 3),
            "last_takeover_s": node.last_takeover_s, "stepped_down": node.stepped_down,
            "started_from": follower["started_from"],
            "seconds_to_ready": follower["seconds_to_ready"],
            "last_error": node.last_error}
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response)
def metrics(node: Node) -> Response:
    return Response(node.metrics.render(), media_type="text/plain; version=0.0.4")
