"""Audit store, second cut: chain bookkeeping, signed Merkle checkpoints, current state
(adapters, versions, aliases, workers and what they hold), worker acks, purges, request
traces and the history tables the compliance views read.

`events.chain_index` numbers each partition's chain from 0: it is the leaf index in that
partition's Merkle tree. Existing rows are numbered in insertion order (their chain
order). `chain_heads` holds each partition's head hash and the Merkle compact range, so
the projector resumes and checkpoints without rereading the log; a projector that finds
no head for a partition with rows rebuilds it from the rows.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TABLES = ("chain_heads", "checkpoints", "adapters", "adapter_versions", "version_history",
          "aliases", "split_history", "workers", "worker_adapters", "worker_heartbeats",
          "worker_acks", "purges", "request_traces")


def upgrade() -> None:
    op.add_column("events", sa.Column("chain_index", sa.BigInteger, nullable=True))
    op.execute("""
        UPDATE events e SET chain_index = n.i
        FROM (SELECT id, row_number() OVER (PARTITION BY topic, "partition" ORDER BY id) - 1 AS i
              FROM events) n
        WHERE e.id = n.id
    """)
    op.alter_column("events", "chain_index", nullable=False)
    op.create_unique_constraint("uq_events_chain", "events", ["topic", "partition", "chain_index"])

    op.create_table(
        "chain_heads",
        sa.Column("topic", sa.Text, primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("head_hash", sa.LargeBinary(32), nullable=False),
        sa.Column("frontier", sa.LargeBinary, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
    )
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("tree_size", sa.BigInteger, nullable=False),
        sa.Column("root", sa.LargeBinary(32), nullable=False),
        sa.Column("chain_head", sa.LargeBinary(32), nullable=False),
        sa.Column("public_key", sa.LargeBinary(32), nullable=False),
        sa.Column("signature", sa.LargeBinary(64), nullable=False),
        sa.Column("signed_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.UniqueConstraint("topic", "partition", "tree_size", name="uq_checkpoints_size"),
    )
    op.create_table(
        "adapters",
        sa.Column("adapter_id", sa.Text, primary_key=True),
        sa.Column("tenant_org", sa.Text),
        sa.Column("tenant_team", sa.Text),
        sa.Column("tenant_project", sa.Text),
        sa.Column("latest_version", sa.Integer),
        sa.Column("active_version", sa.Integer),
        sa.Column("previous_active_version", sa.Integer),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_event_id", postgresql.UUID(as_uuid=True), nullable=False),
    )
    op.create_table(
        "adapter_versions",
        sa.Column("adapter_id", sa.Text, primary_key=True),
        sa.Column("version", sa.Integer, primary_key=True),
        sa.Column("label", sa.Text),
        sa.Column("base_model", sa.Text),
        sa.Column("base_model_digest", sa.Text),
        sa.Column("sha256", sa.Text),
        sa.Column("config_sha256", sa.Text),
        sa.Column("size_bytes", sa.BigInteger),
        sa.Column("rank", sa.Integer),
        sa.Column("qos_tier", sa.Text),
        sa.Column("owner", sa.Text),
        sa.Column("rollback_to", sa.Integer),
        sa.Column("tenant_org", sa.Text),
        sa.Column("tenant_team", sa.Text),
        sa.Column("tenant_project", sa.Text),
        sa.Column("published_at", sa.DateTime(timezone=True)),
        sa.Column("published_by", sa.Text),
        sa.Column("publish_event_id", postgresql.UUID(as_uuid=True)),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("is_active", sa.Boolean, nullable=False),
        sa.Column("disabled", sa.Boolean, nullable=False),
        sa.Column("first_activated_at", sa.DateTime(timezone=True)),
        sa.Column("last_activated_at", sa.DateTime(timezone=True)),
        sa.Column("deactivated_at", sa.DateTime(timezone=True)),
        sa.Column("disabled_at", sa.DateTime(timezone=True)),
        sa.Column("disabled_reason", sa.Text),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "version_history",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("event_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("adapter_id", sa.Text, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("alias", sa.Text),
        sa.Column("weight", sa.Integer),
        sa.Column("reason", sa.Text),
    )
    op.create_table(
        "aliases",
        sa.Column("alias", sa.Text, primary_key=True),
        sa.Column("split", postgresql.JSONB, nullable=False),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("changed_by", sa.Text, nullable=False),
        sa.Column("event_id", postgresql.UUID(as_uuid=True), nullable=False),
    )
    op.create_table(
        "split_history",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("event_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("alias", sa.Text, nullable=False),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("adapter_id", sa.Text, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("weight", sa.Integer, nullable=False),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
    )
    op.create_table(
        "workers",
        sa.Column("worker_id", sa.Text, primary_key=True),
        sa.Column("address", sa.Text),
        sa.Column("base_model", sa.Text),
        sa.Column("base_model_digest", sa.Text),
        sa.Column("first_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True)),
        sa.Column("last_event_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("free_slots", sa.Integer),
        sa.Column("free_kv_blocks", sa.Integer),
        sa.Column("lease_epoch", sa.BigInteger),
    )
    op.create_table(
        "worker_adapters",
        sa.Column("worker_id", sa.Text, primary_key=True),
        sa.Column("adapter_id", sa.Text, primary_key=True),
        sa.Column("version", sa.Integer, primary_key=True),
        sa.Column("sha256", sa.Text),
        sa.Column("tier", sa.Text),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.Column("source", sa.Text, nullable=False),
    )
    op.create_table(
        "worker_heartbeats",
        sa.Column("event_id", postgresql.UUID(as_uuid=True), primary_key=True),
        sa.Column("worker_id", sa.Text, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "worker_acks",
        sa.Column("event_id", postgresql.UUID(as_uuid=True), primary_key=True),
        sa.Column("worker_id", sa.Text, nullable=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("adapter_id", sa.Text),
        sa.Column("version", sa.Integer),
        sa.Column("adapter_sha256", sa.Text),
        sa.Column("purge_id", sa.Text),
        sa.Column("tenant_key", sa.Text),
        sa.Column("reason", sa.Text),
        sa.Column("error", sa.Text),
        sa.Column("load_ms", sa.Float),
        sa.Column("kv_blocks_freed", sa.BigInteger),
        sa.Column("adapters_unloaded", sa.Integer),
        sa.Column("sequences_aborted", sa.Integer),
        sa.Column("refcounts_zero", sa.Boolean),
    )
    op.create_table(
        "purges",
        sa.Column("purge_id", sa.Text, primary_key=True),
        sa.Column("tenant_org", sa.Text),
        sa.Column("tenant_team", sa.Text),
        sa.Column("tenant_project", sa.Text),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("requested_by", sa.Text, nullable=False),
        sa.Column("deadline_s", sa.Float, nullable=False),
        sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("hard", sa.Boolean, nullable=False),
        sa.Column("event_id", postgresql.UUID(as_uuid=True), nullable=False),
    )
    op.create_table(
        "request_traces",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("event_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("ordinal", sa.Integer, nullable=False),
        sa.Column("request_id", sa.Text, nullable=False),
        sa.Column("trace_id", sa.Text),
        sa.Column("worker_id", sa.Text, nullable=False),
        sa.Column("tenant_org", sa.Text, nullable=False),
        sa.Column("tenant_team", sa.Text, nullable=False),
        sa.Column("tenant_project", sa.Text, nullable=False),
        sa.Column("user_id", sa.Text),
        sa.Column("adapter_id", sa.Text),
        sa.Column("version", sa.Integer),
        sa.Column("adapter_sha256", sa.Text),
        sa.Column("base_model_digest", sa.Text),
        sa.Column("prompt_tokens", sa.Integer),
        sa.Column("completion_tokens", sa.Integer),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.UniqueConstraint("event_id", "ordinal", name="uq_request_traces_event_ordinal"),
    )

    op.create_index("ix_version_history_version", "version_history", ["adapter_id", "version"])
    op.create_index("ix_split_history_alias", "split_history", ["alias", "changed_at"])
    op.create_index("ix_worker_heartbeats_at", "worker_heartbeats", ["at", "worker_id"])
    op.create_index("ix_worker_acks_purge", "worker_acks", ["purge_id"])
    op.create_index("ix_worker_acks_adapter", "worker_acks", ["adapter_id", "version"])
    op.create_index("ix_request_traces_request", "request_traces", ["request_id"])
    op.create_index("ix_request_traces_adapter", "request_traces", ["adapter_id", "version"])
    op.create_index("ix_request_traces_tenant", "request_traces",
                    ["tenant_org", "tenant_team", "tenant_project", "started_at"])


def downgrade() -> None:
    for name in reversed(TABLES):
        op.drop_table(name)
    op.drop_constraint("uq_events_chain", "events", type_="unique")
    op.drop_column("events", "chain_index")
