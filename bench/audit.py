"""Sustained audit projection throughput (events/s) on real Kafka and PostgreSQL.

Produces N mixed events first (mostly request traces of 4 requests and heartbeats, see
`tests/audit/scenario.py`), then times a projector draining them from offset 0, `--runs`
times into fresh schemas: every event decoded and validated, its personal fields sealed,
chained, leaf-hashed, folded into the current-state and history tables, with offsets, in
batches of `--batch` per transaction, and a signed checkpoint every `--checkpoint-every`
events per partition (committed synchronously and published as a note). Records the
PostgreSQL durability settings, the load average, and the CPU the projector and the
server spent per event.

    python bench/audit.py [--quick]

Uses LORAPLANE_KAFKA_BOOTSTRAP / LORAPLANE_DATABASE_URL when set, else starts Apache
Kafka (KRaft) and embedded PostgreSQL for the run. Writes bench/results/audit.json.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import os
import pstats
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/audit.py` measures this checkout's code

import psycopg  # noqa: E402
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition  # noqa: E402
from sqlalchemy import func, select  # noqa: E402

from bench.record import BenchRun, Figure  # noqa: E402
from services.audit.db import make_engine, upgrade  # noqa: E402
from services.audit.projector import AuditProjector  # noqa: E402
from services.audit.tables import events, request_traces  # noqa: E402
from services.config import Settings  # noqa: E402
from services.eventlog.client import consumer_config  # noqa: E402
from services.eventlog.topics import ensure_topics  # noqa: E402
from services.stack.postgres import libpq_url  # noqa: E402
from tests.audit.scenario import mixed, produce, recorded  # noqa: E402

RESULTS = REPO / "bench" / "results" / "audit.json"


@contextlib.contextmanager
def services(workdir: Path) -> Iterator[tuple[str, str, int | None, int | None]]:
    """(kafka bootstrap, database url, database server pid, broker pid if started here):
    from the environment or started here."""
    with contextlib.ExitStack() as stack:
        bootstrap = os.environ.get("LORAPLANE_KAFKA_BOOTSTRAP")
        url = os.environ.get("LORAPLANE_DATABASE_URL")
        broker_pid = None
        if not bootstrap:
            from services.stack.brokers import ApacheKafka

            broker = ApacheKafka(Settings(cache_dir=REPO / ".loraplane" / "cache",
                                          topic_partitions=3), workdir / "kafka")
            broker.start()
            stack.callback(broker.stop)
            bootstrap, broker_pid = broker.bootstrap, broker.pid
        if not url:
            from services.stack.postgres import LocalPostgres

            server = LocalPostgres(workdir / "pg")
            server.start()
            stack.callback(server.stop)
            url = server.url
        yield bootstrap, url, _postmaster(url), broker_pid


DURABILITY = ("fsync", "full_page_writes", "synchronous_commit", "wal_compression",
              "max_wal_size", "checkpoint_timeout", "shared_buffers", "wal_buffers")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _postmaster(url: str) -> int | None:
    """The pid of the server when it runs on this machine (the parent of our backend),
    read while the backend lives: once the connection closes its process may be gone."""
    with psycopg.connect(libpq_url(url)) as conn:
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        try:
            return int(Path(f"/proc/{backend}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None


def _server_cpu_s(pid: int | None) -> float | None:
    """CPU seconds of a server we started (PostgreSQL: the postmaster and its children;
    the broker: its one process, all its threads)."""
    if pid is None:
        return None
    total = 0
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for process in [pid, *map(int, children)]:
        try:
            fields = Path(f"/proc/{process}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # a backend that just exited
            continue
        total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


def _drop_schema(url: str, tag: str) -> None:
    """Drop a finished run's schema. Left in place, its tables (50,000 rows inserted into
    empty tables) were vacuumed and analyzed by autovacuum during the next runs, which
    then counted that work as theirs: 20-30 us/event more PostgreSQL CPU in the runs
    where it happened. A production store has one schema, whose own passes still count."""
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{_schema(tag)}" CASCADE')


def _schema(tag: str) -> str:
    """The schema of one run's store."""
    return f"bench_{tag}"


