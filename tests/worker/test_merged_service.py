"""Merged mode on real processes: a registry, Kafka, a general worker PROCESS and one
started with `serve worker --merge`, a router; gRPC all the way.

The merged worker gives the unmerged adapter's greedy tokens, names the version and
digest it served, re-merges on a switch, unmerges on a disable and refuses everything
else; the router sends it that adapter's requests and no others.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from services.contracts.grpc import inference_pb2 as pb
from tests.conftest import isolated_settings
from tests.registry.conftest import TENANT
from tests.waiting import wait_for
from tests.worker.conftest import ServedModel
from tests.worker.harness import (
    Stack,
    alias,
    channel,
    fresh_adapter,
    generate,
    publish_files,
    running_stack,
    signature,
    switch,
)

pytestmark = pytest.mark.slow

ACME = signature(**{"org": "acme", "team": "search", "project": "prod"})
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, served_model: ServedModel,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings(kafka_bootstrap, None)
    with running_stack(settings, tmp_path_factory.mktemp("merged"), served_model.path,
                       None) as running:
        running.worker("m1", worker_merge="bot").start().wait_serving()
        running.wait_live("m1")
        yield running


def ask(stack: Stack, worker: str, adapter: str | None) -> tuple[list[int], pb.FinalUsage]:
    with channel(stack.workers[worker].address) as stub:
        return generate(stub, ACME, adapter=alias(adapter) if adapter else None, ids=PROMPT,
                        max_tokens=6)


def refusal(stack: Stack, worker: str, adapter: str | None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        ask(stack, worker, adapter)
    return caught.value


def until_served(stack: Stack, worker: str, adapter: str, version: int,
                 timeout_s: float = 30.0) -> tuple[list[int], pb.FinalUsage]:
    """The worker folds the log on its own schedule: ask until it serves `version`."""
    def served() -> tuple[list[int], pb.FinalUsage] | None:
        tokens, final = ask(stack, worker, adapter)
        return (tokens, final) if final.served_adapter.version == version else None

    return wait_for(served, timeout_s, interval_s=0.2, ignoring=(grpc.RpcError,),
                    message=f"{worker} to serve {adapter}@{version}")


def test_merged_worker_serves_its_adapter_and_follows_the_log(stack: Stack) -> None:
    from tests.router.conftest import RunningRouter, bearer, router_settings

    with stack.publisher() as pub:
        v1 = publish_files(pub, "bot", fresh_adapter(81), "v1", TENANT)
        v2 = publish_files(pub, "bot", fresh_adapter(82), "v2", TENANT)
        publish_files(pub, "other", fresh_adapter(83), "v1", TENANT)
        switch(pub, "bot", 1)
        switch(pub, "other", 1)
    unmerged, _ = until_served(stack, "w1", "bot", 1)
    tokens, final = until_served(stack, "m1", "bot", 1)
    assert tokens == unmerged  # merged into the base weights: the same greedy tokens
    assert (final.worker_id, final.served_adapter.sha256) == ("m1", v1["sha256"])
    beat = stack.tail.wait("WorkerHeartbeat", worker_id="m1",
                           where=lambda e: e.payload.merged_mode.version == 1)[-1].payload
    assert beat.merged_mode.sha256 == v1["sha256"] and beat.merged_mode.pinned_version is None
    traces = stack.tail.wait("RequestServed", worker_id="m1")[-1].payload.requests
    assert {(t.adapter_id, t.version, t.adapter_sha256) for t in traces} == {
        ("bot", 1, v1["sha256"])}

    other = refusal(stack, "m1", "other")
    assert other.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "only adapter bot" in (other.details() or "")
    assert refusal(stack, "m1", None).code() == grpc.StatusCode.FAILED_PRECONDITION

    router = RunningRouter(router_settings(stack.settings, heartbeat_interval_s=0.5)).start()
    try:
        router.wait_ring({"w1", "m1"})
        for adapter, worker in (("bot", "m1"), ("other", "w1"), ("bot", "m1"), ("other", "w1")):
            request = pb.GenerateRequest(tenant=ACME, adapter=alias(adapter),
                                         sampling=pb.SamplingParams(max_tokens=3,
                                                                    ignore_eos=True))
            request.token_ids.ids.extend(PROMPT)
            answers = list(router.stub().Generate(request, metadata=bearer("acme"), timeout=60))
            assert answers[-1].final.worker_id == worker, adapter
    finally:
        router.stop()

    with stack.publisher() as pub:
        switch(pub, "bot", 2)  # re-merged from the pristine base
    unmerged, _ = until_served(stack, "w1", "bot", 2)
    tokens, final = until_served(stack, "m1", "bot", 2)
    assert tokens == unmerged and final.served_adapter.sha256 == v2["sha256"]

    with stack.admin() as admin:
        response = admin.post("/v1/adapters/bot/versions/2/disable", json={"reason": "bad"})
        assert response.status_code == 200, response.text
    stack.tail.wait("WorkerHeartbeat", worker_id="m1",
                    where=lambda e: e.payload.merged_mode.version is None)  # unmerged
    gone = refusal(stack, "m1", "bot")
    assert gone.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "disabled" in (gone.details() or "")
    assert "loraplane_worker_merges_total 2.0" in stack.workers["m1"].metrics()
