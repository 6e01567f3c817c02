"""Prometheus metrics of the audit projector, served with its checkpoints
(`services.audit.publication`) on `LORAPLANE_AUDIT_METRICS_PORT`.

Lag is measured when scraped, not per batch: the high watermark of every partition
(one metadata round trip to the broker) minus the offset the projector has committed
for it. A projector that stopped writing keeps a growing lag, which is the alert.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.config import Settings
from services.eventlog.client import consumer_config

log = logging.getLogger(__name__)

BATCH_EVENTS = (1, 10, 100, 250, 500, 1000, 2000, 4000, 8000, 16000)


class LagCollector(Collector):
    """`loraplane_audit_lag_records{topic,partition}`: records on the log not yet stored."""

    def __init__(self, settings: Settings, committed: Callable[[], dict[tuple[str, int], int]]
                 ) -> None:
        self.settings = settings
        self.committed = committed

    def _watermarks(self) -> dict[tuple[str, int], tuple[int, int]]:
        """One short-lived client per scrape: nothing lingers when the projector stops."""
        consumer = Consumer(consumer_config(self.settings, "loraplane-audit-lag"))
        try:
            metadata = consumer.list_topics(timeout=5)
            marks = {}
            for topic in self.settings.topics:
                info = metadata.topics.get(topic)
                for partition in sorted(info.partitions if info is not None else ()):
                    marks[(topic, partition)] = consumer.get_watermark_offsets(
                        TopicPartition(topic, partition), timeout=5, cached=False)
            return marks
        finally:
            consumer.close()

    def collect(self) -> Iterator[Any]:
        family = GaugeMetricFamily("loraplane_audit_lag_records",
                                   "Records on the log not yet stored in the audit store",
                                   labels=["topic", "partition"])
        try:
            marks = self._watermarks()
        except KafkaException as exc:
            log.warning("lag unavailable: %s", exc)
            marks = {}
        committed = self.committed()
        for (topic, partition), (low, high) in sorted(marks.items()):
            done = max(committed.get((topic, partition), 0), low)
            family.add_metric([topic, str(partition)], max(0, high - done))
        yield family


class ProjectorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.events = Counter("loraplane_audit_events", "Events stored", ["topic"], registry=r)
        self.batch_events = Histogram("loraplane_audit_batch_events",
                                      "Events per committed batch", buckets=BATCH_EVENTS,
                                      registry=r)
        self.batch_seconds = Histogram("loraplane_audit_batch_seconds",
                                       "Time to write and commit one batch", registry=r)
        self.checkpoints = Counter("loraplane_audit_checkpoints",
                                   "Signed checkpoints written", ["topic"], registry=r)
        self.dead_letters = Counter("loraplane_audit_dead_letters",
                                    "Records rejected into dead_letters", ["topic"], registry=r)
        self.failures = Counter("loraplane_audit_batch_failures",
                                "Batches that failed (retried from the stored offsets)",
                                registry=r)
        self.keys_destroyed = Counter("loraplane_audit_keys_destroyed",
                                      "Tenant data keys destroyed by purges", registry=r)
        self.last_commit = Gauge("loraplane_audit_last_commit_timestamp_seconds",
                                 "When the last batch committed", registry=r)
        self.lag: LagCollector | None = None

    def watch_lag(self, settings: Settings,
                  committed: Callable[[], dict[tuple[str, int], int]]) -> None:
        if self.lag is None:
            self.lag = LagCollector(settings, committed)
            self.registry.register(self.lag)

