"""The engine loop and adapter residency in one process, on a real engine and real tiers,
fed folded events directly: pool-full policy by QoS tier, switch drain then invalidation,
cancel frees KV, an unreachable registry, soft purge, prefetch hints."""

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

import pytest

from services.config import Settings
from services.contracts.events import (
    AdapterDisabled,
    AdapterUnloaded,
    AdapterVersionPublished,
    AdapterVersionSwitched,
    BaseModelRegistered,
    Envelope,
    KVInvalidated,
    Payload,
    RegistryLease,
    TenantPurged,
    TenantPurgeRequested,
    TenantRef,
)
from services.contracts.grpc import inference_pb2 as pb
from services.worker.app import engine_config
from services.worker.engine import Engine, parse_adapter
from services.worker.engine_loop import EngineLoop, Finished, Refused, Ticket
from services.worker.follower import CatalogFollower
from services.worker.intake import PromptRules, work_item
from services.worker.lifecycle import AdapterState, Transition
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


def wait_for(predicate: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


@contextlib.contextmanager
def make_rig(served_model: ServedModel, tmp_path: Path, *, register: bool = True
             ) -> Iterator[Rig]:
    settings = Settings(state_dir=tmp_path, worker_id="w-test", worker_adapter_slots=2,
                        worker_kv_blocks=128, worker_block_size=4, worker_max_lora_rank=16,
                        worker_page_in_timeout_host_s=20.0, worker_page_in_timeout_blob_s=20.0)
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


@pytest.fixture
def rig(served_model: ServedModel, tmp_path: Path) -> Iterator[Rig]:
    with make_rig(served_model, tmp_path) as running:
        assert running.loop.ready.is_set()
        yield running


def test_not_ready_until_the_base_model_is_registered(served_model: ServedModel,
                                                      tmp_path: Path) -> None:
    with make_rig(served_model, tmp_path, register=False) as unregistered:
        loop = unregistered.loop
        assert not loop.ready.is_set()
        assert "not registered" in loop.not_ready_reason
        assert unregistered.engine.base_digest in loop.not_ready_reason
        refused = end(unregistered.ask())
        assert isinstance(refused, Refused) and refused.code == "UNAVAILABLE"
        assert "not registered" in refused.message
        unregistered.fold(BaseModelRegistered(name="tiny", digest=unregistered.engine.base_digest,
                                              config={}), "base-model/tiny")
        wait_for(loop.ready.is_set)
        assert loop.base_model_name == "tiny"
        assert isinstance(end(unregistered.ask()), Finished)


def test_full_pool_bronze_refused_gold_evicts_platinum_stays(rig: Rig) -> None:
    rig.publish("plat", 1, 1, "platinum")
    rig.switch("plat", 1)  # platinum: loaded and pinned ahead of traffic
    wait_for(lambda: rig.state("plat", 1) is AdapterState.LOADED)
    rig.publish("b1", 1, 2, "bronze")
    rig.switch("b1", 1)
    rig.publish("b2", 1, 3, "bronze")
    rig.switch("b2", 1)
    busy = rig.ask("b1", max_tokens=400)
    first_token(busy)
    refused = end(rig.ask("b2"))  # slots: platinum (pinned) + b1 (busy)
    assert isinstance(refused, Refused) and refused.code == "RESOURCE_EXHAUSTED"
    assert refused.retry_after_s and "retry" in refused.message
    assert rig.state("b2", 1) is AdapterState.UNLOADED
    rig.publish("gold", 1, 4, "gold")
    rig.switch("gold", 1)  # ahead of traffic it takes no busy or more important slot
    gold = rig.ask("gold")  # waits for b1's slot, never takes platinum's
    time.sleep(0.5)
    assert gold.sink.empty() and rig.state("gold", 1) is AdapterState.LOADING
    rig.loop.cancel(busy)  # b1 goes idle: now gold may take its slot
    assert isinstance(end(busy), Finished)
    done = end(gold)
    assert isinstance(done, Finished) and done.choice is not None and done.choice.version == 1
    evicted = [p for p in rig.events.of(AdapterUnloaded) if p.adapter_id == "b1"]
    assert evicted and evicted[0].reason.startswith("evicted")
    assert rig.state("plat", 1) is AdapterState.LOADED
    assert isinstance(end(rig.ask("b2")), Refused), "gold and platinum are not bronze's to take"


def test_switch_drains_then_invalidates_then_unloads(rig: Rig) -> None:
    v1 = rig.publish("bot", 1, 10)
    v2 = rig.publish("bot", 2, 11)
    rig.switch("bot", 1)
    old = rig.ask("bot", max_tokens=40)
    first_token(old)
    rig.switch("bot", 2)
    wait_for(lambda: rig.state("bot", 1) is AdapterState.PENDING_SWITCH)
    new = end(rig.ask("bot"))
    assert isinstance(new, Finished) and new.choice.sha256 == v2.sha256  # type: ignore[union-attr]
    finished = end(old)
    assert isinstance(finished, Finished) and finished.choice.sha256 == v1.sha256  # type: ignore[union-attr]
    assert finished.completion_tokens == 40
    wait_for(lambda: rig.state("bot", 1) is AdapterState.UNLOADED)
    freed = [p for p in rig.events.of(KVInvalidated) if p.adapter_sha256 == v1.sha256]
    assert freed and freed[0].reason == "switch"
    assert freed[0].blocks_freed == (5 + 40 - 1) // 4
    rig.fold(AdapterDisabled(adapter_id="bot", version=2, reason="bad"), "adapter/bot", ACME)
    wait_for(lambda: rig.state("bot", 2) is AdapterState.UNLOADED)
    assert [p.reason for p in rig.events.of(KVInvalidated)
            if p.adapter_sha256 == v2.sha256] == ["disable"]
    refused = end(rig.ask("bot"))
    assert isinstance(refused, Refused) and refused.code == "FAILED_PRECONDITION"


def test_cancel_aborts_and_frees_kv(rig: Rig) -> None:
    total = rig.call(lambda: rig.engine.blocks.num_available)
    ticket = rig.ask(max_tokens=400)
    first_token(ticket)
    assert rig.call(lambda: rig.engine.blocks.num_available) < total
    rig.loop.cancel(ticket)
    ended = end(ticket)
    assert isinstance(ended, Finished) and ended.reason == "abort"
    assert rig.call(lambda: rig.engine.blocks.num_available) == total
    assert rig.call(lambda: rig.engine.has_work) is False
    assert rig.events.traces[-1].status == "aborted"


def test_unreachable_registry_is_unavailable_not_failed(rig: Rig) -> None:
    rig.publish("bot", 1, 20)
    rig.switch("bot", 1)
    rig.blobs.down = True
    refused = end(rig.ask("bot"))
    assert isinstance(refused, Refused) and refused.code == "UNAVAILABLE"
    assert rig.state("bot", 1) is AdapterState.UNLOADED
    rig.blobs.down = False
    assert isinstance(end(rig.ask("bot")), Finished)


def test_soft_purge_lets_sequences_finish_then_acks(rig: Rig) -> None:
    rig.publish("bot", 1, 30, tenant=OTHER)
    rig.switch("bot", 1, tenant=OTHER)
    running = rig.ask("bot", tenant=OTHER, max_tokens=60)
    first_token(running)
    rig.fold(TenantPurgeRequested(purge_id="p1", deadline_s=60, hard=False,
                                  expected_workers=["w-test"]), "tenant/other/t/p", OTHER)
    refused = end(rig.ask("bot", tenant=OTHER))
    assert isinstance(refused, Refused) and "purged" in refused.message
    finished = end(running)
    assert isinstance(finished, Finished) and finished.reason == "length"
    wait_for(lambda: rig.events.of(TenantPurged))
    ack = rig.events.of(TenantPurged)[0]
    assert ack.purge_id == "p1" and ack.refcounts_zero and ack.sequences_aborted == 0
    assert ack.adapters_unloaded == 1 and ack.kv_blocks_freed > 0
    assert rig.state("bot", 1) is AdapterState.UNLOADED
    assert isinstance(end(rig.ask("bot", tenant=OTHER)), Finished), "served again afterwards"


def test_prefetch_hints_and_illegal_transitions(rig: Rig) -> None:
    rig.publish("later", 1, 40)
    out = rig.call(lambda: rig.loop.prefetch([("later", 1), ("nope", 1)], device=True))
    assert [o.accepted for o in out] == [True, False] and out[1].detail
    wait_for(lambda: rig.call(lambda: rig.loop.residency.tier_of(("later", 1))) == "host")
    assert rig.state("later", 1) is AdapterState.UNLOADED, "not servable yet: host only"
    assert rig.call(lambda: rig.loop.residency.states.fire(("later", 1),
                                                           Transition.LOADED)) is None
    value = rig.loop.metrics.illegal_transitions.labels("loaded")._value.get()
    assert value == 1
