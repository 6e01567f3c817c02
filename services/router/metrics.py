"""Prometheus metrics of one router (its own CollectorRegistry, served at HTTP /metrics).

Per-tenant and per-adapter labels are what operators asked for (who is sending what); the
tenant label is `org/team/project` and the adapter label the adapter id (not the version:
versions come and go with every canary, the audit store has them per request).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ROUTE_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "loraplane_router_requests_total", "Requests by tenant, adapter, front and outcome",
            ["tenant", "adapter", "front", "outcome"], registry=r)
        self.route_seconds = Histogram(
            "loraplane_router_route_seconds",
            "Routing decision: resolve the version, admit, place (no I/O)",
            registry=r, buckets=ROUTE_BUCKETS)
        self.first_token_seconds = Histogram(
            "loraplane_router_first_token_seconds",
            "Request received to first response from a worker", ["front"], registry=r,
            buckets=LATENCY_BUCKETS)
        self.retries = Counter(
            "loraplane_router_retries_total",
            "Requests retried on the next ring worker after failing before the first token",
            ["code"], registry=r)
        self.rejections = Counter(
            "loraplane_router_rejections_total", "Requests refused, by reason",
            ["reason"], registry=r)
        self.midstream_errors = Counter(
            "loraplane_router_midstream_errors_total",
            "Worker failures after the first token (passed to the client, not retried)",
            ["code"], registry=r)
        self.placements = Counter(
            "loraplane_router_placements_total",
            "Placements by where the chosen worker held the adapter",
            ["tier"], registry=r)
        self.prefetch_hints = Counter(
            "loraplane_router_prefetch_hints_total", "Prefetch hints sent, by reason and result",
            ["reason", "result"], registry=r)
        self.ring_size = Gauge("loraplane_router_ring_size", "Workers in the ring",
                               registry=r)
        self.ring_changes = Counter(
            "loraplane_router_ring_changes_total", "Workers joining or leaving the ring",
            ["change"], registry=r)
        self.in_flight = Gauge("loraplane_router_in_flight", "Requests in flight per worker",
                               ["worker"], registry=r)
        self.ready = Gauge("loraplane_router_ready", "1 once the log is replayed",
                           registry=r)
        self.events_folded = Counter(
            "loraplane_router_events_folded_total", "Events folded, by type", ["type"],
            registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
