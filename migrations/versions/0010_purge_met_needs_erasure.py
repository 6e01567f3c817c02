"""A purge is met only once its blobs are erased: `purge_proofs` follows the purge rule.

The rule of `services/catalog/purge.py` now asks for the registry's `TenantBlobsDeleted`
as well as every expected worker's ack, both by the deadline. `purge_proofs` gains
`blobs_erased_at` (when that event occurred, read from `events` by `blobs_event_id`) and
says `met` only when the erasure is there in time; the rest of the view is revision
0007's.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from alembic import op

from services.audit.db import revision_module

revision = "0010"
down_revision = "0009"
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
       erased.at AS blobs_erased_at,
       CASE WHEN cardinality(missing.workers) = 0
                 AND erased.at IS NOT NULL AND erased.at <= p.deadline_at THEN 'met'
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
CROSS JOIN LATERAL (
    SELECT (SELECT e.occurred_at FROM events e WHERE e.event_id = p.blobs_event_id) AS at
) erased
"""

PURGE_PROOFS_COMMENT = (
    "One row per tenant purge, by the rule of services/catalog/purge.py (the registry's "
    "GET /v1/purges/{id} uses the same rule; an agreement test pins both). "
    "workers_expected: the workers the TenantPurgeRequested event lists (live when the "
    "registry decided it). An ack counts when it is a TenantPurged for this purge from an "
    "expected worker, with refcounts_zero, and occurred_at <= deadline_at; any counting ack "
    "counts, not only a worker's first. workers_done: expected workers with a counting ack. "
    "blobs_erased_at: when the registry's TenantBlobsDeleted for this purge occurred "
    "(blobs_event_id; null until it is recorded). status: met when no expected worker is "
    "missing (none expected: none to wait for) and blobs_erased_at <= deadline_at, missed "
    "when now() is past deadline_at short of that, else pending. keys_destroyed: the "
    "tenant's data keys this purge destroyed (crypto-shredding of its sealed personal "
    "fields) and when. blobs_deleted / blobs_kept: what the registry erased from the blob "
    "store, and what it kept because a version the purge did not end holds the same bytes.")


def _create(definition: str, comment: str) -> None:
    op.execute("DROP VIEW purge_proofs")
    op.execute(definition)
    quoted = comment.replace("'", "''")
    op.execute(f"COMMENT ON VIEW purge_proofs IS '{quoted}'")


def upgrade() -> None:
    _create(PURGE_PROOFS, PURGE_PROOFS_COMMENT)


def downgrade() -> None:
    old = revision_module("0007")
    _create(old.PURGE_PROOFS, old.PURGE_PROOFS_COMMENT)
