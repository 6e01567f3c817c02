"""Project `scenario.story()` through real Kafka and PostgreSQL and print each compliance
view's example query with its output, and the auditor's walk-through (fetch a checkpoint,
verify inclusion and consistency proofs with the stand-alone verifier, verify the store
against a kept checkpoint and Kafka, read a purge proof), as shown in docs/audit.md.

    python -m tests.audit.docs_example
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from datetime import datetime
from pathlib import Path

import httpx
import psycopg
from sqlalchemy import Engine, text

from bench.audit import libpq_url, services
from services.audit.db import make_engine, upgrade
from services.audit.projector import AuditProjector
from services.audit.publication import HttpEndpoint, http_app
from services.config import Settings
from services.eventlog.topics import ensure_topics
from tests.audit.conftest import cli, drain
from tests.audit.scenario import mixed, produce, recorded, story

QUERIES = {
    "adapter_lineage": """SELECT adapter_id, version, status, published_by, first_activated_at,
       rolled_back_by, rollback_reason, disabled_at, splits
FROM adapter_lineage WHERE adapter_id = 'acme-support' ORDER BY version""",
    "served_by": """SELECT request_id, tenant_org, worker_id, adapter_id, version,
       left(served_sha256, 12) AS served, digest_matches, served_while_disabled, started_at
FROM served_by WHERE tenant_org = 'acme' ORDER BY started_at, request_id""",
    "purge_proofs": """SELECT purge_id, tenant_org, requested_at, deadline_at, workers_expected,
       workers_acked, workers_done, workers_missing, kv_blocks_freed, refcounts_zero, status
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


def _section(title: str, body: str, lang: str = "") -> None:
    print(f"#### {title}\n\n```{lang}\n{body.rstrip()}\n```\n")


def _short(document: dict, keep: int = 48) -> dict:
    """Long base64 values cut for print (marked with …); the files hold them whole."""
    out: dict = {}
    for key, value in document.items():
        if key == "leaf" and len(value) > keep:
            value = value[:keep] + "…"
        elif isinstance(value, list) and len(value) > 3:
            value = [*value[:2], f"… {len(value) - 2} more"]
        out[key] = value
    return out


