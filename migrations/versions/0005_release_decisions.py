"""release_decisions: every quality-gate request and result, override and canary step.

A view over `events` (the hash-chained log itself, not a derived table), so what it shows
is exactly what the signed checkpoints cover: nothing the projector folds can drift from
it. One row per decision with who or what decided it (`decided_by` is the event's actor:
the worker that ran a gate, the registry instance that expired one, the admin who
overrode, the canary controller's token or the operator who stepped a rollout;
`automatic` tells the controller from a human), the figures it was decided on, and the
event id to prove it with `loraplane audit proof`.

A partial index on the decision event types keeps the view from scanning the whole log.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

DECISION_TYPES = ("QualityGateRequested", "QualityGateCompleted", "QualityGateExpired",
                  "ReleaseOverridden", "RolloutHalted", "RolloutResumed",
                  "AdapterVersionPublished", "TrafficSplitChanged", "AdapterVersionSwitched")
TYPES_SQL = ", ".join(f"'{t}'" for t in DECISION_TYPES)

INDEX = f"""
CREATE INDEX ix_events_release_decisions ON events (occurred_at, id)
WHERE type IN ({TYPES_SQL})
"""

RELEASE_DECISIONS = f"""
CREATE VIEW release_decisions AS
WITH decision_events AS (
    SELECT e.*,
           CASE WHEN jsonb_typeof(e.payload->'rollout') = 'object'
                THEN e.payload->'rollout' END AS step,
           CASE WHEN e.type = 'AdapterVersionPublished'
                THEN e.payload->'quality_gate'
                WHEN e.type = 'QualityGateRequested' THEN e.payload->'gate' END AS gate_req
    FROM events e
    WHERE e.type IN ({TYPES_SQL})
), gate_cases AS (
    SELECT d.id,
           count(c.value) AS cases,
           count(c.value) FILTER (
               WHERE NOT (c.value->>'passed')::boolean
                  OR EXISTS (SELECT 1 FROM jsonb_array_elements(c.value->'checks') k
                             WHERE k.value->>'verdict' = 'fail')) AS failed_cases,
           (array_agg(c.value->>'case_id' ORDER BY (c.value->>'line')::int) FILTER (
               WHERE NOT (c.value->>'passed')::boolean
                  OR EXISTS (SELECT 1 FROM jsonb_array_elements(c.value->'checks') k
                             WHERE k.value->>'verdict' = 'fail'))) AS failed_case_ids
    FROM decision_events d
    CROSS JOIN LATERAL jsonb_array_elements(d.payload->'cases') c
    WHERE d.type = 'QualityGateCompleted'
    GROUP BY d.id
)
SELECT
    d.occurred_at AS decided_at,
    CASE d.type
        WHEN 'AdapterVersionPublished' THEN 'gate_requested'
        WHEN 'QualityGateRequested' THEN 'gate_requested'
        WHEN 'QualityGateCompleted' THEN
            CASE WHEN (d.payload->>'passed')::boolean AND d.payload->>'error' IS NULL
                      AND coalesce(g.failed_cases, 0) = 0 THEN 'gate_passed'
                 ELSE 'gate_failed' END
        WHEN 'QualityGateExpired' THEN 'gate_expired'
        WHEN 'ReleaseOverridden' THEN 'override'
        WHEN 'RolloutHalted' THEN 'rollout_halted'
        WHEN 'RolloutResumed' THEN 'rollout_resumed'
        ELSE 'rollout_' || (d.step->>'action')
    END AS decision,
    d.actor AS decided_by,
    coalesce((d.step->>'automatic')::boolean, (d.payload->>'automatic')::boolean,
             d.type IN ('QualityGateCompleted', 'QualityGateExpired')) AS automatic,
    coalesce(d.payload->>'adapter_id', d.step->>'adapter_id') AS adapter_id,
    coalesce((d.payload->>'version')::int, (d.step->>'canary_version')::int) AS version,
    (d.step->>'baseline_version')::int AS baseline_version,
    coalesce(d.payload->>'alias', d.step->>'alias') AS alias,
    coalesce(d.gate_req->>'gate_id', d.payload->>'gate_id') AS gate_id,
    coalesce(d.step->>'rollout_id', d.payload->>'rollout_id') AS rollout_id,
    coalesce((d.step->>'stage')::int, (d.payload->>'stage')::int) AS stage,
    (d.step->>'weight')::int AS weight,
    coalesce(nullif(d.step->>'reason', ''), d.payload->>'reason', d.payload->>'error',
             'failed cases: ' || array_to_string(g.failed_case_ids, ', ')) AS reason,
    coalesce(d.step->'judgement', d.payload->'judgement') AS judgement,
    (coalesce(d.step, d.payload)->'judgement'->>'window_start')::timestamptz AS window_start,
    (coalesce(d.step, d.payload)->'judgement'->>'window_end')::timestamptz AS window_end,
    (coalesce(d.step, d.payload)->'judgement'->'canary'->>'requests')::int AS canary_requests,
    (coalesce(d.step, d.payload)->'judgement'->'canary'->>'errors')::int AS canary_errors,
    (coalesce(d.step, d.payload)->'judgement'->'canary'->>'error_rate')::float8
        AS canary_error_rate,
    (coalesce(d.step, d.payload)->'judgement'->'canary'->>'p95_ms')::float8 AS canary_p95_ms,
    (coalesce(d.step, d.payload)->'judgement'->'baseline'->>'requests')::int
        AS baseline_requests,
    (coalesce(d.step, d.payload)->'judgement'->'baseline'->>'errors')::int AS baseline_errors,
    (coalesce(d.step, d.payload)->'judgement'->'baseline'->>'error_rate')::float8
        AS baseline_error_rate,
    (coalesce(d.step, d.payload)->'judgement'->'baseline'->>'p95_ms')::float8
        AS baseline_p95_ms,
    d.step->'plan' AS plan,
    d.gate_req->>'worker_id' AS gate_worker,
    d.gate_req->>'regression_set_sha256' AS regression_set_sha256,
    g.cases AS gate_cases,
    g.failed_cases AS gate_failed_cases,
    g.failed_case_ids AS gate_failed_case_ids,
    d.payload->>'cause' AS expiry_cause,
    d.type AS event_type,
    d.event_id,
    d.topic, d.partition, d."offset"
