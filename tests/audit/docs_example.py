"""Project `scenario.story()` through real Kafka and PostgreSQL and print each compliance
view's example query with its output, as shown in README.md (and services/audit/README.md).

    python -m tests.audit.docs_example
"""

from __future__ import annotations

import tempfile
import uuid
from datetime import datetime
from pathlib import Path

import psycopg
from sqlalchemy import text

from bench.audit import services
from services.audit.db import make_engine, upgrade
from services.audit.projector import AuditProjector
from services.config import Settings
from services.eventlog.topics import ensure_topics
from tests.audit.scenario import produce, recorded, story

QUERIES = {
    "adapter_lineage": """SELECT adapter_id, version, status, published_by, first_activated_at,
       rolled_back_by, rollback_reason, disabled_at, splits
FROM adapter_lineage WHERE adapter_id = 'acme-support' ORDER BY version""",
    "served_by": """SELECT request_id, tenant_org, worker_id, adapter_id, version,
       left(served_sha256, 12) AS served, digest_matches, served_while_disabled, started_at
FROM served_by WHERE tenant_org = 'acme' ORDER BY started_at, request_id""",
    "purge_proofs": """SELECT purge_id, tenant_org, requested_at, deadline_at, workers_live,
       workers_acked, workers_missing, kv_blocks_freed, adapters_unloaded, refcounts_zero,
       status
FROM purge_proofs ORDER BY requested_at""",
    "rollback_candidates": """SELECT adapter_id, active_version, candidate_version, candidate_label,
       left(candidate_sha256, 12) AS candidate_sha, declared_rollback_to, rollback_target
FROM rollback_candidates ORDER BY adapter_id""",
}


def cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, list):
        return "{" + ",".join(str(v) if not isinstance(v, dict) else
                              f"{v.get('alias')}:{v.get('weight')}" for v in value) + "}"
    return str(value)


def render(columns: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c)
              for i, c in enumerate(columns)]
    line = " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    out = [" " + line, "-" + "-+-".join("-" * w for w in widths) + "-"]
    out += [" " + " | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    out.append(f"({len(rows)} rows)")
    return "\n".join(out)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, services(Path(tmp)) as (bootstrap, url):
        tag = uuid.uuid4().hex[:8]
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")
                             .split("?")[0], autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "docs_{tag}"')
        sep = "&" if "?" in url else "?"
        settings = Settings(
            kafka_bootstrap=bootstrap,
            database_url=f"{url}{sep}options=-csearch_path%3Ddocs_{tag}",
            adapter_events_topic=f"docs{tag}.adapter-events",
            worker_events_topic=f"docs{tag}.worker-events",
            liveness_topic=f"docs{tag}.liveness",
            dead_letter_topic=f"docs{tag}.dead-letter", topic_partitions=3,
            audit_signing_key="42" * 32, state_dir=Path(tmp) / "state")
        ensure_topics(settings)
        assert settings.database_url
        upgrade(settings.database_url)
        events = story()
        produce(settings, events)
        engine = make_engine(settings.database_url)
        projector = AuditProjector(settings, engine)
        stored = 0
        while stored < len(recorded(events)):
            stored += projector.project_batch(timeout=0.5)
        projector.close()
        with engine.connect() as conn:
            for view, query in QUERIES.items():
                result = conn.execute(text(query))
                columns = list(result.keys())
                rows = [[cell(v) for v in r] for r in result]
                print(f"### {view}\n\n```sql\n{query};\n```\n\n```\n{render(columns, rows)}\n```\n")
        engine.dispose()


if __name__ == "__main__":
    main()
