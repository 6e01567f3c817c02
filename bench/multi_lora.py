"""Multi-LoRA throughput: the engine against PEFT's mixed-adapter `generate`, on CPU.

One random Llama (hidden 1024, 8 layers, GQA) serves 64 requests over 32 distinct LoRA
adapters (ranks 8-64, attention and MLP targets), prompt lengths 16-512 and output lengths
8-128 drawn from a fixed seed. The baseline is PEFT's `generate(adapter_names=...)` over
one batch of 64 in arrival order, left padded, greedy, KV cache on; since one batch must
share a length, it generates the batch's longest output for every request and only each
request's real tokens are counted (and compared). The engine runs the same requests with
continuous batching, at most 64 in flight; then once more with every request on one
adapter, to show how much mixing 32 adapters costs.

Usage: python bench/multi_lora.py [--requests 64] [--adapters 32] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.worker.engine import (
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
    SchedulerLimits,
)

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGET_SETS = (ATTN, MLP, ATTN + MLP, ("q_proj", "v_proj", "down_proj"))
RANKS = (8, 16, 32, 64)
LOADS: list[float] = []
"""1-minute load average after each timed run: the machine may be shared, and a load above
the thread count means the timings include waiting for a CPU."""


def build_base(path: Path, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
        rms_norm_eps=1e-5, eos_token_id=2, bos_token_id=1, pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def write_adapter(path: Path, cfg, rank: int, targets: tuple[str, ...], seed: int) -> None:
    """A PEFT-format LoRA adapter with random, non-zero A and B."""
    g = torch.Generator().manual_seed(seed)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hd = cfg.hidden_size // cfg.num_attention_heads
    dims = {"q_proj": (h, h), "k_proj": (h, cfg.num_key_value_heads * hd),
            "v_proj": (h, cfg.num_key_value_heads * hd), "o_proj": (h, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for m in targets:
            fin, fout = dims[m]
            parent = "self_attn" if m in ATTN else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=g) / fin**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
        "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
        "base_model_name_or_path": None, "inference_mode": True,
    }))


def make_workload(n: int, n_adapters: int, vocab: int, seed: int):
    rng = random.Random(seed)
    adapters = [i % n_adapters for i in range(n)]
    rng.shuffle(adapters)
    reqs = []
    for i in range(n):
        plen = rng.randint(16, 512)
        reqs.append({
            "prompt": [rng.randrange(3, vocab) for _ in range(plen)],
            "max_tokens": rng.randint(8, 128),
            "adapter": adapters[i],
        })
    return reqs


def run_peft(base, adapter_dirs, workload):
    from peft import PeftModel

    model = PeftModel.from_pretrained(base, adapter_dirs[0], adapter_name="a0")
    for i, d in enumerate(adapter_dirs[1:], start=1):
        model.load_adapter(d, adapter_name=f"a{i}")
    model.eval()
    width = max(len(r["prompt"]) for r in workload)
    ids = torch.zeros(len(workload), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(workload):
        ids[row, width - len(r["prompt"]):] = torch.tensor(r["prompt"])
        mask[row, width - len(r["prompt"]):] = 1
    new = max(r["max_tokens"] for r in workload)
    names = [f"a{r['adapter']}" for r in workload]
    with torch.no_grad():
        # warm-up on a tiny batch so both sides start with initialised kernels
        model.generate(input_ids=ids[:2, -8:], attention_mask=mask[:2, -8:],
                       adapter_names=names[:2], max_new_tokens=2, do_sample=False)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=names,
                             max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             use_cache=True, pad_token_id=0)
        elapsed = time.perf_counter() - t0
    LOADS.append(os.getloadavg()[0])
    tokens = [out[row, width: width + r["max_tokens"]].tolist() for row, r in enumerate(workload)]
    return tokens, elapsed


def run_engine(base_dir, adapter_dirs, workload, one_adapter: bool):
    eng = Engine.from_pretrained(base_dir, EngineConfig(
        block_size=16, num_kv_blocks=3000, max_lora_rank=64, adapter_slots=len(adapter_dirs),
        limits=SchedulerLimits(max_running=64, max_tokens_per_step=4096,
                               max_adapters_per_step=len(adapter_dirs))))
    digests = [eng.load_adapter(d).digest for d in adapter_dirs]
    eng.generate([GenerationRequest(prompt_token_ids=[5, 6, 7, 8], adapter_digest=digests[0],
                                    sampling=SamplingParams(max_tokens=2))])  # warm-up
    reqs = [GenerationRequest(
        prompt_token_ids=r["prompt"],
        adapter_digest=digests[0 if one_adapter else r["adapter"]],
        sampling=SamplingParams(max_tokens=r["max_tokens"], min_tokens=r["max_tokens"]),
    ) for r in workload]
    t0 = time.perf_counter()
    results = eng.generate(reqs)
    elapsed = time.perf_counter() - t0
    LOADS.append(os.getloadavg()[0])
    stats = eng.stats()
    return [r.token_ids for r in results], elapsed, stats, eng.adapters.padding_fraction()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "multi_lora.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = build_base(root / "base", args.seed)
        rng = random.Random(args.seed)
        specs = [(RANKS[i % len(RANKS)], TARGET_SETS[rng.randrange(len(TARGET_SETS))])
                 for i in range(args.adapters)]
        dirs = []
        for i, (rank, targets) in enumerate(specs):
            write_adapter(root / f"a{i}", base.config, rank, targets, seed=args.seed + i)
            dirs.append(root / f"a{i}")
        workload = make_workload(args.requests, args.adapters, base.config.vocab_size, args.seed)
        real_tokens = sum(r["max_tokens"] for r in workload)
        print(f"{args.requests} requests, {args.adapters} adapters, {real_tokens} output tokens, "
              f"{sum(len(r['prompt']) for r in workload)} prompt tokens", flush=True)

        eng_tokens, eng_s, stats, padding = run_engine(root / "base", dirs, workload, False)
        print(f"engine, {args.adapters} adapters: {eng_s:.1f} s, "
              f"{real_tokens / eng_s:.1f} tok/s, {stats.steps} steps", flush=True)
        _, one_s, _, _ = run_engine(root / "base", dirs, workload, True)
        print(f"engine, 1 adapter: {one_s:.1f} s, {real_tokens / one_s:.1f} tok/s", flush=True)
        base_tokens, base_s = run_peft(base, dirs, workload)
        print(f"PEFT baseline: {base_s:.1f} s, {real_tokens / base_s:.1f} tok/s", flush=True)

    agree = sum(a == b for a, b in zip(eng_tokens, base_tokens, strict=True)) / len(workload)
    tok_agree = sum(x == y for a, b in zip(eng_tokens, base_tokens, strict=True)
                    for x, y in zip(a, b, strict=True)) / real_tokens
    speedup = base_s / eng_s
    mixing_cost = eng_s / one_s
    result = {
        "requests": args.requests, "adapters": args.adapters, "seed": args.seed,
        "model": {"hidden": 1024, "layers": 8, "heads": 16, "kv_heads": 4,
                  "intermediate": 2816, "vocab": 32000, "dtype": "float32"},
        "threads": torch.get_num_threads(),
        "output_tokens": real_tokens,
        "engine_seconds": round(eng_s, 2), "engine_tok_s": round(real_tokens / eng_s, 2),
        "engine_one_adapter_seconds": round(one_s, 2),
        "engine_one_adapter_tok_s": round(real_tokens / one_s, 2),
        "peft_seconds": round(base_s, 2), "peft_tok_s": round(real_tokens / base_s, 2),
        "speedup_vs_peft": round(speedup, 3), "target_speedup": 3.0,
        "one_adapter_vs_32_adapters": round(mixing_cost, 3), "target_one_adapter_max": 1.25,
        "requests_identical_to_peft": round(agree, 4),
        "tokens_identical_to_peft": round(tok_agree, 4),
        "load_avg_after_runs": {"engine_32": LOADS[0], "engine_1": LOADS[1], "peft": LOADS[2]},
        "engine_steps": stats.steps, "adapter_padding_fraction": round(padding, 4),
    }
    print(f"speedup vs PEFT: {speedup:.2f}x (target >= 3x); one adapter vs {args.adapters}: "
          f"{mixing_cost:.2f}x faster (target <= 1.25x); requests identical to PEFT: "
          f"{agree:.0%}, tokens identical: {tok_agree:.1%}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
