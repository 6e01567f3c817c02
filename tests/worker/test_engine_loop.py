"""The engine loop and adapter residency in one process, on a real engine and real tiers,
fed folded events directly: pool-full policy by QoS tier, switch drain then invalidation,
cancel frees KV, an unreachable registry, soft purge, prefetch hints."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from loraplane_kernels.threads import one_thread
from services.contracts.events import (
    AdapterDisabled,
    AdapterUnloaded,
    AdapterVersionPublished,
    BaseModelRegistered,
    Envelope,
    KVInvalidated,
    TenantPurged,
    TenantPurgeRequested,
)
from services.worker.engine_loop import Finished, Refused
from services.worker.lifecycle import AdapterState, Transition
from tests.registry.artifacts import build_adapter
from tests.waiting import wait_for
from tests.worker.conftest import ServedModel
from tests.worker.rig import ACME, OTHER, Rig, end, first_token, make_rig


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
        wait_for(loop.ready.is_set, 20)
        assert loop.base_model_name == "tiny"
        assert isinstance(end(unregistered.ask()), Finished)


def test_full_pool_bronze_refused_gold_evicts_platinum_stays(rig: Rig) -> None:
    rig.publish("plat", 1, 1, "platinum")
    rig.switch("plat", 1)  # platinum: loaded and pinned ahead of traffic
    wait_for(lambda: rig.state("plat", 1) is AdapterState.LOADED, 20)
    rig.publish("b1", 1, 2, "bronze")
    rig.switch("b1", 1)
    rig.publish("b2", 1, 3, "bronze")
    rig.switch("b2", 1)
    step = rig.engine.step

    def throttled() -> object:  # b1's 400 tokens outlast the checks below on any machine
        time.sleep(0.01)
        return step()

    rig.engine.step = throttled  # type: ignore[method-assign]
    busy = rig.ask("b1", max_tokens=400)
    first_token(busy)
    refused = end(rig.ask("b2"))  # slots: platinum (pinned) + b1 (busy)
    assert isinstance(refused, Refused) and refused.code == "RESOURCE_EXHAUSTED"
    assert refused.retry_after_s and "retry" in refused.message
    assert rig.state("b2", 1) is AdapterState.UNLOADED
    rig.publish("gold", 1, 4, "gold")
    rig.switch("gold", 1)  # ahead of traffic it takes no busy or more important slot
    gold = rig.ask("gold")  # waits for b1's slot, never takes platinum's
    seen = busy.completion_tokens  # gold has had 20 steps of b1's to take a slot in, and did not
    wait_for(lambda: busy.completion_tokens >= seen + 20, 20, message="b1's next 20 tokens")
    assert gold.sink.empty() and rig.state("gold", 1) is AdapterState.LOADING
    assert busy.status == "running"
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
    wait_for(lambda: rig.state("bot", 1) is AdapterState.PENDING_SWITCH, 20)
    new = end(rig.ask("bot"))
    assert isinstance(new, Finished) and new.choice.sha256 == v2.sha256  # type: ignore[union-attr]
    finished = end(old)
    assert isinstance(finished, Finished) and finished.choice.sha256 == v1.sha256  # type: ignore[union-attr]
    assert finished.completion_tokens == 40
    wait_for(lambda: rig.state("bot", 1) is AdapterState.UNLOADED, 20)
    freed = [p for p in rig.events.of(KVInvalidated) if p.adapter_sha256 == v1.sha256]
    assert freed and freed[0].reason == "switch"
    assert freed[0].blocks_freed == (5 + 40 - 1) // 4
    rig.fold(AdapterDisabled(adapter_id="bot", version=2, reason="bad"), "adapter/bot", ACME)
    wait_for(lambda: rig.state("bot", 2) is AdapterState.UNLOADED, 20)
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
    assert rig.events.traces[-1].status == "cancelled"


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
    wait_for(lambda: rig.events.of(TenantPurged), 20)
    ack = rig.events.of(TenantPurged)[0]
    assert ack.purge_id == "p1" and ack.refcounts_zero and ack.sequences_aborted == 0
    assert ack.adapters_unloaded == 1 and ack.kv_blocks_freed > 0
    assert rig.state("bot", 1) is AdapterState.UNLOADED
    gone = end(rig.ask("bot", tenant=OTHER))  # the purge ended bot@1 for good
    assert isinstance(gone, Refused) and gone.code == "NOT_FOUND" and "p1" in gone.message
    rig.publish("bot", 2, 31, tenant=OTHER)  # published after the purge: served as usual
    rig.switch("bot", 2, tenant=OTHER)
    assert isinstance(end(rig.ask("bot", tenant=OTHER)), Finished)


def test_a_purged_version_is_never_fetched_again(rig: Rig) -> None:
    """On-demand loads, prefetch hints, pre-warming of gold versions, and a version whose
    purge was read before it: none of them fetches a purged version's files."""
    rig.publish("gone", 1, 32, tier="gold", tenant=OTHER)
    rig.switch("gone", 1, tenant=OTHER)
    wait_for(lambda: rig.state("gone", 1) is AdapterState.LOADED, 20)
    published = datetime.now(UTC)
    rig.fold(TenantPurgeRequested(purge_id="p9", deadline_s=60, expected_workers=["w-test"]),
             "tenant/other/t/p", OTHER)
    wait_for(lambda: rig.events.of(TenantPurged), 20)
    fetches = rig.blobs.fetches
    refused = end(rig.ask("gone", tenant=OTHER))
    assert isinstance(refused, Refused) and refused.code == "NOT_FOUND"
    assert "purge p9" in refused.message
    out = rig.call(lambda: rig.loop.prefetch([("gone", 1)], device=True))
    assert [o.accepted for o in out] == [False] and "p9" in out[0].detail
    # a gold version published before the purge, read after it (another partition)
    files = build_adapter(seed=33)
    late = Envelope.new(AdapterVersionPublished(
        adapter_id="late", version=1, label="v1", base_model="tiny",
        base_model_digest=rig.engine.base_digest, sha256=rig.blobs.add(files.weights),
        config_sha256=rig.blobs.add(files.config), size_bytes=len(files.weights), rank=4,
        lora_alpha=8, target_modules=["q_proj", "v_proj"], dtype="float16", qos_tier="gold",
        owner="o"), stream="adapter/late", seq=1, actor="test", tenant=OTHER,
        occurred_at=published)
    rig.follower.fold(late)
    rig.loop.on_catalog([late])
    rig.switch("late", 1, tenant=OTHER)
    rig.call(lambda: rig.loop.initial_sync())  # as after a restart: reloads what it held
    assert isinstance(end(rig.ask("late", tenant=OTHER)), Refused)
    assert rig.blobs.fetches == fetches, "a purged version was fetched"
    assert rig.state("gone", 1) is AdapterState.UNLOADED
    assert rig.state("late", 1) is AdapterState.UNLOADED