def _schema_url(url: str, tag: str) -> str:
    schema = _schema(tag)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options=-csearch_path%3D{schema}"


def project_once(settings: Settings, produced: int, kept: int, server_pid: int | None,
                 profile: bool, watcher: _MaintenanceWatcher,
                 broker_pid: int | None = None) -> dict[str, object]:
    """One projector draining all `produced` events (`kept` of them stored one by one, the
    rest liveness summaries) into a fresh schema."""
    assert settings.database_url
    upgrade(settings.database_url)
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
    profiler = cProfile.Profile() if profile else None
    preparer_profiler = cProfile.Profile() if profile else None
    spent = {"poll": 0.0, "prepare": 0.0, "write": 0.0}
    threads: dict[str, float] = {}
    _account(projector, spent, preparer_profiler, threads)
    collections = _GarbageCollections()
    load_before = os.getloadavg()
    wal0 = _server_stats(settings.database_url)
    broker0 = _server_cpu_s(broker_pid)
    cpu0, server0, t0 = time.process_time(), _server_cpu_s(server_pid), time.perf_counter()
    if profiler:
        profiler.enable()
    started = time.perf_counter()
    with collections:
        projector.run(stop)  # what `loraplane serve audit` runs: reader thread + writer
    project_s = time.perf_counter() - t0
    cpu, server1 = time.process_time() - cpu0, _server_cpu_s(server_pid)
    broker1 = _server_cpu_s(broker_pid)
    if profiler and preparer_profiler:
        profiler.disable()
        print("--- writer thread ---")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
        print("--- preparer thread (poll, decode, prepare) ---")
        pstats.Stats(preparer_profiler).sort_stats("tottime").print_stats(40)
        preparer_profiler.dump_stats(str(RESULTS.with_suffix(".prof")))
    projector.close()
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(events)).scalar_one() == kept
        traces = conn.execute(select(func.count()).select_from(request_traces)).scalar_one()
    engine.dispose()
    wal1 = _server_stats(settings.database_url, settled=True)
    return {
        "events_per_second": round(produced / project_s),
        "stored_events_per_second": round(kept / project_s), "projection_seconds":
        round(project_s, 2), "batches": batches, "request_trace_rows": traces,
        "projector_cpu_us_per_event": round(cpu / produced * 1e6),
        "postgres_cpu_us_per_event": (round((server1 - server0) / produced * 1e6)
                                      if server0 is not None and server1 is not None
                                      else None),
        "broker_cpu_us_per_event": (round((broker1 - broker0) / produced * 1e6)
                                    if broker0 is not None and broker1 is not None else None),
        "cpu_us_per_event_by_step": {
            step: round(seconds / produced * 1e6) for step, seconds in
            {**spent, "other (librdkafka threads, garbage collector, thread hand-off)":
             cpu - sum(spent.values())}.items()},
        "thread_cpu_us_per_event": {name: round(seconds / produced * 1e6)
                                    for name, seconds in threads.items()},
        "garbage_collector": collections.summary(produced),
        "postgres_per_event": {name: round((wal1[name] - wal0[name]) / produced, 2)
                               for name in wal0 if name not in MAINTENANCE},
        "postgres_maintenance": {
            **{name: int(wal1[name] - wal0[name]) for name in MAINTENANCE},
            "autovacuum_seconds_seen": watcher.between(started, time.perf_counter()),
            "run_window_s": [round(started - watcher.t0, 1),
                             round(time.perf_counter() - watcher.t0, 1)]},
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


class _GarbageCollections:
    """Count and time the cyclic garbage collector's passes per generation (all threads)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._started

    def __enter__(self) -> _GarbageCollections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self, produced: int) -> dict[str, object]:
        return {"collections_per_generation": self.count,
                "us_per_event_per_generation": [round(s / produced * 1e6, 2)
                                                for s in self.seconds]}


SERVER_STATS = """
    SELECT w.wal_records, w.wal_fpi, w.wal_bytes, c.num_timed + c.num_requested,
           c.buffers_written, (SELECT sum(writes) FROM pg_stat_io
                               WHERE backend_type = 'client backend'),
           w.wal_buffers_full,
           (SELECT sum(autovacuum_count) FROM pg_stat_all_tables),
           (SELECT sum(autoanalyze_count) FROM pg_stat_all_tables)
    FROM pg_stat_wal w, pg_stat_checkpointer c"""


MAINTENANCE = ("autovacuums", "autoanalyzes")
"""Counts over the run, not per event: each one is a pass over a whole table."""


class _MaintenanceWatcher:
    """Samples `pg_stat_activity` every 0.1 s for the whole bench for autovacuum workers
    (what they work on, when), so a run slowed by a vacuum or analyze pass says so, and the
    passes between runs are seen too."""

    def __init__(self, url: str) -> None:
        self._url = libpq_url(url)
        self._stop = threading.Event()
        self.t0 = time.perf_counter()
        self.seen: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        with psycopg.connect(self._url, autocommit=True) as conn:
            while not self._stop.wait(0.1):
                now = time.perf_counter()
                for (query,) in conn.execute(
                        "SELECT query FROM pg_stat_activity "
                        "WHERE backend_type = 'autovacuum worker' AND query <> ''"):
                    self.seen.append((now, query))

    def __enter__(self) -> _MaintenanceWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> dict[str, float]:
        """Seconds each autovacuum pass was seen running between two `perf_counter`s."""
        seen: dict[str, float] = {}
        for at, query in self.seen:
            if start <= at <= end:
                seen[query] = round(seen.get(query, 0.0) + 0.1, 1)
        return dict(sorted(seen.items(), key=lambda kv: -kv[1]))

    def timeline(self) -> list[tuple[float, float, str]]:
        """(first seen, last seen, pass) in seconds from the watcher's start."""
        spans: dict[str, list[float]] = {}
        for at, query in self.seen:
            spans.setdefault(query, [at, at])[1] = at
        return [(round(a - self.t0, 1), round(b - self.t0, 1), q)
                for q, (a, b) in sorted(spans.items(), key=lambda kv: kv[1][0])]


def _server_stats(url: str | None, *, settled: bool = False) -> dict[str, float]:
    """WAL records, full-page images and bytes, checkpoints, the checkpointer's and the
    client backends' buffer writes, WAL writes forced by full WAL buffers, autovacuum and
    autoanalyze passes so far (server-wide: the bench is the only writer).

    A backend adds its counts to these views at most once a second and when it exits, so
    a run's last second was counted in the next run's figures (WAL records per event read
    10.4 to 13.6 across runs of the same batches): `settled` waits for the run's
    connections, already closed, to exit first."""
    assert url
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        deadline = time.perf_counter() + 5
        while settled and time.perf_counter() < deadline and conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
                "AND pid <> pg_backend_pid() AND query NOT LIKE '%pg_stat_activity%'"
                ).fetchone() != (0,):
            time.sleep(0.02)
        row = conn.execute(SERVER_STATS).fetchone()
    assert row is not None
    names = ("wal_records", "wal_full_page_images", "wal_bytes", "checkpoints",
             "checkpointer_buffers_written", "backend_buffers_written", "wal_buffers_full",
             "autovacuums", "autoanalyzes")
    return {name: float(value or 0) for name, value in zip(names, row, strict=True)}


