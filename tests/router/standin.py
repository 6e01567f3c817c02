"""Stand-in workers: real grpc.aio servers of `loraplane.v1.Inference` and `WorkerControl`
that emit real `WorkerHeartbeat`s to Kafka, with behaviour a test can steer (fail before
or after the first token, hold requests open, take time to load an adapter).

They run on one asyncio loop in a background thread (`ServerLoop`), like a worker process
would run its own; the test talks to them only through gRPC and Kafka, as the router does.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from services.config import Settings
from services.contracts.events import Envelope, LoadedAdapter, WorkerHeartbeat
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.eventlog import EventProducer

T = TypeVar("T")
BASE_DIGEST = "b" * 64


class ServerLoop:
    """One asyncio loop in a daemon thread; `call` runs a coroutine on it and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@dataclass
class Behaviour:
    tokens: int = 3
    token_delay_s: float = 0.0
    cold_load_s: float = 0.0
    promote_s: float = 0.0
    fail_before_first: int = 0
    """The next N requests fail with UNAVAILABLE before any response."""
    fail_after_tokens: int | None = None
    """Abort with UNAVAILABLE after this many tokens (every request)."""
    gate: asyncio.Event | None = None
    """When set, requests wait on it before their first token."""


@dataclass
class Seen:
    request: pb.GenerateRequest
    time_remaining: float | None
    metadata: dict[str, str] = field(default_factory=dict)


