"""Serving overhead: gRPC streaming tokens/s of a worker process vs the bare engine.

The same requests, in the same run, on the same model and adapters: the random Llama and
workload of `bench/multi_lora.py` (hidden 1024, 8 layers, GQA, vocab 32000, fp32, CPU;
prompts of 16-512 tokens, 8-128 output tokens each, greedy, `ignore_eos`), over
`--adapters` PEFT adapters of ranks 8-64 published over REST. `--family qwen2` serves the
random Qwen2 of that shape instead (q/k/v biases, tied embeddings; results in
`bench/results/serve_qwen2.json`).

- worker: Apache Kafka (embedded), a registry, one `loraplane serve worker` process; the
  bench opens one grpc.aio stream per request, all at once, and counts streamed tokens
  from the first request sent to the last FinalUsage received.
- engine: `Engine` in a process of its own with the worker's engine settings, the same
  adapter files loaded, the same requests submitted at once and run to completion in one
  thread (as the worker's engine loop runs it).

Each side is warmed up (adapters resident) and run `--repeats` times, alternating; the
median of each is reported. Target: the worker at least 90% of the engine.

Durable traces: the worker above holds each request's FinalUsage until its trace is
acknowledged by Kafka (`worker_trace_durable`, the default). A second worker process
with it off (traces batched every 0.5 s, finals not held) runs the same requests in the
same rounds, so the cost is measured side by side: tokens/s, time to first token,
end-to-end latency, and the gap between a request's last token and its FinalUsage (where
the hold shows itself), per request, client side.

`--tls` adds the cost of TLS: a second worker process serving the same model over TLS
(certificates made for the run, `services.tls`), run in the same rounds as the plaintext
one, alternating; tokens/s and time to first token (per request, client side) of each
(results in `bench/results/serve_tls.json`).

Usage: python bench/serve.py [--quick] [--requests 32] [--adapters 8] [--repeats 2]
                             [--family llama|qwen2] [--tls]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from bench.multi_lora import ATTN, MLP, RANKS, build_random_base, mixed_workload, write_adapter
from bench.record import BenchRun, Figure
from services.config import Settings
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.worker.app import engine_config
from services.worker.engine import (
    AdapterFiles,
    Engine,
    GenerationRequest,
    ModelConfig,
    SamplingParams,
)
from tests.registry.conftest import TENANT
from tests.worker.harness import bench_stack, peft_files, publish_files, switch

WORKER = {"worker_adapter_slots": 8, "worker_max_lora_rank": 64, "worker_kv_blocks": 4096,
          "worker_block_size": 16, "worker_max_running": 64,
          "worker_max_tokens_per_step": 2048, "worker_device": "cpu",
          "worker_dtype": "float32"}


async def grpc_run(address: str, workload: list[dict], names: list[str],
                   credentials: grpc.ChannelCredentials | None = None
                   ) -> tuple[int, float, list[tuple[float, float, float]]]:
    """Streamed tokens, seconds from the first request sent to the last FinalUsage, and per
    request (time to first token, end to end, last token to FinalUsage), in seconds. With
    `credentials`, over TLS."""
    tenant = pb.TenantSignature(org_id=TENANT["org"], team_id=TENANT["team"],
                                project_id=TENANT["project"])
    channel = (grpc.aio.secure_channel(address, credentials) if credentials is not None
               else grpc.aio.insecure_channel(address))
    async with channel:
        stub = pb_grpc.InferenceStub(channel)

        async def one(r: dict) -> tuple[int, tuple[float, float, float]]:
            request = pb.GenerateRequest(
                tenant=tenant, adapter=pb.AdapterRef(alias=names[r["adapter"]]),
                sampling=pb.SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True))
            request.token_ids.ids.extend(r["prompt"])
            tokens = 0
            sent = time.perf_counter()
            first = last = final = sent
            async for response in stub.Generate(request, timeout=600):
                if response.HasField("token"):
                    last = time.perf_counter()
                    if not tokens:
                        first = last
                    tokens += 1
                else:
                    final = time.perf_counter()
            return tokens, (first - sent, final - sent, final - last)

        started = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in workload))
        return (sum(n for n, _ in results), time.perf_counter() - started,
                [times for _, times in results])


def percentile(values: list[float], q: float) -> float:
    """Nearest rank, in milliseconds."""
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1e3, 2)


def latencies(samples: list[tuple[float, float, float]]) -> dict[str, float]:
    ttft, total, hold = (list(x) for x in zip(*samples, strict=True))
    return {"ttft_p50_ms": percentile(ttft, 0.5), "e2e_p50_ms": percentile(total, 0.5),
            "e2e_p95_ms": percentile(total, 0.95),
            "last_token_to_final_p50_ms": percentile(hold, 0.5),
            "last_token_to_final_p95_ms": percentile(hold, 0.95)}


_ENGINE: dict[str, object] = {}


def engine_open(model_dir: str, adapter_dirs: list[str]) -> None:
    """In the engine's own process: load the model and adapters once."""
    settings = Settings().model_copy(update=WORKER)
    engine = Engine.from_pretrained(model_dir, engine_config(settings))
    _ENGINE["engine"] = engine
    _ENGINE["digests"] = [engine.load_adapter(AdapterFiles.from_dir(d)).digest
                          for d in adapter_dirs]