def test_prefetch_hints_and_illegal_transitions(rig: Rig) -> None:
    rig.publish("later", 1, 40)
    out = rig.call(lambda: rig.loop.prefetch([("later", 1), ("nope", 1)], device=True))
    assert [o.accepted for o in out] == [True, False] and out[1].detail
    wait_for(lambda: rig.call(lambda: rig.loop.residency.tier_of(("later", 1))) == "host", 20)
    assert rig.state("later", 1) is AdapterState.UNLOADED, "not servable yet: host only"
    assert rig.call(lambda: rig.loop.residency.states.fire(("later", 1),
                                                           Transition.LOADED)) is None
    value = rig.loop.metrics.illegal_transitions.labels("loaded")._value.get()
    assert value == 1


def test_the_loop_computes_with_its_threads_when_started_during_an_adapter_parse(
        served_model: ServedModel, tmp_path: Path) -> None:
    """A thread's first torch op copies the process-wide thread count, which `one_thread`
    lowers to 1 while an adapter is parsed: a loop started then would have stepped on one
    thread for the rest of its life."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    parsing, parsed = threading.Event(), threading.Event()

    def parse() -> None:
        with one_thread():
            parsing.set()
            parsed.wait(30)

    parser = threading.Thread(target=parse, daemon=True)
    parser.start()
    try:
        assert parsing.wait(10)
        with make_rig(served_model, tmp_path) as running:
            assert running.call(torch.get_num_threads) == 2
            parsed.set()
            parser.join(10)
            assert isinstance(end(running.ask()), Finished)
            assert running.call(torch.get_num_threads) == 2
    finally:
        parsed.set()
        torch.set_num_threads(before)


def test_a_version_the_router_just_switched_to_is_served_once_the_log_is_read(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The router resolves an adapter to the version it last read a switch to and pins
    it; a worker whose fold has not read that switch yet reads the log to its end once
    before it refuses (it answered FAILED_PRECONDITION to such requests, a few per
    thousand while versions switched every second under the cluster's fault runs)."""
    import asyncio

    from services.contracts.grpc import inference_pb2 as pb
    from services.worker.intake import PromptRules, work_item
    from services.worker.server import CATCH_UP_S, Gate, InferenceService

    rig.publish("bot", 1, seed=1)
    rig.switch("bot", 1)
    rig.publish("bot", 2, seed=2)
    service = InferenceService(rig.loop, PromptRules(96, 1024, 8), Gate(rig.loop, lambda: None),
                               "w-test")

    def pinned(version: int) -> object:
        request = pb.GenerateRequest(
            tenant=pb.TenantSignature(org_id=ACME.org, team_id=ACME.team,
                                      project_id=ACME.project),
            adapter=pb.AdapterRef(pinned=pb.PinnedVersion(adapter_id="bot", version=version)))
        request.token_ids.ids.extend([5, 6, 7])
        return work_item(request, PromptRules(96, 1024, 8))

    class NoDeadline:  # a call without a deadline waits the whole catch-up bound
        @staticmethod
        def time_remaining() -> None:
            return None

    reads: list[float] = []

    def read_to_the_end(timeout_s: float) -> bool:  # the switch to v2 is already in the log
        reads.append(timeout_s)
        rig.switch("bot", 2)
        return True

    monkeypatch.setattr(rig.follower, "sync", read_to_the_end)
    assert asyncio.run(service._refusal(pinned(2), NoDeadline())) is None
    assert reads == [CATCH_UP_S]
    refused = asyncio.run(service._refusal(pinned(1), NoDeadline()))  # superseded: still refused
    assert refused is not None and refused.kind == "precondition"
    assert "neither the active version" in refused.message

    def publish_and_switch(timeout_s: float) -> bool:  # a version it has not read at all
        reads.append(timeout_s)
        rig.publish("bot", 3, seed=3)
        rig.switch("bot", 3)
        return True

    monkeypatch.setattr(rig.follower, "sync", publish_and_switch)
    assert asyncio.run(service._refusal(pinned(3), NoDeadline())) is None
    missing = asyncio.run(service._refusal(pinned(9), NoDeadline()))
    assert missing is not None and missing.kind == "not_found"
