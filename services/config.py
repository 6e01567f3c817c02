"""One settings class for every loraplane process.

Every process (registry, worker, router, audit projector, the embedded stack) reads the
same class so an environment variable means the same thing everywhere; docker-compose
configures services only through these `LORAPLANE_*` variables, and a test checks that
each variable it names is a field here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

BrokerKind = Literal["auto", "apache", "tansu"]


class Settings(BaseSettings):
    """Process configuration, from `LORAPLANE_*` environment variables or keyword args."""

    model_config = SettingsConfigDict(env_prefix="LORAPLANE_", extra="ignore", frozen=True)

    # --- where things live -------------------------------------------------------------
    state_dir: Path = Field(
        Path(".loraplane"), description="Runtime state of `loraplane up`: data, logs, lock."
    )
    cache_dir: Path = Field(
        Path(".loraplane/cache"),
        description="Downloads kept across runs (the Apache Kafka jars). Safe to share.",
    )

    # --- Kafka ---------------------------------------------------------------------------
    kafka_bootstrap: str | None = Field(
        None, description="An existing broker; when unset, `loraplane up` starts one."
    )
    kafka_broker: BrokerKind = Field(
        "auto", description="Embedded broker: apache (KRaft jars), tansu, or auto (apache if Java)."
    )
    kafka_version: str = Field("4.1.1", description="Apache Kafka version fetched for KRaft.")
    kafka_heap: str = Field("512m", description="JVM heap of the embedded Apache Kafka broker.")
    adapter_events_topic: str = "loraplane.adapter-events"
    worker_events_topic: str = "loraplane.worker-events"
    dead_letter_topic: str = "loraplane.dead-letter"
    topic_partitions: int = Field(8, ge=1, le=1024)
    topic_replication: int = Field(1, ge=1)
    adapter_events_retention_ms: int = Field(
        -1, description="The adapter log is the system of record: kept forever by default."
    )
    worker_events_retention_ms: int = Field(
        30 * 24 * 3600 * 1000, description="Worker events are projected into Postgres."
    )
    dead_letter_retention_ms: int = 30 * 24 * 3600 * 1000

    # --- PostgreSQL ----------------------------------------------------------------------
    database_url: str | None = Field(
        None, description="SQLAlchemy URL; when unset, `loraplane up` starts embedded PostgreSQL."
    )

    # --- registry ------------------------------------------------------------------------
    registry_host: str = "127.0.0.1"
    registry_port: int = 8780
    registry_url: str | None = Field(
        None, description="How other processes reach the registry (default from host/port)."
    )
    registry_transactional_id: str = Field(
        "loraplane-registry", description="Fixed so a second registry instance fences the first."
    )
    lease_interval_s: float = Field(2.0, gt=0)
    lease_ttl_s: float = Field(5.0, gt=0)
    registry_write_timeout_s: float = Field(
        10.0, gt=0, description="How long a registry write waits on the broker before 503.")
    blob_dir: Path | None = Field(
        None, description="Content-addressed blob store (sha256/ab/abcd…); default STATE_DIR/blobs."
    )
    max_upload_bytes: int = Field(512 * 1024 * 1024, ge=1)
    max_lora_rank: int = Field(128, ge=1)
    allowed_dtypes: list[str] = Field(default_factory=lambda: ["float16", "bfloat16", "float32"])
    auth_tokens: str | None = Field(
        None,
        description='JSON list of {"sha256": hex of the token, "role": admin|publisher|reader|'
        'worker, "tenant": "org/team/project" for publishers}. Tokens are stored hashed.',
    )

    # --- worker / router / audit --------------------------------------------------------
    worker_id: str | None = None
    worker_host: str = "127.0.0.1"
    worker_port: int = 8781
    stale_lease_threshold_s: float = Field(30.0, gt=0)
    router_host: str = "127.0.0.1"
    router_port: int = 8782
    audit_metrics_port: int = 8783
    audit_batch_size: int = Field(
        4000, ge=1, description="Most events per projector transaction; 4000 measured best "
        "(bench/audit.py: 5,000+ events/s on 2 cores; 2000 and 8000 were slower)."
    )
    audit_signing_key: str | None = Field(
        None, description="Ed25519 private key (32-byte seed, hex) that signs Merkle checkpoints."
    )
    audit_checkpoint_every: int = Field(
        1000, ge=1, description="Events per partition between signed Merkle checkpoints."
    )

    log_level: str = "INFO"

    @property
    def registry_base_url(self) -> str:
        return self.registry_url or f"http://{self.registry_host}:{self.registry_port}"

    @property
    def blob_root(self) -> Path:
        return self.blob_dir or self.state_dir / "blobs"

    @property
    def topics(self) -> tuple[str, str]:
        """The two event topics every reader folds, in a fixed order."""
        return (self.adapter_events_topic, self.worker_events_topic)
