"""Prometheus metrics of one worker, on their own registry (several workers can share a
process in tests and benches), served on `LORAPLANE_WORKER_METRICS_PORT`.

Rates are left to PromQL: tokens/s is `rate(loraplane_worker_generated_tokens_total[1m])`;
the KV prefix-hit rate of a tenant is
`rate(..._prefix_cached_tokens_total[5m]) / rate(..._prompt_tokens_total[5m])`, also
given as a cumulative gauge for a glance at `/metrics`.

Beside the `loraplane_*` series, a worker exports the `vllm:*` series that inference
gateways and vLLM dashboards read (`VllmSeries`): the Gateway API Inference Extension's
model-server protocol (queue depth, running requests, KV-cache utilisation, and
`vllm:lora_requests_info` for LoRA affinity) and vLLM's latency histograms, with vLLM's
names, label names and buckets (vLLM's `vllm/v1/metrics/loggers.py`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2,
                   0.25, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
LAG_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025,
               0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.5, 1.0,
               2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# vLLM's buckets, as its Prometheus logger declares them
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                                30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                                7680.0)
VLLM_LABELS = ("model_name", "engine")
"""vLLM labels its engine series by served model and engine index (one engine here: "0")."""
FINISH_REASONS = ("stop", "length", "abort")
"""vLLM's `finished_reason` values of `vllm:request_success`."""


