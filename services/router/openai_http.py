"""The OpenAI-compatible HTTP front: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.

Requests become `GenerateRequest`s handed to the same `Dispatcher.generate` as gRPC, so
resolution, placement, limits and failover are the same. This module turns bodies into
requests and answers into OpenAI's shapes; the routes are an `APIRouter` in
`services.router.openai_routes`, whose `create_http_app` serves them. Specifics:

- `model` is `base:adapter_or_alias`, `adapter@version` or `base:adapter@version` (pinned),
  a base model name alone (no adapter), or an adapter id / alias alone.
- The tenant is the token's scope; a token with `*` segments (or an admin token) names the
  rest in `X-Loraplane-Tenant: org/team/project`. `X-Loraplane-Compliance-Scope` and
  `X-Loraplane-Region` complete the tenant signature; OpenAI's `user` field is the user id
  that keeps a user on one side of a canary.
- Streaming is server-sent events ending in `data: [DONE]`; with
  `stream_options.include_usage` the last chunk before it carries `usage` (a whole
  answer always does).
- Bodies and what each field does: `services.router.openai_schema` (every field is
  honoured, or refused with 400 `unsupported_parameter` naming it).
- Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`; a rate
  limit is 429 with `Retry-After`. An error after the first token of a stream arrives as
  an SSE event with an `error` member (the official client raises it as `APIError`).
- Chat messages are passed to the worker, which renders the base model's chat template.
- A client that disconnects stops the work, streamed or not: its request's streams are
  closed, so the router cancels the worker's calls and the worker aborts the sequences
  (traced `cancelled`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Header, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.catalog.auth import Principal, TokenBook
from services.catalog.serving import purged_reason, split_order
from services.catalog.state import CatalogState
from services.contracts.events import TenantRef
from services.contracts.generate import UINT32_MAX
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.roles import Permission, holders
from services.router.dispatch import Dispatcher, RouteError, authorize
from services.router.openai_answers import (
    PromptAnswer,
)
from services.router.openai_schema import (
    ChatBody,
    ChatMessage,
    OpenAIBody,
    http_param,
)

bearer = HTTPBearer(auto_error=False, description="An inference token (stored hashed).")

_STATUS = {
    "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400, "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409, "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499,
    "UNIMPLEMENTED": 501, "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error",
          503: "service_unavailable_error", 504: "timeout_error"}
_VERSION = re.compile(r"^[0-9]{1,10}$")

class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @classmethod
    def of(cls, error: RouteError) -> OpenAIError:
        status = _STATUS.get(error.code, 502 if error.reason == "worker_error" else 500)
        if error.reason == "worker_error" and status >= 500:
            status = 502
        headers = {"Retry-After": error.retry_after} if error.retry_after else {}
        param, message = http_param(error.field), error.message
        if param and error.field and message.startswith(f"{error.field}:"):
            message = param + message[len(error.field):]  # the body's name, not the proto's
        code = "model_not_found" if status == 404 else error.reason
        return cls(status, message, code=code, param=param, headers=headers)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": _TYPES.get(self.status, "server_error" if self.status >= 500
                                             else "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# --- model names ----------------------------------------------------------------------------


def parse_model(model: str, catalog: CatalogState) -> tuple[str | None, pb.AdapterRef]:
    """`model` → (base model name or None, adapter reference); see the module doc."""
    base, sep, name = model.partition(":")
    if not sep:
        base, name = "", model
        if "@" not in model and model in catalog.base_models:
            return model, pb.AdapterRef()
    if sep and not name:
        return base, pb.AdapterRef()
    adapter, at, version = name.partition("@")
    if at:
        if (not _VERSION.match(version) or not 1 <= int(version) <= UINT32_MAX
                or not adapter):
            raise OpenAIError(400, f"model {model[:80]!r}: the version after '@' is a number "
                                   f"from 1 to {UINT32_MAX}", param="model",
                              code="invalid_model")
        ref = pb.AdapterRef(pinned=pb.PinnedVersion(adapter_id=adapter, version=int(version)))
    else:
        ref = pb.AdapterRef(alias=name)
    return base or None, ref


def listed_models(catalog: CatalogState, tenant: TenantRef) -> list[dict[str, Any]]:
    """The caller's servable adapters and aliases as `base:name`, and the base models."""
    models = [{"id": b.name, "object": "model", "created": int(b.registered_at.timestamp()),
               "owned_by": "loraplane", "root": b.name, "parent": None,
               "max_model_len": b.config.get("max_position_embeddings")}
              for b in catalog.base_models.values()]
    for adapter in catalog.adapters.values():
        number = adapter.active_version
        if adapter.tenant != tenant or number is None or number not in adapter.versions:
            continue
        version = adapter.versions[number]
        if version.disabled or version.rolled_back or purged_reason(adapter, number, version):
            continue
        base = version.published.base_model
        models.append({"id": f"{base}:{adapter.adapter_id}",
                       "object": "model", "created": int(version.published_at.timestamp()),
                       "owned_by": tenant.key, "root": f"{adapter.adapter_id}@{number}",
                       "parent": base})
    for alias in catalog.aliases.values():
        if alias.tenant != tenant:
            continue
        entries = [e for e in split_order(alias.split) if e.weight > 0]
        target = catalog.adapters.get(entries[0].adapter_id) if entries else None
        version = target.versions.get(entries[0].version) if target else None
        if (target is None or version is None
                or purged_reason(target, entries[0].version, version)):
            continue
        base = version.published.base_model
        models.append({"id": f"{base}:{alias.alias}",
                       "object": "model", "created": int(alias.changed_at.timestamp()),
                       "owned_by": tenant.key, "root": alias.alias, "parent": base})
    return sorted(models, key=lambda m: m["id"])


