"""Registry on loopback: publish throughput (versions/s) and rollback latency p50/p99.

Run from the repository root::

    python bench/registry.py [--quick] [--versions 200] [--rollbacks 200] [--concurrency 4]

Starts its own Apache Kafka (KRaft) unless LORAPLANE_KAFKA_BOOTSTRAP names a broker, runs
one registry under uvicorn on a loopback port, and drives it over HTTP:

- publish: validated PEFT uploads (rank 8, q/k/v/o on a 2-layer 64-wide Llama-like base)
  from `--concurrency` clients; each answer arrives only after the registry has read its
  own committed event back, so versions/s is end to end.
- rollback: switch to v2, then time `POST …/rollback` (default target v1) from request to
  answer, i.e. to the committed AdapterRolledBack event being folded.

Writes the numbers to bench/results/registry.json.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
import uvicorn
from safetensors.torch import save

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import BenchRun, Figure, load_average  # noqa: E402
from services.catalog.auth import token_hash  # noqa: E402
from services.config import Settings  # noqa: E402
from services.contracts.capacity import AdapterLimits  # noqa: E402
from services.eventlog import ensure_topics  # noqa: E402
from services.registry.app import create_app  # noqa: E402
from services.registry.validation import validate_adapter  # noqa: E402
from services.stack.brokers import ApacheKafka  # noqa: E402
from services.stack.process import free_port  # noqa: E402

TOKEN = "bench-admin"
BASE = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_hidden_layers": 2}
TENANT = {"org": "bench", "team": "t", "project": "p"}
SHAPES = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64)}


def adapter(seed: int, rank: int = 8) -> tuple[bytes, bytes]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(BASE["num_hidden_layers"]):
        for module, (fin, fout) in SHAPES.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fin, generator=gen).half()
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fout, rank, generator=gen).half()
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": list(SHAPES)}
    return json.dumps(config).encode(), save(tensors)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(args: argparse.Namespace, settings: Settings) -> dict[str, object]:
    port = free_port()
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    if not app.state.node.ready.wait(60):
        raise RuntimeError(f"registry not ready: {app.state.node.last_error}")
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    uploads = [adapter(n) for n in range(args.versions)]
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            digest = hashlib.sha256(json.dumps(BASE).encode()).hexdigest()
            client.post("/v1/base-models", json={"name": "llama", "digest": digest,
                                                 "config": BASE}).raise_for_status()

        def publish(n: int) -> None:
            config, weights = uploads[n]
            with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
                c.post(f"/v1/adapters/bench-{n % args.concurrency}/versions",
                       data={**TENANT, "owner": "bench", "base_model": "llama",
                             "label": f"v{n}"},
                       files={"adapter_config": ("c", config),
                              "adapter_model": ("m", weights)}).raise_for_status()

        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(publish, range(args.versions)))
        publish_s = time.perf_counter() - started
        validate_s = validation_alone(uploads)

        latencies = []
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            client.put("/v1/adapters/bench-0/active", json={"version": 1}).raise_for_status()
            for _ in range(args.rollbacks):
                client.put("/v1/adapters/bench-0/active", json={"version": 2}
                           ).raise_for_status()
                t0 = time.perf_counter()
                answer = client.post("/v1/adapters/bench-0/rollback", json={"reason": "bench"})
                latencies.append((time.perf_counter() - t0) * 1000)
                answer.raise_for_status()
                assert answer.json()["to_version"] == 1
            reads = []
            for _ in range(args.rollbacks):
                t0 = time.perf_counter()
                client.get("/v1/adapters/bench-0").raise_for_status()
                reads.append((time.perf_counter() - t0) * 1000)
    finally:
        server.should_exit = True
        thread.join(30)
    return {
        "versions": args.versions,
        "concurrency": args.concurrency,
        "adapter_bytes": len(uploads[0][1]),
        "publish_versions_per_s": round(args.versions / publish_s, 1),
        "validation_alone_versions_per_s": round(args.versions / validate_s, 1),
        "rollbacks": args.rollbacks,
        "rollback_ms_p50": round(statistics.median(latencies), 2),
        "rollback_ms_p99": round(percentile(latencies, 0.99), 2),
        "rollback_ms_max": round(max(latencies), 2),
        "read_ms_p50": round(statistics.median(reads), 2),
        "read_ms_p99": round(percentile(reads, 0.99), 2),
        "broker": "given" if os.environ.get("LORAPLANE_KAFKA_BOOTSTRAP") else "apache-kraft",
        "load_average_after": load_average(),
    }


def validation_alone(uploads: list[tuple[bytes, bytes]]) -> float:
    """Seconds to validate every upload in this process, one thread: every check the
    registry makes on an upload, without HTTP, blob store or Kafka."""
    started = time.perf_counter()
    for config, weights in uploads:
        validate_adapter(config, io.BytesIO(weights), len(weights), BASE,
                         limits=AdapterLimits(128), sink=io.BytesIO())
    return time.perf_counter() - started


def figures(result: dict[str, Any]) -> list[Figure]:
    load = result.get("load_average_after")
    upload = (f"{result['versions']} rank-8 uploads of {result['adapter_bytes']:,} bytes "
              f"(q/k/v/o, 2 layers) from {result['concurrency']} clients")
    return [
        Figure("publish, end to end (validated, stored, committed, read back)",
               result["publish_versions_per_s"], "versions/s",
               baseline="the same uploads validated in process, one thread (no HTTP, blob "
                        "store or Kafka)",
               baseline_value=result.get("validation_alone_versions_per_s"),
               settings=upload, load_average=load),
        Figure("rollback request to committed event read back, p50",
               result["rollback_ms_p50"], "ms",
               baseline="GET of the same adapter on the same registry, p50",
               baseline_value=result.get("read_ms_p50"), better="lower",
               settings=f"{result['rollbacks']} rollbacks, one client", load_average=load),
        Figure("rollback request to committed event read back, p99",
               result["rollback_ms_p99"], "ms",
               baseline="GET of the same adapter on the same registry, p99",
               baseline_value=result.get("read_ms_p99"), better="lower",
               settings=f"{result['rollbacks']} rollbacks, one client", load_average=load),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50 versions, 50 rollbacks")
    parser.add_argument("--versions", type=int, default=None, help="default 200")
    parser.add_argument("--rollbacks", type=int, default=None, help="default 200")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "registry.json")
    args = parser.parse_args()
    record = BenchRun("registry", quick=args.quick)
    args.versions = args.versions or (50 if args.quick else 200)
    args.rollbacks = args.rollbacks or (50 if args.quick else 200)
    scratch = Path(tempfile.mkdtemp(prefix="registry-bench-"))
    base = Settings(cache_dir=ROOT / ".loraplane" / "cache", blob_dir=scratch / "blobs",
                    topic_partitions=3, registry_transactional_id=f"bench-{os.getpid()}",
                    release_ungated="allow",  # versions without regression sets: no gates
                    auth_tokens=json.dumps([{"sha256": token_hash(TOKEN), "role": "admin"}]),
                    adapter_events_topic=f"bench{os.getpid()}.adapter-events",
                    worker_events_topic=f"bench{os.getpid()}.worker-events",
                    liveness_topic=f"bench{os.getpid()}.liveness",
                    dead_letter_topic=f"bench{os.getpid()}.dead-letter")
    broker = None
    if not base.kafka_bootstrap:
        broker = ApacheKafka(base, scratch / "kafka")
        broker.start()
        base = base.model_copy(update={"kafka_bootstrap": broker.bootstrap})
    try:
        ensure_topics(base)
        result = run(args, base)
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    record.save(args.out, result, figures(result))


if __name__ == "__main__":
    main()
