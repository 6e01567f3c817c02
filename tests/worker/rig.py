"""An engine loop in one process on a real engine and real tiers, fed folded events
directly (no broker): what the in-process worker tests drive."""

from __future__ import annotations

import contextlib
import itertools
import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.config import Settings
from services.contracts.events import (
    AdapterVersionPublished,
    AdapterVersionSwitched,
    BaseModelRegistered,
    Envelope,
    Payload,
    RegistryLease,
    TenantRef,
)
from services.contracts.grpc import inference_pb2 as pb
from services.worker.app import engine_config
from services.worker.engine import Engine, parse_adapter
from services.worker.engine_loop import EngineLoop, Finished, Refused, Ticket
from services.worker.follower import CatalogFollower
from services.worker.intake import PromptRules, work_item
from services.worker.lifecycle import AdapterState
from services.worker.metrics import WorkerMetrics
from services.worker.pool.disk import DiskCache
from services.worker.pool.host import HostCache
from services.worker.pool.loader import AdapterLoader
from tests.registry.artifacts import build_adapter
from tests.worker.conftest import ServedModel
from tests.worker.doubles import DictBlobs, RecordedEvents

ACME = TenantRef(org="acme", team="t", project="p")
OTHER = TenantRef(org="other", team="t", project="p")


@dataclass
class Rig:
    loop: EngineLoop
    follower: CatalogFollower
    events: RecordedEvents
    blobs: DictBlobs
    engine: Engine
    seqs: Iterator[int]

    def fold(self, payload: Payload, stream: str, tenant: TenantRef | None = None) -> None:
        envelope = Envelope.new(payload, stream=stream, seq=next(self.seqs), actor="test",
                                tenant=tenant)
        self.follower.fold(envelope)
        self.loop.on_catalog([envelope])

    def publish(self, adapter_id: str, version: int, seed: int, tier: str = "silver",
                tenant: TenantRef = ACME) -> AdapterVersionPublished:
        files = build_adapter(seed=seed)
        payload = AdapterVersionPublished(
            adapter_id=adapter_id, version=version, label=f"v{version}", base_model="tiny",
            base_model_digest=self.engine.base_digest, sha256=self.blobs.add(files.weights),
            config_sha256=self.blobs.add(files.config), size_bytes=len(files.weights), rank=4,
            lora_alpha=8, target_modules=["q_proj", "v_proj"], dtype="float16",
            qos_tier=tier, owner="o")  # type: ignore[arg-type]
        self.fold(payload, f"adapter/{adapter_id}", tenant)
        return payload

    def switch(self, adapter_id: str, to: int, tenant: TenantRef = ACME) -> None:
        self.fold(AdapterVersionSwitched(adapter_id=adapter_id, from_version=None,
                                         to_version=to), f"adapter/{adapter_id}", tenant)

    def ask(self, adapter_id: str | None = None, *, tenant: TenantRef = ACME,
            max_tokens: int = 4) -> Ticket:
        request = pb.GenerateRequest(
            tenant=pb.TenantSignature(org_id=tenant.org, team_id=tenant.team,
                                      project_id=tenant.project),
            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        request.token_ids.ids.extend([5, 6, 7, 8, 9])
        if adapter_id:
            request.adapter.alias = adapter_id
        rules = PromptRules(vocab_size=96, max_model_len=1024, default_max_tokens=8)
        ticket = Ticket(work_item(request, rules), sink=queue.Queue())
        self.loop.submit(ticket)
        return ticket

    def call(self, fn: Any) -> Any:
        return self.loop.call(fn, timeout_s=10)

    def state(self, adapter_id: str, version: int) -> AdapterState:
        return self.call(lambda: self.loop.residency.state((adapter_id, version)))


def first_token(ticket: Ticket, timeout_s: float = 30.0) -> None:
    output = ticket.sink.get(timeout=timeout_s)
    assert not isinstance(output, Refused | Finished), output


def end(ticket: Ticket, timeout_s: float = 60.0) -> Finished | Refused:
    deadline = time.monotonic() + timeout_s
    while True:
        output = ticket.sink.get(timeout=max(0.0, deadline - time.monotonic()))
        if isinstance(output, Finished | Refused):
            return output


@contextlib.contextmanager
def make_rig(served_model: ServedModel, tmp_path: Path, *, register: bool = True,
             **overrides: Any) -> Iterator[Rig]:
    settings = Settings(**{
        "state_dir": tmp_path, "worker_id": "w-test", "worker_adapter_slots": 2,
        "worker_kv_blocks": 128, "worker_block_size": 4, "worker_max_lora_rank": 16,
        "worker_page_in_timeout_host_s": 20.0, "worker_page_in_timeout_blob_s": 20.0,
        **overrides})
    engine = Engine.from_pretrained(served_model.path, engine_config(settings))
    follower = CatalogFollower(settings, "w-test")
    events = RecordedEvents()
    blobs = DictBlobs()
    host = HostCache(1 << 30)
    disk = DiskCache(tmp_path / "adapter-cache", 1 << 30)
    metrics = WorkerMetrics()
    holder: dict[str, EngineLoop] = {}
    loader = AdapterLoader(host, disk, blobs,  # type: ignore[arg-type]
                           lambda f, d: parse_adapter(f, engine.model.cfg, d),
                           on_done=lambda r: holder["loop"].fetched(r))
    loop = EngineLoop(settings, engine, follower, events, metrics,  # type: ignore[arg-type]
                      host, disk, loader, "w-test")
    holder["loop"] = loop
    loader.start()
    loop.start()
    running = Rig(loop, follower, events, blobs, engine, itertools.count(1))
    if register:
        running.fold(BaseModelRegistered(name="tiny", digest=engine.base_digest, config={}),
                     "base-model/tiny")
    running.fold(RegistryLease(registry_id="r", epoch=1,
                               expires_at=datetime(2999, 1, 1, tzinfo=UTC)), "registry/lease")
    running.call(loop.initial_sync)
    try:
        yield running
    finally:
        loop.stop()
        loader.stop()
