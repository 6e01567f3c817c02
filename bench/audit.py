"""Sustained audit projection throughput (events/s) on real Kafka and PostgreSQL.

Produces N mixed events first (mostly request traces of 4 requests and heartbeats, see
`tests/audit/scenario.py`), then times one projector draining them from offset 0: every
event decoded and validated, chained, leaf-hashed, folded into the current-state and
history tables, with offsets, in batches of `--batch` per transaction, and a signed
checkpoint every `--checkpoint-every` events per partition.

    python -m bench.audit --events 50000

Uses LORAPLANE_KAFKA_BOOTSTRAP / LORAPLANE_DATABASE_URL when set, else starts Apache
Kafka (KRaft) and embedded PostgreSQL for the run. Writes bench/results/audit.json.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import platform
import pstats
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
from sqlalchemy import func, select

from services.audit.db import make_engine, upgrade
from services.audit.projector import AuditProjector
from services.audit.tables import events, request_traces
from services.config import Settings
from services.eventlog.topics import ensure_topics
from tests.audit.scenario import mixed, produce, recorded

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "audit.json"


@contextlib.contextmanager
def services(workdir: Path) -> Iterator[tuple[str, str]]:
    """(kafka bootstrap, database url): from the environment or started here."""
    with contextlib.ExitStack() as stack:
        bootstrap = os.environ.get("LORAPLANE_KAFKA_BOOTSTRAP")
        url = os.environ.get("LORAPLANE_DATABASE_URL")
        if not bootstrap:
            from services.stack.brokers import ApacheKafka

            broker = ApacheKafka(Settings(cache_dir=REPO / ".loraplane" / "cache",
                                          topic_partitions=3), workdir / "kafka")
            broker.start()
            stack.callback(broker.stop)
            bootstrap = broker.bootstrap
        if not url:
            from services.stack.postgres import LocalPostgres

            server = LocalPostgres(workdir / "pg")
            server.start()
            stack.callback(server.stop)
            url = server.url
        yield bootstrap, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=Settings().audit_batch_size)
    parser.add_argument("--checkpoint-every", type=int, default=1000)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile the projection")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp, services(Path(tmp)) as (bootstrap, url):
        tag = uuid.uuid4().hex[:8]
        schema = f"bench_{tag}"
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")
                             .split("?")[0], autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
        sep = "&" if "?" in url else "?"
        settings = Settings(
            kafka_bootstrap=bootstrap, database_url=f"{url}{sep}options=-csearch_path%3D{schema}",
            adapter_events_topic=f"bench{tag}.adapter-events",
            worker_events_topic=f"bench{tag}.worker-events",
            liveness_topic=f"bench{tag}.liveness",
            dead_letter_topic=f"bench{tag}.dead-letter", topic_partitions=args.partitions,
            audit_batch_size=args.batch, audit_checkpoint_every=args.checkpoint_every,
            audit_signing_key="42" * 32, state_dir=Path(tmp) / "state")
        ensure_topics(settings)
        assert settings.database_url
        upgrade(settings.database_url)

        t0 = time.perf_counter()
        generated = list(mixed(args.events))
        kept = len(recorded(generated))  # heartbeats update summaries, are not stored
        produced = produce(settings, generated)
        produce_s = time.perf_counter() - t0
        print(f"produced {produced} events in {produce_s:.1f}s "
              f"({produced / produce_s:,.0f}/s)")

        engine = make_engine(settings.database_url)
        projector = AuditProjector(settings, engine)
        projector.open()  # seek and load heads before the clock starts
        stored = 0
        batches = 0
        stop = threading.Event()

        def counted(n: int) -> None:
            nonlocal stored, batches
            stored += n
            batches += 1
            if stored >= kept:
                stop.set()

        projector.on_batch = counted
        profiler = cProfile.Profile() if args.profile else None
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        projector.run(stop)  # what `loraplane serve audit` runs: reader thread + writer
        project_s = time.perf_counter() - t0
        if profiler:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
            profiler.dump_stats(str(RESULTS.with_suffix(".prof")))
        projector.close()
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(events)).scalar_one() == kept
            traces = conn.execute(select(func.count()).select_from(request_traces)).scalar_one()
        engine.dispose()

    rate = produced / project_s
    result = {
        "events": produced, "events_stored": kept, "request_trace_rows": traces, "batches": batches,
        "batch_size": args.batch, "checkpoint_every": args.checkpoint_every,
        "partitions": args.partitions, "projection_seconds": round(project_s, 2),
        "events_per_second": round(rate), "produce_events_per_second": round(produced / produce_s),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(), "python": platform.python_version(),
        "machine": platform.machine(),
        "note": "broker, PostgreSQL, producer-free projector on the same machine",
    }
    print(json.dumps(result, indent=2))
    print(f"projection: {rate:,.0f} events/s ({traces / project_s:,.0f} request rows/s)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
