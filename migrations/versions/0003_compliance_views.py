"""Compliance views: adapter_lineage, served_by, purge_proofs, rollback_candidates.

Plain SQL over the tables of revision 0002, so an auditor can answer "which version
served this request", "was this tenant purged in time" and "what would a rollback go
to" with psql alone. Each view carries its definition as a COMMENT.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

LIVENESS_WINDOW = """
CREATE FUNCTION audit_liveness_window() RETURNS interval
LANGUAGE sql IMMUTABLE AS $$ SELECT interval '30 seconds' $$
"""

ADAPTER_LINEAGE = """
CREATE VIEW adapter_lineage AS
SELECT v.adapter_id, v.version, v.label, v.sha256, v.status,
       v.tenant_org, v.tenant_team, v.tenant_project,
       v.published_at, v.published_by,
       h.first_activated_at, h.first_activated_by, h.last_activated_at, h.last_deactivated_at,
       h.splits,
       h.rolled_back_at, h.rolled_back_by, h.rollback_reason,
       h.disabled_at, h.disabled_by, h.disabled_reason, h.enabled_at, h.enabled_by,
       h.history
FROM adapter_versions v
LEFT JOIN LATERAL (
    SELECT
        min(x.at) FILTER (WHERE x.action = 'activated') AS first_activated_at,
        (array_agg(x.actor ORDER BY x.at, x.id) FILTER (WHERE x.action = 'activated'))[1]
            AS first_activated_by,
        max(x.at) FILTER (WHERE x.action = 'activated') AS last_activated_at,
        max(x.at) FILTER (WHERE x.action = 'deactivated') AS last_deactivated_at,
        jsonb_agg(jsonb_build_object('alias', x.alias, 'weight', x.weight, 'at', x.at,
                                     'actor', x.actor) ORDER BY x.at, x.id)
            FILTER (WHERE x.action = 'split') AS splits,
        max(x.at) FILTER (WHERE x.action = 'rolled_back') AS rolled_back_at,
        (array_agg(x.actor ORDER BY x.at DESC, x.id DESC)
            FILTER (WHERE x.action = 'rolled_back'))[1] AS rolled_back_by,
        (array_agg(x.reason ORDER BY x.at DESC, x.id DESC)
            FILTER (WHERE x.action = 'rolled_back'))[1] AS rollback_reason,
        max(x.at) FILTER (WHERE x.action = 'disabled') AS disabled_at,
        (array_agg(x.actor ORDER BY x.at DESC, x.id DESC)
            FILTER (WHERE x.action = 'disabled'))[1] AS disabled_by,
        (array_agg(x.reason ORDER BY x.at DESC, x.id DESC)
            FILTER (WHERE x.action = 'disabled'))[1] AS disabled_reason,
        max(x.at) FILTER (WHERE x.action = 'enabled') AS enabled_at,
        (array_agg(x.actor ORDER BY x.at DESC, x.id DESC)
            FILTER (WHERE x.action = 'enabled'))[1] AS enabled_by,
        jsonb_agg(jsonb_build_object('action', x.action, 'at', x.at, 'actor', x.actor,
                                     'alias', x.alias, 'weight', x.weight,
                                     'reason', x.reason) ORDER BY x.at, x.id) AS history
    FROM version_history x
    WHERE x.adapter_id = v.adapter_id AND x.version = v.version
) h ON true
"""

SERVED_BY = """
CREATE VIEW served_by AS
SELECT t.request_id, t.trace_id, t.tenant_org, t.tenant_team, t.tenant_project, t.user_id,
       t.worker_id, t.adapter_id, t.version, v.label,
       t.adapter_sha256 AS served_sha256, v.sha256 AS published_sha256,
       CASE WHEN t.adapter_id IS NULL THEN NULL
            ELSE t.adapter_sha256 IS NOT DISTINCT FROM v.sha256 END AS digest_matches,
       (d.action = 'disabled') IS TRUE AS served_while_disabled,
       t.base_model_digest, t.started_at, t.finished_at, t.status,
       t.prompt_tokens, t.completion_tokens, t.event_id
FROM request_traces t
LEFT JOIN adapter_versions v ON v.adapter_id = t.adapter_id AND v.version = t.version
LEFT JOIN LATERAL (
    SELECT x.action FROM version_history x
    WHERE x.adapter_id = t.adapter_id AND x.version = t.version
      AND x.action IN ('disabled', 'enabled') AND x.at <= t.started_at
    ORDER BY x.at DESC, x.id DESC LIMIT 1
) d ON true
"""

PURGE_PROOFS = """
CREATE VIEW purge_proofs AS
SELECT p.purge_id, p.tenant_org, p.tenant_team, p.tenant_project,
       p.requested_at, p.requested_by, p.deadline_at,
       live.workers AS workers_live,
       acked.workers AS workers_acked,
       missing.workers AS workers_missing,
       acked.kv_blocks_freed, acked.adapters_unloaded, acked.refcounts_zero,
       acked.last_ack_at,
       CASE WHEN cardinality(missing.workers) = 0 THEN 'met'
            WHEN now() > p.deadline_at THEN 'missed'
            ELSE 'pending' END AS status
