"""The `vllm:*` series of a running worker, scraped over HTTP and read the way an inference
gateway reads them: the Gateway API Inference Extension's model-server protocol (queue,
running requests, KV-cache utilisation; `vllm:lora_requests_info` for LoRA affinity) and
vLLM's latency histograms with vLLM's names, label names and buckets.

Two worker processes, one adapter served by one of them: an endpoint picker that sees
only the two scrapes must send that adapter's requests to the worker that holds it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.conftest import isolated_settings
from tests.registry.conftest import TENANT
from tests.waiting import wait_for
from tests.worker.conftest import ServedModel
from tests.worker.harness import (
    Stack,
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

ACME = signature(**TENANT)

# vLLM's buckets (vllm/v1/metrics/loggers.py), written out here on purpose: the test pins
# the worker to them rather than reading them from the code under test.
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0]
E2E = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
       120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, served_model: ServedModel,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings(kafka_bootstrap, None)
    with running_stack(settings, tmp_path_factory.mktemp("gateway"), served_model.path,
                       None) as running:
        running.worker("w2").start().wait_serving()
        yield running


def scrape(stack: Stack, worker: str) -> dict[str, tuple[str, list[Sample]]]:
    """name → (type, samples) of one worker's /metrics, parsed as Prometheus parses it."""
    text = httpx.get(f"http://127.0.0.1:{stack.workers[worker].metrics_port}/metrics",
                     timeout=5).text
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def lora_info(families: dict[str, tuple[str, list[Sample]]]) -> dict[str, str]:
    """The newest `vllm:lora_requests_info` series' labels, as an endpoint picker takes it."""
    kind, samples = families["vllm:lora_requests_info"]
    assert kind == "gauge"
    return dict(max(samples, key=lambda s: s.value).labels)


def adapters(csv: str) -> set[str]:
    return {a.strip() for a in csv.split(",") if a.strip()}


def pick(scrapes: dict[str, dict[str, tuple[str, list[Sample]]]], model: str) -> str:
    """A LoRA-affinity endpoint picker in a few lines, after the protocol: prefer workers
    whose running adapters hold the requested one, then the shortest queue, then the
    emptiest KV cache; a worker with room for one more adapter comes next."""

    def gauge(families: dict[str, tuple[str, list[Sample]]], name: str) -> float:
        kind, samples = families[name]
        assert kind == "gauge"
        return sum(s.value for s in samples)

    def rank(worker: str) -> tuple[int, float, float]:
        families = scrapes[worker]
        info = lora_info(families)
        running = adapters(info["running_lora_adapters"])
        waiting = adapters(info["waiting_lora_adapters"])
        affinity = 0 if model in running | waiting else (
            1 if len(running) < int(info["max_lora"]) else 2)
        return (affinity, gauge(families, "vllm:num_requests_waiting"),
                gauge(families, "vllm:kv_cache_usage_perc"))

    return min(sorted(scrapes), key=rank)


def test_gateway_series_have_vllms_names_types_and_labels(stack: Stack) -> None:
    with stack.publisher() as pub:
        publish_files(pub, "gw-support", fresh_adapter(4011), "v1", TENANT)
        switch(pub, "gw-support", 1)
    with channel(stack.workers["w2"].address) as stub:
        for _ in range(3):
            tokens, final = generate(stub, ACME, adapter=pinned("gw-support", 1),
                                     ids=[5, 6, 7, 8], max_tokens=6)
            assert len(tokens) == 6 and final.worker_id == "w2"
    loads = ("vllm:num_requests_running", "vllm:num_requests_waiting",
             "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")

    def settled() -> dict[str, tuple[str, list[Sample]]] | None:
        """Every load gauge there, and the finished requests no longer counted (the loop
        reports its load at most every 50 ms, so a scrape can still see the last one)."""
        families = scrape(stack, "w2")
        if not all(name in families for name in loads):
            return None
        busy = families["vllm:num_requests_running"][1][0].value
        return families if busy == 0 else None

    families = wait_for(settled, 10, message="w2's load gauges, with nothing running")

    for name in loads:
        kind, samples = families[name]
        assert kind == "gauge", name
        (sample,) = samples
        assert set(sample.labels) == {"model_name", "engine"}, name
        assert sample.labels["engine"] == "0"
    assert families["vllm:num_requests_waiting"][1][0].value == 0
    usage = families["vllm:kv_cache_usage_perc"][1][0].value
    assert 0.0 <= usage <= 1.0

    info = lora_info(families)
    assert set(info) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert info["max_lora"] == "4"  # the worker's adapter slots (the harness gives 4)
    assert "gw-support" in adapters(info["running_lora_adapters"])
    assert info["waiting_lora_adapters"] == ""
    (series,) = families["vllm:lora_requests_info"][1]  # one series, not one per change
    assert abs(series.value - time.time()) < 30  # its value: when it was last set

    for name, buckets in (("vllm:time_to_first_token_seconds", TTFT),
                          ("vllm:time_per_output_token_seconds", TPOT),
                          ("vllm:e2e_request_latency_seconds", E2E),
                          ("vllm:request_queue_time_seconds", E2E)):
        kind, samples = families[name]
        assert kind == "histogram", name
        bounds = [float(s.labels["le"]) for s in samples if s.name == f"{name}_bucket"]
        assert bounds == [*buckets, float("inf")], name
        count = next(s.value for s in samples if s.name == f"{name}_count")
        assert count >= 3, name  # three requests, each observed
        assert all(set(s.labels) - {"le"} == {"model_name", "engine"} for s in samples)
    tpot = next(s.value for s in families["vllm:time_per_output_token_seconds"][1]
                if s.name.endswith("_count"))
    assert tpot >= 3 * 5  # every token after the first
    kind, samples = families["vllm:request_success"]
    assert kind == "counter"
    assert {s.labels["finished_reason"]: s.value for s in samples
            if s.name.endswith("_total")}.get("length") >= 3
    assert families["vllm:generation_tokens"][0] == "counter"
    # the loraplane_* series are still there beside them
    assert "loraplane_worker_time_to_first_token_seconds" in families


def test_an_endpoint_picker_routes_lora_requests_from_the_metrics_alone(stack: Stack) -> None:
    with stack.publisher() as pub:
        publish_files(pub, "gw-only-w1", fresh_adapter(4012), "v1", TENANT)
        switch(pub, "gw-only-w1", 1)
    with channel(stack.workers["w1"].address) as stub:
        generate(stub, ACME, adapter=pinned("gw-only-w1", 1), ids=[5, 6, 7], max_tokens=2)

    def scraped() -> tuple[dict, dict] | None:
        scrapes = {w: scrape(stack, w) for w in ("w1", "w2")}
        held = {w: adapters(lora_info(f)["running_lora_adapters"]) for w, f in scrapes.items()}
        return (scrapes, held) if "gw-only-w1" in held["w1"] else None

    scrapes, held = wait_for(scraped, 10, interval_s=0.1, message="w1 to report gw-only-w1")
    assert "gw-only-w1" in held["w1"] and "gw-only-w1" not in held["w2"], held
    assert pick(scrapes, "gw-only-w1") == "w1"
    # and the adapter w2 served in the test before goes to w2
    assert "gw-support" in held["w2"]
    assert pick(scrapes, "gw-support") == "w2"
