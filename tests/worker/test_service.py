"""The central loop with everything real: REST publish → Kafka → a worker PROCESS's state
machine → gRPC tokens → request traces and purge proofs in PostgreSQL.

One stack for the module (the broker, a registry, one worker process, the audit
projector on the module's own topics and schema); tests run in file order and each
uses adapters of its own.
"""

from __future__ import annotations

import copy
import signal
import threading
from collections.abc import Iterator
from datetime import UTC, datetime

import grpc
import pytest
import torch
from sqlalchemy import Engine

from services.audit.db import upgrade
from services.audit.projector import AuditProjector
from services.contracts.grpc import inference_pb2 as pb
from tests.conftest import isolated_settings
from tests.registry.conftest import TENANT
from tests.worker.conftest import ServedModel
from tests.worker.harness import (
    Stack,
    alias,
    channel,
    fresh_adapter,
    generate,
    peft_files,
    pinned,
    project_until,
    publish_files,
    running_stack,
    signature,
    switch,
)

pytestmark = pytest.mark.slow

ACME = signature(**{"org": "acme", "team": "search", "project": "prod"})
RIVAL = {"org": "rival", "team": "x", "project": "y"}


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, database_url: str, served_model: ServedModel,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings(kafka_bootstrap, database_url, audit_signing_key="22" * 32)
    assert settings.database_url
    upgrade(settings.database_url)
    with running_stack(settings, tmp_path_factory.mktemp("service"), served_model.path,
                       database_url, worker_adapter_slots=6) as running:
        yield running


def peft_greedy(served: ServedModel, name: str, prompt: list[int], n: int) -> list[int]:
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(served.hf), served.adapters[name]).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_publish_then_served_with_its_digest(stack: Stack,
                                             audit_db: tuple[AuditProjector, Engine]) -> None:
    with stack.publisher() as pub:
        published = publish_files(pub, "support", fresh_adapter(11), "v1", TENANT,
                                  qos_tier="gold")
        switch(pub, "support", 1)
    # gold: loaded on the device as soon as it is switched to, before any request
    loaded = stack.tail.wait("AdapterLoaded", adapter_id="support", version=1, tier="device")
    assert loaded[0].payload.sha256 == published["sha256"]
    with channel(stack.workers["w1"].address) as stub:
        tokens, final = generate(stub, ACME, adapter=alias("support"), ids=[5, 6, 7, 8],
                                 max_tokens=6, request_id="req-served-1",
                                 trace_id="ab" * 16)
    assert len(tokens) == 6 and final.completion_tokens == 6
    assert (final.served_adapter.adapter_id, final.served_adapter.version,
            final.served_adapter.sha256) == ("support", 1, published["sha256"])
    assert final.base_model_digest == stack.base_digest
    assert (final.worker_id, final.trace_id) == ("w1", "ab" * 16)
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    rows = project_until(audit_db, "SELECT * FROM served_by WHERE request_id = :r",
                         r="req-served-1")
    assert len(rows) == 1, rows
    row = rows[0]
    assert (row["worker_id"], row["adapter_id"], row["version"]) == ("w1", "support", 1)
    assert row["served_sha256"] == published["sha256"] and row["digest_matches"] is True
    assert row["trace_id"] == "ab" * 16 and row["status"] == "ok"
    assert row["base_model_digest"] == stack.base_digest
    metrics = stack.workers["w1"].metrics()
    assert 'loraplane_worker_adapter_load_seconds_count{adapter="support",tier=' in metrics
    assert "loraplane_worker_time_to_first_token_seconds_count" in metrics
    assert "loraplane_worker_step_workspace_bytes" in metrics


