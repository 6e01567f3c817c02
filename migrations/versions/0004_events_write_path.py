"""Cheaper event inserts: drop the `events` indexes nothing reads, store the event bytes
uncompressed.

Every event pays for each index on `events` at insert time, and inserting is what the
projector spends most of its PostgreSQL time on. No view (revision 0003) and no query
of the audit service reads `events` by (stream, seq), by type or by tenant: lookups go
by event_id, by chain position (topic, partition, chain_index) and by id, all of which
keep their unique indexes, as does (topic, partition, offset). An ad hoc query by tenant
or type still works, as a scan.

`canonical` and `payload` are the same event twice (bytes and jsonb), together about
4 KB a row: over the TOAST threshold, so PostgreSQL compressed both with pglz on every
insert, the most expensive step after the jsonb parse. EXTERNAL keeps them out of line
but uncompressed: more disk (JSON compresses ~3x) for a cheaper write path; reads of
single events are unaffected.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

UNREAD_INDEXES = {
    "ix_events_stream_seq": ["stream", "seq"],
    "ix_events_type": ["type"],
    "ix_events_tenant": ["tenant_org", "tenant_team", "tenant_project"],
}


def upgrade() -> None:
    for name in UNREAD_INDEXES:
        op.drop_index(name, table_name="events")
    op.execute("ALTER TABLE events ALTER COLUMN canonical SET STORAGE EXTERNAL, "
               "ALTER COLUMN payload SET STORAGE EXTERNAL")


def downgrade() -> None:
    op.execute("ALTER TABLE events ALTER COLUMN canonical SET STORAGE EXTENDED, "
               "ALTER COLUMN payload SET STORAGE EXTENDED")
    for name, columns in UNREAD_INDEXES.items():
        op.create_index(name, "events", columns)
