"""Evidence a third party can check, one purge rule, and a purge that erases.

- `events.leaf_hash`: each event's RFC 6962 leaf hash, so inclusion and consistency
  proofs read 32 bytes per event instead of every stored event's bytes.
- `checkpoints`: each checkpoint is now a C2SP signed note (`note`), whose origin line
  names the partition's log and whose signature line names the key (`key_name`,
  `key_hash`). Rows written before this revision keep `note` NULL and are checked with
  their original signed message.
- `purges`: the workers the request event names (`expected_workers`), and what the
  registry erased from the blob store for it (`TenantBlobsDeleted`).
- `tenant_keys`: per-tenant data keys (wrapped by the KEK, which is never stored here),
  and when and by which purge each was destroyed.
- `purge_proofs` implements the one purge rule of `services/catalog/purge.py` (see its
  COMMENT) and shows the destroyed keys and erased blobs; the liveness window function
  of revision 0003 is gone with the old rule.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from services.audit.db import revision_module

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

PURGE_PROOFS = """
CREATE VIEW purge_proofs AS
SELECT p.purge_id, p.tenant_org, p.tenant_team, p.tenant_project,
       p.requested_at, p.requested_by, p.deadline_at, p.event_id AS request_event_id,
       p.expected_workers AS workers_expected,
       acked.workers AS workers_acked,
       acked.counted AS workers_done,
       missing.workers AS workers_missing,
       acked.kv_blocks_freed, acked.adapters_unloaded, acked.refcounts_zero,
       acked.last_ack_at,
       keys.key_ids AS keys_destroyed, keys.destroyed_at AS keys_destroyed_at,
       p.blobs_deleted, p.blobs_kept, p.blobs_event_id,
       CASE WHEN cardinality(missing.workers) = 0 THEN 'met'
            WHEN now() > p.deadline_at THEN 'missed'
            ELSE 'pending' END AS status
