"""Prometheus metrics of one worker, on their own registry (several workers can share a
process in tests and benches), served on `LORAPLANE_WORKER_METRICS_PORT`.

Rates are left to PromQL: tokens/s is `rate(loraplane_worker_generated_tokens_total[1m])`;
the KV prefix-hit rate of a tenant is
`rate(..._prefix_cached_tokens_total[5m]) / rate(..._prompt_tokens_total[5m])`, also
given as a cumulative gauge for a glance at `/metrics`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2,
                   0.25, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
LAG_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025,
               0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.5, 1.0,
               2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
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
        self.queue_seconds = Histogram("loraplane_worker_queue_seconds",
                                       "Arrival until the request joins a batch "
                                       "(adapter page-in included)",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("loraplane_worker_time_to_first_token_seconds",
                                      "Arrival until the first token", buckets=LATENCY_BUCKETS,
                                      registry=r)
        self.itl_seconds = Histogram("loraplane_worker_inter_token_seconds",
                                     "Time between two tokens of one request",
                                     buckets=LATENCY_BUCKETS, registry=r)
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
