"""The OpenAI-compatible HTTP front's routes (`services.router.openai_http` is the rest
of the front: bodies to requests, answers back in OpenAI's shapes), and the app that
serves them.

Each route reads the dispatcher and the front from the app's state
(`create_http_app`) through its dependencies, as the registry's routes read their node.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from services.catalog.auth import TokenBook
from services.contracts.grpc import inference_pb2 as pb
from services.router.dispatch import Dispatcher, RouteError
from services.router.model_info import on_worker
from services.router.openai_answers import (
    ChunkMaker,
    PromptAnswer,
    chat_choices,
    completion_choices,
)
from services.router.openai_http import (
    Front,
    OpenAIError,
    Who,
    fingerprint,
    listed_models,
    parse_model,
    served,
    sse,
    usage_of,
)
from services.router.openai_schema import (
    BodyError,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    OpenAIBody,
    TokenizeBody,
    parse,
    read_body,
)

router = APIRouter()


def get_dispatcher(request: Request) -> Dispatcher:
    dispatcher: Dispatcher = request.app.state.dispatcher
    return dispatcher


def get_front(request: Request) -> Front:
    front: Front = request.app.state.front
    return front


Routed = Annotated[Dispatcher, Depends(get_dispatcher)]
Fronted = Annotated[Front, Depends(get_front)]


def create_http_app(dispatcher: Dispatcher, tokens: TokenBook) -> FastAPI:
    app = FastAPI(title="loraplane router (OpenAI-compatible)", version="1",
                  docs_url=None, redoc_url=None)
    app.state.dispatcher = dispatcher
    app.state.front = Front(dispatcher)
    app.state.tokens = tokens

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    @app.exception_handler(BodyError)
    async def _bad_body(_: Request, exc: BodyError) -> JSONResponse:
        dispatcher.metrics.rejections.labels("invalid").inc()
        return OpenAIError(exc.status, exc.message, param=exc.param, code=exc.code).response()

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return OpenAIError(exc.status_code, str(exc.detail), code=code,
                           headers=dict(exc.headers or {})).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ())[1:])
        dispatcher.metrics.rejections.labels("invalid").inc()
        return OpenAIError(400, f"{loc or 'body'}: {first.get('msg', 'invalid request')}",
                           param=loc or None, code="invalid_request").response()

    app.include_router(router)
    return app


def _ready(dispatcher: Dispatcher) -> None:
    if not dispatcher.ready:
        raise OpenAIError(503, "router is replaying the log", code="not_ready",
                          headers={"Retry-After": "1"})


@router.get("/v1/models")
async def models(who: Who, dispatcher: Routed) -> dict[str, Any]:
    _ready(dispatcher)
    return {"object": "list", "data": listed_models(dispatcher.catalog, who.tenant)}


@router.get("/v1/models/{model:path}")
async def model(model: str, who: Who, dispatcher: Routed) -> dict[str, Any]:
    _ready(dispatcher)
    for entry in listed_models(dispatcher.catalog, who.tenant):
        if entry["id"] == model:
            return entry
    raise OpenAIError(404, f"model {model!r} does not exist", param="model",
                      code="model_not_found")


@router.post("/v1/completions")
async def completions(request: Request, who: Who, dispatcher: Routed, front: Fronted
                      ) -> Response:
    _ready(dispatcher)
    body: CompletionBody = parse(CompletionBody, await read_body(request))
    base, ref = parse_model(body.model, dispatcher.catalog)
    requests = front.requests(who, body, base, ref, body.prompts(), body.max_tokens)
    opened = await _unless_gone(request, front.open_streams(who, requests, base))
    logprobs = body.logprobs is not None
    return await _respond(request, front, opened, body, f"cmpl-{requests[0].request_id}",
                          ("text_completion", "text_completion"),
                          ChunkMaker(False, body.n, body.echo, logprobs),
                          lambda o: completion_choices(o, body.n, body.echo, logprobs))


@router.post("/v1/chat/completions")
async def chat(request: Request, who: Who, dispatcher: Routed, front: Fronted) -> Response:
    _ready(dispatcher)
    body: ChatBody = parse(ChatBody, await read_body(request))
    base, ref = parse_model(body.model, dispatcher.catalog)
    limit = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    requests = front.requests(who, body, base, ref, [body.messages], limit)
    opened = await _unless_gone(request, front.open_streams(who, requests, base))
    return await _respond(request, front, opened, body,
                          f"chatcmpl-{requests[0].request_id}",
                          ("chat.completion.chunk", "chat.completion"),
                          ChunkMaker(True, body.n, False, body.logprobs),
                          lambda o: chat_choices(o, body.n, body.logprobs))


@router.post("/tokenize")
async def tokenize(request: Request, who: Who, dispatcher: Routed) -> dict[str, Any]:
    """vLLM's route, tenant-scoped: the model resolves as for a completion."""
    _ready(dispatcher)
    body = parse(TokenizeBody, await read_body(request))
    base, ref = parse_model(body.model, dispatcher.catalog)
    ask = pb.TokenizeRequest(tenant=who.signature, adapter=ref, base_model=base or "")
    if body.messages is not None:
        ask.chat.messages.extend(pb.ChatMessage(role=m.role, content=m.text())
                                 for m in body.messages)
        ask.chat.tools.extend(ChatBody.tools_pb(body))  # type: ignore[arg-type]
    else:
        ask.text = body.prompt or ""
    try:
        reply = await on_worker(dispatcher, who.principal, who.signature, ref, base,
                                "Tokenize", ask)
    except RouteError as error:
        raise OpenAIError.of(error) from None
    return {"count": reply.count, "max_model_len": reply.max_model_len,
            "tokens": list(reply.token_ids)}