def _account(projector: AuditProjector, spent: dict[str, float],
             profiler: cProfile.Profile | None, threads: dict[str, float]) -> None:
    """Add each step's thread CPU time to `spent` (poll: consume and decode; prepare: the
    rest of the Python work; write: the transaction), profiling the preparer's steps, and
    each Python thread's whole CPU time (steps, waits, hand-off, collections) to
    `threads`, with the wall time of each step and of the parts of the preparer's that
    may wait (librdkafka's `consume`, the dedupe query, loading current-state rows, polls
    that read nothing) and of the writer's COMMIT."""
    seen: dict[str, float] = {}
    committing: list[float] = []  # when the batch's writes were done and COMMIT was sent
    projector.before_commit = lambda conn: committing.append(time.perf_counter())

    def timed(step: str, method: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            if profiler is not None and step != "write":
                profiler.enable()
            started, wall = time.thread_time(), time.perf_counter()
            thread = "writer" if step == "write" else "preparer"
            seen.setdefault(thread, started)
            result = None
            try:
                result = method(*args, **kwargs)
                return result
            finally:
                now = time.thread_time()
                if step == "poll" and result is not None and not result.records:
                    _add_time(threads, "preparer polls that read nothing", wall)
                if step == "write" and committing:
                    _add_time(threads, "writer commit", committing.pop())
                _add_time(threads, step, wall)
                spent[step] += now - started
                threads[thread] = now - seen[thread]
                threads[f"{thread} wall in steps"] = threads.get(
                    f"{thread} wall in steps", 0.0) + time.perf_counter() - wall
                if profiler is not None and step != "write":
                    profiler.disable()
        return run

    projector.poll_batch = timed("poll", projector.poll_batch)  # type: ignore[method-assign]
    reader = projector.consumer  # opened (and seeked) before the clock starts
    reader._consumer = _TimedConsume(reader._consumer, threads)  # type: ignore[assignment]
    for part in ("_fresh", "_load_state"):
        setattr(projector, part, _timed_part(part, getattr(projector, part), threads))
    projector._prepare = timed("prepare", projector._prepare)  # type: ignore[method-assign]
    projector.write_batch = timed("write", projector.write_batch)  # type: ignore[method-assign]


def _add_time(threads: dict[str, float], name: str, wall: float,
              cpu: float | None = None) -> None:
    """Add the wall time (and the thread CPU time) since `wall` (`cpu`) to `threads`."""
    threads[f"{name} wall"] = threads.get(f"{name} wall", 0.0) + time.perf_counter() - wall
    if cpu is not None:
        threads[f"{name} cpu"] = threads.get(f"{name} cpu", 0.0) + time.thread_time() - cpu


class _TimedConsume:
    """A Kafka consumer whose `consume` adds its wall and thread CPU time to `threads`:
    waits for librdkafka's fetches show as wall above CPU."""

    def __init__(self, consumer: Any, threads: dict[str, float]) -> None:
        self._consumer = consumer
        self.consume = _timed_part("consume", consumer.consume, threads)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def _timed_part(name: str, method: Any, threads: dict[str, float]) -> Any:
    """`method` adding its wall and thread CPU time to `threads` (a database round trip
    inside the preparer shows as wall well above CPU)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            _add_time(threads, f"preparer {name}", wall, cpu)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10,000 events, one run")
    parser.add_argument("--events", type=int, default=None, help="default 50,000")
    parser.add_argument("--runs", type=int, default=None,
                        help="projections of the same log (default 3)")
    parser.add_argument("--batch", type=int, default=Settings().audit_batch_size)
    parser.add_argument("--checkpoint-every", type=int, default=1000)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile the projection")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    record = BenchRun("audit", quick=args.quick)
    args.events = args.events or (10_000 if args.quick else 50_000)
    args.runs = args.runs or (1 if args.quick else 3)

    with tempfile.TemporaryDirectory() as tmp, \
            services(Path(tmp)) as (bootstrap, url, pid, broker_pid):
        tag = uuid.uuid4().hex[:8]
        settings = Settings(
            kafka_bootstrap=bootstrap, adapter_events_topic=f"bench{tag}.adapter-events",
            worker_events_topic=f"bench{tag}.worker-events",
            liveness_topic=f"bench{tag}.liveness",
            dead_letter_topic=f"bench{tag}.dead-letter", topic_partitions=args.partitions,
            audit_batch_size=args.batch, audit_checkpoint_every=args.checkpoint_every,
            audit_signing_key="42" * 32, audit_kek="43" * 32, state_dir=Path(tmp) / "state")
        ensure_topics(settings)

        t0 = time.perf_counter()
        generated = list(mixed(args.events))
        kept = len(recorded(generated))  # heartbeats update summaries, are not stored
        produced = produce(settings, generated)
        produce_s = time.perf_counter() - t0
        print(f"produced {produced} events in {produce_s:.1f}s "
              f"({produced / produce_s:,.0f}/s)")
        with psycopg.connect(libpq_url(url)) as conn:
            server = {name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
                      for name in DURABILITY}
        read_s = read_alone(settings, produced)
        print(f"bare consumer: {produced / read_s:,.0f} events/s")
        runs = []
        with _MaintenanceWatcher(url) as watcher:
            for run in range(args.runs):
                url_of_run = _schema_url(url, f"{tag}_{run}")
                runs.append(project_once(settings.model_copy(update={"database_url": url_of_run}),
                                         produced, kept, pid, args.profile and run == 0,
                                         watcher, broker_pid))
                _drop_schema(url, f"{tag}_{run}")
                print(f"run {run + 1}: {runs[-1]['events_per_second']:,} events/s "
                      f"(projector {runs[-1]['projector_cpu_us_per_event']} us CPU/event, "
                      f"PostgreSQL {runs[-1]['postgres_cpu_us_per_event']} us CPU/event, "
                      f"broker {runs[-1]['broker_cpu_us_per_event']} us CPU/event, "
                      f"load {runs[-1]['load_average_before']}; "
                      f"maintenance {runs[-1]['postgres_maintenance']})")

    rates = sorted(r["events_per_second"] for r in runs)  # type: ignore[type-var]
    median = rates[len(rates) // 2]
    result = {
        "events": produced, "events_stored": kept, "events_per_second": median,
        "reported": f"median of {args.runs} runs", "runs": runs, "batch_size": args.batch,
        "checkpoint_every": args.checkpoint_every, "partitions": args.partitions,
        "postgres_settings": server, "autovacuum_timeline_s": watcher.timeline(),
        "produce_events_per_second": round(produced / produce_s),
        "read_alone_events_per_second": round(produced / read_s),
        "note": "broker, PostgreSQL and the projector on the same machine; durable PostgreSQL "
                "(settings above); personal fields sealed (AES-GCM-SIV) as in production",
    }
    print(f"projection: {median:,} events/s (median of {args.runs})")
    record.save(args.out, result, figures(result))


def read_alone(settings: Settings, produced: int) -> float:
    """Seconds for a bare Kafka consumer (the projector's client settings) to fetch every
    record of the same log, decoding nothing and writing nothing: the ceiling a projector
    on this broker and machine could reach."""
    consumer = Consumer(consumer_config(settings, f"bench-read-{uuid.uuid4().hex[:6]}"))
    metadata = consumer.list_topics(timeout=30)
    parts = [TopicPartition(topic, p, OFFSET_BEGINNING) for topic in settings.topics
             for p in metadata.topics[topic].partitions]
    pending = {(tp.topic, tp.partition) for tp in parts}
    seen = 0
    started = time.perf_counter()
    consumer.assign(parts)
    while pending:
        for message in consumer.consume(num_messages=1000, timeout=1.0):
            if message.error() is None:
                seen += 1
            elif message.error().code() == KafkaError._PARTITION_EOF:
                pending.discard((message.topic(), message.partition()))
    took = time.perf_counter() - started
    consumer.close()
    assert seen >= produced, (seen, produced)
    return took


def figures(result: dict[str, Any]) -> list[Figure]:
    runs = result["runs"]
    median = sorted(runs, key=lambda r: r["events_per_second"])[len(runs) // 2]
    pg = result["postgres_settings"]
    settings = (f"{result['events']:,} mixed events ({result['events_stored']:,} stored and "
                f"chained), {result['partitions']} partitions, batches of "
                f"{result['batch_size']}, a signed checkpoint every "
                f"{result['checkpoint_every']} events; PostgreSQL fsync={pg['fsync']}, "
                f"synchronous_commit={pg['synchronous_commit']}; {result['reported']}")
    return [Figure(
        "audit projection, durable PostgreSQL", result["events_per_second"], "events/s",
        baseline="a bare Kafka consumer fetching the same log (no decoding, no database)",
        baseline_value=result.get("read_alone_events_per_second"),
        target=">= 10,000 events/s", meets_target=result["events_per_second"] >= 10_000,
        settings=settings, load_average=median["load_average_after"])]


if __name__ == "__main__":
    main()