def engine_run(workload: list[dict]) -> tuple[int, float]:
    """The bare engine on the same requests, all submitted at once, run to completion."""
    engine: Engine = _ENGINE["engine"]  # type: ignore[assignment]
    digests: list = _ENGINE["digests"]  # type: ignore[assignment]
    requests = [GenerationRequest(prompt_token_ids=r["prompt"],
                                  sampling=SamplingParams(max_tokens=r["max_tokens"],
                                                          ignore_eos=True),
                                  adapter_digest=digests[r["adapter"]])
                for r in workload]
    results: list = []
    # in a thread of its own, as the worker's engine loop runs: torch's OpenMP team behaves
    # differently from the main thread (several times slower there on a loaded 2-core box)
    runner = threading.Thread(target=lambda: results.extend(engine.generate(requests)))
    started = time.perf_counter()
    runner.start()
    runner.join()
    return sum(len(r.token_ids) for r in results), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="12 requests, 4 adapters, 1 run")
    parser.add_argument("--requests", type=int, default=None, help="default 32")
    parser.add_argument("--adapters", type=int, default=None, help="default 8")
    parser.add_argument("--repeats", type=int, default=None, help="default 2")
    parser.add_argument("--batched-first", action="store_true",
                        help="start the batched-trace worker process first (by default the "
                             "durable one is): a check that a difference follows the mode, "
                             "not the process")
    parser.add_argument("--family", default="llama", choices=("llama", "qwen2"),
                        help="the random model served (bench/multi_lora.py builds both)")
    parser.add_argument("--tls", action="store_true",
                        help="plaintext against TLS, two worker processes, same rounds")
    parser.add_argument("--out", default=None, help="default bench/results/serve.json "
                        "(serve_qwen2.json for --family qwen2, serve_tls.json with --tls)")
    args = parser.parse_args()
    args.out = args.out or str(Path(__file__).parent / "results" / (
        "serve_tls.json" if args.tls else
        "serve.json" if args.family == "llama" else f"serve_{args.family}.json"))
    if args.tls:
        tls_main(args)
        return
    record = BenchRun("serve", quick=args.quick)
    args.requests = args.requests or (12 if args.quick else 32)
    args.adapters = args.adapters or (4 if args.quick else 8)
    args.repeats = args.repeats or (1 if args.quick else 2)
    bases: list = []
    with bench_stack("serve", lambda d: bases.append(build_random_base(d, 7, smoke=False,
                                                                       family=args.family)),
                     tail=False, max_upload_bytes=256 * 1024 * 1024) as (root, stack):
        targets = (ATTN, MLP, ATTN + MLP, ("q_proj", "v_proj", "down_proj"))
        dirs = []
        shape = ModelConfig.from_dir(root / "base")
        for i in range(args.adapters):
            write_adapter(root / f"a{i}", shape, RANKS[i % len(RANKS)],
                          targets[i % len(targets)], seed=100 + i)
            dirs.append(root / f"a{i}")
        bases.clear()
        workload = mixed_workload(args.requests, args.adapters, 32000, seed=1234)
        names = [f"bench-{i}" for i in range(args.adapters)]
        with stack.publisher() as pub:
            for name, folder in zip(names, dirs, strict=True):
                publish_files(pub, name, peft_files(folder), "v1", TENANT)
                switch(pub, name, 1)
        worker = stack.worker("bench-w", heartbeat_interval_s=1.0,
                              worker_trace_flush_s=0.5, log_level="WARNING",
                              worker_trace_durable=True, **WORKER)
        batched = stack.worker("bench-b", heartbeat_interval_s=1.0,
                               worker_trace_flush_s=0.5, log_level="WARNING",
                               worker_trace_durable=False, **WORKER)
        for process in (batched, worker) if args.batched_first else (worker, batched):
            process.start().wait_serving(300)
        warm = [{"prompt": [5, 6, 7], "max_tokens": 2, "adapter": i}
                for i in range(args.adapters)]
        asyncio.run(grpc_run(worker.address, warm, names))
        asyncio.run(grpc_run(batched.address, warm, names))
        # the bare engine in a process of its own, like the worker's: this one runs the
        # registry and the gRPC client, whose threads would slow a Python loop here
        bare = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=engine_open,
                                   initargs=(str(root / "base"), [str(d) for d in dirs]))
        bare.submit(engine_run, warm).result()
        runs: dict[str, list[float]] = {"engine": [], "grpc": [], "grpc_batched": []}
        samples: dict[str, list[tuple[float, float, float]]] = {"grpc": [],
                                                                "grpc_batched": []}
        loads: list[float] = []
        tokens = 0
        for repeat in range(args.repeats):
            tokens, seconds = bare.submit(engine_run, workload).result()
            runs["engine"].append(tokens / seconds)
            loads.append(os.getloadavg()[0])
            # the two trace modes alternate which goes first, round by round
            order = [("grpc", worker), ("grpc_batched", batched)]
            for name, process in order if repeat % 2 == 0 else order[::-1]:
                streamed, seconds, times = asyncio.run(
                    grpc_run(process.address, workload, names))
                assert streamed == tokens, (streamed, tokens)
                runs[name].append(streamed / seconds)
                samples[name].extend(times)
                loads.append(os.getloadavg()[0])
        bare.shutdown()
    engine_tok_s = statistics.median(runs["engine"])
    grpc_tok_s = statistics.median(runs["grpc"])
    batched_tok_s = statistics.median(runs["grpc_batched"])
    report = {
        "requests": args.requests, "adapters": args.adapters, "output_tokens": tokens,
        "model": {"family": args.family, "hidden": 1024, "layers": 8, "heads": 16,
                  "kv_heads": 4,
                  "intermediate": 2816, "vocab": 32000, "dtype": "float32", "device": "cpu"},
        "worker_settings": WORKER, "threads": torch.get_num_threads(),
        "engine_tok_s": round(engine_tok_s, 2), "grpc_tok_s": round(grpc_tok_s, 2),
        "runs_tok_s": {k: [round(x, 2) for x in v] for k, v in runs.items()},
        "grpc_vs_engine": round(grpc_tok_s / engine_tok_s, 4),
        "target_ratio": 0.9,
        "trace_durability": {
            "durable": {"tok_s": round(grpc_tok_s, 2), **latencies(samples["grpc"])},
            "batched": {"tok_s": round(batched_tok_s, 2),
                        **latencies(samples["grpc_batched"])},
            "durable_vs_batched_tok_s": round(grpc_tok_s / batched_tok_s, 4),
            "settings": "durable: worker_trace_durable on (FinalUsage after the trace's "
                        "Kafka ack, group commit); batched: off, worker_trace_flush_s 0.5; "
                        "latencies per request, client side, over every round",
            "started_first": "batched" if args.batched_first else "durable",
        },
        "load_avg_after_runs": [round(x, 2) for x in loads],
    }
    report["meets_target"] = report["grpc_vs_engine"] >= 0.9
    record.save(args.out, report, figures(report))