@router.post("/detokenize")
async def detokenize(request: Request, who: Who, dispatcher: Routed) -> dict[str, Any]:
    _ready(dispatcher)
    body = parse(DetokenizeBody, await read_body(request))
    base, ref = parse_model(body.model, dispatcher.catalog)
    ask = pb.DetokenizeRequest(tenant=who.signature, adapter=ref, base_model=base or "",
                               token_ids=body.tokens)
    try:
        reply = await on_worker(dispatcher, who.principal, who.signature, ref, base,
                                "Detokenize", ask)
    except RouteError as error:
        raise OpenAIError.of(error) from None
    return {"prompt": reply.text}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(dispatcher: Routed) -> JSONResponse:
    ready = dispatcher.ready
    return JSONResponse({"ready": ready, "ring": sorted(dispatcher.ring.members)},
                        status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(dispatcher: Routed) -> Response:
    return Response(dispatcher.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/debug/traces")
async def traces(who: Who, dispatcher: Routed, trace_id: str | None = None, limit: int = 50
                 ) -> dict[str, Any]:
    """The router's recent route traces for the caller's tenant (all, for an admin)."""
    found = [t.as_dict() for t in reversed(dispatcher.traces)
             if (who.principal.role == "admin" or t.tenant == who.tenant.key)
             and (trace_id is None or t.trace_id == trace_id)]
    return {"traces": found[:max(1, min(limit, 500))]}


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


_T = TypeVar("_T")


async def _unless_gone(request: Request, work: Awaitable[_T]) -> _T:
    """`work`, cancelled as soon as the client disconnects (then `ClientGone`).

    uvicorn does not cancel a handler whose client left, so without this a non-streamed
    answer (and any answer still waiting for its first token) is generated to its end for
    nobody. Cancelling `work` closes the request's streams: the router cancels the worker's
    calls and the worker aborts the sequences before their next step. (A streamed answer
    is stopped by Starlette itself, which listens for the disconnect while it streams.)"""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        gone.cancel()
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _respond(request: Request, front: Front,
                   opened: list[tuple[pb.GenerateResponse, AsyncIterator[Any]]],
                   body: OpenAIBody, rid: str, objects: tuple[str, str], chunk_choice: Any,
                   full_choice: Any) -> Response:
    """The answer in OpenAI's shape: SSE chunks (`objects[0]`) or one body (`objects[1]`)."""
    created = int(time.time())
    if body.stream:
        head = {"id": rid, "object": objects[0], "created": created, "model": body.model}
        return _stream(front, opened,
                       lambda index, response: [{**head, "choices": [entry]} for entry in
                                                chunk_choice.entries(index, response)],
                       (lambda finals: {**head, "choices": [], "usage": usage_of(finals)})
                       if body.include_usage else None, len(opened))
    outcomes = await _unless_gone(request, front.gather(opened))
    _raise_worker_errors(outcomes)
    finals = [o.final for o in outcomes]
    return JSONResponse({
        "id": rid, "object": objects[1], "created": created, "model": body.model,
        "system_fingerprint": fingerprint(finals),
        "choices": [c for o in outcomes for c in full_choice(o)],
        "usage": usage_of(finals), "loraplane": {"served": served(finals)}})


def _raise_worker_errors(outcomes: list[PromptAnswer]) -> None:
    for outcome in outcomes:
        if outcome.final is not None and outcome.final.finish_reason == pb.FINISH_REASON_ERROR:
            raise OpenAIError(502, f"the worker failed after {outcome.final.completion_tokens} "
                                   f"tokens (trace {outcome.final.trace_id})",
                              code="worker_error")


def _stream(front: Front, opened: list[tuple[pb.GenerateResponse, AsyncIterator[Any]]],
            chunk: Any, usage_chunk: Any, count: int) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        finals: list[pb.FinalUsage | None] = [None] * count
        try:
            async for index, response in front.events(opened):
                if response.HasField("final"):
                    finals[index] = response.final
                    if response.final.finish_reason == pb.FINISH_REASON_ERROR:
                        raise OpenAIError(502, "the worker failed mid-stream (trace "
                                               f"{response.final.trace_id})",
                                          code="worker_error")
                for piece in chunk(index, response):
                    yield sse(piece)
            if usage_chunk is not None:
                yield sse(usage_chunk(finals))
            yield b"data: [DONE]\n\n"
        except RouteError as error:
            yield sse(OpenAIError.of(error).body())
        except OpenAIError as error:
            yield sse(error.body())

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
