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


def security_config(settings: Settings) -> dict[str, Any]:
    """The broker's TLS and SASL settings (LORAPLANE_KAFKA_SECURITY_PROTOCOL, _SSL_*,
    _SASL_*), as librdkafka names them; nothing for PLAINTEXT. A setting that the protocol
    would not use is refused by name rather than ignored."""
    protocol = settings.kafka_security_protocol
    config: dict[str, Any] = {}
    if protocol != "PLAINTEXT":
        config["security.protocol"] = protocol
    tls = {"ssl.ca.location": settings.kafka_ssl_ca_file,
           "ssl.certificate.location": settings.kafka_ssl_cert_file,
           "ssl.key.location": settings.kafka_ssl_key_file}
    sasl = {"sasl.mechanism": settings.kafka_sasl_mechanism,
            "sasl.username": settings.kafka_sasl_username,
            "sasl.password": settings.kafka_sasl_password}
    for group, uses, values, protocols in (("SSL", "SSL" in protocol, tls, "SSL or SASL_SSL"),
                                           ("SASL", "SASL" in protocol, sasl,
                                            "SASL_PLAINTEXT or SASL_SSL")):
        given = {k: v for k, v in values.items() if v is not None}
        if given and not uses:
            raise ValueError(f"LORAPLANE_KAFKA_SECURITY_PROTOCOL={protocol} does not use the "
                             f"{group} settings given ({', '.join(sorted(given))}): use "
                             f"{protocols}")
        config.update({k: str(v) for k, v in given.items()})
    if "SASL" in protocol and settings.kafka_sasl_mechanism is None:
        raise ValueError(f"LORAPLANE_KAFKA_SECURITY_PROTOCOL={protocol} needs "
                         "LORAPLANE_KAFKA_SASL_MECHANISM (and a username and password)")
    return config


def base_config(settings: Settings, client_id: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap_of(settings),
        "client.id": client_id,
        "socket.connection.setup.timeout.ms": 5000,
        "reconnect.backoff.max.ms": 2000,
        "log_level": 3,
        **security_config(settings),
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
