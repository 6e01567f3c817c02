"""The worker's gRPC front (grpc.aio): `loraplane.v1.Inference`, `loraplane.v1.WorkerControl`,
the standard health service and server reflection.

Thin by design (vLLM's AsyncLLM): a call is checked (`intake`), refused early when the
worker is not ready or behind the version wall, resolved once for a quick refusal, then
handed to the engine loop as a `Ticket` with its own output queue. The loop hands each
iteration's outputs over in one hop (`call_soon_threadsafe`); this side only turns them
into messages. A client cancel or a passed deadline cancels the handler, which cancels
the ticket: the engine aborts the sequence before its next step, frees its KV and traces
the request `cancelled`. The final message (FinalUsage) waits until the request's trace
is in the log (`services.worker.events`), so an answer a client saw complete is always
traced, even if the worker dies the next moment.

Errors: INVALID_ARGUMENT names the field; the serving rule's refusals map to NOT_FOUND
(another tenant's adapter or alias too, in the same words) and FAILED_PRECONDITION; the
version wall and not-ready are
UNAVAILABLE; a full adapter pool is RESOURCE_EXHAUSTED with `retry-after` (seconds) and
`retry-after-ms` trailers, as the router sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from services import tls
from services.catalog.state import Refusal
from services.config import Settings
from services.contracts.generate import Undecodable, add_inference_servicer
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.worker.engine_loop import (
    REFUSAL_CODE,
    EngineLoop,
    Finished,
    Output,
    Refused,
    Ticket,
    choose,
)
from services.worker.intake import (
    InvalidArgument,
    PromptRules,
    WorkItem,
    render_chat,
    work_item,
)
from services.worker.outputs import FINISH, ResponseBuilder, TokenTexts

log = logging.getLogger("loraplane.worker.server")

CATCH_UP_S = 2.0
"""How long a refusal waits for this worker's fold to read what was committed before it."""

INFERENCE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
CONTROL = pb.DESCRIPTOR.services_by_name["WorkerControl"].full_name


class Gate:
    """Why the worker refuses every request right now (None: it serves)."""

    def __init__(self, loop: EngineLoop, wall: Callable[[], str | None]) -> None:
        self.loop = loop
        self.wall = wall

    def not_ready(self) -> str | None:
        if not self.loop.ready.is_set():
            return f"worker not ready: {self.loop.not_ready_reason}"
        return None