def tls_main(args: argparse.Namespace) -> None:
    """Plaintext and TLS workers on the same model, adapters and requests, alternating."""
    from tests.certificates import Authority

    record = BenchRun("serve_tls", quick=args.quick)
    args.requests = args.requests or (12 if args.quick else 32)
    args.adapters = args.adapters or (4 if args.quick else 8)
    args.repeats = args.repeats or (3 if args.quick else 4)
    bases: list = []
    with bench_stack("serve-tls", lambda d: bases.append(build_random_base(d, 7, smoke=False)),
                     tail=False, max_upload_bytes=256 * 1024 * 1024) as (root, stack):
        shape = ModelConfig.from_dir(root / "base")
        targets = (ATTN, MLP, ATTN + MLP, ("q_proj", "v_proj", "down_proj"))
        names = [f"bench-{i}" for i in range(args.adapters)]
        with stack.publisher() as pub:
            for i, name in enumerate(names):
                write_adapter(root / f"a{i}", shape, RANKS[i % len(RANKS)],
                              targets[i % len(targets)], seed=100 + i)
                publish_files(pub, name, peft_files(root / f"a{i}"), "v1", TENANT)
                switch(pub, name, 1)
        bases.clear()
        ca = Authority(root / "certs")
        pem = ca.issue("worker")
        credentials = grpc.ssl_channel_credentials(root_certificates=ca.ca.read_bytes())
        common = {"heartbeat_interval_s": 1.0, "worker_trace_flush_s": 0.5,
                  "log_level": "WARNING", **WORKER}
        workers = {"plaintext": (stack.worker("bench-plain", **common), None),
                   "tls": (stack.worker("bench-tls", tls_cert_file=pem.cert,
                                        tls_key_file=pem.key, tls_ca_file=ca.ca, **common),
                           credentials)}
        for name, (worker, creds) in workers.items():
            worker.start()
            deadline = time.monotonic() + 300
            while not _serving(worker.address, creds):
                assert worker.proc is not None and worker.proc.poll() is None, \
                    worker.log_tail()
                assert time.monotonic() < deadline, f"{name} worker never served"
                time.sleep(0.5)
        workload = mixed_workload(args.requests, args.adapters, 32000, seed=1234)
        warm = [{"prompt": [5, 6, 7], "max_tokens": 2, "adapter": i}
                for i in range(args.adapters)]
        for worker, creds in workers.values():  # adapters resident, every shape compiled
            asyncio.run(grpc_run(worker.address, warm, names, creds))
            asyncio.run(grpc_run(worker.address, workload, names, creds))
        rates: dict[str, list[float]] = {name: [] for name in workers}
        ttft: dict[str, list[float]] = {name: [] for name in workers}
        loads: list[float] = []
        tokens = 0
        for round_ in range(args.repeats):
            order = list(workers) if round_ % 2 == 0 else list(reversed(workers))
            for name in order:
                worker, creds = workers[name]
                tokens, seconds, times = asyncio.run(
                    grpc_run(worker.address, workload, names, creds))
                ttft[name].extend(first for first, _, _ in times)
                rates[name].append(tokens / seconds)
                loads.append(os.getloadavg()[0])

    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    plain, secure = statistics.median(rates["plaintext"]), statistics.median(rates["tls"])
    report = {
        "requests": args.requests, "adapters": args.adapters, "output_tokens": tokens,
        "rounds": args.repeats, "worker_settings": WORKER,
        "plaintext_tok_s": round(plain, 2), "tls_tok_s": round(secure, 2),
        "tls_vs_plaintext": round(secure / plain, 4),
        "runs_tok_s": {k: [round(x, 2) for x in v] for k, v in rates.items()},
        "ttft_ms": {name: {"p50": round(pct(v, 0.5), 1), "p95": round(pct(v, 0.95), 1)}
                    for name, v in ttft.items()},
        "load_avg_after_runs": [round(x, 2) for x in loads],
    }
    record.save(args.out, report, [Figure(
        "worker over gRPC with TLS, streamed tokens/s", report["tls_tok_s"], "tokens/s",
        baseline="the same worker settings in plaintext, same requests, alternating rounds",
        baseline_value=report["plaintext_tok_s"],
        settings=(f"{args.requests} requests at once over {args.adapters} adapters; TTFT p50 "
                  f"{report['ttft_ms']['tls']['p50']} ms with TLS, "
                  f"{report['ttft_ms']['plaintext']['p50']} ms without"),
        load_average=report["load_avg_after_runs"][-1:] or None)])


