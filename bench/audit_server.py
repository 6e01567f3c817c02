"""A server setting of the embedded PostgreSQL, A/B: the same prepared audit batches
committed into two servers, one with the setting as `SERVER_SETTINGS` has it and one with
the baseline value, back to back in one process.

A server setting needs a server of its own (`bench/audit_inline.py` compares schemas of
one server). Produces N mixed events, prepares the projector's batches once, then commits
every batch into a fresh schema on each server, alternating which goes first, pausing
after each commit so the WAL writer's work lands in that batch's window. Compared per
event read: the CPU of the server's own backend, of the whole server (postmaster and all
its children: WAL writer, checkpointer, autovacuum), the wall time of the transactions
(`AuditProjector.write_batch`), and the WAL writes a backend made itself because the WAL
buffers were full (`pg_stat_wal.wal_buffers_full`). `--rounds` repeats the write into
emptied tables.

    python bench/audit_server.py [--quick] [--setting wal_buffers --baseline -1]

Writes bench/results/audit_server.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/audit_server.py` measures this checkout's code

import psycopg  # noqa: E402

from bench.audit import (  # noqa: E402
    _postmaster,
    _schema_url,
    _server_cpu_s,
    _server_stats,
    libpq_url,
    services,
)
from bench.audit_inline import backend_cpu_s, backend_pid, empty, prepare_all  # noqa: E402
from bench.record import BenchRun, Figure  # noqa: E402
from services.audit.db import make_engine, upgrade  # noqa: E402
from services.audit.projector import AuditProjector  # noqa: E402
from services.config import Settings  # noqa: E402
from services.eventlog.topics import ensure_topics  # noqa: E402
from services.stack.postgres import SERVER_SETTINGS, LocalPostgres  # noqa: E402
from tests.audit.scenario import mixed, produce  # noqa: E402

RESULTS = REPO / "bench" / "results" / "audit_server.json"
SERVERS = ("embedded", "baseline")
SETTLE_S = 0.3
"""Pause after each commit: more than the WAL writer's 200 ms cycle."""


