"""Prometheus metrics of one registry instance.

Each app gets its own CollectorRegistry so several instances can live in one process (the
fencing and restart tests run two), and `/metrics` shows only its own numbers.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class RegistryMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.commands = Counter(
            "loraplane_registry_commands_total", "Commands by type and outcome",
            ["command", "outcome"], registry=self.registry)
        self.command_seconds = Histogram(
            "loraplane_registry_command_seconds",
            "Publish to read-back of a command's event", ["command"], registry=self.registry,
            buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.events_folded = Counter(
            "loraplane_registry_events_folded_total", "Events folded into state", ["type"],
            registry=self.registry)
        self.upload_bytes = Counter(
            "loraplane_registry_upload_bytes_total", "Adapter bytes accepted",
            registry=self.registry)
        self.uploads_rejected = Counter(
            "loraplane_registry_uploads_rejected_total", "Uploads refused by validation",
            ["status"], registry=self.registry)
        self.ready = Gauge("loraplane_registry_ready", "1 once the log is replayed",
                           registry=self.registry)
        self.writable = Gauge("loraplane_registry_writable",
                              "1 while this instance may write (not fenced)",
                              registry=self.registry)
        self.active = Gauge("loraplane_registry_active",
                            "1 while this instance holds the writer role",
                            registry=self.registry)
        self.takeovers = Counter("loraplane_registry_takeovers_total",
                                 "Times this instance took the writer role from a silent one",
                                 registry=self.registry)
        self.takeover_seconds = Gauge(
            "loraplane_registry_takeover_seconds",
            "Last takeover: seconds from the old writer's last folded write to this "
            "instance's first lease", registry=self.registry)
        self.lease_epoch = Gauge("loraplane_registry_lease_epoch", "Epoch of this instance",
                                 registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