FROM decision_events d
LEFT JOIN gate_cases g ON g.id = d.id
WHERE d.type NOT IN ('AdapterVersionPublished', 'QualityGateRequested', 'TrafficSplitChanged',
                     'AdapterVersionSwitched')
   OR d.gate_req IS NOT NULL AND jsonb_typeof(d.gate_req) = 'object'
   OR d.step IS NOT NULL
"""

COMMENT = (
    "Every release decision, one row each: gate requested (with the worker assigned), gate "
    "passed/failed (a worker's QualityGateCompleted: cases, failed cases), gate expired (the "
    "registry: no worker, timeout, worker lost), override (an admin, with the reason), "
    "rollout started/advanced/halted/resumed/rolled_back/completed with the judgement it was "
    "decided on: both arms' requests, errors, error rate and p95 over the window. decided_by "
    "is the event's actor; automatic is true for the canary controller, workers and the "
    "registry's expiry. Whether a gate result counts (assigned worker, before the deadline "
    "and any expiry) is services/catalog/state.py's rule.")


def upgrade() -> None:
    op.execute(INDEX)
    op.execute(RELEASE_DECISIONS)
    op.execute(f"COMMENT ON VIEW release_decisions IS '{COMMENT.replace(chr(39), chr(39) * 2)}'")


def downgrade() -> None:
    op.execute("DROP VIEW release_decisions")
    op.execute("DROP INDEX ix_events_release_decisions")