FROM purges p
CROSS JOIN LATERAL (
    SELECT coalesce(array_agg(DISTINCT h.worker_id ORDER BY h.worker_id), '{}') AS workers
    FROM worker_heartbeats h
    WHERE h.at > p.requested_at - audit_liveness_window() AND h.at <= p.requested_at
) live
CROSS JOIN LATERAL (
    SELECT coalesce(array_agg(DISTINCT a.worker_id ORDER BY a.worker_id), '{}') AS workers,
           coalesce(array_agg(DISTINCT a.worker_id ORDER BY a.worker_id)
                    FILTER (WHERE a.refcounts_zero AND a.at <= p.deadline_at), '{}') AS good,
           coalesce(sum(a.kv_blocks_freed), 0) AS kv_blocks_freed,
           coalesce(sum(a.adapters_unloaded), 0) AS adapters_unloaded,
           bool_and(a.refcounts_zero) AS refcounts_zero,
           max(a.at) AS last_ack_at
    FROM worker_acks a
    WHERE a.type = 'TenantPurged' AND a.purge_id = p.purge_id
) acked
CROSS JOIN LATERAL (
    SELECT ARRAY(SELECT w FROM unnest(live.workers) AS w
                 WHERE NOT w = ANY(acked.good) ORDER BY w) AS workers
) missing
"""

ROLLBACK_CANDIDATES = """
CREATE VIEW rollback_candidates AS
SELECT a.adapter_id, a.active_version, cur.sha256 AS active_sha256,
       c.version AS candidate_version, c.label AS candidate_label,
       c.sha256 AS candidate_sha256, c.last_activated_at AS candidate_last_active_at,
       cur.rollback_to AS declared_rollback_to,
       CASE WHEN decl.version IS NOT NULL THEN decl.version ELSE c.version END
           AS rollback_target
FROM adapters a
LEFT JOIN adapter_versions cur
       ON cur.adapter_id = a.adapter_id AND cur.version = a.active_version
LEFT JOIN LATERAL (
    SELECT v.version, v.label, v.sha256, v.last_activated_at
    FROM adapter_versions v
    WHERE v.adapter_id = a.adapter_id
      AND v.version < a.active_version
      AND v.first_activated_at IS NOT NULL
      AND NOT v.disabled
    ORDER BY v.version DESC
    LIMIT 1
) c ON true
LEFT JOIN adapter_versions decl
       ON decl.adapter_id = a.adapter_id AND decl.version = cur.rollback_to
      AND decl.version <> a.active_version AND NOT decl.disabled
WHERE a.active_version IS NOT NULL
"""

COMMENTS = {
    "adapter_lineage": "Every version of every adapter with publish, activation, traffic "
    "split, rollback, disable and enable times and actors; history is the full ordered "
    "list of lifecycle actions.",
    "served_by": "Request -> the adapter version and digest that served it (one row per "
    "traced request). digest_matches: the digest the worker reported equals the published "
    "one. served_while_disabled: the version was disabled when the request started.",
    "purge_proofs": "One row per tenant purge. workers_live: workers with a heartbeat in "
    "(requested_at - audit_liveness_window(), requested_at]. A live worker counts as done "
    "when it acked TenantPurged with refcounts_zero by the deadline. status: met (no live "
    "worker missing), missed (deadline passed with one missing), pending (otherwise).",
    "rollback_candidates": "Last stable version per adapter, the registry's default "
    "rollback target: among versions with a number lower than the current active version, "
    "the highest that was active at some point (it was the to_version of an "
    "AdapterVersionSwitched or AdapterRolledBack event) and is not disabled now (its last "
    "disable/enable event is not a disable). NULL when there is none. "
    "declared_rollback_to is the active version's rollback_to from its publish event. "
    "rollback_target is where the registry's default rollback goes: declared_rollback_to "
    "when that version exists, is not the active one and is not disabled, else "
    "candidate_version.",
}


def upgrade() -> None:
    op.execute(LIVENESS_WINDOW)
    for sql in (ADAPTER_LINEAGE, SERVED_BY, PURGE_PROOFS, ROLLBACK_CANDIDATES):
        op.execute(sql)
    for view, comment in COMMENTS.items():
        op.execute(f"COMMENT ON VIEW {view} IS '{comment.replace(chr(39), chr(39) * 2)}'")


def downgrade() -> None:
    for view in ("rollback_candidates", "purge_proofs", "served_by", "adapter_lineage"):
        op.execute(f"DROP VIEW {view}")
    op.execute("DROP FUNCTION audit_liveness_window()")