class InferenceService(pb_grpc.InferenceServicer):
    def __init__(self, loop: EngineLoop, rules: PromptRules, gate: Gate, worker_id: str) -> None:
        self.loop = loop
        self.rules = rules
        self.gate = gate
        self.worker_id = worker_id
        self.texts = TokenTexts(rules.tokenizer)

    async def Generate(self, request: pb.GenerateRequest | Undecodable,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        metrics = self.loop.metrics
        try:
            work = work_item(request, self.rules)
        except InvalidArgument as exc:
            metrics.requests.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        reason = self.gate.not_ready()
        if reason is not None:
            metrics.requests.labels("UNAVAILABLE").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, reason)
        wall = self.gate.wall()
        if wall is not None:
            metrics.stale_lease_rejections.inc()
            metrics.requests.labels("UNAVAILABLE").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, wall)
        refusal = await self._refusal(work, context)
        if refusal is not None:
            answer = refusal.public()
            if answer is not refusal:
                log.info("request %s refused: %s", work.request_id, refusal.message)
            code = REFUSAL_CODE[answer.kind]
            metrics.requests.labels(code).inc()
            await context.abort(grpc.StatusCode[code], answer.message)
        outputs: asyncio.Queue[list[Output]] = asyncio.Queue()
        ticket = Ticket(work, sink=outputs, time_limit_s=context.time_remaining())
        self.loop.submit(ticket)
        finished = False
        builder = ResponseBuilder(work, self.texts)
        try:
            while True:
                for output in await outputs.get():
                    if isinstance(output, Finished):
                        finished = True
                        if output.durable is not None:  # the trace is in the log before
                            await asyncio.wrap_future(output.durable)  # any end is sent
                        held, ends = builder.on_finished(output.reason, output.choices)
                        for response in held:
                            yield response
                        for end in ends:
                            yield pb.GenerateResponse(choice_end=end)
                        usage = self._usage(work.trace_id, output)
                        usage.choices.extend(ends)
                        if ends:
                            usage.finish_reason = ends[0].finish_reason
                        yield pb.GenerateResponse(final=usage)
                        return
                    elif isinstance(output, Refused):
                        finished = True
                        await self._refuse(context, output)  # raises: ends the call
                    else:
                        for response in builder.on_event(output):
                            yield response
        finally:
            if not finished:  # cancelled by the client, or its deadline passed
                self.loop.cancel(ticket)

    async def _refusal(self, work: WorkItem, context: grpc.aio.ServicerContext
                       ) -> Refusal | None:
        """Why the serving rule refuses `work`, or None. A refusal stands only once this
        worker's fold holds everything committed before the call: a publish or switch the
        registry has just answered may still be on its way here, and its caller would be
        refused what it was told is done. Catching up costs a look at the log's ends, and
        only refusals pay it."""
        follower = self.loop.follower
        try:
            with follower.lock:
                choose(follower.state, work, self.loop.base_digest)
            return None
        except Refusal:
            left = context.time_remaining()
            limit = CATCH_UP_S if left is None else max(0.0, min(CATCH_UP_S, left - 0.1))
            await asyncio.to_thread(follower.sync, limit)
        try:
            with follower.lock:
                choose(follower.state, work, self.loop.base_digest)
            return None
        except Refusal as refusal:
            return refusal

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeReply:
        """This model's tokens for a text (special tokens as the tokenizer adds them) or a
        chat (through its template, generation prompt included)."""
        tok = self.rules.tokenizer
        if tok is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the base model has no tokenizer.json")
        try:
            if request.WhichOneof("prompt") == "chat":
                ids = render_chat(request.chat, self.rules)
            else:
                ids = list(tok.encode(request.text).ids)
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.TokenizeReply(token_ids=ids, count=len(ids),
                                max_model_len=self.rules.max_model_len)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeReply:
        tok = self.rules.tokenizer
        if tok is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the base model has no tokenizer.json")
        bad = next((t for t in request.token_ids if t >= self.rules.vocab_size), None)
        if bad is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token_ids: {bad} is outside the vocabulary of "
                                f"{self.rules.vocab_size}")
        return pb.DetokenizeReply(text=tok.decode(list(request.token_ids)))

    async def ModelInfo(self, request: pb.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> pb.ModelInfoReply:
        """The worker's own base model (the router answers with the caller's adapters)."""
        name = self.loop.base_model_name or ""
        return pb.ModelInfoReply(models=[pb.ModelEntry(
            id=name, base_model_digest=self.loop.base_digest,
            max_model_len=self.rules.max_model_len, owned_by="loraplane")])

    @staticmethod
    async def _refuse(context: grpc.aio.ServicerContext, refused: Refused) -> None:
        trailers: tuple[tuple[str, str], ...] = ()
        if refused.retry_after_s is not None:  # the router's convention: both forms
            trailers = (("retry-after", str(max(1, math.ceil(refused.retry_after_s)))),
                        ("retry-after-ms", str(max(1, round(refused.retry_after_s * 1000)))))
        await context.abort(grpc.StatusCode[refused.code], refused.message,
                            trailing_metadata=trailers)

    def _usage(self, trace_id: str, done: Finished) -> pb.FinalUsage:
        usage = pb.FinalUsage(
            prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
            cached_prompt_tokens=done.cached_prompt_tokens,
            base_model_digest=self.loop.base_digest, trace_id=trace_id,
            worker_id=self.worker_id, finish_reason=FINISH[done.reason],
            time_to_first_token_ms=done.ttft_ms, total_ms=done.total_ms)
        if done.choice is not None:
            usage.served_adapter.CopyFrom(pb.ServedAdapter(
                adapter_id=done.choice.adapter_id, version=done.choice.version,
                sha256=done.choice.sha256))
        return usage


class ControlService(pb_grpc.WorkerControlServicer):
    """Internal: the router's prefetch hints."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    async def Prefetch(self, request: pb.PrefetchRequest,
                       context: grpc.aio.ServicerContext) -> pb.PrefetchReply:
        wanted = [(a.adapter_id, int(a.version)) for a in request.adapters]
        device = request.tier == pb.PREFETCH_TIER_DEVICE
        future = self.loop.schedule(lambda: self.loop.prefetch(wanted, device))
        outcomes = await asyncio.wrap_future(future)
        return pb.PrefetchReply(adapters=[
            pb.PrefetchStatus(adapter=pb.PinnedVersion(adapter_id=o.key[0], version=o.key[1]),
                              accepted=o.accepted, tier=o.tier, detail=o.detail)
            for o in outcomes])


def deliver_via(aio_loop: asyncio.AbstractEventLoop) -> Callable[[list[Any]], None]:
    """The engine loop's `deliver`: one hop onto the asyncio loop per engine iteration."""

    def fan_out(batch: list[tuple[Ticket, list[Output]]]) -> None:
        for ticket, outputs in batch:
            ticket.sink.put_nowait(outputs)

    def deliver(batch: list[tuple[Ticket, list[Output]]]) -> None:
        aio_loop.call_soon_threadsafe(fan_out, batch)

    return deliver


class WorkerServer:
    """The grpc.aio server and its health reporting."""

    def __init__(self, loop: EngineLoop, rules: PromptRules, gate: Gate, worker_id: str,
                 address: str, settings: Settings | None = None) -> None:
        self.loop = loop
        self.gate = gate
        self.address = address
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.so_reuseport", 0)])
        add_inference_servicer(InferenceService(loop, rules, gate, worker_id), self.server)
        pb_grpc.add_WorkerControlServicer_to_server(ControlService(loop), self.server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (INFERENCE, CONTROL, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        self.port = (tls.add_grpc_port(self.server, address, settings, "worker")
                     if settings is not None else self.server.add_insecure_port(address))
        self._serving: bool | None = None

    async def start(self) -> None:
        for name in ("", INFERENCE, CONTROL):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def watch_health(self, stop: asyncio.Event) -> None:
        """SERVING once the log is replayed and the base model registered; the reason is
        logged in one line each time it changes."""
        last_reason: str | None = None
        while not stop.is_set():
            reason = self.gate.not_ready()
            serving = reason is None
            if serving != self._serving:
                status = (health_pb2.HealthCheckResponse.SERVING if serving
                          else health_pb2.HealthCheckResponse.NOT_SERVING)
                for name in ("", INFERENCE, CONTROL):
                    await self.health.set(name, status)
                self._serving = serving
                log.info("worker %s", "ready: serving" if serving else "not serving")
            if reason and reason != last_reason:
                log.warning("%s", reason)
            last_reason = reason
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.2)

    async def not_serving(self) -> None:
        """Health NOT_SERVING for every service name (the drain: probes and load balancers
        stop sending), while calls keep being answered."""
        for name in ("", INFERENCE, CONTROL):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._serving = False

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
