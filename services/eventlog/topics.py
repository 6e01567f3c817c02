"""Explicit topic creation (no broker auto-create: partitions and retention are decisions).

What each topic holds and for how long (docs/event-log.md repeats this):

- adapter events: the registry's commands, one event each. Kept forever (system of record).
- worker events: loads, unloads, KV invalidations, purge acks, request traces. 30 days
  (the audit store keeps them).
- liveness: registry leases and worker heartbeats. The newest per stream, at most an hour.
- dead letters: records that failed validation, with the reason. 30 days.

The liveness topic is compacted by stream (`registry/lease`, `heartbeat/{worker}`) and
deleted after `liveness_retention_ms`: a reader needs only the newest lease and each
worker's newest heartbeat, and a lease every two seconds must not grow the record that
auditors read. Segments roll often enough for compaction and deletion to happen.
"""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from services.config import Settings
from services.contracts.events import ADAPTER_TOPIC, LIVENESS_TOPIC, WORKER_TOPIC, Envelope
from services.eventlog.client import base_config
from services.eventlog.errors import BrokerUnavailable


def topic_specs(settings: Settings) -> dict[str, dict[str, str]]:
    """Topic name → configs, for the adapter log, the worker log, liveness and dead letters."""
    liveness_ms = settings.liveness_retention_ms
    return {
        settings.adapter_events_topic: {"retention.ms": str(settings.adapter_events_retention_ms)},
        settings.worker_events_topic: {"retention.ms": str(settings.worker_events_retention_ms)},
        settings.liveness_topic: {
            "cleanup.policy": "compact,delete",
            "retention.ms": str(liveness_ms),
            "segment.ms": str(max(60_000, liveness_ms // 6)),
            "min.cleanable.dirty.ratio": "0.1",
            "max.compaction.lag.ms": str(max(60_000, liveness_ms // 6)),
        },
        settings.dead_letter_topic: {"retention.ms": str(settings.dead_letter_retention_ms)},
    }


def ensure_topics(settings: Settings, timeout_s: float = 30.0) -> list[str]:
    """Create the topics that do not exist yet; returns the names created."""
    admin = AdminClient(base_config(settings, "loraplane-admin"))
    try:
        existing = set(admin.list_topics(timeout=timeout_s).topics)
    except KafkaException as exc:
        raise BrokerUnavailable(f"cannot list topics: {exc}") from exc
    wanted = [
        NewTopic(name, num_partitions=settings.topic_partitions,
                 replication_factor=settings.topic_replication, config=config)
        for name, config in topic_specs(settings).items()
        if name not in existing
    ]
    created = []
    for name, future in (admin.create_topics(wanted, request_timeout=timeout_s).items()
                         if wanted else []):
        try:
            future.result(timeout=timeout_s)
            created.append(name)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    return created


def topic_for(envelope: Envelope, settings: Settings) -> str:
    """The topic an event belongs on; old barriers have none (their writer named it)."""
    topic = type(envelope.payload).topic
    if topic == ADAPTER_TOPIC:
        return settings.adapter_events_topic
    if topic == WORKER_TOPIC:
        return settings.worker_events_topic
    if topic == LIVENESS_TOPIC:
        return settings.liveness_topic
    raise ValueError(f"{envelope.type} has no fixed topic; pass one explicitly")
