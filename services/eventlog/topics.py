"""Explicit topic creation (no broker auto-create: partitions and retention are decisions)."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from services.config import Settings
from services.contracts.events import ADAPTER_TOPIC, WORKER_TOPIC, Envelope
from services.eventlog.client import base_config
from services.eventlog.errors import BrokerUnavailable


def topic_specs(settings: Settings) -> dict[str, dict[str, str]]:
    """Topic name → configs, for the adapter log, the worker log and the dead letters."""
    return {
        settings.adapter_events_topic: {"retention.ms": str(settings.adapter_events_retention_ms)},
        settings.worker_events_topic: {"retention.ms": str(settings.worker_events_retention_ms)},
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
    """The topic an event belongs on; barriers have none (the writer names the topic)."""
    topic = type(envelope.payload).topic
    if topic == ADAPTER_TOPIC:
        return settings.adapter_events_topic
    if topic == WORKER_TOPIC:
        return settings.worker_events_topic
    raise ValueError(f"{envelope.type} has no fixed topic; pass one explicitly")
