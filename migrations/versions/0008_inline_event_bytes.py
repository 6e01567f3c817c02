"""Keep an event's stored bytes in its row: no TOAST insert per request trace.

Revision 0004 set `canonical` to EXTERNAL (never compressed, out of line once a row is
over the TOAST threshold, ~2 KB). A request trace of four requests is 2.5 to 3 KB once its
user ids are sealed, so most stored events had their bytes written as a second tuple
into the TOAST table, with a TOAST index entry and its own WAL records, on top of the
`events` row: a second heap insert and a fourth index insert per traced request batch,
for bytes every reader fetches whole anyway. With `toast_tuple_target` at its maximum
(8160, a heap page less its header), PostgreSQL toasts a row only when it would not fit
a page otherwise: events up to ~8 KB are stored inline, uncompressed (as before), larger
ones still go out of line. Nothing else changes: same columns, same indexes, same bytes.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

INLINE_UP_TO = 8160
"""`toast_tuple_target`'s largest value for 8 KB pages (BLCKSZ less the page header)."""


def upgrade() -> None:
    op.execute(f"ALTER TABLE events SET (toast_tuple_target = {INLINE_UP_TO})")


def downgrade() -> None:
    op.execute("ALTER TABLE events RESET (toast_tuple_target)")
