"""Who traced a request, and `served_by` with one row per request.

A worker writes the trace of every request it serves. A worker killed mid-answer cannot,
so the router whose stream from it broke writes the trace instead (`RequestServed` with
`witness = 'router'`, status `cut`). A worker can also have made its trace durable and
died before its final message got out: then both witnessed the same request.
`request_traces` keeps every witness's row as written (`witness`: worker or router);
`served_by` answers one row per request, the worker's where there is one, else the
router's first. A router's row is checked against the others of its request through
`ix_request_traces_request`; a worker's row passes as it is, so no query pays more for
the few router rows than one index probe each.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

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

SERVED_BY = f"""
CREATE OR REPLACE VIEW served_by AS {COLUMNS}, t.witness {JOINS}
WHERE t.witness = 'worker' OR NOT EXISTS (
    SELECT 1 FROM request_traces o
    WHERE o.request_id = t.request_id AND o.trace_id = t.trace_id
      AND (o.witness = 'worker' OR (o.event_id, o.ordinal) < (t.event_id, t.ordinal)))
"""

OLD_SERVED_BY = f"CREATE VIEW served_by AS {COLUMNS} {JOINS}"

COMMENT = ("Request -> the adapter version and digest that served it (one row per traced "
           "request). digest_matches: the digest the worker reported equals the published "
           "one. served_while_disabled: the version was disabled when the request started. "
           "witness: worker (the worker that served it traced it) or router (the worker's "
           "stream broke mid-answer, status cut, and the router traced it); a request both "
           "traced shows the worker's row.")
OLD_COMMENT = ("Request -> the adapter version and digest that served it (one row per traced "
               "request). digest_matches: the digest the worker reported equals the published "
               "one. served_while_disabled: the version was disabled when the request started.")


def _quoted(text: str) -> str:
    return text.replace("'", "''")


def upgrade() -> None:
    op.add_column("request_traces", sa.Column("witness", sa.Text, nullable=False,
                                              server_default="worker"))
    op.execute(SERVED_BY)
    op.execute(f"COMMENT ON VIEW served_by IS '{_quoted(COMMENT)}'")


def downgrade() -> None:
    op.execute("DROP VIEW served_by")
    op.execute(OLD_SERVED_BY)
    op.execute(f"COMMENT ON VIEW served_by IS '{_quoted(OLD_COMMENT)}'")
    op.drop_column("request_traces", "witness")