# --- running requests -----------------------------------------------------------------------


@dataclass(frozen=True)
class HttpCaller:
    """An HTTP caller once its token is checked: who, the tenant signature its headers
    make, and the tenant that signature authorises."""

    principal: Principal
    signature: pb.TenantSignature
    tenant: TenantRef


class Front:
    """Turns HTTP bodies into dispatcher calls and answers back in OpenAI's shapes."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def requests(self, caller: HttpCaller, body: OpenAIBody, base: str | None, ref: pb.AdapterRef,
                 prompts: Sequence[str | list[int] | list[ChatMessage]], default_max: int | None
                 ) -> list[pb.GenerateRequest]:
        sampling = body.sampling(default_max)
        signature = pb.TenantSignature()
        signature.CopyFrom(caller.signature)
        signature.user_id = body.user or ""
        built = []
        for prompt in prompts:
            request = pb.GenerateRequest(request_id=uuid.uuid4().hex, tenant=signature,
                                         adapter=ref, sampling=sampling)
            if isinstance(prompt, str):
                request.text = prompt
            elif prompt and isinstance(prompt[0], ChatMessage):
                request.chat.messages.extend(
                    pb.ChatMessage(role=m.role, content=m.text(),  # role: canonical
                                   tool_call_id=m.tool_call_id or "",
                                   tool_calls=[pb.ToolCall(id=c.id, name=c.function.name,
                                                           arguments=c.function.arguments)
                                               for c in m.tool_calls or []])
                    for m in prompt)  # type: ignore[union-attr]
                if isinstance(body, ChatBody):
                    request.chat.tools.extend(body.tools_pb())
            else:
                request.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
            built.append(request)
        return built

    async def open_streams(self, caller: HttpCaller, requests: list[pb.GenerateRequest],
                           base: str | None
                           ) -> list[tuple[pb.GenerateResponse, AsyncIterator[Any]]]:
        """Start every request and wait for its first response, so that an error before
        any token is an HTTP error status rather than a broken stream."""
        streams = [self.dispatcher.generate(caller.principal, r, timeout_s=None, front="http",
                                            base_model=base) for r in requests]
        try:
            firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
        except asyncio.CancelledError:  # the client left (`_unless_gone`)
            for stream in streams:
                await stream.aclose()
            raise
        failure = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failure is not None:
            for stream in streams:
                await stream.aclose()
            if isinstance(failure, RouteError):
                raise OpenAIError.of(failure)
            if isinstance(failure, StopAsyncIteration):
                raise OpenAIError(502, "the worker closed the stream without an answer",
                                  code="worker_error")
            raise failure
        return list(zip(firsts, streams, strict=True))  # type: ignore[arg-type]

    async def gather(self, opened: list[tuple[pb.GenerateResponse, AsyncIterator[Any]]]
                     ) -> list[PromptAnswer]:
        async def one(index: int, first: pb.GenerateResponse,
                      stream: AsyncIterator[pb.GenerateResponse]) -> PromptAnswer:
            outcome = PromptAnswer(index)
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                response: pb.GenerateResponse | None = first
                while response is not None:
                    outcome.add(response)
                    response = await anext(stream, None)
            return outcome

        try:
            return list(await asyncio.gather(*(one(i, f, s)
                                               for i, (f, s) in enumerate(opened))))
        except RouteError as error:
            raise OpenAIError.of(error) from None

    async def events(self, opened: list[tuple[pb.GenerateResponse, AsyncIterator[Any]]]
                     ) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
        """Responses of all prompts, as they come, tagged with the prompt's index."""
        queue: asyncio.Queue[tuple[int, pb.GenerateResponse | BaseException | None]] = \
            asyncio.Queue()

        async def pump(index: int, first: pb.GenerateResponse,
                       stream: AsyncIterator[pb.GenerateResponse]) -> None:
            try:
                async with contextlib.aclosing(stream):  # type: ignore[type-var]
                    await queue.put((index, first))
                    async for response in stream:
                        await queue.put((index, response))
                await queue.put((index, None))
            except Exception as exc:
                await queue.put((index, exc))

        tasks = [asyncio.create_task(pump(i, f, s)) for i, (f, s) in enumerate(opened)]
        try:
            open_count = len(tasks)
            while open_count:
                index, item = await queue.get()
                if item is None:
                    open_count -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def usage_of(finals: Sequence[pb.FinalUsage | None]) -> dict[str, Any]:
    prompt = sum(f.prompt_tokens for f in finals if f)
    completion = sum(f.completion_tokens for f in finals if f)
    cached = sum(f.cached_prompt_tokens for f in finals if f)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def fingerprint(finals: Sequence[pb.FinalUsage | None]) -> str | None:
    digest = next((f.base_model_digest for f in finals if f and f.base_model_digest), "")
    return f"lp-{digest[:16]}" if digest else None


