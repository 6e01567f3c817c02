"""SRE drills on a real worker process (the operations checklist): the device budget
full, an adapter file that is corrupt, a blob store that fails. One stack for the module:
the broker, a registry, one worker with two device slots.

The other drills live beside the code they exercise: a tenant's contract ending
(tests/worker/test_service.py::test_purge_one_tenant_while_another_streams: KV cleared,
refcounts zero, a met purge proof in SQL), a corrupted blob on the worker's disk
(test_corrupted_blob_is_refused_and_never_served), a worker killed mid-stream
(tests/router), the broker restarted and a service killed under `loraplane up`
(tests/stack/test_up.py).
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.client import problem_line
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

ACME = signature(**TENANT)


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, served_model: ServedModel,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings(kafka_bootstrap, None)
    with running_stack(settings, tmp_path_factory.mktemp("drills"), served_model.path, None,
                       worker_adapter_slots=2) as running:
        yield running


def _serving(stack: Stack) -> bool:
    return stack.workers["w1"].health() == health_pb2.HealthCheckResponse.SERVING


def test_device_budget_full_queues_and_evicts_without_a_crash(stack: Stack) -> None:
    """Four adapters wanted at once by a worker with two device slots: the worker evicts
    what is idle and refuses (RESOURCE_EXHAUSTED, "retry shortly") what cannot fit while
    the slots are in use; retried, every request ends with its full length; it never
    holds more than two."""
    names = [f"budget-{i}" for i in range(4)]
    with stack.publisher() as pub:
        for i, name in enumerate(names):
            publish_files(pub, name, fresh_adapter(300 + i), "v1", TENANT)
            switch(pub, name, 1)
    finals: dict[str, pb.FinalUsage] = {}
    errors: list[BaseException] = []
    refusals: list[str] = []

    def ask(name: str) -> None:
        """As the router does: a RESOURCE_EXHAUSTED (every slot in use) is retried."""
        try:
            with channel(stack.workers["w1"].address) as stub:
                for _ in range(200):
                    try:
                        finals[name] = generate(stub, ACME, adapter=alias(name),
                                                ids=[5, 6, 7], max_tokens=12, timeout=120)[1]
                        return
                    except grpc.RpcError as exc:
                        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                            raise
                        refusals.append(exc.details() or "")
                        time.sleep(0.1)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(name,)) for name in names * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert errors == []
    assert all("retry" in r for r in refusals), refusals  # backpressure says what to do
    assert {n: f.completion_tokens for n, f in finals.items()} == {n: 12 for n in names}
    assert {f.served_adapter.adapter_id for f in finals.values()} == set(names)
    device = [line for line in stack.workers["w1"].metrics().splitlines()
              if line.startswith('loraplane_worker_adapters{tier="device"}')]
    assert device and float(device[0].split()[-1]) <= 2
    assert _serving(stack)


def test_a_corrupt_adapter_file_is_refused_in_one_clear_line(stack: Stack) -> None:
    good = fresh_adapter(320)
    broken = type(good)(good.config, good.weights[: len(good.weights) // 2])
    with stack.publisher() as pub:
        data = {**TENANT, "owner": "alice@example", "base_model": "tiny-llama",
                "label": "broken", "qos_tier": "silver"}
        response = pub.post("/v1/adapters/broken/versions", data=data, files={
            "adapter_config": ("adapter_config.json", broken.config),
            "adapter_model": ("adapter_model.safetensors", broken.weights)})
        listed = pub.get("/v1/adapters/broken")
    assert response.status_code == 422, response.text
    line = problem_line(response)
    assert "\n" not in line and line.startswith("422") and "safetensors" in line.lower()
    assert listed.status_code == 404  # nothing was stored


def test_a_failing_blob_store_is_a_clear_error_and_the_worker_recovers(stack: Stack) -> None:
    """The adapter's blob vanishes from the store before any worker fetched it: the
    request fails with a status that says so, the worker keeps serving, and once the blob
    is back the same alias is served."""
    with stack.publisher() as pub:
        published = publish_files(pub, "blobless", fresh_adapter(330), "v1", TENANT)
        switch(pub, "blobless", 1)
    sha = published["sha256"]
    blob = stack.settings.blob_root / "sha256" / sha[:2] / sha
    assert blob.exists()
    aside = blob.with_suffix(".aside")
    shutil.move(blob, aside)
    with channel(stack.workers["w1"].address) as stub, \
            pytest.raises(grpc.RpcError) as failed:
        generate(stub, ACME, adapter=alias("blobless"), ids=[5, 6], max_tokens=4, timeout=90)
    assert failed.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND,
                                   grpc.StatusCode.FAILED_PRECONDITION,
                                   grpc.StatusCode.DEADLINE_EXCEEDED)
    assert "blobless" in (failed.value.details() or "") or sha[:12] in (
        failed.value.details() or ""), failed.value.details()
    assert _serving(stack)
    shutil.move(aside, blob)
    with channel(stack.workers["w1"].address) as stub:
        tokens, final = generate(stub, ACME, adapter=alias("blobless"), ids=[5, 6],
                                 max_tokens=4, timeout=90)
    assert final.served_adapter.sha256 == sha and len(tokens) == 4


def test_a_slow_blob_store_times_the_page_in_out_and_the_load_goes_on(stack: Stack) -> None:
    """A worker whose blob page-in budget (1 ms) no fetch can meet: the request is refused
    at once with UNAVAILABLE, the tier and "retry" in its details (the router retries it
    elsewhere); the fetch goes on, so a retry a moment later is served."""
    with stack.publisher() as pub:
        publish_files(pub, "slowblob", fresh_adapter(340), "v1", TENANT)
        switch(pub, "slowblob", 1)
    stack.tail.wait("AdapterVersionSwitched", adapter_id="slowblob")
    # Started after the publish, so no quality gate of the new version ran on it (a gate
    # would have fetched the adapter already).
    slow = stack.worker("w2", worker_page_in_timeout_blob_s=0.001).start()
    slow.wait_serving()
    with channel(slow.address) as stub:
        with pytest.raises(grpc.RpcError) as late:
            generate(stub, ACME, adapter=alias("slowblob"), ids=[5, 6], max_tokens=4,
                     timeout=60)
        assert late.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "blob tier in time; retry" in (late.value.details() or "")

        def served() -> pb.FinalUsage | None:
            try:
                return generate(stub, ACME, adapter=alias("slowblob"), ids=[5, 6],
                                max_tokens=4, timeout=60)[1]
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
                return None

        final = wait_for(served, 60, interval_s=0.2, message="slowblob served once paged in")
    assert final.worker_id == "w2" and final.completion_tokens == 4
    slow.kill(signal.SIGTERM)
