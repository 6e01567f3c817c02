"""SQLAlchemy Core tables of the audit store. Alembic revisions own the schema; these
mirror them for queries and inserts, and a test checks the two agree."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Identity,
    Integer,
    LargeBinary,
    MetaData,
    Table,
    Text,
    func,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

metadata = MetaData()

events = Table(
    # `canonical` is stored uncompressed (0004) and inline up to ~8 KB (0008:
    # toast_tuple_target 8160), so a request trace is one heap tuple, not two
    "events",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("topic", Text, nullable=False),
    Column("partition", Integer, nullable=False),
    Column("offset", BigInteger, nullable=False),
    Column("event_id", UUID(as_uuid=True), nullable=False, unique=True),
    Column("type", Text, nullable=False),
    Column("schema_version", Integer, nullable=False),
    Column("stream", Text, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("actor", Text, nullable=False),
    Column("tenant_org", Text),
    Column("tenant_team", Text),
    Column("tenant_project", Text),
    Column("trace_id", Text),
    Column("canonical", LargeBinary, nullable=False),
    Column("occurred_at", DateTime(timezone=True), nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("prev_hash", LargeBinary(32), nullable=False),
    Column("hash", LargeBinary(32), nullable=False),
    Column("chain_index", BigInteger, nullable=False),  # revision 0002
    Column("leaf_hash", LargeBinary(32), nullable=False),  # revision 0007
)

consumer_offsets = Table(
    "consumer_offsets",
    metadata,
    Column("consumer", Text, primary_key=True),
    Column("topic", Text, primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("next_offset", BigInteger, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

dead_letters = Table(
    "dead_letters",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("consumer", Text, nullable=False),
    Column("topic", Text, nullable=False),
    Column("partition", Integer, nullable=False),
    Column("offset", BigInteger, nullable=False),
    Column("key", LargeBinary),
    Column("value", LargeBinary),
    Column("reason", Text, nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# --- revision 0002: chain bookkeeping, checkpoints, current state, history ---------------

chain_heads = Table(
    "chain_heads",
    metadata,
    Column("topic", Text, primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("size", BigInteger, nullable=False),
    Column("head_hash", LargeBinary(32), nullable=False),
    Column("frontier", LargeBinary, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("topic", Text, nullable=False),
    Column("partition", Integer, nullable=False),
    Column("tree_size", BigInteger, nullable=False),
    Column("root", LargeBinary(32), nullable=False),
    Column("chain_head", LargeBinary(32), nullable=False),
    Column("public_key", LargeBinary(32), nullable=False),
    Column("signature", LargeBinary(64), nullable=False),
    Column("signed_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # revision 0007: the checkpoint as a C2SP signed note (NULL on older rows)
    Column("origin", Text),
    Column("note", Text),
    Column("key_name", Text),
    Column("key_hash", LargeBinary(4)),
)

adapters = Table(
    "adapters",
    metadata,
    Column("adapter_id", Text, primary_key=True),
    Column("tenant_org", Text),
    Column("tenant_team", Text),
    Column("tenant_project", Text),
    Column("latest_version", Integer),
    Column("active_version", Integer),
    Column("previous_active_version", Integer),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("last_event_id", UUID(as_uuid=True), nullable=False),
)

adapter_versions = Table(
    "adapter_versions",
    metadata,
    Column("adapter_id", Text, primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("label", Text),
    Column("base_model", Text),
    Column("base_model_digest", Text),
    Column("sha256", Text),
    Column("config_sha256", Text),
    Column("size_bytes", BigInteger),
    Column("rank", Integer),
    Column("qos_tier", Text),
    Column("owner", Text),
    Column("rollback_to", Integer),
    Column("tenant_org", Text),
    Column("tenant_team", Text),
    Column("tenant_project", Text),
    Column("published_at", DateTime(timezone=True)),
    Column("published_by", Text),
    Column("publish_event_id", UUID(as_uuid=True)),
    Column("status", Text, nullable=False),
    Column("is_active", Boolean, nullable=False),
    Column("disabled", Boolean, nullable=False),
    Column("first_activated_at", DateTime(timezone=True)),
    Column("last_activated_at", DateTime(timezone=True)),
    Column("deactivated_at", DateTime(timezone=True)),
    Column("disabled_at", DateTime(timezone=True)),
    Column("disabled_reason", Text),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)

version_history = Table(
    "version_history",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("event_id", UUID(as_uuid=True), nullable=False),
    Column("adapter_id", Text, nullable=False),
    Column("version", Integer, nullable=False),
    Column("action", Text, nullable=False),
    Column("at", DateTime(timezone=True), nullable=False),
    Column("actor", Text, nullable=False),
    Column("alias", Text),
    Column("weight", Integer),
    Column("reason", Text),
)

aliases = Table(
    "aliases",
    metadata,
    Column("alias", Text, primary_key=True),
    Column("split", JSONB, nullable=False),
    Column("changed_at", DateTime(timezone=True), nullable=False),
    Column("changed_by", Text, nullable=False),
    Column("event_id", UUID(as_uuid=True), nullable=False),
)

split_history = Table(
    "split_history",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("event_id", UUID(as_uuid=True), nullable=False),
    Column("alias", Text, nullable=False),
    Column("position", Integer, nullable=False),
    Column("adapter_id", Text, nullable=False),
    Column("version", Integer, nullable=False),
    Column("weight", Integer, nullable=False),
    Column("changed_at", DateTime(timezone=True), nullable=False),
    Column("actor", Text, nullable=False),
)

workers = Table(
    "workers",
    metadata,
    Column("worker_id", Text, primary_key=True),
    Column("address", Text),
    Column("base_model", Text),
    Column("base_model_digest", Text),
    Column("first_seen_at", DateTime(timezone=True), nullable=False),
    Column("last_heartbeat_at", DateTime(timezone=True)),
    Column("last_event_at", DateTime(timezone=True), nullable=False),
    Column("free_slots", Integer),
    Column("free_kv_blocks", Integer),
    Column("lease_epoch", BigInteger),
    Column("base_weights", Text, nullable=False, server_default="dense"),  # revision 0012
)

worker_adapters = Table(
    "worker_adapters",
    metadata,
    Column("worker_id", Text, primary_key=True),
    Column("adapter_id", Text, primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("sha256", Text),
    Column("tier", Text),
    Column("since", DateTime(timezone=True), nullable=False),
    Column("source", Text, nullable=False),
)

worker_heartbeats = Table(
    "worker_heartbeats",
    metadata,
    Column("event_id", UUID(as_uuid=True), primary_key=True),
    Column("worker_id", Text, nullable=False),
    Column("at", DateTime(timezone=True), nullable=False),
)

worker_acks = Table(
    "worker_acks",
    metadata,
    Column("event_id", UUID(as_uuid=True), primary_key=True),
    Column("worker_id", Text, nullable=False),
    Column("type", Text, nullable=False),
    Column("at", DateTime(timezone=True), nullable=False),
    Column("adapter_id", Text),
    Column("version", Integer),
    Column("adapter_sha256", Text),
    Column("purge_id", Text),
    Column("tenant_key", Text),
    Column("reason", Text),
    Column("error", Text),
    Column("load_ms", Float),
    Column("kv_blocks_freed", BigInteger),
    Column("adapters_unloaded", Integer),
    Column("sequences_aborted", Integer),
    Column("refcounts_zero", Boolean),
)

purges = Table(
    "purges",
    metadata,
    Column("purge_id", Text, primary_key=True),
    Column("tenant_org", Text),
    Column("tenant_team", Text),
    Column("tenant_project", Text),
    Column("requested_at", DateTime(timezone=True), nullable=False),
    Column("requested_by", Text, nullable=False),
    Column("deadline_s", Float, nullable=False),
    Column("deadline_at", DateTime(timezone=True), nullable=False),
    Column("hard", Boolean, nullable=False),
    Column("event_id", UUID(as_uuid=True), nullable=False),
    # revision 0007
    Column("expected_workers", ARRAY(Text), nullable=False, server_default="{}"),
    Column("blobs_deleted", ARRAY(Text)),
    Column("blobs_kept", ARRAY(Text)),
    Column("blobs_event_id", UUID(as_uuid=True)),
)

request_traces = Table(
    "request_traces",
    metadata,
    Column("event_id", UUID(as_uuid=True), primary_key=True),  # revision 0006
    Column("ordinal", Integer, primary_key=True),
    Column("request_id", Text, nullable=False),
    Column("trace_id", Text),
    Column("worker_id", Text, nullable=False),
    Column("tenant_org", Text, nullable=False),
    Column("tenant_team", Text, nullable=False),
    Column("tenant_project", Text, nullable=False),
    Column("user_id", Text),
    Column("adapter_id", Text),
    Column("version", Integer),
    Column("adapter_sha256", Text),
    Column("base_model_digest", Text),
    Column("prompt_tokens", Integer),
    Column("completion_tokens", Integer),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("finished_at", DateTime(timezone=True), nullable=False),
    Column("status", Text, nullable=False),
    Column("witness", Text, nullable=False, server_default="worker"),  # revision 0011
    Column("base_weights", Text, nullable=False, server_default="dense"),  # revision 0012
)

tenant_keys = Table(  # revision 0007
    "tenant_keys",
    metadata,
    Column("key_id", Text, primary_key=True),
    Column("tenant_org", Text, nullable=False),
    Column("tenant_team", Text, nullable=False),
    Column("tenant_project", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("kek_id", Text, nullable=False),
    Column("wrapped_key", LargeBinary),
    Column("destroyed_at", DateTime(timezone=True)),
    Column("destroyed_by_purge", Text),
)

STATE_TABLES = (adapters, adapter_versions, version_history, aliases, split_history, workers,
                worker_adapters, worker_heartbeats, worker_acks, purges, request_traces)
"""Everything folded from events (not the log itself): what a rebuild truncates."""
