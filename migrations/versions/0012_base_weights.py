"""The base weights format a worker computes with, on its row and on every trace.

A worker serves a base checkpoint (its digest) either dense in its serving dtype or with
int8 weights (`LORAPLANE_WORKER_WEIGHTS`): the same digest, not the same numbers. The
heartbeat and each `RequestServed` trace say which; `workers.base_weights` keeps the
newest heartbeat's, `request_traces.base_weights` each trace's, and `served_by` shows it.
Rows written before this revision were all dense.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

# the view's columns and joins as revision 0011 left them (a migration is frozen)
COLUMNS = """
SELECT t.request_id, t.trace_id, t.tenant_org, t.tenant_team, t.tenant_project, t.user_id,
       t.worker_id, t.adapter_id, t.version, v.label,
       t.adapter_sha256 AS served_sha256, v.sha256 AS published_sha256,
       CASE WHEN t.adapter_id IS NULL THEN NULL
            ELSE t.adapter_sha256 IS NOT DISTINCT FROM v.sha256 END AS digest_matches,
       (d.action = 'disabled') IS TRUE AS served_while_disabled,
       t.base_model_digest, t.started_at, t.finished_at, t.status,
       t.prompt_tokens, t.completion_tokens, t.event_id"""

JOINS = """
FROM request_traces t
LEFT JOIN adapter_versions v ON v.adapter_id = t.adapter_id AND v.version = t.version
LEFT JOIN LATERAL (
    SELECT x.action FROM version_history x
    WHERE x.adapter_id = t.adapter_id AND x.version = t.version
      AND x.action IN ('disabled', 'enabled') AND x.at <= t.started_at
    ORDER BY x.at DESC, x.id DESC LIMIT 1
) d ON true"""

OLD_SERVED_BY = f"""
CREATE OR REPLACE VIEW served_by AS {COLUMNS}, t.witness {JOINS}
WHERE t.witness = 'worker' OR NOT EXISTS (
    SELECT 1 FROM request_traces o
    WHERE o.request_id = t.request_id AND o.trace_id = t.trace_id
      AND (o.witness = 'worker' OR (o.event_id, o.ordinal) < (t.event_id, t.ordinal)))
"""

SERVED_BY = f"""
CREATE OR REPLACE VIEW served_by AS {COLUMNS}, t.witness, t.base_weights {JOINS}
WHERE t.witness = 'worker' OR NOT EXISTS (
    SELECT 1 FROM request_traces o
    WHERE o.request_id = t.request_id AND o.trace_id = t.trace_id
      AND (o.witness = 'worker' OR (o.event_id, o.ordinal) < (t.event_id, t.ordinal)))
"""

OLD_COMMENT = ("Request -> the adapter version and digest that served it (one row per traced "
               "request). digest_matches: the digest the worker reported equals the published "
               "one. served_while_disabled: the version was disabled when the request started. "
               "witness: worker (the worker that served it traced it) or router (the worker's "
               "stream broke mid-answer, status cut, and the router traced it); a request both "
               "traced shows the worker's row.")
COMMENT = OLD_COMMENT + (" base_weights: how the worker computed the base model the digest "
                         "names (dense in its serving dtype, or int8 weights).")


def _quoted(text: str) -> str:
    return text.replace("'", "''")


def upgrade() -> None:
    for table in ("workers", "request_traces"):
        op.add_column(table, sa.Column("base_weights", sa.Text, nullable=False,
                                       server_default="dense"))
    op.execute(SERVED_BY)
    op.execute(f"COMMENT ON VIEW served_by IS '{_quoted(COMMENT)}'")


def downgrade() -> None:
    op.execute("DROP VIEW served_by")
    op.execute(OLD_SERVED_BY)
    op.execute(f"COMMENT ON VIEW served_by IS '{_quoted(OLD_COMMENT)}'")
    for table in ("workers", "request_traces"):
        op.drop_column(table, "base_weights")
