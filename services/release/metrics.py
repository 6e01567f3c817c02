"""Prometheus metrics of the canary controller, on their own registry (tests run several
controllers in one process), served on `LORAPLANE_CANARY_METRICS_PORT`.

The controller's decisions are also events in the audit store; these are for the
operator's glance and alerts: is it judging at all (`last_judgement_timestamp`), what
does it decide, and can it reach the registry.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class CanaryMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.judgements = Counter(
            "loraplane_canary_judgements_total",
            "Judgements of running rollouts by outcome: advance, rollback, halt (cannot be "
            "judged), wait (not enough evidence yet)", ["outcome"], registry=r)
        self.steps = Counter(
            "loraplane_canary_rollout_steps_total",
            "Rollout steps the registry applied: advanced, completed, rolled_back, halted",
            ["action"], registry=r)
        self.registry_errors = Counter(
            "loraplane_canary_registry_errors_total",
            "Steps the registry did not apply: unreachable, refused (4xx: the log moved on), "
            "failed (other status; retried)", ["reason"], registry=r)
        self.last_judgement = Gauge(
            "loraplane_canary_last_judgement_timestamp_seconds",
            "Unix time of the last tick that judged at least one running rollout", registry=r)
        self.running = Gauge("loraplane_canary_rollouts_running", "Rollouts in progress",
                             registry=r)
        self.ready = Gauge("loraplane_canary_ready", "1 once the log is replayed", registry=r)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics in a daemon thread; returns the bound port (0 asks for any)."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