class StandInWorker(pb_grpc.InferenceServicer, pb_grpc.WorkerControlServicer):
    def __init__(self, settings: Settings, worker_id: str, loop: ServerLoop, *,
                 catalog: dict[tuple[str, int], str] | None = None,
                 base_digest: str = BASE_DIGEST, base_model: str = "tiny-llama",
                 heartbeat_s: float | None = None) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.loop = loop
        self.catalog = catalog if catalog is not None else {}
        """(adapter_id, version) → sha256, as the worker would learn it from the log."""
        self.base_digest = base_digest
        self.base_model = base_model
        self.heartbeat_s = heartbeat_s or settings.heartbeat_interval_s
        self.behaviour = Behaviour()
        self.held: dict[tuple[str, int], str] = {}
        """(adapter_id, version) → tier."""
        self.seen: list[Seen] = []
        self.prefetches: list[pb.PrefetchRequest] = []
        self.served_tiers: list[str | None] = []
        """Where the request's adapter was when each request arrived (None = not held)."""
        self.in_flight = 0
        self.max_in_flight = 0
        self.beating = threading.Event()
        self._stop = threading.Event()
        self._producer = EventProducer(settings, client_id=f"standin-{worker_id}")
        self._server: grpc.aio.Server | None = None
        self.port = 0
        self._beats: threading.Thread | None = None
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._loads: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self, port: int = 0) -> StandInWorker:
        async def listen() -> int:
            server = grpc.aio.server()
            pb_grpc.add_InferenceServicer_to_server(self, server)
            pb_grpc.add_WorkerControlServicer_to_server(self, server)
            bound = server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            self._server = server
            return bound

        self.port = self.loop.call(listen())
        self.beating.set()
        self._beats = threading.Thread(target=self._beat_loop, daemon=True)
        self._beats.start()
        self.heartbeat()
        return self

    def stop_server(self) -> None:
        """The process is gone: connections refused from now on (heartbeats stop too)."""
        self.beating.clear()
        if self._server is not None:
            self.loop.call(self._server.stop(0))
            self._server = None

    def close(self) -> None:
        self._stop.set()
        self.beating.clear()
        if self._beats is not None:
            self._beats.join(timeout=5)
        self.stop_server()
        self._producer.close()

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if self.beating.is_set():
                try:
                    self.heartbeat()
                except Exception:  # the test's broker may be going away at teardown
                    if self._stop.is_set():
                        return

    def heartbeat(self) -> None:
        loaded = [LoadedAdapter(adapter_id=a, version=v, sha256=self.catalog[(a, v)],
                                tier=tier)  # type: ignore[arg-type]
                  for (a, v), tier in list(self.held.items()) if (a, v) in self.catalog]
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
        self._producer.publish(Envelope.new(
            WorkerHeartbeat(worker_id=self.worker_id, address=self.address,
                            base_model=self.base_model, base_model_digest=self.base_digest,
                            loaded=loaded, free_slots=8, free_kv_blocks=100),
            stream=f"worker/{self.worker_id}", seq=seq, actor=self.worker_id))

    # --- the services ------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> Any:
        b = self.behaviour
        self.seen.append(Seen(request, context.time_remaining(),
                              {k: v for k, v in context.invocation_metadata() or ()
                               if isinstance(v, str)}))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if b.fail_before_first > 0:
                b.fail_before_first -= 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, "stand-in: failing on purpose")
            if b.gate is not None:
                await b.gate.wait()
            key = None
            sha = ""
            if request.adapter.HasField("pinned"):
                p = request.adapter.pinned
                key = (p.adapter_id, p.version)
                sha = self.catalog.get(key, "")
                tier = self.held.get(key)
                self.served_tiers.append(tier)
                if tier is None or tier == "disk":
                    await asyncio.sleep(b.cold_load_s)
                elif tier == "host":
                    await asyncio.sleep(b.promote_s)
                self.held[key] = "device"
            for index in range(b.tokens):
                if b.fail_after_tokens is not None and index == b.fail_after_tokens:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        "stand-in: worker lost mid-stream")
                if b.token_delay_s:
                    await asyncio.sleep(b.token_delay_s)
                yield pb.GenerateResponse(token=pb.TokenChunk(
                    index=index, token_id=index + 1, text=f" {self.worker_id}.{index}"))
            final = pb.FinalUsage(prompt_tokens=len(request.text.split()) or 1,
                                  completion_tokens=b.tokens, base_model_digest=self.base_digest,
                                  trace_id=request.trace_id, worker_id=self.worker_id,
                                  finish_reason=pb.FINISH_REASON_LENGTH)
            if key is not None:
                final.served_adapter.CopyFrom(pb.ServedAdapter(
                    adapter_id=key[0], version=key[1], sha256=sha))
            yield pb.GenerateResponse(final=final)
        finally:
            self.in_flight -= 1

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeReply:
        """One token per byte of the text (a stand-in's tokenizer)."""
        ids = list(request.text.encode()) if request.WhichOneof("prompt") == "text" else [1]
        return pb.TokenizeReply(token_ids=ids, count=len(ids), max_model_len=2048)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeReply:
        return pb.DetokenizeReply(text=bytes(t % 256 for t in request.token_ids).decode(
            errors="replace"))

    async def Prefetch(self, request: pb.PrefetchRequest,
                       context: grpc.aio.ServicerContext) -> pb.PrefetchReply:
        self.prefetches.append(request)
        tier = "device" if request.tier == pb.PREFETCH_TIER_DEVICE else "host"
        reply = pb.PrefetchReply()
        for adapter in request.adapters:
            key = (adapter.adapter_id, adapter.version)
            known = key in self.catalog
            if known and self.held.get(key) not in ("device", tier):
                self._loads.add(asyncio.get_running_loop().create_task(
                    self._load_later(key, tier)))
            reply.adapters.add(adapter=adapter, accepted=known, tier=self.held.get(key, ""),
                               detail="" if known else "unknown adapter version")
        return reply

    async def _load_later(self, key: tuple[str, int], tier: str) -> None:
        """Like a worker's loader: the copy takes time, then the next report shows it."""
        await asyncio.sleep(self.behaviour.cold_load_s)
        if self.held.get(key) != "device":
            self.held[key] = tier
        if self.beating.is_set():
            await asyncio.to_thread(self.heartbeat)