class VllmSeries:
    """The `vllm:*` families of one worker: what an inference gateway's endpoint picker
    scrapes to route (queue, running, KV usage, LoRA adapters held) and what vLLM
    dashboards plot (TTFT, TPOT, end-to-end latency, tokens, finished requests).

    The engine loop reports its load with `load(...)`; latencies are observed next to the
    `loraplane_*` histograms. `vllm:lora_requests_info` follows vLLM: one series whose
    labels list the adapters and whose value is when it was last set (a gateway takes the
    newest); older label sets are dropped so the series count stays one."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_lora: int) -> None:
        r = registry
        self.model_name = model_name
        self.max_lora = max_lora
        labels = list(VLLM_LABELS)
        self.running = Gauge("vllm:num_requests_running",
                             "Number of requests in model execution batches.", labels,
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting",
                             "Number of requests waiting to be processed (queued for the "
                             "batch or for their adapter to page in).", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
        self.gpu_kv_usage = Gauge("vllm:gpu_cache_usage_perc",
                                  "KV-cache usage. 1 means 100 percent usage. (vLLM's older "
                                  "name, still read by older gateways.)", labels, registry=r)
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                               registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.", labels,
                                         registry=r)
        self.request_success = Counter("vllm:request_success",
                                       "Count of successfully processed requests.",
                                       [*labels, "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", labels,
                              buckets=VLLM_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", labels,
                              buckets=VLLM_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", labels,
                             buckets=VLLM_REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", labels,
                               buckets=VLLM_REQUEST_LATENCY_BUCKETS, registry=r)
        self._lora_labels: tuple[str, str, str] | None = None
        self.load(running=0, waiting=0, kv_usage=0.0, running_adapters=(),
                  waiting_adapters=())

    def _of(self, family: Gauge | Counter | Histogram):  # -> the child of this engine
        return family.labels(self.model_name, "0")

    def load(self, *, running: int, waiting: int, kv_usage: float,
             running_adapters: Iterable[str], waiting_adapters: Iterable[str]) -> None:
        """The engine's state now: requests batched and waiting, the share of KV blocks in
        use, the adapters ready in a device slot and those requests wait for."""
        self._of(self.running).set(running)
        self._of(self.waiting).set(waiting)
        self._of(self.kv_usage).set(kv_usage)
        self._of(self.gpu_kv_usage).set(kv_usage)
        labels = (str(self.max_lora), ",".join(sorted(set(waiting_adapters))),
                  ",".join(sorted(set(running_adapters))))
        if labels != self._lora_labels:
            if self._lora_labels is not None:
                self.lora_info.remove(*self._lora_labels)
            self._lora_labels = labels
        self.lora_info.labels(*labels).set(time.time())

    def finished(self, reason: str, prompt: int, completion: int, e2e_s: float) -> None:
        self._of(self.prompt_tokens).inc(prompt)
        self._of(self.generation_tokens).inc(completion)
        if reason in FINISH_REASONS:
            self.request_success.labels(self.model_name, "0", reason).inc()
        self._of(self.e2e).observe(e2e_s)


class Twin:
    """A `loraplane_*` histogram and its `vllm:*` namesake observing the same values, so
    the engine loop records a latency once and both names carry it."""

    def __init__(self, ours: Histogram, theirs) -> None:  # theirs: a labelled child
        self.ours = ours
        self.theirs = theirs

    def observe(self, value: float) -> None:
        self.ours.observe(value)
        self.theirs.observe(value)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, *,
                 model_name: str = "", max_lora: int = 8) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.vllm = VllmSeries(r, model_name, max_lora)
        self.load_seconds = Histogram(
            "loraplane_worker_adapter_load_seconds",
            "Adapter load latency until usable on the device, by the tier it came from and "
            "the adapter id (never the version or digest: a few series per adapter, so "
            "hundreds of adapters stay cheap to scrape)",
            ["tier", "adapter"], buckets=LATENCY_BUCKETS, registry=r)
        self.adapters = Gauge("loraplane_worker_adapters", "Adapter versions held, per tier",
                              ["tier"], registry=r)
        self.adapter_states = Gauge("loraplane_worker_adapter_states",
                                    "Adapter versions per state of the state machine",
                                    ["state"], registry=r)
        self.prompt_tokens = Counter("loraplane_worker_prompt_tokens_total",
                                     "Prompt tokens of finished requests", ["tenant"], registry=r)
        self.cached_tokens = Counter("loraplane_worker_prefix_cached_tokens_total",
                                     "Prompt tokens served from the KV prefix cache",
                                     ["tenant"], registry=r)
        self.prefix_hit_rate = Gauge("loraplane_worker_prefix_hit_rate",
                                     "Cumulative share of prompt tokens found in the prefix "
                                     "cache", ["tenant"], registry=r)
        self.batch_size = Histogram("loraplane_worker_batch_size",
                                    "Sequences running in each engine step",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.queue_seconds = Twin(Histogram(
            "loraplane_worker_queue_seconds", "Arrival until the request joins a batch "
            "(adapter page-in included)", buckets=LATENCY_BUCKETS, registry=r),
            self.vllm._of(self.vllm.queue))
        self.ttft_seconds = Twin(Histogram(
            "loraplane_worker_time_to_first_token_seconds", "Arrival until the first token",
            buckets=LATENCY_BUCKETS, registry=r), self.vllm._of(self.vllm.ttft))
        self.itl_seconds = Twin(Histogram(
            "loraplane_worker_inter_token_seconds", "Time between two tokens of one request",
            buckets=LATENCY_BUCKETS, registry=r), self.vllm._of(self.vllm.tpot))
        self.generated_tokens = Counter("loraplane_worker_generated_tokens_total",
                                        "Completion tokens produced", registry=r)
        self.requests = Counter("loraplane_worker_requests_total",
                                "Generate calls by final gRPC status", ["code"], registry=r)
        self.stale_lease_rejections = Counter(
            "loraplane_worker_stale_lease_rejections_total",
            "Requests refused by the version wall (registry lease too old)", registry=r)
        self.illegal_transitions = Counter(
            "loraplane_worker_illegal_transitions_total",
            "Adapter state transitions refused by the state machine", ["transition"],
            registry=r)
        self.catalog_lag_seconds = Histogram(
            "loraplane_worker_catalog_apply_seconds",
            "Adapter-log event written (occurred_at) until applied by the engine loop",
            buckets=LAG_BUCKETS, registry=r)
        self.ready = Gauge("loraplane_worker_ready", "1 once replayed and the base model is "
                           "registered", registry=r)
        self.free_kv_blocks = Gauge("loraplane_worker_free_kv_blocks", "Free KV blocks",
                                    registry=r)
        self.workspace_bytes = Gauge(
            "loraplane_worker_step_workspace_bytes",
            "Engine step scratch buffers kept between steps (grown to the largest step)",
            registry=r)
        self.events_unsent = Gauge("loraplane_worker_events_unsent",
                                   "Worker events waiting for the broker", registry=r)
        self.merged_version = Gauge(
            "loraplane_worker_merged_version",
            "Merged mode: the adapter version merged into the base weights (0: none)",
            ["adapter"], registry=r)
        self.merges = Counter("loraplane_worker_merges_total",
                              "Merged mode: adapter versions merged into the base weights",
                              registry=r)
        self._tenant_totals: dict[str, tuple[int, int]] = {}

    def request_finished(self, tenant: str, prompt: int, cached: int) -> None:
        self.prompt_tokens.labels(tenant).inc(prompt)
        self.cached_tokens.labels(tenant).inc(cached)
        total, hit = self._tenant_totals.get(tenant, (0, 0))
        total, hit = total + prompt, hit + cached
        self._tenant_totals[tenant] = (total, hit)
        self.prefix_hit_rate.labels(tenant).set(hit / total if total else 0.0)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        if port:
            start_http_server(port, addr=host, registry=self.registry)
