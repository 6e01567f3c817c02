"""The registry's FastAPI app: wiring only (routes, dependencies, errors, lifespan).

The lifespan starts a `RegistryNode`, which fences older instances, replays the log in
the background (`/readyz` and every catalog route answer 503 until then, `/healthz`
answers at once) and then leases every `lease_interval_s`. Shutdown stops the node.

Every error is an RFC 9457 problem (`services/contracts/problems.py`) with a stable
`code`: a refusal of the catalog its kind (`not_found`, `conflict`, `precondition`,
`invalid`, `key_reused`; another tenant's resource is `not_found`, like a missing one),
a role without the route's permission `forbidden`, an upload `invalid_adapter` or `too_large`
(naming the `tensor` or `field`), the event log `replaying`, `halted`, `fenced`,
`standby`, `timeout` or `unavailable` (503 with Retry-After, and `outcome`: whether the
command was `not_written`, is `unknown`, or `committed`), a bad request `invalid_request`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.catalog.auth import TokenBook
from services.catalog.state import Refusal
from services.config import Settings
from services.contracts.events import PATTERN_WORDS
from services.contracts.problems import (
    PROBLEM_MEDIA_TYPE,
    install_problems,
    problem_bytes,
    problem_response,
    validation_problem,
)
from services.registry.blobstore import LocalBlobStore
from services.registry.erasure import ErasureResumer
from services.registry.gate_sweeper import GateSweeper
from services.registry.metrics import RegistryMetrics
from services.registry.node import RegistryNode, WritesUnavailable
from services.registry.routes import (
    adapters,
    aliases,
    base_models,
    blobs,
    gates_rollouts,
    health,
    purges,
)
from services.registry.validation import UploadRejected

log = logging.getLogger("loraplane.registry")

REFUSAL_STATUS = {"not_found": 404, "conflict": 409, "precondition": 412, "invalid": 422,
                  "key_reused": 422}
"""`Refusal.kind`, as answered (`Refusal.public`: another tenant's resource reads as a
missing one) → HTTP status."""
MULTIPART_SLACK_BYTES = 1024 * 1024
"""Room for form fields and adapter_config.json on top of the weights limit."""


class BodyLimit:
    """413 for a request body over the limit, counted as it streams in.

    A declared Content-Length over the limit is refused before reading; a chunked body is
    cut off at the limit, and whatever the app answered is replaced by the 413.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await _too_large(send, self.limit)
            return
        seen = 0
        exceeded = False
        started = False

        async def limited_receive() -> Message:
            nonlocal seen, exceeded
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    exceeded = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded:
                if not started:
                    started = True
                    await _too_large(send, self.limit)
                return
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not exceeded:
                raise
            if not started:
                await _too_large(send, self.limit)


async def _too_large(send: Send, limit: int) -> None:
    body = problem_bytes(413, "too_large", f"the request body is over the upload limit of "
                                           f"{limit} bytes")
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", PROBLEM_MEDIA_TYPE.encode()),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def create_app(settings: Settings, *, registry_id: str | None = None) -> FastAPI:
    """One registry instance; `registry_id` names it in leases and logs."""
    metrics = RegistryMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        node = RegistryNode(settings, metrics, registry_id)
        app.state.node = node
        erasing = ErasureResumer(node, app.state.blobs)  # before start: sees the first role
        node.start()
        sweeper = GateSweeper(node)
        sweeper.start()
        erasing.start()
        try:
            yield
        finally:
            erasing.stop()
            sweeper.stop()
            node.stop()

    app = FastAPI(
        title="loraplane registry",
        version="1",
        summary="Publishes, validates, splits traffic, rolls back and purges LoRA adapters; "
                "the single writer of the adapter event log.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.tokens = TokenBook.from_setting(settings.auth_tokens)
    app.state.blobs = LocalBlobStore(settings.blob_root)
    if not len(app.state.tokens):
        log.warning("no LORAPLANE_AUTH_TOKENS configured: every API call will answer 401")
    for module in (adapters, base_models, aliases, purges, gates_rollouts, blobs, health):
        app.include_router(module.router)

    install_problems(app, pattern_words=PATTERN_WORDS)

    @app.exception_handler(Refusal)
    async def refused(request: Request, exc: Refusal) -> JSONResponse:
        answer = exc.public()
        if answer is not exc:  # answered as a missing resource; the log keeps why
            log.info("%s %s refused: %s", request.method, request.url.path, exc.message)
        return problem_response(REFUSAL_STATUS[answer.kind], answer.kind, answer.message,
                                instance=request.url.path)

    @app.exception_handler(UploadRejected)
    async def rejected(request: Request, exc: UploadRejected) -> JSONResponse:
        return problem_response(exc.status, "too_large" if exc.status == 413
                                else "invalid_adapter", exc.message, instance=request.url.path,
                                tensor=exc.tensor, field=exc.field, **exc.extensions)

    @app.exception_handler(WritesUnavailable)
    async def unavailable(request: Request, exc: WritesUnavailable) -> JSONResponse:
        return problem_response(503, exc.code, exc.message, instance=request.url.path,
                                headers={"Retry-After": str(exc.retry_after_s)},
                                outcome=exc.outcome)

    @app.exception_handler(ValidationError)
    async def invalid(request: Request, exc: ValidationError) -> JSONResponse:
        detail, fields = validation_problem(exc.errors(), PATTERN_WORDS)
        return problem_response(422, "invalid_request", detail, instance=request.url.path,
                                field=fields[0].field if fields else None,
                                errors=[f.model_dump() for f in fields])

    @app.middleware("http")
    async def who_answered(request: Request, call_next: Any) -> Any:
        """Which instance answered and how current its reads are: `X-Loraplane-Read:
        linearizable` from the writer while its writes commit (see `read_consistency`),
        `stale-possible` otherwise (a standby, or a writer cut off from the log)."""
        response = await call_next(request)
        node: RegistryNode | None = getattr(app.state, "node", None)
        if node is not None:
            response.headers["X-Loraplane-Registry"] = node.registry_id
            response.headers["X-Loraplane-Role"] = node.role
            response.headers["X-Loraplane-Read"] = node.read_consistency()
        return response

    app.add_middleware(BodyLimit, limit=settings.max_upload_bytes + MULTIPART_SLACK_BYTES)
    return app