def _serving(address: str, credentials: grpc.ChannelCredentials | None) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = (grpc.secure_channel(address, credentials) if credentials is not None
               else grpc.insecure_channel(address))
    with channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=2)
        except grpc.RpcError:
            return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


def figures(report: dict[str, Any]) -> list[Figure]:
    m = report["model"]
    load = report["load_avg_after_runs"][-1:] or None
    runs = len(report["runs_tok_s"]["grpc"])
    family = "Qwen2" if m.get("family") == "qwen2" else "Llama"
    served = [Figure(
        "worker over gRPC, streamed tokens/s" + (", random Qwen2" if family == "Qwen2" else ""),
        report["grpc_tok_s"], "tokens/s",
        baseline="the bare engine on the same requests and adapters, own process",
        baseline_value=report["engine_tok_s"], target="ratio >= 0.90",
        meets_target=report["meets_target"],
        settings=(f"{report['requests']} requests at once over {report['adapters']} adapters "
                  f"(r 8-64), random {family} hidden {m['hidden']}, {m['layers']} layers, "
                  f"{m['dtype']} {m['device']}, greedy, {report['output_tokens']} output "
                  f"tokens, median of {runs} alternating runs"),
        load_average=load)]
    durable, batched = (report["trace_durability"][k] for k in ("durable", "batched"))
    same = (f"the same {report['requests']} requests, in the same {runs} round(s), modes "
            "alternating; per request, client side")
    compared = (("streamed tokens/s", "tok_s", "tokens/s", "higher"),
                ("time to first token p50", "ttft_p50_ms", "ms", "lower"),
                ("end-to-end latency p50", "e2e_p50_ms", "ms", "lower"),
                ("end-to-end latency p95", "e2e_p95_ms", "ms", "lower"),
                ("last token to FinalUsage p50", "last_token_to_final_p50_ms", "ms", "lower"),
                ("last token to FinalUsage p95", "last_token_to_final_p95_ms", "ms", "lower"))
    return served + [
        Figure(f"durable traces: {name}", durable[key], unit,
               baseline="the same worker settings with batched traces (finals not held)",
               baseline_value=batched[key], better=better,  # type: ignore[arg-type]
               settings=same, load_average=load)
        for name, key, unit, better in compared]


if __name__ == "__main__":
    main()
