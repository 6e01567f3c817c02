"""Merged mode: gRPC streaming tokens/s of one adapter served merged into the base weights
(`serve worker --merge`) vs the same adapter served as a LoRA, in the same run.

Apache Kafka (embedded), a registry and two `loraplane serve worker` processes with the
same engine settings: `lora` (a general worker) and `merged` (`--merge bench-merged`). One
PEFT adapter (rank 16 on every projection) is published over REST and switched to; both
workers serve it. The same requests go to each worker in turn, `--repeats` times,
alternating; the median of each is reported:

- batch: `--requests` requests of the `bench/multi_lora.py` mixed workload (prompts of
  16-512 tokens, 8-128 output tokens, greedy, `ignore_eos`), one grpc.aio stream each,
  all at once; tokens/s from the first request sent to the last FinalUsage.
- single: one stream at a time (16-token prompt, 64 tokens): the decode-bound case,
  where the LoRA's extra matmuls weigh most.

Before timing, both workers answer the same greedy request and the tokens are compared
(`same_greedy_tokens`). Random Llama of `bench/multi_lora.py` (hidden 1024, 8 layers,
GQA, vocab 32000), fp32 on CPU; `--smoke` a tiny one for a quick check.

Usage: python bench/merged.py [--requests 16] [--repeats 2] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from bench.multi_lora import ATTN, MLP, build_random_base, mixed_workload, write_adapter
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.worker.engine import ModelConfig
from tests.registry.conftest import TENANT
from tests.worker.harness import bench_stack, peft_files, publish_files, save_report, switch

ADAPTER = "bench-merged"
RANK = 16
WORKER = {"worker_adapter_slots": 2, "worker_max_lora_rank": 64, "worker_kv_blocks": 4096,
          "worker_block_size": 16, "worker_max_running": 64,
          "worker_max_tokens_per_step": 2048, "worker_device": "cpu",
          "worker_dtype": "float32"}


async def stream(stub: pb_grpc.InferenceStub, prompt: list[int], max_tokens: int
                 ) -> list[int]:
    request = pb.GenerateRequest(
        tenant=pb.TenantSignature(org_id=TENANT["org"], team_id=TENANT["team"],
                                  project_id=TENANT["project"]),
        adapter=pb.AdapterRef(alias=ADAPTER),
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    request.token_ids.ids.extend(prompt)
    tokens = []
    async for response in stub.Generate(request, timeout=900):
        if response.HasField("token"):
            tokens.append(response.token.token_id)
    return tokens


async def run(address: str, workload: list[dict], concurrent: bool
              ) -> tuple[list[list[int]], float]:
    """Every request of the workload (all at once, or one after another): their tokens
    and the seconds from the first sent to the last ended."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        started = time.perf_counter()
        if concurrent:
            outs = await asyncio.gather(*(stream(stub, r["prompt"], r["max_tokens"])
                                          for r in workload))
        else:
            outs = [await stream(stub, r["prompt"], r["max_tokens"]) for r in workload]
        return list(outs), time.perf_counter() - started


def tok_s(address: str, workload: list[dict], concurrent: bool) -> float:
    outs, seconds = asyncio.run(run(address, workload, concurrent))
    return sum(len(o) for o in outs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--singles", type=int, default=3,
                        help="one-at-a-time requests per single run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a tiny model: a quick check")
    parser.add_argument("--quick", action="store_true",
                        help="8 requests, 2 singles, one repeat (what `make bench` runs)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "merged.json"))
    args = parser.parse_args()
    if args.quick:
        args.requests, args.singles, args.repeats = 8, 2, 1
    with bench_stack("merged", lambda d: build_random_base(d, 7, args.smoke), tail=False,
                     max_upload_bytes=256 * 1024 * 1024) as (root, stack):
        mc = ModelConfig.from_dir(root / "base")
        write_adapter(root / "adapter", mc, RANK, ATTN + MLP, seed=101)
        with stack.publisher() as pub:
            publish_files(pub, ADAPTER, peft_files(root / "adapter"), "v1", TENANT)
            switch(pub, ADAPTER, 1)
        workers = {
            "lora": stack.worker("bench-lora", heartbeat_interval_s=1.0,
                                 worker_trace_flush_s=0.5, log_level="WARNING", **WORKER),
            "merged": stack.worker("bench-merged", heartbeat_interval_s=1.0,
                                   worker_trace_flush_s=0.5, log_level="WARNING",
                                   worker_merge=ADAPTER, **WORKER)}
        for worker in workers.values():
            worker.start().wait_serving(300)
        check = [{"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 16}]
        greedy = {}
        for name, worker in workers.items():  # also the warm-up: adapter loaded (merged)
            deadline = time.monotonic() + 120
            while True:
                try:
                    greedy[name] = asyncio.run(run(worker.address, check, False))[0][0]
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)  # the merged worker merges once it has read the switch
        batch = mixed_workload(args.requests, 1, mc.vocab_size, seed=1234,
                               scale=0.25 if args.smoke else 1.0)
        single = [{"prompt": list(range(3, 19)), "max_tokens": 64}] * args.singles
        runs: dict[str, dict[str, list[float]]] = {
            "batch": {"lora": [], "merged": []}, "single": {"lora": [], "merged": []}}
        loads: list[float] = []
        for _ in range(args.repeats):
            for kind, workload, concurrent in (("batch", batch, True),
                                               ("single", single, False)):
                for name, worker in workers.items():
                    runs[kind][name].append(tok_s(worker.address, workload, concurrent))
                    loads.append(round(os.getloadavg()[0], 2))
    medians = {kind: {name: round(statistics.median(v), 2) for name, v in by.items()}
               for kind, by in runs.items()}
    report = {
        "model": {"hidden": mc.hidden_size, "layers": mc.num_hidden_layers,
                  "heads": mc.num_attention_heads, "kv_heads": mc.num_key_value_heads,
                  "intermediate": mc.intermediate_size, "vocab": mc.vocab_size,
                  "dtype": "float32", "device": "cpu"},
        "adapter": {"rank": RANK, "targets": list(ATTN + MLP)},
        "worker_settings": WORKER, "requests": args.requests, "singles": args.singles,
        "repeats": args.repeats, "smoke": args.smoke,
        "same_greedy_tokens": greedy["lora"] == greedy["merged"],
        "tok_s": medians,
        "merged_vs_lora": {kind: round(m["merged"] / m["lora"], 3)
                           for kind, m in medians.items()},
        "runs_tok_s": {kind: {name: [round(x, 2) for x in v] for name, v in by.items()}
                       for kind, by in runs.items()},
        "load_avg_after_runs": loads,
    }
    save_report(args.out, report)


if __name__ == "__main__":
    main()
