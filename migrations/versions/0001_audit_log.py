"""Audit store, first cut: every event with its per-partition hash chain, the
projector's consumer offsets and the dead letters.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("event_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("schema_version", sa.Integer, nullable=False),
        sa.Column("stream", sa.Text, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("tenant_org", sa.Text),
        sa.Column("tenant_team", sa.Text),
        sa.Column("tenant_project", sa.Text),
        sa.Column("trace_id", sa.Text),
        sa.Column("payload", postgresql.JSONB, nullable=False),
        sa.Column("canonical", sa.LargeBinary, nullable=False),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.Column("prev_hash", sa.LargeBinary(32), nullable=False),
        sa.Column("hash", sa.LargeBinary(32), nullable=False),
        sa.UniqueConstraint("event_id", name="uq_events_event_id"),
        sa.UniqueConstraint("topic", "partition", "offset", name="uq_events_position"),
    )
    op.create_index("ix_events_stream_seq", "events", ["stream", "seq"])
    op.create_index("ix_events_type", "events", ["type"])
    op.create_index("ix_events_tenant", "events", ["tenant_org", "tenant_team", "tenant_project"])

    op.create_table(
        "consumer_offsets",
        sa.Column("consumer", sa.Text, primary_key=True),
        sa.Column("topic", sa.Text, primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True),
        sa.Column("next_offset", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
    )

    op.create_table(
        "dead_letters",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("consumer", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("key", sa.LargeBinary),
        sa.Column("value", sa.LargeBinary),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.UniqueConstraint("consumer", "topic", "partition", "offset",
                            name="uq_dead_letters_position"),
    )


def downgrade() -> None:
    op.drop_table("dead_letters")
    op.drop_table("consumer_offsets")
    op.drop_index("ix_events_tenant", table_name="events")
    op.drop_index("ix_events_type", table_name="events")
    op.drop_index("ix_events_stream_seq", table_name="events")
    op.drop_table("events")
