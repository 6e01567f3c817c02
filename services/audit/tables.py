"""SQLAlchemy Core tables of the audit store. Alembic revisions own the schema; these
mirror them for queries and inserts, and a test checks the two agree."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Identity,
    Integer,
    LargeBinary,
    MetaData,
    Table,
    Text,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

metadata = MetaData()

events = Table(
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
    Column("payload", JSONB, nullable=False),
    Column("canonical", LargeBinary, nullable=False),
    Column("occurred_at", DateTime(timezone=True), nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("prev_hash", LargeBinary(32), nullable=False),
    Column("hash", LargeBinary(32), nullable=False),
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
