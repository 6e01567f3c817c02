"""Every question an auditor asks of the per-event tables is answered through an index.

Indexes are what the projector pays for on every insert, so the store keeps only the ones
a query needs (and the exactly-once keys); these tests pin that each query still has one.
Sequential scans are disabled, so the planner picks a sequential scan only where no
index applies at all: a plan without one proves an index serves the query."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, text

pytestmark = pytest.mark.slow

SEED = """
INSERT INTO request_traces (event_id, ordinal, request_id, trace_id, worker_id, tenant_org,
                            tenant_team, tenant_project, user_id, adapter_id, version,
                            adapter_sha256, started_at, finished_at, status)
SELECT md5('e' || (g / 4))::uuid, g % 4, 'req-' || g, 'trace-' || (g / 4), 'worker-' || g % 3,
       'org-' || g % 5, 'team', 'project-' || g % 2, 'user-' || g % 7, 'adapter-' || g % 9,
       1 + g % 3, repeat('a', 64),
       timestamptz '2026-01-01' + g * interval '1 second',
       timestamptz '2026-01-01' + g * interval '1 second' + interval '200 ms', 'ok'
FROM generate_series(0, 19999) g;
INSERT INTO request_traces (event_id, ordinal, request_id, trace_id, worker_id, tenant_org,
                            tenant_team, tenant_project, user_id, adapter_id, version,
                            adapter_sha256, started_at, finished_at, status, witness)
SELECT md5('r' || g)::uuid, 0, 'req-' || g, 'trace-' || (g / 4), 'worker-' || g % 3,
       'org-' || g % 5, 'team', 'project-' || g % 2, 'user-' || g % 7, 'adapter-' || g % 9,
       1 + g % 3, repeat('a', 64),
       timestamptz '2026-01-01' + g * interval '1 second',
       timestamptz '2026-01-01' + g * interval '1 second' + interval '100 ms', 'cut', 'router'
FROM generate_series(0, 19999, 50) g;
INSERT INTO worker_heartbeats (event_id, worker_id, at)
SELECT md5('h' || g)::uuid, 'worker-' || g % 3, timestamptz '2026-01-01' + g * interval '1 second'
FROM generate_series(0, 19999) g;
ANALYZE request_traces;
ANALYZE worker_heartbeats
"""

QUERIES = {
    "which adapter served request R":
        "SELECT * FROM served_by WHERE request_id = 'req-12345'",
    "which adapter served request R, traced by a worker and a router":
        "SELECT * FROM served_by WHERE request_id = 'req-12350'",
    "what did tenant T's users get, in a time window":
        "SELECT * FROM served_by WHERE tenant_org = 'org-3' AND tenant_team = 'team' "
        "AND tenant_project = 'project-1' AND started_at >= '2026-01-01 02:00+00' "
        "AND started_at < '2026-01-01 02:10+00'",
    "what did tenant T's users get":
        "SELECT count(*) FROM served_by WHERE tenant_org = 'org-3' AND tenant_team = 'team' "
        "AND tenant_project = 'project-1'",
    "what did version V serve":
        "SELECT * FROM served_by WHERE adapter_id = 'adapter-4' AND version = 2",
    "the rows of one trace event":
        "SELECT * FROM request_traces WHERE event_id = md5('e' || 77)::uuid",
    "which workers were live before a purge (purge_proofs)":
        "SELECT DISTINCT worker_id FROM worker_heartbeats "
        "WHERE at > '2026-01-01 03:00+00' AND at <= '2026-01-01 03:00:30+00'",
}


@pytest.fixture
def seeded(db_engine: Engine) -> Engine:
    with db_engine.begin() as conn:
        for statement in SEED.split(";"):
            conn.execute(text(statement))
    return db_engine


@pytest.mark.parametrize("question", QUERIES)
def test_auditor_queries_use_an_index(seeded: Engine, question: str) -> None:
    with seeded.begin() as conn:
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        plan = "\n".join(row[0] for row in conn.execute(text("EXPLAIN " + QUERIES[question])))
    table = "worker_heartbeats" if "worker_heartbeats" in QUERIES[question] else "request_traces"
    assert f"Seq Scan on {table}" not in plan, plan
    assert "Index" in plan, plan


def test_time_window_of_a_tenant_reads_only_that_window(seeded: Engine) -> None:
    """A tenant's window is found without visiting the tenant's other rows: the plan's
    index conditions bound `started_at`, not only the tenant."""
    with seeded.begin() as conn:
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        plan = "\n".join(row[0] for row in conn.execute(text(
            "EXPLAIN " + QUERIES["what did tenant T's users get, in a time window"])))
    index_conditions = [line for line in plan.splitlines() if "Index Cond" in line]
    assert any("started_at" in line for line in index_conditions), plan