FROM purges p
CROSS JOIN LATERAL (
    SELECT coalesce(array_agg(DISTINCT a.worker_id ORDER BY a.worker_id), '{}') AS workers,
           coalesce(array_agg(DISTINCT a.worker_id ORDER BY a.worker_id) FILTER (
               WHERE a.worker_id = ANY(p.expected_workers)
                 AND a.refcounts_zero
                 AND a.at <= p.deadline_at), '{}') AS counted,
           coalesce(sum(a.kv_blocks_freed), 0) AS kv_blocks_freed,
           coalesce(sum(a.adapters_unloaded), 0) AS adapters_unloaded,
           bool_and(a.refcounts_zero) AS refcounts_zero,
           max(a.at) AS last_ack_at
    FROM worker_acks a
    WHERE a.type = 'TenantPurged' AND a.purge_id = p.purge_id
) acked
CROSS JOIN LATERAL (
    SELECT ARRAY(SELECT w FROM unnest(p.expected_workers) AS w
                 WHERE NOT w = ANY(acked.counted) ORDER BY w) AS workers
) missing
CROSS JOIN LATERAL (
    SELECT coalesce(array_agg(k.key_id ORDER BY k.destroyed_at), '{}') AS key_ids,
           max(k.destroyed_at) AS destroyed_at
    FROM tenant_keys k
    WHERE k.destroyed_by_purge = p.purge_id
) keys
"""

PURGE_PROOFS_COMMENT = (
    "One row per tenant purge, by the rule of services/catalog/purge.py (the registry's "
    "GET /v1/purges/{id} uses the same rule; an agreement test pins both). "
    "workers_expected: the workers the TenantPurgeRequested event lists (live when the "
    "registry decided it). An ack counts when it is a TenantPurged for this purge from an "
    "expected worker, with refcounts_zero, and occurred_at <= deadline_at; any counting ack "
    "counts, not only a worker's first. workers_done: expected workers with a counting ack. "
    "status: met when no expected worker is missing (none expected: met), missed when now() "
    "is past deadline_at with one missing, else pending. keys_destroyed: the tenant's data "
    "keys this purge destroyed (crypto-shredding of its sealed personal fields) and when. "
    "blobs_deleted / blobs_kept: what the registry erased from the blob store "
    "(TenantBlobsDeleted, blobs_event_id).")

def upgrade() -> None:
    op.add_column("events", sa.Column("leaf_hash", sa.LargeBinary(32), nullable=True))
    op.execute("UPDATE events SET leaf_hash = sha256('\\x00'::bytea || canonical)")
    op.alter_column("events", "leaf_hash", nullable=False)

    for column in (sa.Column("origin", sa.Text), sa.Column("note", sa.Text),
                   sa.Column("key_name", sa.Text), sa.Column("key_hash", sa.LargeBinary(4))):
        op.add_column("checkpoints", column)

    op.add_column("purges", sa.Column("expected_workers", postgresql.ARRAY(sa.Text),
                                      nullable=False, server_default="{}"))
    op.execute("""
        UPDATE purges p SET expected_workers = ARRAY(
            SELECT jsonb_array_elements_text(
                convert_from(e.canonical, 'UTF8')::jsonb -> 'payload' -> 'expected_workers'))
        FROM events e
        WHERE e.event_id = p.event_id
          AND jsonb_typeof(convert_from(e.canonical, 'UTF8')::jsonb
                           -> 'payload' -> 'expected_workers') = 'array'
    """)
    op.add_column("purges", sa.Column("blobs_deleted", postgresql.ARRAY(sa.Text)))
    op.add_column("purges", sa.Column("blobs_kept", postgresql.ARRAY(sa.Text)))
    op.add_column("purges", sa.Column("blobs_event_id", postgresql.UUID(as_uuid=True)))

    op.create_table(
        "tenant_keys",
        sa.Column("key_id", sa.Text, primary_key=True),
        sa.Column("tenant_org", sa.Text, nullable=False),
        sa.Column("tenant_team", sa.Text, nullable=False),
        sa.Column("tenant_project", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.Column("kek_id", sa.Text, nullable=False),
        sa.Column("wrapped_key", sa.LargeBinary),
        sa.Column("destroyed_at", sa.DateTime(timezone=True)),
        sa.Column("destroyed_by_purge", sa.Text),
        sa.CheckConstraint("(wrapped_key IS NULL) = (destroyed_at IS NOT NULL)",
                           name="ck_tenant_keys_destroyed"),
    )
    op.create_index("ix_tenant_keys_live", "tenant_keys",
                    ["tenant_org", "tenant_team", "tenant_project"], unique=True,
                    postgresql_where=sa.text("destroyed_at IS NULL"))
    op.create_index("ix_tenant_keys_purge", "tenant_keys", ["destroyed_by_purge"])

    op.execute("DROP VIEW purge_proofs")
    op.execute("DROP FUNCTION audit_liveness_window()")
    op.execute(PURGE_PROOFS)
    quoted = PURGE_PROOFS_COMMENT.replace("'", "''")
    op.execute(f"COMMENT ON VIEW purge_proofs IS '{quoted}'")


def downgrade() -> None:
    old = revision_module("0003")
    op.execute("DROP VIEW purge_proofs")
    op.execute(old.LIVENESS_WINDOW)
    op.execute(old.PURGE_PROOFS)
    quoted = old.COMMENTS["purge_proofs"].replace("'", "''")
    op.execute(f"COMMENT ON VIEW purge_proofs IS '{quoted}'")
    op.drop_table("tenant_keys")
    for column in ("blobs_event_id", "blobs_kept", "blobs_deleted", "expected_workers"):
        op.drop_column("purges", column)
    for column in ("key_hash", "key_name", "note", "origin"):
        op.drop_column("checkpoints", column)
    op.drop_column("events", "leaf_hash")