def wal_buffers_full(url: str) -> int:
    return int(_server_stats(url)["wal_buffers_full"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5,000 events, one round")
    parser.add_argument("--events", type=int, default=None, help="default 20,000")
    parser.add_argument("--rounds", type=int, default=None, help="default 3")
    parser.add_argument("--setting", default="wal_buffers")
    parser.add_argument("--baseline", default="-1",
                        help="the setting's value on the baseline server (default -1: "
                             "PostgreSQL's own default, 1/32 of shared_buffers)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    record = BenchRun("audit_server", quick=args.quick)
    n = args.events or (5_000 if args.quick else 20_000)
    rounds = args.rounds or (1 if args.quick else 3)

    with tempfile.TemporaryDirectory() as tmp, services(Path(tmp)) as (bootstrap, url, pid, _):
        baseline = LocalPostgres(Path(tmp) / "baseline",
                                 settings={args.setting: args.baseline})
        baseline.start()
        try:
            urls = {"embedded": url, "baseline": baseline.url}
            pids = {"embedded": pid, "baseline": _postmaster(baseline.url)}
            tag = uuid.uuid4().hex[:8]
            settings = Settings(
                kafka_bootstrap=bootstrap, adapter_events_topic=f"srv{tag}.adapter-events",
                worker_events_topic=f"srv{tag}.worker-events",
                liveness_topic=f"srv{tag}.liveness", dead_letter_topic=f"srv{tag}.dead-letter",
                topic_partitions=3, audit_batch_size=4000, audit_checkpoint_every=1000,
                audit_signing_key="42" * 32, audit_kek="43" * 32, state_dir=Path(tmp) / "state")
            ensure_topics(settings)
            produced = produce(settings, list(mixed(n)))
            prepared = prepare_all(settings, _schema_url(url, f"{tag}_prepare"))
            shown, engines, projectors, backends = {}, {}, {}, {}
            for server in SERVERS:
                with psycopg.connect(libpq_url(urls[server])) as conn:
                    shown[server] = conn.execute(f"SHOW {args.setting}").fetchone()[0]  # type: ignore[index]
                schema_url = _schema_url(urls[server], f"{tag}_write")
                upgrade(schema_url)
                engines[server] = make_engine(schema_url)
                projectors[server] = AuditProjector(
                    settings.model_copy(update={"database_url": schema_url}), engines[server])
                backends[server] = backend_pid(engines[server])
            figures = ("backend_cpu", "server_cpu", "transaction_wall", "wal_buffers_full")
            per_round = {s: {f: [] for f in figures} for s in SERVERS}  # type: ignore[var-annotated]
            loads = []
            for round_ in range(rounds):
                spent = {s: dict.fromkeys(figures, 0.0) for s in SERVERS}
                full = {s: wal_buffers_full(urls[s]) for s in SERVERS}
                for server in SERVERS:
                    if round_:
                        empty(engines[server])
                    projectors[server]._committed = {}  # the tables were emptied
                for i, batch in enumerate(prepared):
                    for server in SERVERS if i % 2 == 0 else SERVERS[::-1]:
                        backend0 = backend_cpu_s(backends[server])
                        server0, wall0 = _server_cpu_s(pids[server]), time.perf_counter()
                        projectors[server].write_batch(batch)
                        wall = time.perf_counter() - wall0
                        time.sleep(SETTLE_S)
                        spent[server]["backend_cpu"] += backend_cpu_s(backends[server]) - backend0
                        spent[server]["server_cpu"] += (_server_cpu_s(pids[server]) or 0.0) - (
                            server0 or 0.0)
                        spent[server]["transaction_wall"] += wall
                for server in SERVERS:
                    for figure in figures[:3]:
                        per_round[server][figure].append(
                            round(spent[server][figure] / produced * 1e6, 1))
                    per_round[server]["wal_buffers_full"].append(
                        wal_buffers_full(urls[server]) - full[server])
                loads.append([round(x, 2) for x in os.getloadavg()])
                print(f"round {round_ + 1}: " + "; ".join(
                    f"{s} " + ", ".join(f"{f} {v[-1]}" for f, v in per_round[s].items())
                    for s in SERVERS) + f" (us/event; load {loads[-1]})")
            for engine in engines.values():
                engine.dispose()
        finally:
            baseline.stop()

    median = {s: {f: statistics.median(v) for f, v in per_round[s].items()} for s in SERVERS}
    result = {"events": produced, "batches": len(prepared), "rounds": rounds,
              "setting": args.setting, "values": shown, "per_round": per_round,
              "median": median, "load_average_per_round": loads,
              "note": "us per event read (wal_buffers_full: count per round); same prepared "
                      "batches committed into both servers, alternating which goes first; "
                      "both durable (fsync, full-page writes, synchronous_commit=off, "
                      "checkpoint batches synchronous)"}
    label = f"{args.setting}={SERVER_SETTINGS.get(args.setting, 'default')}"
    settings_text = (f"{produced:,} mixed events, batches of 4000, checkpoint every 1000, "
                     f"3 partitions, median of {rounds} rounds")
    record.save(args.out, result, [
        Figure(f"audit transactions' wall time per event, {label}",
               median["embedded"]["transaction_wall"], "us/event",
               baseline=f"{args.setting}={args.baseline}",
               baseline_value=median["baseline"]["transaction_wall"], better="lower",
               settings=settings_text, load_average=loads[-1]),
        Figure(f"PostgreSQL server CPU per event, {label}", median["embedded"]["server_cpu"],
               "us/event", baseline=f"{args.setting}={args.baseline}",
               baseline_value=median["baseline"]["server_cpu"], better="lower",
               settings=settings_text, load_average=loads[-1])])


if __name__ == "__main__":
    main()
