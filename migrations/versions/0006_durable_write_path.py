"""A cheaper write path for a durable store: events without the derived `payload`
column, request traces keyed by their event.

With fsync and full-page writes on (the default since this revision's change to the
embedded server), every byte written is paid twice (heap and WAL), so the store keeps
each event once:
- `events.payload` was the event's payload a second time (jsonb parsed from the
  canonical bytes, through a staging table). Nothing reads it on the write path and no
  view uses it; the `events_json` view derives it at read time for ad hoc queries
  (`SELECT payload FROM events_json WHERE …`). The projector now COPYs straight into
  `events`.
- `request_traces` had a surrogate `id` plus a unique (event_id, ordinal); the pair is
  now the primary key (one index and one sequence fewer per traced request).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from services.audit.db import revision_module

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

EVENTS_JSON = """
CREATE VIEW events_json AS
SELECT e.*, convert_from(e.canonical, 'UTF8')::jsonb AS document,
       convert_from(e.canonical, 'UTF8')::jsonb -> 'payload' AS payload
FROM events e
"""


def _release_decisions(source: str) -> str:
    """Revision 0005's release_decisions, reading events from `source`."""
    sql: str = revision_module("0005").RELEASE_DECISIONS
    assert "    FROM events e\n" in sql
    return sql.replace("    FROM events e\n", f"    FROM {source} e\n", 1)


def _comment_release_decisions() -> None:
    comment = revision_module("0005").COMMENT.replace("'", "''")
    op.execute(f"COMMENT ON VIEW release_decisions IS '{comment}'")


def upgrade() -> None:
    op.execute("DROP VIEW release_decisions")
    op.drop_column("events", "payload")
    op.execute(EVENTS_JSON)
    op.execute(_release_decisions("events_json"))
    _comment_release_decisions()
    op.execute("COMMENT ON VIEW events_json IS 'Every stored event with its stored bytes "
               "parsed: document (the whole event) and payload. Personal fields appear as "
               "sealed tokens, as they are stored.'")
    op.drop_constraint("uq_request_traces_event_ordinal", "request_traces", type_="unique")
    op.drop_constraint("request_traces_pkey", "request_traces", type_="primary")
    op.drop_column("request_traces", "id")
    op.create_primary_key("request_traces_pkey", "request_traces", ["event_id", "ordinal"])


def downgrade() -> None:
    op.drop_constraint("request_traces_pkey", "request_traces", type_="primary")
    op.add_column("request_traces", sa.Column("id", sa.BigInteger, sa.Identity()))
    op.create_primary_key("request_traces_pkey", "request_traces", ["id"])
    op.create_unique_constraint("uq_request_traces_event_ordinal", "request_traces",
                                ["event_id", "ordinal"])
    op.execute("DROP VIEW release_decisions")
    op.execute("DROP VIEW events_json")
    op.add_column("events", sa.Column("payload", postgresql.JSONB, nullable=True))
    op.execute("UPDATE events SET payload = convert_from(canonical, 'UTF8')::jsonb -> 'payload'")
    op.alter_column("events", "payload", nullable=False)
    op.execute(_release_decisions("events"))
    _comment_release_decisions()