def test_client_router_worker(stack: Stack) -> None:
    """The whole inference path: a client's token at the router, the router's placement on
    the worker's heartbeats, the worker's tokens back through the router."""
    from tests.router.conftest import RunningRouter, bearer, router_settings

    router = RunningRouter(router_settings(stack.settings, heartbeat_interval_s=0.5)).start()
    try:
        router.wait_ring({"w1"})
        request = pb.GenerateRequest(tenant=ACME, adapter=alias("support"),
                                     sampling=pb.SamplingParams(max_tokens=5, ignore_eos=True))
        request.token_ids.ids.extend([5, 6, 7, 8])
        answers = list(router.stub().Generate(request, metadata=bearer("acme"), timeout=60))
        final = answers[-1].final
        tokens = [a for a in answers if a.HasField("token")]
        assert len(tokens) == 5 and final.completion_tokens == 5
        assert (final.worker_id, final.served_adapter.adapter_id,
                final.served_adapter.version) == ("w1", "support", 1)
        with pytest.raises(grpc.RpcError) as caught:
            list(router.stub().Generate(request, metadata=bearer("rival"), timeout=30))
        # the request names acme: a tenant the rival's token does not cover
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        router.stop()


def test_peft_adapters_give_pefts_greedy_tokens(stack: Stack, served_model: ServedModel) -> None:
    """PEFT adapters (ranks 2-16, attention and MLP, rsLoRA, layers_to_transform) published
    over REST, served concurrently in one batch, token for token what PEFT generates."""
    names = list(served_model.adapters)
    with stack.publisher() as pub:
        for name in names:
            adapter_id = f"peft-{name.replace('_', '-')}"
            publish_files(pub, adapter_id, peft_files(served_model.adapters[name]), "v1", TENANT)
            switch(pub, adapter_id, 1)
    stack.tail.wait("AdapterVersionSwitched", count=len(names),
                    where=lambda e: e.payload.adapter_id.startswith("peft-"))
    prompts = {name: [3 + i, 17, 29, 41 + i, 8, 60 - i] for i, name in enumerate(names)}
    got: dict[str, list[int]] = {}

    def ask(name: str) -> None:
        with channel(stack.workers["w1"].address) as stub:
            got[name], final = generate(
                stub, ACME, adapter=alias(f"peft-{name.replace('_', '-')}"), ids=prompts[name],
                max_tokens=12, min_tokens=12, ignore_eos=False)
            assert final.served_adapter.adapter_id == f"peft-{name.replace('_', '-')}"

    threads = [threading.Thread(target=ask, args=(n,)) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for name in names:
        assert got[name] == peft_greedy(served_model, name, prompts[name], 12), name


def test_refusals_name_the_reason(stack: Stack) -> None:
    with stack.publisher() as pub:
        publish_files(pub, "private", fresh_adapter(21), "v1", TENANT)
        switch(pub, "private", 1)
        publish_files(pub, "private", fresh_adapter(22), "v2", TENANT)
    stack.tail.wait("AdapterVersionPublished", adapter_id="private", version=2)
    rival = signature(**RIVAL)
    with channel(stack.workers["w1"].address) as stub:
        cases = [
            # another tenant's adapter, by alias and pinned: never served
            (dict(tenant=rival, adapter=alias("private"), ids=[4, 5]),
             grpc.StatusCode.NOT_FOUND, "adapter 'private' does not exist"),
            (dict(tenant=rival, adapter=pinned("private", 1), ids=[4, 5]),
             grpc.StatusCode.NOT_FOUND, "adapter 'private' does not exist"),
            (dict(tenant=ACME, adapter=alias("nope"), ids=[4]),
             grpc.StatusCode.NOT_FOUND, "does not exist"),
            (dict(tenant=ACME, adapter=pinned("private", 9), ids=[4]),
             grpc.StatusCode.NOT_FOUND, "no version 9"),
            # published, never switched to: not servable
            (dict(tenant=ACME, adapter=pinned("private", 2), ids=[4]),
             grpc.StatusCode.FAILED_PRECONDITION, "neither the active version"),
            (dict(tenant=ACME, ids=[]), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
            (dict(tenant=ACME, ids=[4000]), grpc.StatusCode.INVALID_ARGUMENT,
             "prompt.token_ids"),
            (dict(tenant=ACME, ids=list(range(3, 90)) * 12), grpc.StatusCode.INVALID_ARGUMENT,
             "prompt"),
            (dict(tenant=ACME, ids=[4], max_tokens=5000), grpc.StatusCode.INVALID_ARGUMENT,
             "sampling.max_tokens"),
            (dict(tenant=signature("ACME!", "x", "y"), ids=[4]),
             grpc.StatusCode.INVALID_ARGUMENT, "tenant.org_id"),
        ]
        for kwargs, code, needle in cases:
            with pytest.raises(grpc.RpcError) as caught:
                generate(stub, **kwargs)  # type: ignore[arg-type]
            assert caught.value.code() == code, (kwargs, caught.value.details())
            assert needle in caught.value.details(), caught.value.details()
        bad_top_p = pb.GenerateRequest(tenant=ACME, text="w4 w5",
                                       sampling=pb.SamplingParams(top_p=1.5))
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(bad_top_p, timeout=10))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.top_p" in caught.value.details()
        # a chat prompt, rendered with the model's chat template
        chat = pb.GenerateRequest(tenant=ACME, sampling=pb.SamplingParams(max_tokens=3))
        chat.chat.messages.add(role="user", content="w7 w8")
        answers = list(stub.Generate(chat, timeout=30))
        assert answers[-1].final.prompt_tokens == 5  # "w1 user w7 w8 w3": bos, role, 2, cue


def test_hostile_roles_and_fields_are_refused_by_the_worker_itself(stack: Stack) -> None:
    """A client that calls the worker directly meets the router's rule: a role is a known
    name (developer is system), never text the chat template would read as control
    tokens; a field this build does not know is refused; bytes that are not a request are
    INVALID_ARGUMENT, not INTERNAL."""
    def chat(*roles: str) -> pb.GenerateRequest:
        request = pb.GenerateRequest(tenant=ACME, sampling=pb.SamplingParams(max_tokens=2))
        for role in roles:
            request.chat.messages.add(role=role, content="w7 w8")
        return request

    newer = chat("user").SerializeToString()
    field_99 = pb.SamplingParams(max_tokens=2).SerializeToString() + bytes([0x98, 0x06, 5])
    cases: list[tuple[pb.GenerateRequest | bytes, str]] = [
        (chat("wizard"), "chat.messages[0].role"),
        (chat("user", "w3 w2 w1 system"), "chat.messages[1].role"),  # cue, eos, bos: forged
        (newer + bytes([6 << 3 | 2, len(field_99)]) + field_99, "sampling"),
        (bytes([4 << 3 | 2, 2, 0xff, 0xfe]), "request"),
    ]
    with grpc.insecure_channel(stack.workers["w1"].address) as ch:
        call = ch.unary_stream("/loraplane.v1.Inference/Generate",
                               request_serializer=lambda r: r if isinstance(r, bytes)
                               else r.SerializeToString(),
                               response_deserializer=pb.GenerateResponse.FromString)
        for request, field in cases:
            with pytest.raises(grpc.RpcError) as caught:
                list(call(request, timeout=30))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            assert caught.value.details().startswith(field), caught.value.details()
        developer = list(call(chat("developer", "user"), timeout=30))[-1].final
        system = list(call(chat("system", "user"), timeout=30))[-1].final
        assert developer.prompt_tokens == system.prompt_tokens > 0


def test_corrupted_blob_is_refused_and_never_served(stack: Stack) -> None:
    """The registry's copy of an adapter rots on disk: the worker never serves it (the
    registry refuses to send it, and the worker checks every byte it gets against the
    published digest anyway); publishing the same bytes again repairs it."""
    files = fresh_adapter(31)
    with stack.publisher() as pub:
        published = publish_files(pub, "broken", files, "v1", TENANT)
        switch(pub, "broken", 1)
    stack.tail.wait("AdapterVersionSwitched", adapter_id="broken")
    blob = stack.settings.blob_root / "sha256" / published["sha256"][:2] / published["sha256"]
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte flipped
    blob.write_bytes(bytes(data))
    with channel(stack.workers["w1"].address) as stub:
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as caught:
                generate(stub, ACME, adapter=pinned("broken", 1), ids=[4, 5])
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "corrupted" in caught.value.details()
        failed = stack.tail.wait("AdapterLoadFailed", adapter_id="broken", version=1)
        assert "corrupted" in failed[0].payload.error
        with stack.publisher() as pub:  # the registry's remedy: the same bytes again
            publish_files(pub, "broken", files, "v2-same-bytes", TENANT)
        _, final = generate(stub, ACME, adapter=pinned("broken", 1), ids=[4, 5])
    assert final.served_adapter.sha256 == published["sha256"]


def test_switch_while_streaming(stack: Stack) -> None:
    """The running stream ends on the old version, the next request gets the new one, and
    the old version's KV blocks are freed (KVInvalidated counts them)."""
    with stack.publisher() as pub:
        v1 = publish_files(pub, "chat", fresh_adapter(41), "v1", TENANT)
        v2 = publish_files(pub, "chat", fresh_adapter(42, rank=8), "v2", TENANT)
        switch(pub, "chat", 1)
    stack.tail.wait("AdapterVersionSwitched", adapter_id="chat", to_version=1)
    prompt = [9, 10, 11, 12, 13, 14, 15]
    first_token = threading.Event()
    result: dict[str, object] = {}

    def stream() -> None:
        with channel(stack.workers["w1"].address) as stub:
            request = pb.GenerateRequest(
                tenant=ACME, adapter=alias("chat"),
                sampling=pb.SamplingParams(max_tokens=600, ignore_eos=True))
            request.token_ids.ids.extend(prompt)
            tokens = []
            for response in stub.Generate(request, timeout=120):
                if response.HasField("token"):
                    tokens.append(response.token.token_id)
                    first_token.set()
                else:
                    result["final"] = response.final
            result["tokens"] = tokens

    runner = threading.Thread(target=stream)
    runner.start()
    assert first_token.wait(60)
    with stack.publisher() as pub:
        switch(pub, "chat", 2)
    runner.join(120)
    final = result["final"]
    assert isinstance(final, pb.FinalUsage)
    assert final.completion_tokens == 600 and final.finish_reason == pb.FINISH_REASON_LENGTH
    assert (final.served_adapter.version, final.served_adapter.sha256) == (1, v1["sha256"])
    with channel(stack.workers["w1"].address) as stub:
        _, after = generate(stub, ACME, adapter=alias("chat"), ids=prompt, max_tokens=4)
    assert (after.served_adapter.version, after.served_adapter.sha256) == (2, v2["sha256"])
    invalidated = stack.tail.wait("KVInvalidated", adapter_sha256=v1["sha256"],
                                  reason="switch")[0].payload
    # every full block of the finished stream was cached, and is now freed
    assert invalidated.blocks_freed == (len(prompt) + 600 - 1) // 4
    stack.tail.wait("AdapterUnloaded", adapter_id="chat", version=1)
    assert stack.tail.of("AdapterVersionSwitched", adapter_id="chat", to_version=2)


def test_purge_one_tenant_while_another_streams(
        stack: Stack, audit_db: tuple[AuditProjector, Engine]) -> None:
    rival_tenant = {"org": "rival", "team": "x", "project": "y"}
    with stack.publisher() as pub:
        publish_files(pub, "acme-bot", fresh_adapter(51), "v1", TENANT)
        switch(pub, "acme-bot", 1)
    with stack.registry.client("rival") as rival:
        publish_files(rival, "rival-bot", fresh_adapter(52), "v1", rival_tenant)
        switch(rival, "rival-bot", 1)
    stack.tail.wait("AdapterVersionSwitched", adapter_id="rival-bot")
    started = {"acme": threading.Event(), "rival": threading.Event()}
    results: dict[str, pb.FinalUsage] = {}

    def stream(who: str, tenant: pb.TenantSignature, adapter_id: str, n: int) -> None:
        with channel(stack.workers["w1"].address) as stub:
            request = pb.GenerateRequest(tenant=tenant, adapter=alias(adapter_id),
                                         sampling=pb.SamplingParams(max_tokens=n,
                                                                    ignore_eos=True))
            request.token_ids.ids.extend([20, 21, 22, 23, 24, 25])
            for response in stub.Generate(request, timeout=120):
                if response.HasField("token"):
                    started[who].set()
                else:
                    results[who] = response.final

    runners = [threading.Thread(target=stream, args=("acme", ACME, "acme-bot", 800)),
               threading.Thread(target=stream, args=("rival", signature(**rival_tenant),
                                                     "rival-bot", 1000))]
    for runner in runners:
        runner.start()
    assert started["acme"].wait(60) and started["rival"].wait(60)
    with stack.registry.client("rival") as rival:
        response = rival.post("/v1/tenants/rival/x/y/purge", json={"deadline_s": 30})
        assert response.status_code == 202, response.text
        purge_id = response.json()["purge_id"]
        assert response.json()["expected_workers"] == ["w1"]
    ack = stack.tail.wait("TenantPurged", purge_id=purge_id)[0].payload
    for runner in runners:
        runner.join(120)
    assert results["rival"].finish_reason == pb.FINISH_REASON_ABORTED
    assert results["acme"].finish_reason == pb.FINISH_REASON_LENGTH
    assert results["acme"].completion_tokens == 800
    assert ack.refcounts_zero and ack.sequences_aborted == 1
    assert ack.kv_blocks_freed > 0 and ack.adapters_unloaded == 1
    stack.tail.wait("AdapterUnloaded", adapter_id="rival-bot", version=1)
    with stack.registry.client("rival") as rival:
        status = rival.get(f"/v1/purges/{purge_id}").json()
    assert status["status"] == "met" and [a["worker_id"] for a in status["acks"]] == ["w1"]
    proofs = project_until(audit_db, "SELECT * FROM purge_proofs WHERE purge_id = :p "
                                     "AND status = 'met'", p=purge_id)
    assert proofs and proofs[0]["workers_missing"] == [] and proofs[0]["refcounts_zero"]
    # the rival's files are gone from the worker's disk tier too
    cache = stack.workers["w1"].state_dir / "adapter-cache" / "sha256"
    rival_sha = stack.tail.of("AdapterVersionPublished", adapter_id="rival-bot")[0]
    assert not (cache / rival_sha.payload.sha256[:2] / rival_sha.payload.sha256).exists()


def test_health_reflection_prefetch_hints_and_deadlines(stack: Stack) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    from services.contracts.grpc import inference_pb2_grpc as pb_grpc

    w1 = stack.workers["w1"]
    with grpc.insecure_channel(w1.address) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert {"loraplane.v1.Inference", "loraplane.v1.WorkerControl",
                "grpc.health.v1.Health"} <= services
        with stack.publisher() as pub:
            hinted = publish_files(pub, "hinted", fresh_adapter(71), "v1", TENANT)
        stack.tail.wait("AdapterVersionPublished", adapter_id="hinted")
        reply = pb_grpc.WorkerControlStub(ch).Prefetch(pb.PrefetchRequest(
            adapters=[pb.PinnedVersion(adapter_id="hinted", version=1),
                      pb.PinnedVersion(adapter_id="nope", version=1)],
            tier=pb.PREFETCH_TIER_HOST, reason="cold placement"), timeout=10)
        assert [s.accepted for s in reply.adapters] == [True, False]
        stack.tail.wait("AdapterLoaded", adapter_id="hinted", tier="host")
        beat = stack.tail.wait("WorkerHeartbeat", where=lambda e: any(
            a.adapter_id == "hinted" for a in e.payload.loaded))[-1]
        assert {(a.adapter_id, a.tier, a.sha256) for a in beat.payload.loaded
                if a.adapter_id == "hinted"} == {("hinted", "host", hinted["sha256"])}
        # a deadline that passes mid-stream: the sequence is aborted and its KV freed
        stub = pb_grpc.InferenceStub(ch)
        with pytest.raises(grpc.RpcError) as caught:
            generate(stub, ACME, ids=[30, 31, 32], max_tokens=900, timeout=0.5,
                     request_id="req-deadline")
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    traces = stack.tail.wait("RequestServed", where=lambda e: any(
        r.request_id == "req-deadline" for r in e.payload.requests))
    trace = next(r for e in traces for r in e.payload.requests if r.request_id == "req-deadline")
    assert trace.status == "cancelled" and trace.completion_tokens < 900
    after = datetime.now(UTC)
    idle = stack.tail.wait("WorkerHeartbeat", where=lambda e: e.occurred_at > after)[-1]
    assert idle.payload.free_kv_blocks == 512, "every KV block is free (or cached) again"


def test_quality_gates_run_on_the_worker(stack: Stack) -> None:
    """A version published with a regression set is gated by the live worker on its base:
    the worker runs base, previous and new through its engine among the traffic and writes
    the result; a passed gate lets the version serve, a failed one keeps it off."""
    import json

    def case(pattern: str) -> bytes:
        return (json.dumps({"id": "c1", "prompt_token_ids": [5, 6, 7], "max_tokens": 4,
                            "checks": [{"type": "regex", "pattern": pattern}]}) + "\n").encode()

    def publish_gated(label: str, seed: int, pattern: str) -> int:
        files = fresh_adapter(seed)
        with stack.publisher() as pub:
            response = pub.post("/v1/adapters/gated/versions", data={
                **TENANT, "owner": "alice@acme", "base_model": "tiny-llama", "label": label},
                files={"adapter_config": ("adapter_config.json", files.config),
                       "adapter_model": ("adapter_model.safetensors", files.weights),
                       "regression_set": ("set.jsonl", case(pattern))})
        assert response.status_code == 201, response.text
        return int(response.json()["version"])

    good = publish_gated("good", 81, r"^w\d+( w\d+)*$")  # any output of the tiny vocabulary
    done = stack.tail.wait("QualityGateCompleted", version=good, timeout_s=60)[0].payload
    assert done.worker_id == "w1" and done.passed and done.error is None
    assert [o.role for o in done.cases[0].outputs] == ["base", "new"]
    with stack.publisher() as pub:
        switch(pub, "gated", good)
    with channel(stack.workers["w1"].address) as stub:
        _, final = generate(stub, ACME, adapter=alias("gated"), ids=[5, 6, 7], max_tokens=4)
    assert final.served_adapter.version == good
    bad = publish_gated("bad", 82, r"^never$")
    failed = stack.tail.wait("QualityGateCompleted", version=bad, timeout_s=60)[0].payload
    assert not failed.passed and failed.baseline_version == good
    assert [o.role for o in failed.cases[0].outputs] == ["base", "previous", "new"]
    with stack.publisher() as pub:
        refused = pub.put("/v1/adapters/gated/active", json={"version": bad})
    assert refused.status_code == 409 and "quality gate" in refused.text
    with channel(stack.workers["w1"].address) as stub, pytest.raises(grpc.RpcError) as caught:
        generate(stub, ACME, adapter=pinned("gated", bad), ids=[5, 6, 7])
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION



LAGGING_FOLD = '''
"""Loaded by a test's worker process: its log reader holds each batch with a switch in it
for a second before folding it (outside the fold's lock), as a loaded machine would."""
import time

from services.eventlog.follower import LogFollower

_fold_all = LogFollower._fold_all


def _late(self, records):
    if any(r.envelope.type == "AdapterVersionSwitched" for r in records):
        time.sleep(1.0)
    return _fold_all(self, records)


LogFollower._fold_all = _late
'''


def test_a_switch_the_registry_answered_is_served_by_a_worker_still_reading_it(
        stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Read your writes: a request sent the moment the registry answers a switch reaches
    a worker whose fold has not read the switch yet (here held back a second). The
    worker catches up with the log before it refuses anything, so the request is served
    with the new version instead of 'has no active version'."""
    from tests.conftest import REPO

    hook = tmp_path_factory.mktemp("lagging-fold")
    (hook / "sitecustomize.py").write_text(LAGGING_FOLD)
    late = stack.worker("late")
    late.env["PYTHONPATH"] = f"{hook}:{REPO}"
    late.start().wait_serving()
    try:
        with stack.publisher() as pub:
            publish_files(pub, "just-switched", fresh_adapter(77), "v1", TENANT)
            switch(pub, "just-switched", 1)
        with channel(late.address) as stub:
            _, final = generate(stub, ACME, adapter=alias("just-switched"), ids=[5, 6, 7],
                                max_tokens=3)
        assert final.served_adapter.adapter_id == "just-switched"
        assert final.served_adapter.version == 1
        with channel(late.address) as stub, pytest.raises(grpc.RpcError) as missing:
            generate(stub, ACME, adapter=alias("never-published"), ids=[5, 6], max_tokens=2)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND  # refusals still stand
    finally:
        late.kill(signal.SIGTERM)