def auditors(settings: Settings, engine: Engine, projector: AuditProjector,
             events: list, workdir: Path) -> None:
    """The auditor's walk-through of docs/audit.md: real commands, real output."""
    endpoint = HttpEndpoint("127.0.0.1", 0, http_app(projector.folder,
                                                     projector.metrics.registry))
    try:
        cli(settings, "checkpoint")
        index = httpx.get(f"http://127.0.0.1:{endpoint.port}/checkpoints").json()
        log = max((entry for entry in index["logs"]
                   if entry["topic"] == settings.worker_events_topic),
                  key=lambda entry: entry["size"])
        url = f"/checkpoints/{log['topic']}/{log['partition']}/latest"
        note = httpx.get(f"http://127.0.0.1:{endpoint.port}{url}").text
    finally:
        endpoint.close()
    _section(f"curl http://AUDIT_HOST:8783{url}", note)
    _, keys = cli(settings, "public-key")
    _section("loraplane audit public-key", keys)
    vkey = next(k for k in keys.split() if k.startswith(f"{settings.audit_origin}/"
                                                        f"{log['topic']}/{log['partition']}+"))
    verifier = workdir / "verifier.py"
    shutil.copy(Path(__file__).resolve().parents[2] / "services/audit/verifier.py", verifier)
    (workdir / "checkpoint").write_text(note)

    def standalone(*args: str) -> str:
        done = subprocess.run([sys.executable, "-I", str(verifier), *args, "--key", vkey],
                              capture_output=True, text=True, cwd=workdir)
        return done.stdout

    _section("python verifier.py checkpoint checkpoint --key \"$VKEY\"",
             standalone("checkpoint", "checkpoint"))
    with engine.connect() as conn:
        event_id = conn.execute(text(
            "SELECT event_id FROM events WHERE topic = :t AND \"partition\" = :p "
            "AND type = 'RequestServed' ORDER BY chain_index LIMIT 1"),
            {"t": log["topic"], "p": log["partition"]}).scalar_one()
    cli(settings, "proof", str(event_id), "-o", str(workdir / "proof.json"))
    document = json.loads((workdir / "proof.json").read_text())
    _section(f"loraplane audit proof {event_id} -o proof.json  # printed shortened",
             json.dumps(_short(document), indent=2, ensure_ascii=False), "json")
    _section("python verifier.py inclusion proof.json --key \"$VKEY\"",
             standalone("inclusion", "proof.json"))
    first = projector.folder.read(log["topic"], log["partition"], 8)
    (workdir / "kept-last-month").write_text(first or "")
    more = list(mixed(40, seed=21))
    produce(settings, more)
    drain(projector, len(recorded(events + more)))
    cli(settings, "checkpoint")
    cli(settings, "consistency", "kept-last-month", "-o", "consistency.json")
    _section("loraplane audit consistency kept-last-month -o consistency.json "
             "# printed shortened", json.dumps(_short(json.loads(
                 (Path("consistency.json")).read_text())), indent=2, ensure_ascii=False), "json")
    shutil.move("consistency.json", workdir / "consistency.json")
    _section("python verifier.py consistency consistency.json --key \"$VKEY\"",
             standalone("consistency", "consistency.json"))
    _, out = cli(settings, "verify", "--checkpoint", str(workdir / "kept-last-month"),
                 "--against-kafka")
    _section("loraplane audit verify --checkpoint kept-last-month --against-kafka", out)
    with engine.connect() as conn:
        row = conn.execute(text("SELECT * FROM purge_proofs WHERE purge_id = 'purge-met'")
                           ).one()._mapping
    width = max(map(len, row))
    _section("psql -x -c \"SELECT * FROM purge_proofs WHERE purge_id = 'purge-met'\"",
             "\n".join(f"{k.ljust(width)} | {cell(v)}" for k, v in row.items()))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, services(Path(tmp)) as (bootstrap, url, *_):
        tag = uuid.uuid4().hex[:8]
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "docs_{tag}"')
        sep = "&" if "?" in url else "?"
        prefix = f"docs{tag}." if os.environ.get("LORAPLANE_KAFKA_BOOTSTRAP") else "loraplane."
        settings = Settings(
            kafka_bootstrap=bootstrap,
            database_url=f"{url}{sep}options=-csearch_path%3Ddocs_{tag}",
            adapter_events_topic=f"{prefix}adapter-events",
            worker_events_topic=f"{prefix}worker-events", liveness_topic=f"{prefix}liveness",
            dead_letter_topic=f"{prefix}dead-letter", topic_partitions=3,
            audit_signing_key="42" * 32, audit_kek="43" * 32,
            audit_origin="audit.example.com/loraplane", audit_checkpoint_every=8,
            audit_batch_size=10,  # small batches: a tenant's data is stored before its purge
            state_dir=Path(tmp) / "state")
        ensure_topics(settings)
        assert settings.database_url
        upgrade(settings.database_url)
        events = story()
        produce(settings, events)
        engine = make_engine(settings.database_url)
        projector = AuditProjector(settings, engine)
        drain(projector, len(recorded(events)))
        with engine.connect() as conn:
            for view, query in QUERIES.items():
                result = conn.execute(text(query))
                columns = list(result.keys())
                rows = [[cell(v) for v in r] for r in result]
                print(f"### {view}\n\n```sql\n{query};\n```\n\n```\n{render(columns, rows)}\n```\n")
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            auditors(settings, engine, projector, events, Path(tmp))
        finally:
            os.chdir(cwd)
            projector.close()
            engine.dispose()


if __name__ == "__main__":
    main()
