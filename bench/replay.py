"""Time to ready of a catalog reader against log length, with and without a snapshot.

Run from the repository root::

    python bench/replay.py [--quick] [--sizes 10000 100000 1000000] [--tail 20000]

Starts its own Apache Kafka (KRaft) unless LORAPLANE_KAFKA_BOOTSTRAP names a broker. For
each size N it writes a log of N events shaped like a busy platform's (see `MIX`: mostly
request traces on the worker topic, a few percent catalog commands on the adapter topic,
one heartbeat per worker on the liveness topic), then times, in the same process:

- `full_decode`: the reader before this change: every record decoded and validated and
  handed to `CatalogState.apply`, until every partition reported its end;
- `follower`: `LogFollower` + `CatalogFold` from the beginning, no snapshot (records of
  types the catalog does not fold are skipped undecoded);
- `snapshot`: the same follower resuming from the snapshot a previous follower wrote when
  it stopped at N events, after `--tail` more events were written (the worst case with the
  default `snapshot_every_events`).

Each figure is the wall time from constructing the reader to ready; the load average is
recorded with it. Writes bench/results/replay.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import BenchRun, Figure  # noqa: E402
from services.catalog.snapshot import CatalogFold  # noqa: E402
from services.catalog.state import CatalogState, LogPosition  # noqa: E402
from services.config import Settings  # noqa: E402
from services.contracts.codec import canonical_bytes, decode  # noqa: E402
from services.contracts.events import (  # noqa: E402
    AdapterLoaded,
    AdapterVersionPublished,
    AdapterVersionSwitched,
    Envelope,
    RequestServed,
    ServedRequest,
    SplitEntry,
    TenantRef,
    TrafficSplitChanged,
    WorkerHeartbeat,
    uuid7,
)
from services.eventlog import EventConsumer, ensure_topics  # noqa: E402
from services.eventlog.follower import LogFollower  # noqa: E402
from services.eventlog.topics import topic_for  # noqa: E402
from services.stack.brokers import ApacheKafka  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "replay.json"
MIX = {"RequestServed": 0.90, "AdapterLoaded": 0.05, "AdapterVersionPublished": 0.03,
       "AdapterVersionSwitched": 0.015, "TrafficSplitChanged": 0.005}
"""Share of each event type in the log (heartbeats: one per worker, on the liveness topic)."""
ADAPTERS, WORKERS = 2000, 16
DIGEST = "ab" * 32
TENANT = TenantRef(org="bench", team="t", project="p")


class Templates:
    """One valid event document per type; each event is a copy with its own ids, so a
    million of them are written in seconds and each still passes its schema."""

    def __init__(self) -> None:
        at = "2026-01-01T00:00:00+00:00"
        served = ServedRequest(request_id="r", trace_id="0" * 32, tenant=TENANT, user_id="u",
                               adapter_id="a0", version=1, adapter_sha256=DIGEST,
                               base_model_digest=DIGEST, prompt_tokens=120,
                               completion_tokens=80, started_at=at, finished_at=at)
        payloads = {
            "RequestServed": RequestServed(worker_id="w0", requests=[served, served]),
            "AdapterLoaded": AdapterLoaded(worker_id="w0", adapter_id="a0", version=1,
                                           sha256=DIGEST, load_ms=12.5),
            "AdapterVersionPublished": AdapterVersionPublished(
                adapter_id="a0", version=1, label="v1", base_model="base",
                base_model_digest=DIGEST, sha256=DIGEST, config_sha256=DIGEST,
                size_bytes=4096, rank=8, lora_alpha=16.0, target_modules=["q_proj", "v_proj"],
                dtype="float16", owner="bench"),
            "AdapterVersionSwitched": AdapterVersionSwitched(adapter_id="a0", from_version=None,
                                                             to_version=1),
            "TrafficSplitChanged": TrafficSplitChanged(alias="a0", split=[
                SplitEntry(adapter_id="a0", version=1, weight=100)]),
            "WorkerHeartbeat": WorkerHeartbeat(worker_id="w0", address="w0:1",
                                               base_model="base", base_model_digest=DIGEST),
        }
        self.documents = {t: Envelope.new(p, stream="s", seq=1, actor="bench",
                                          tenant=TENANT).to_json()
                          for t, p in payloads.items()}
        self.topics = {t: type(p).topic for t, p in payloads.items()}

    def event(self, kind: str, n: int, seqs: dict[str, int]) -> tuple[str, bytes, str]:
        """(stream, value, topic kind) of the n-th event of `kind`."""
        doc = json.loads(json.dumps(self.documents[kind]))
        payload = doc["payload"]
        adapter = f"a{n % ADAPTERS}"
        worker = f"w{n % WORKERS}"
        if kind in ("RequestServed", "AdapterLoaded", "WorkerHeartbeat"):
            payload["worker_id"] = worker
            stream = f"heartbeat/{worker}" if kind == "WorkerHeartbeat" else f"worker/{worker}"
        elif kind == "TrafficSplitChanged":
            payload["alias"] = adapter
            payload["split"][0]["adapter_id"] = adapter
            stream = f"alias/{adapter}"
        else:
            payload["adapter_id"] = adapter
            stream = f"adapter/{adapter}"
        seqs[stream] = seqs.get(stream, 0) + 1
        if kind == "AdapterVersionPublished":
            version = seqs[f"v/{adapter}"] = seqs.get(f"v/{adapter}", 0) + 1
            payload["version"], payload["label"] = version, f"v{version}"
        if kind == "AdapterVersionSwitched":
            payload["to_version"] = max(1, seqs.get(f"v/{adapter}", 1))
        doc.update(event_id=str(uuid7()), stream=stream, seq=seqs[stream])
        return stream, canonical_bytes(doc), self.topics[kind]


def write_log(settings: Settings, count: int, templates: Templates, seqs: dict[str, int],
              start: int = 0) -> float:
    """Write `count` events in the mix; returns seconds taken."""
    topics = {"adapter": settings.adapter_events_topic, "worker": settings.worker_events_topic,
              "liveness": settings.liveness_topic}
    producer = Producer({"bootstrap.servers": settings.kafka_bootstrap, "linger.ms": 20,
                         "batch.num.messages": 10000, "compression.type": "lz4",
                         "enable.idempotence": True, "queue.buffering.max.messages": 500000})
    kinds = [k for k, share in MIX.items() for _ in range(round(share * 1000))]
    started = time.perf_counter()
    for n in range(start, start + count):
        kind = "WorkerHeartbeat" if n - start < WORKERS else kinds[n % len(kinds)]
        stream, value, topic = templates.event(kind, n, seqs)
        while True:
            try:
                producer.produce(topics[topic], key=stream.encode(), value=value,
                                 headers={"type": kind})
                break
            except BufferError:
                producer.poll(0.05)
        if n % 10000 == 0:
            producer.poll(0)
    producer.flush(120)
    return time.perf_counter() - started


def full_decode(settings: Settings) -> tuple[float, int]:
    """The reader before: decode and fold every record, until every partition ended."""
    state = CatalogState()
    started = time.perf_counter()
    with EventConsumer(settings, settings.topics,
                       reader_id=f"bench-full-{uuid.uuid4().hex[:6]}") as consumer:
        count = consumer.catch_up(lambda r: state.apply(
            r.envelope, LogPosition(r.topic, r.partition, r.offset)), timeout_s=3600)
    return time.perf_counter() - started, count


def follow(settings: Settings, snapshot_name: str | None) -> tuple[float, dict[str, Any],
                                                                  CatalogState]:
    fold = CatalogFold()
    started = time.perf_counter()
    follower = LogFollower(settings, fold, reader_id=f"bench-{uuid.uuid4().hex[:6]}",
                           snapshot_name=snapshot_name)
    follower.start()
    if not follower.wait_ready(3600):
        raise RuntimeError(f"follower not ready: {follower.status()}")
    took = time.perf_counter() - started
    status = follower.status()
    follower.stop()
    return took, status, fold.state


def run_size(base: Settings, size: int, tail: int, templates: Templates) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    settings = base.model_copy(update={
        "adapter_events_topic": f"replay{tag}.adapter-events",
        "worker_events_topic": f"replay{tag}.worker-events",
        "liveness_topic": f"replay{tag}.liveness", "dead_letter_topic": f"replay{tag}.dlq",
        "snapshot_dir": Path(tempfile.mkdtemp(prefix="replay-snapshots-")),
        "snapshot_every_events": 10**12, "snapshot_every_s": 10**9})
    ensure_topics(settings)
    seqs: dict[str, int] = {}
    write_s = write_log(settings, size, templates, seqs)
    print(f"{size:>9,} events written in {write_s:.1f}s", flush=True)
    load = os.getloadavg()
    full_s, count = full_decode(settings)
    print(f"  full decode: {full_s:.2f}s ({count:,} records handed over)", flush=True)
    follower_s, _, full_state = follow(settings, "bench")  # writes the snapshot on stop
    print(f"  follower, no snapshot: {follower_s:.2f}s", flush=True)
    snapshot_bytes = (settings.snapshot_root / "bench.snapshot.json").stat().st_size
    write_log(settings, tail, templates, seqs, start=size)
    resumed_s, resumed, resumed_state = follow(settings, "bench")
    assert resumed["started_from"] == "snapshot", resumed
    _, _, check_state = follow(settings, None)
    assert resumed_state == check_state, "the snapshot path must give the full replay's state"
    print(f"  follower from a snapshot + {tail:,} events: {resumed_s:.2f}s "
          f"(snapshot {snapshot_bytes / 1e6:.1f} MB)", flush=True)
    return {"events": size, "write_seconds": round(write_s, 1),
            "full_decode_seconds": round(full_s, 3),
            "follower_seconds": round(follower_s, 3),
            "snapshot_seconds": round(resumed_s, 3), "snapshot_tail_events": tail,
            "snapshot_bytes": snapshot_bytes,
            "snapshot_start": {k: resumed[k] for k in ("snapshot_read_s", "snapshot_load_s",
                                                       "consumer_open_s", "folded")},
            "adapters_in_state": len(full_state.adapters),
            "load_average_before": [round(x, 2) for x in load],
            "load_average_after": [round(x, 2) for x in os.getloadavg()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes 10,000 and 100,000")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="default 10,000 100,000 1,000,000")
    parser.add_argument("--tail", type=int, default=Settings().snapshot_every_events)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    record = BenchRun("replay", quick=args.quick)
    args.sizes = args.sizes or ([10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000])
    scratch = Path(tempfile.mkdtemp(prefix="replay-bench-"))
    base = Settings(cache_dir=ROOT / ".loraplane" / "cache", topic_partitions=args.partitions,
                    state_dir=scratch / "state")
    broker = None
    if not base.kafka_bootstrap:
        broker = ApacheKafka(base.model_copy(update={"kafka_heap": "1g"}), scratch / "kafka")
        broker.start()
        base = base.model_copy(update={"kafka_bootstrap": broker.bootstrap})
    templates = Templates()
    for kind, doc in templates.documents.items():  # every template is a valid event
        assert decode(canonical_bytes(doc)).type == kind
        assert topic_for(decode(canonical_bytes(doc)), base)
    try:
        rows = [run_size(base, size, args.tail, templates) for size in args.sizes]
    finally:
        if broker is not None:
            broker.stop()
    result = {
        "rows": rows, "mix": MIX, "adapters": ADAPTERS, "workers": WORKERS,
        "partitions": args.partitions,
        "note": "broker and reader on the same machine; seconds are wall time from creating "
                "the reader to ready (every partition at its end)",
    }
    record.save(args.out, result, figures(result))


def figures(result: dict[str, Any]) -> list[Figure]:
    out = []
    for row in result["rows"]:
        settings = (f"{row['events']:,} events ({row['adapters_in_state']:,} adapters in the "
                    f"state) over {result['partitions']} partitions; the snapshot resumes "
                    f"{row['snapshot_tail_events']:,} events before the end")
        out.append(Figure(f"catalog reader ready from a snapshot, {row['events']:,} events",
                          row["snapshot_seconds"], "s",
                          baseline="every record decoded and folded from the beginning",
                          baseline_value=row["full_decode_seconds"], better="lower",
                          settings=settings, load_average=row["load_average_after"]))
    return out


if __name__ == "__main__":
    main()
