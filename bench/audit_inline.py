"""PostgreSQL CPU per event of the audit write path: event bytes inline (revision 0008)
against out of line in TOAST (revision 0007's storage), back to back in one process.

Produces N mixed events, prepares the projector's batches once, then commits every
prepared batch into two fresh schemas of the same durable server, alternating which goes
first: `inline` at the head revision and `toasted` with 0008's `toast_tuple_target`
reset. What is compared is the CPU time of each schema's own server backend over its
transactions (rows, state, checkpoints, offsets: `AuditProjector.write_batch`), per event
read; `--rounds` repeats the whole write into emptied tables. Also records each
schema's `events` size (heap and TOAST).

    python bench/audit_inline.py [--quick]

Writes bench/results/audit_inline.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/audit_inline.py` measures this checkout's code

from sqlalchemy import Engine, text  # noqa: E402

from bench.audit import _schema_url, services  # noqa: E402
from bench.record import BenchRun, Figure  # noqa: E402
from services.audit.db import make_engine, upgrade  # noqa: E402
from services.audit.projector import AuditProjector, PreparedBatch  # noqa: E402
from services.audit.tables import metadata  # noqa: E402
from services.config import Settings  # noqa: E402
from services.eventlog.topics import ensure_topics  # noqa: E402
from tests.audit.scenario import mixed, produce  # noqa: E402

RESULTS = REPO / "bench" / "results" / "audit_inline.json"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
LAYOUTS = ("inline", "toasted")


def backend_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def backend_pid(engine: Engine) -> int:
    """The pid of the engine's one pooled connection (the bench writes from one thread)."""
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def events_size(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        heap, toast = conn.execute(text(
            "SELECT pg_relation_size(oid), coalesce(pg_relation_size(reltoastrelid), 0) "
            "FROM pg_class WHERE oid = 'events'::regclass")).one()
    return {"heap_bytes": int(heap), "toast_bytes": int(toast)}


def empty(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE " + ", ".join(t.name for t in metadata.sorted_tables)))


def prepare_all(settings: Settings, url: str) -> list[PreparedBatch]:
    """Every batch of the log as the projector prepares it (against an empty store)."""
    upgrade(url)
    engine = make_engine(url)
    projector = AuditProjector(settings.model_copy(update={"database_url": url}), engine)
    prepared = []
    while not (batch := projector.prepare_batch(projector.poll_batch(timeout=2.0))).empty:
        prepared.append(batch)
    projector.close()
    engine.dispose()
    return prepared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5,000 events, one round")
    parser.add_argument("--events", type=int, default=None, help="default 30,000")
    parser.add_argument("--rounds", type=int, default=None, help="default 3")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    record = BenchRun("audit_inline", quick=args.quick)
    n = args.events or (5_000 if args.quick else 30_000)
    rounds = args.rounds or (1 if args.quick else 3)

    with tempfile.TemporaryDirectory() as tmp, services(Path(tmp)) as (bootstrap, url, *_):
        tag = uuid.uuid4().hex[:8]
        settings = Settings(
            kafka_bootstrap=bootstrap, adapter_events_topic=f"inl{tag}.adapter-events",
            worker_events_topic=f"inl{tag}.worker-events", liveness_topic=f"inl{tag}.liveness",
            dead_letter_topic=f"inl{tag}.dead-letter", topic_partitions=3,
            audit_batch_size=4000, audit_checkpoint_every=1000, audit_signing_key="42" * 32,
            audit_kek="43" * 32, state_dir=Path(tmp) / "state")
        ensure_topics(settings)
        produced = produce(settings, list(mixed(n)))
        prepared = prepare_all(settings, _schema_url(url, f"{tag}_prepare"))
        engines, projectors, pids = {}, {}, {}
        for layout in LAYOUTS:
            schema_url = _schema_url(url, f"{tag}_{layout}")
            upgrade(schema_url)
            engines[layout] = make_engine(schema_url)
            projectors[layout] = AuditProjector(
                settings.model_copy(update={"database_url": schema_url}), engines[layout])
            pids[layout] = backend_pid(engines[layout])
        with engines["toasted"].begin() as conn:
            conn.execute(text("ALTER TABLE events RESET (toast_tuple_target)"))
        per_round: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        loads = []
        for round_ in range(rounds):
            spent = dict.fromkeys(LAYOUTS, 0.0)
            for layout in LAYOUTS:
                if round_:
                    empty(engines[layout])
                projectors[layout]._committed = {}  # the tables were emptied
            for i, batch in enumerate(prepared):
                order = LAYOUTS if i % 2 == 0 else LAYOUTS[::-1]
                for layout in order:
                    before = backend_cpu_s(pids[layout])
                    projectors[layout].write_batch(batch)
                    spent[layout] += backend_cpu_s(pids[layout]) - before
            for layout in LAYOUTS:
                per_round[layout].append(round(spent[layout] / produced * 1e6, 1))
            loads.append([round(x, 2) for x in os.getloadavg()])
            print(f"round {round_ + 1}: " + ", ".join(
                f"{k} {v[-1]} us/event" for k, v in per_round.items()) + f" (load {loads[-1]})")
        sizes = {layout: events_size(engines[layout]) for layout in LAYOUTS}
        for engine in engines.values():
            engine.dispose()

    median = {layout: statistics.median(v) for layout, v in per_round.items()}
    result = {"events": produced, "batches": len(prepared), "rounds": rounds,
              "postgres_backend_cpu_us_per_event": per_round, "median": median,
              "events_table": sizes, "load_average_per_round": loads,
              "note": "same prepared batches committed into both schemas, alternating which "
                      "goes first; durable embedded PostgreSQL (fsync, full-page writes, "
                      "synchronous_commit=off, checkpoint batches synchronous)"}
    record.save(args.out, result, [Figure(
        "PostgreSQL backend CPU per event, event bytes inline (0008)", median["inline"],
        "us/event", baseline="the same batches with the bytes out of line in TOAST (0007)",
        baseline_value=median["toasted"], better="lower",
        settings=f"{produced:,} mixed events, batches of 4000, checkpoint every 1000, "
                 f"3 partitions, median of {rounds} rounds",
        load_average=loads[-1])])


if __name__ == "__main__":
    main()