def served(finals: Sequence[pb.FinalUsage | None]) -> list[dict[str, Any]]:
    """Which adapter version and worker answered each choice (for the caller's records)."""
    out = []
    for f in finals:
        if f is None:
            out.append({})
            continue
        entry: dict[str, Any] = {"worker_id": f.worker_id, "trace_id": f.trace_id,
                                 "base_model_digest": f.base_model_digest}
        if f.HasField("served_adapter"):
            a = f.served_adapter
            entry["adapter"] = f"{a.adapter_id}@{a.version}"
            entry["sha256"] = a.sha256
        out.append(entry)
    return out


def sse(data: dict[str, Any]) -> bytes:
    import json

    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


# --- the app ------------------------------------------------------------------------------------


class Allowed:
    """A route's permission (`services.contracts.roles`), kept on the dependency so the
    routes' table can be read back; resolves the caller's principal and tenant signature:
    401 / 403 / 400 in OpenAI's shape."""

    def __init__(self, permission: Permission) -> None:
        self.permission = permission

    def __call__(
        self,
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
        tenant: Annotated[str | None, Header(alias="X-Loraplane-Tenant")] = None,
        scope: Annotated[str | None, Header(alias="X-Loraplane-Compliance-Scope")] = None,
        region: Annotated[str | None, Header(alias="X-Loraplane-Region")] = None,
    ) -> HttpCaller:
        dispatcher: Dispatcher = request.app.state.dispatcher
        tokens: TokenBook = request.app.state.tokens
        principal = tokens.resolve(credentials.credentials) if credentials else None
        if principal is None:
            dispatcher.metrics.rejections.labels("unauthenticated").inc()
            raise OpenAIError(401, "missing or unknown bearer token", code="invalid_api_key")
        if not principal.holds(self.permission):
            dispatcher.metrics.rejections.labels("forbidden").inc()
            raise OpenAIError(403, f"role {principal.role} may not {self.permission.value} "
                              f"(roles that may: {', '.join(holders(self.permission))})",
                              code="forbidden")
        return caller(dispatcher, principal, tenant, scope, region)


def caller(dispatcher: Dispatcher, principal: Principal, tenant: str | None,
           scope: str | None, region: str | None) -> HttpCaller:
    """The tenant signature the token and the headers give."""
    parts = tenant.split("/") if tenant else ["", "", ""]
    if len(parts) != 3:
        raise OpenAIError(400, "X-Loraplane-Tenant is org/team/project",
                          param="X-Loraplane-Tenant")
    signature = pb.TenantSignature(org_id=parts[0], team_id=parts[1], project_id=parts[2],
                                   compliance_scope=scope or "", region_hint=region or "")
    try:
        ref = authorize(principal, signature)
    except RouteError as error:
        dispatcher.metrics.rejections.labels(error.reason).inc()
        raise OpenAIError.of(error) from None
    return HttpCaller(principal, signature, ref)


Who = Annotated[HttpCaller, Depends(Allowed(Permission.INFER))]
