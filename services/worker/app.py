"""Wiring of one worker process: engine, tiers, loader, log follower, events, gRPC front.

Threads: the engine loop (owns the engine), the log follower (replays, then follows the
log and posts each folded batch to the engine loop), the adapter loader (fetches into the
host tier), the gate thread (quality gates assigned to this worker, run through the
engine loop), the events sender (acks, heartbeats, traces, gate results), and the
asyncio thread that runs the grpc.aio server. Start order: load the base model and
compute its digest, start the gRPC server (health NOT_SERVING), replay the log to a
barrier of our own, restore this worker's adapter states, then serve once the base model
is registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from services import tls
from services.config import Settings
from services.contracts.capacity import AdapterLimits, serving_context
from services.contracts.events import Envelope
from services.worker.chat import ChatTemplate
from services.worker.engine import (
    AdapterDigest,
    AdapterFiles,
    Engine,
    EngineConfig,
    LoraAdapter,
    SchedulerLimits,
    parse_adapter,
)
from services.worker.engine_loop import Deliver, EngineLoop, deliver_to_queues
from services.worker.events import WorkerEvents
from services.worker.follower import CatalogFollower
from services.worker.gates import GateWork
from services.worker.intake import PromptRules
from services.worker.metrics import WorkerMetrics
from services.worker.pool.blobs import RegistryBlobs
from services.worker.pool.disk import DiskCache
from services.worker.pool.host import HostCache
from services.worker.pool.loader import AdapterLoader
from services.worker.server import Gate, WorkerServer, deliver_via
from services.worker.wall import wall_reason

log = logging.getLogger("loraplane.worker")


def engine_config(settings: Settings) -> EngineConfig:
    """CUDA when present (or asked for), else CPU; the dtype "auto" is the engine's own
    rule (`precision.serving_dtype`: bf16 where the hardware runs it natively)."""
    device = settings.worker_device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return EngineConfig(
        dtype=settings.worker_dtype, device=device, weights=settings.worker_weights,
        block_size=settings.worker_block_size,
        num_kv_blocks=settings.worker_kv_blocks, max_lora_rank=settings.worker_max_lora_rank,
        adapter_slots=settings.worker_adapter_slots,
        row_weights_bytes=settings.worker_row_weights_bytes,
        limits=SchedulerLimits(
            max_running=settings.worker_max_running,
            max_tokens_per_step=max(settings.worker_max_tokens_per_step,
                                    settings.worker_max_running),
            max_adapters_per_step=min(32, settings.worker_adapter_slots)))


def checked_parser(settings: Settings, engine: Engine
                   ) -> Callable[[AdapterFiles, AdapterDigest], LoraAdapter]:
    """How the loader parses a fetched adapter: against the base model and the fleet's
    limits (`services.contracts.capacity`), the ones the registry checked at publish."""
    cfg, limits, base = engine.model.cfg, AdapterLimits.of(settings), engine.adapters.base_vocab
    return lambda files, digest: parse_adapter(files, cfg, digest, limits, base)


def prompt_rules(settings: Settings, engine: Engine, model_dir: Path | None) -> PromptRules:
    """What requests this worker takes; its context is the one the registry checks a
    regression set against (`services.contracts.capacity.serving_context`)."""
    cfg = engine.model.cfg
    kv_tokens = engine.config.num_kv_blocks * engine.config.block_size
    return PromptRules(
        vocab_size=cfg.vocab_size,
        max_model_len=min(kv_tokens, serving_context(settings, {
            "max_position_embeddings": cfg.max_position_embeddings})),
        default_max_tokens=settings.worker_default_max_tokens,
        tokenizer=engine.tokenizer,
        chat_template=ChatTemplate.from_model_dir(model_dir) if model_dir else None,
        grammars=engine.grammars)


class WorkerRuntime:
    """Everything but the gRPC server; usable in-process (tests, benches)."""

    def __init__(self, settings: Settings, engine: Engine | None = None) -> None:
        if settings.base_model is None and engine is None:
            raise ValueError("LORAPLANE_BASE_MODEL is not set: name a Hugging Face model "
                             "directory (config.json, safetensors, tokenizer.json)")
        self.settings = settings
        self.worker_id = settings.worker_name
        self.model_dir = Path(settings.base_model) if settings.base_model else Path(".")
        self.engine = engine or Engine.from_pretrained(self.model_dir, engine_config(settings))
        self.metrics = WorkerMetrics(model_name=self.model_dir.name,
                                     max_lora=self.engine.adapters.num_slots)
        self.follower = CatalogFollower(settings, self.worker_id, on_ready=self._caught_up)
        self.host = HostCache(settings.worker_host_cache_bytes,
                              pin=self.engine.model.device.type == "cuda")
        self.disk = DiskCache(settings.adapter_cache_dir, settings.worker_disk_cache_bytes)
        self.blobs = RegistryBlobs(",".join(settings.registry_urls), settings.worker_token,
                                   verify=tls.client_ssl_context(settings))
        self.loader = AdapterLoader(self.host, self.disk, self.blobs,
                                    checked_parser(settings, self.engine),
                                    on_done=lambda result: self.loop.fetched(result))
        self.events = WorkerEvents(settings, self.worker_id,
                                   heartbeat=lambda: self.loop.heartbeat())
        self.loop = EngineLoop(settings, self.engine, self.follower, self.events, self.metrics,
                               self.host, self.disk, self.loader, self.worker_id,
                               model_dir=self.model_dir)
        self.gates = GateWork(self.engine, self.worker_id, self.follower, self.loader,
                              self.blobs, self.events.emit, self.loop.start_gate)
        self.follower.on_batch = self._on_batch
        self.rules = prompt_rules(settings, self.engine,
                                  self.model_dir if settings.base_model else None)
        self.gate = Gate(self.loop, self.wall)

    def _on_batch(self, batch: list[Envelope]) -> None:
        self.loop.on_catalog(batch)
        self.gates.poke()

    def wall(self) -> str | None:
        return wall_reason(self.follower.lease_at, datetime.now(UTC),
                           self.settings.stale_lease_threshold_s)

    def start(self, deliver: Deliver = deliver_to_queues) -> None:
        self.loop.deliver = deliver
        self.metrics.serve(self.settings.worker_metrics_port, self.settings.worker_host)
        self.loader.start()
        self.loop.start()
        self.follower.start()  # replays (from its snapshot), then `_caught_up`

    def _caught_up(self) -> None:
        """Replayed (the follower's thread): number new events after what the log holds,
        restore this worker's adapter states, take gates."""
        log.info("worker %s replayed the log", self.worker_id)
        self.events.start(dict(self.follower.own.last_seq))
        self.loop.post(self.loop.initial_sync)
        self.gates.start()

    def stop(self) -> None:
        self.follower.stop()
        self.gates.stop()
        self.loop.stop()
        self.loader.stop()
        self.events.stop()
        self.blobs.close()


async def serve(settings: Settings, stop: asyncio.Event,
                runtime: WorkerRuntime | None = None) -> None:
    """Run a worker until `stop` is set (the gRPC server on the running event loop)."""
    runtime = runtime or WorkerRuntime(settings)
    server = WorkerServer(runtime.loop, runtime.rules, runtime.gate, runtime.worker_id,
                          f"{settings.worker_host}:{settings.worker_port}", settings)
    await server.start()
    runtime.start(deliver_via(asyncio.get_running_loop()))
    log.info("worker %s: gRPC on %s:%d (%s), base model %s (digest %s), metrics on %s%s",
             runtime.worker_id, settings.worker_host, server.port, tls.describe(settings),
             runtime.model_dir,
             f"{runtime.engine.base_digest}, {runtime.engine.base_weights} weights",
             settings.worker_metrics_port or "off",
             f"; merged mode: serves only {settings.worker_merge}, merged into the base "
             "weights" if settings.worker_merge else "")
    grace_s = 0.5
    try:
        await server.watch_health(stop)
        grace_s = max(grace_s, await drain(runtime, server, settings))
    finally:
        # calls still answering (a final message waiting for its trace to be durable) get
        # what is left of the drain before they are cancelled
        await server.stop(grace_s=grace_s)
        await asyncio.to_thread(runtime.stop)
        log.info("worker %s stopped", runtime.worker_id)


async def drain(runtime: WorkerRuntime, server: WorkerServer, settings: Settings) -> float:
    """Leave without failing a request: a heartbeat that says `draining` (routers take the
    worker out of their rings and send it nothing new) and health NOT_SERVING; requests
    routers sent before they read it are still taken for two heartbeat intervals; then
    new ones are refused UNAVAILABLE (a router retries those elsewhere before their first
    token) while the streams in flight finish, all within `worker_drain_s`. Returns the
    seconds of it left, for the calls still sending their last messages."""
    loop = runtime.loop
    began = time.monotonic()
    budget = settings.worker_drain_s
    loop.draining = True
    runtime.events.beat_now()
    await server.not_serving()
    log.info("worker %s draining: %d requests in flight, up to %.0f s", runtime.worker_id,
             loop.in_flight(), budget)
    await asyncio.sleep(min(2 * settings.heartbeat_interval_s, budget / 2))
    loop.admitting = False
    while loop.in_flight() and time.monotonic() - began < budget:
        await asyncio.sleep(0.05)
    left = loop.in_flight()
    log.info("worker %s drained in %.1f s%s", runtime.worker_id, time.monotonic() - began,
             f"; {left} requests still running are cut" if left else "")
    return max(0.0, budget - (time.monotonic() - began))


def run_worker(settings: Settings) -> None:
    """`loraplane serve worker`: serve until SIGINT / SIGTERM."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per blob fetch is noise

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await serve(settings, stop)

    asyncio.run(main())
