"""A worker PROCESS killed with SIGKILL comes back to the same adapter states by replaying
the log; a worker that stops hearing registry leases refuses to serve until it does."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.contracts.events import Envelope
from services.contracts.grpc import inference_pb2 as pb
from tests.conftest import isolated_settings
from tests.registry.conftest import TENANT, RunningRegistry
from tests.waiting import wait_for
from tests.worker.conftest import ServedModel
from tests.worker.harness import (
    Stack,
    alias,
    channel,
    fresh_adapter,
    generate,
    pinned,
    publish_files,
    running_stack,
    signature,
    switch,
)

pytestmark = pytest.mark.slow

ACME = signature("acme", "search", "prod")


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, served_model: ServedModel,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(isolated_settings(kafka_bootstrap, None),
                       tmp_path_factory.mktemp("recovery"), served_model.path, None,
                       stale_lease_threshold_s=3) as running:
        yield running


def device_set(beat: Envelope) -> set[tuple[str, int, str]]:
    return {(a.adapter_id, a.version, a.sha256) for a in beat.payload.loaded
            if a.tier == "device"}


def last_beat(stack: Stack, after: datetime) -> Envelope:
    return stack.tail.wait("WorkerHeartbeat", worker_id="w1",
                           where=lambda e: e.occurred_at > after)[-1]


def test_kill_9_and_restart_replays_to_the_same_adapter_states(stack: Stack) -> None:
    with stack.publisher() as pub:
        served = publish_files(pub, "served", fresh_adapter(61), "v1", TENANT)
        switch(pub, "served", 1)
        gold = publish_files(pub, "golden", fresh_adapter(62), "v1", TENANT, qos_tier="gold")
        switch(pub, "golden", 1)
        publish_files(pub, "moved", fresh_adapter(63), "v1", TENANT)
        switch(pub, "moved", 1)
        moved2 = publish_files(pub, "moved", fresh_adapter(64), "v2", TENANT)
        # valid for the registry (rank <= 128), beyond this worker's slots (rank <= 16):
        # it fails to load here for good
        publish_files(pub, "bad", fresh_adapter(65, rank=32), "v1", TENANT)
        switch(pub, "bad", 1)
    stack.tail.wait("AdapterVersionSwitched", adapter_id="bad")
    w1 = stack.workers["w1"]
    with channel(w1.address) as stub:
        generate(stub, ACME, adapter=alias("served"), ids=[4, 5, 6])
        generate(stub, ACME, adapter=alias("moved"), ids=[4, 5, 6])
        with stack.publisher() as pub:
            switch(pub, "moved", 2)
        stack.tail.wait("AdapterUnloaded", adapter_id="moved", version=1)
        generate(stub, ACME, adapter=alias("moved"), ids=[4, 5, 6])
        with pytest.raises(grpc.RpcError) as caught:
            generate(stub, ACME, adapter=alias("bad"), ids=[4, 5])
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    expected = {("served", 1, served["sha256"]), ("golden", 1, gold["sha256"]),
                ("moved", 2, moved2["sha256"])}
    before = last_beat(stack, datetime.now(UTC))
    assert device_set(before) == expected
    failures = len(stack.tail.of("AdapterLoadFailed", adapter_id="bad"))

    w1.kill()  # SIGKILL: no goodbye, no flush
    restarted_at = datetime.now(UTC)
    w1.start().wait_serving()
    # loads replay from the disk tier; wait until all three are back
    wait_for(lambda: device_set(last_beat(stack, restarted_at)) == expected, 30, interval_s=0.3,
             message="a heartbeat with all three on the device")
    with channel(w1.address) as stub:
        with pytest.raises(grpc.RpcError) as caught:
            generate(stub, ACME, adapter=pinned("bad", 1), ids=[4, 5])
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "never served" in caught.value.details()
        _, final = generate(stub, ACME, adapter=alias("moved"), ids=[4, 5, 6])
        assert final.served_adapter.version == 2
    assert len(stack.tail.of("AdapterLoadFailed", adapter_id="bad")) == failures, \
        "a version that failed before the crash is not fetched again"
    metrics = w1.metrics()
    # the restarted process reloaded all three from its disk tier, nothing from the registry
    loads = {(s.labels["tier"], s.labels["adapter"]): s.value
             for family in text_string_to_metric_families(metrics) for s in family.samples
             if s.name == "loraplane_worker_adapter_load_seconds_count"}
    assert loads == {("disk", "served"): 1.0, ("disk", "golden"): 1.0,
                     ("disk", "moved"): 1.0}, metrics
    seqs = sorted(e.seq for e in stack.tail.events if e.stream == "worker/w1")
    assert seqs == list(range(1, len(seqs) + 1)), "the worker's stream has no gap or repeat"


def test_stale_lease_refused_then_served_again(stack: Stack) -> None:
    w1 = stack.workers["w1"]
    with channel(w1.address) as stub:
        generate(stub, ACME, ids=[7, 8, 9])
        stack.registry.stop()  # no more leases

        def refused() -> grpc.RpcError | None:
            try:
                generate(stub, ACME, ids=[7, 8, 9], timeout=10)
            except grpc.RpcError as exc:
                return exc
            return None

        exc = wait_for(refused, 30, interval_s=0.3, message="a refusal behind the version wall")
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
        assert "version wall" in exc.details() and "lease" in exc.details()
        stack.registry = RunningRegistry(stack.settings).start()  # leases again

        def served() -> pb.FinalUsage | None:
            try:
                return generate(stub, ACME, ids=[7, 8, 9], timeout=10)[1]
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
                return None

        final = wait_for(served, 30, interval_s=0.2, message="service again after a fresh lease")
        assert final.completion_tokens == 8
    assert re.search(r"stale_lease_rejections_total [1-9]", w1.metrics())
