"""librdkafka settings shared by every loraplane Kafka client.

The control plane is latency bound (a registry answers only after reading its own event
back), hence `linger.ms=0` and a short `fetch.wait.max.ms`; see KAFKA_NOTES.
"""

from __future__ import annotations

from typing import Any

from services.config import Settings


def bootstrap_of(settings: Settings) -> str:
    if not settings.kafka_bootstrap:
        raise ValueError("LORAPLANE_KAFKA_BOOTSTRAP is not set and no embedded broker is running")
    return settings.kafka_bootstrap


def base_config(settings: Settings, client_id: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap_of(settings),
        "client.id": client_id,
        "socket.connection.setup.timeout.ms": 5000,
        "reconnect.backoff.max.ms": 2000,
        "log_level": 3,
    }


def producer_config(settings: Settings, client_id: str, **extra: Any) -> dict[str, Any]:
    return {
        **base_config(settings, client_id),
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 0,
        "compression.type": "lz4",
        "message.timeout.ms": 10000,
        **extra,
    }


def consumer_config(settings: Settings, client_id: str, **extra: Any) -> dict[str, Any]:
    return {
        **base_config(settings, client_id),
        "group.id": f"{client_id}.unused",  # librdkafka requires one even for assign()
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "isolation.level": "read_committed",
        "enable.partition.eof": True,
        "auto.offset.reset": "earliest",
        "fetch.wait.max.ms": 10,
        **extra,
    }
