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
    503: {"description": "replaying, halted on an event it cannot fold, fenced, or the event "
                         "log does not take writes (`reason` says which)"}})
def readyz(node: Node) -> JSONResponse:
    """200 once the log is replayed and this instance can write; otherwise 503 and why."""
    ready, reason = node.readiness()
    follower = node.follower.status()
    body = {"ready": ready, "reason": reason, "replayed": node.ready.is_set(),
            "writable": node.writable, "fenced": node.fenced, "halted": follower["halt"],
            "registry_id": node.registry_id, "epoch": node.epoch,
            "started_from": follower["started_from"],
            "seconds_to_ready": follower["seconds_to_ready"],
            "last_error": node.last_error}
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response)
def metrics(node: Node) -> Response:
    return Response(node.metrics.render(), media_type="text/plain; version=0.0.4")
