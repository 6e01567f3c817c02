"""Every served model family on the CPU: the compiled layer ops against the torch ops.

Usage: python bench/families.py [--quick] [--rounds N] [--layers N] [--families a,b]
                                [--out bench/results/families.json]

For each family (`services.families.FAMILIES`), a random bf16 model at SmolLM2-135M's
shapes (hidden 576, 9 heads over 3 KV heads of 64, MLP 1536, vocab 49,152; 30 layers, 8
with --quick) with the family's own traits (q/k norms, norms after attention and the MLP,
soft-capping, sliding windows, no-rope layers), served twice by the worker's engine: once
with each layer's elementwise ops as the compiled calls of `loraplane_kernels.cpu_layer`
(the default), once with torch's ops (`COMPILED_LAYERS` off). Both run the same requests
in interleaved rounds, in one process: a single stream (128-token prompt, its
inter-token latency) and a batch of 16 streams decoding at once (64-token prompts; the
decode steps' tokens per second). The greedy tokens of the two are compared: in bf16 the
norms' sums may round an ulp apart, so a few may differ.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import BenchRun, Figure, load_average  # noqa: E402
from services.families import FAMILIES  # noqa: E402
from services.worker.engine import (  # noqa: E402
    DecoderModel,
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
)
from services.worker.engine import model as model_mod  # noqa: E402

SHAPES: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
"""SmolLM2-135M's shapes; each family's own traits come from its config's defaults and
`TRAITS`."""

TRAITS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096},
    "qwen2": {"use_sliding_window": False},
    "gemma": {"hidden_act": "gelu_pytorch_tanh"},
    "gemma2": {"query_pre_attn_scalar": 64, "sliding_window": 512,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"query_pre_attn_scalar": 64, "sliding_window": 512},
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.015625, "logits_scaling": 8.0},
    "smollm3": {"no_rope_layer_interval": 4},
}

SINGLE_PROMPT, SINGLE_TOKENS = 128, 32
BATCH, BATCH_PROMPT, BATCH_TOKENS = 16, 64, 16


def build(path: Path, model_type: str, layers: int) -> None:
    """A random checkpoint of the family at `SHAPES`, saved as the engine loads one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**SHAPES, "num_hidden_layers": layers,
                                              **TRAITS.get(model_type, {})})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms at 1 (Gemma's at 0) would hide a dropped weight
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)  # token ids only: no tokenizer


def engine(path: Path, compiled: bool) -> Engine:
    model_mod.COMPILED_LAYERS = compiled
    try:
        model = DecoderModel.from_pretrained(path, torch.bfloat16, "cpu", "dense")
    finally:
        model_mod.COMPILED_LAYERS = True
    assert model.compiled_layers is compiled, "the family does not take the compiled ops"
    return Engine(model, EngineConfig(dtype="bfloat16", num_kv_blocks=512, block_size=16,
                                      prefix_cache=False))


def request(prompt: list[int], tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0.0))


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n * length)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def decode_steps(eng: Engine, reqs: list[GenerationRequest]) -> tuple[list[float], list]:
    """Seconds of each step after the one that prefilled every request, and the tokens."""
    ids = [eng.submit(r) for r in reqs]
    eng.step()  # the prompts (at most one chunk each here)
    steps = []
    while eng.has_work:
        t0 = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t0)
    return steps, [eng.pop_result(i).token_ids for i in ids]  # type: ignore[union-attr]


def measure(eng: Engine, vocab: int) -> dict[str, Any]:
    single, single_tokens = decode_steps(
        eng, [request(prompts(1, SINGLE_PROMPT, vocab)[0], SINGLE_TOKENS)])
    batch, batch_tokens = decode_steps(
        eng, [request(p, BATCH_TOKENS) for p in prompts(BATCH, BATCH_PROMPT, vocab)])
    return {"itl_ms": round(statistics.median(single) * 1e3, 3),
            "batch_tok_s": round(BATCH * len(batch) / sum(batch), 1),
            "tokens": single_tokens + batch_tokens}


def family_run(model_type: str, layers: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build(path, model_type, layers)
        engines = {"compiled": engine(path, True), "torch": engine(path, False)}
    vocab = SHAPES["vocab_size"]
    for eng in engines.values():  # warm: workspace buffers, first-touch pages
        decode_steps(eng, [request(prompts(1, 16, vocab)[0], 4)])
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in engines}
    for r in range(rounds):
        for kind in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            runs[kind].append(measure(engines[kind], vocab))
    out: dict[str, Any] = {}
    for kind, done in runs.items():
        out[kind] = {"itl_ms": round(statistics.median(d["itl_ms"] for d in done), 3),
                     "batch_tok_s": round(statistics.median(d["batch_tok_s"] for d in done), 1),
                     "rounds": [{k: v for k, v in d.items() if k != "tokens"} for d in done]}
    a, b = runs["compiled"][0]["tokens"], runs["torch"][0]["tokens"]
    out["greedy_sequences_identical"] = f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"
    out["load_average"] = load_average()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 layers, 2 rounds")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--layers", type=int, help="layers per model (default 30, 8 quick)")
    parser.add_argument("--families", help="comma-separated model types (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" /
                        "families.json")
    args = parser.parse_args()
    run = BenchRun("families", quick=args.quick)
    layers = args.layers or (8 if args.quick else 30)
    rounds = args.rounds or (2 if args.quick else 3)
    wanted = args.families.split(",") if args.families else list(FAMILIES)
    results: dict[str, Any] = {}
    figures: list[Figure] = []
    setting = (f"random bf16 model at SmolLM2-135M's shapes, {layers} layers, the family's "
               f"traits; CPU, {torch.get_num_threads()} threads; {rounds} interleaved "
               "rounds, median")
    for model_type in wanted:
        got = results[model_type] = family_run(model_type, layers, rounds)
        c, t = got["compiled"], got["torch"]
        print(f"[families] {model_type}: ITL {c['itl_ms']} / {t['itl_ms']} ms, batch "
              f"{c['batch_tok_s']} / {t['batch_tok_s']} tok/s (compiled / torch ops), "
              f"greedy identical {got['greedy_sequences_identical']}", flush=True)
        figures += [
            Figure(f"{model_type}: single-stream inter-token latency", c["itl_ms"], "ms",
                   baseline="the torch ops, same run", baseline_value=t["itl_ms"],
                   better="lower", settings=f"{SINGLE_PROMPT}-token prompt, "
                   f"{SINGLE_TOKENS} new tokens; {setting}",
                   load_average=got["load_average"]),
            Figure(f"{model_type}: {BATCH} streams decoding", c["batch_tok_s"], "tok/s",
                   baseline="the torch ops, same run", baseline_value=t["batch_tok_s"],
                   settings=f"{BATCH_PROMPT}-token prompts, {BATCH_TOKENS} new tokens each; "
                   f"{setting}", load_average=got["load_average"]),
        ]
    run.save(args.out, {"layers": layers, "rounds": rounds, "families": results}, figures)


if __name__ == "__main__":
    main()
