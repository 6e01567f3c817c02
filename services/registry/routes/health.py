"""Liveness, readiness (only after replaying to our own barrier) and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from services.registry.deps import Node

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process answers; says nothing about the log."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "replaying, or fenced"}})
def readyz(node: Node) -> JSONResponse:
    """200 once the log is replayed to this instance's barrier and it may write."""
    body = {"ready": node.ready.is_set() and not node.fenced, "replayed": node.ready.is_set(),
            "writable": node.writable, "fenced": node.fenced, "registry_id": node.registry_id,
            "epoch": node.epoch, "last_error": node.last_error}
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


@router.get("/metrics", response_class=Response)
def metrics(node: Node) -> Response:
    return Response(node.metrics.render(), media_type="text/plain; version=0.0.4")
