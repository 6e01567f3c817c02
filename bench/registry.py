"""Registry on loopback: publish throughput (versions/s) and rollback latency p50/p99.

Run from the repository root::

    python bench/registry.py [--versions 200] [--rollbacks 200] [--concurrency 4]

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
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
import uvicorn
from safetensors.torch import save

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.config import Settings  # noqa: E402
from services.eventlog import ensure_topics  # noqa: E402
from services.registry.app import create_app  # noqa: E402
from services.registry.auth import token_hash  # noqa: E402
from services.stack.brokers import ApacheKafka  # noqa: E402
from services.stack.process import free_port  # noqa: E402

TOKEN = "bench-admin"
BASE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2}
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
    finally:
        server.should_exit = True
        thread.join(30)
    return {
        "versions": args.versions,
        "concurrency": args.concurrency,
        "adapter_bytes": len(uploads[0][1]),
        "publish_versions_per_s": round(args.versions / publish_s, 1),
        "rollbacks": args.rollbacks,
        "rollback_ms_p50": round(statistics.median(latencies), 2),
        "rollback_ms_p99": round(percentile(latencies, 0.99), 2),
        "rollback_ms_max": round(max(latencies), 2),
        "broker": "given" if os.environ.get("LORAPLANE_KAFKA_BOOTSTRAP") else "apache-kraft",
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=200)
    parser.add_argument("--rollbacks", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "registry.json")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="registry-bench-"))
    base = Settings(cache_dir=ROOT / ".loraplane" / "cache", blob_dir=scratch / "blobs",
                    topic_partitions=3, registry_transactional_id=f"bench-{os.getpid()}",
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
