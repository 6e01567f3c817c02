"""Structured output and parallel sampling in one mixed batch: tokens/s against the plain run.

One engine in this process (the worker's engine settings, CPU, fp32), a random Llama
(hidden 512, 4 layers, GQA) over SmolLM2's 49,152-token byte-level BPE tokenizer when the
model cache has it (else the tests' small BPE tokenizer), `--requests` requests of 32
prompt tokens, up to 32 output tokens each, sampled (temperature 1, seeded), all
submitted at once and run to completion. Runs, alternating, each `--repeats` times, each
a ratio to the plain n = 1 run measured in the same process. The figures take each run's
fastest repeat (on a shared machine the other repeats measure its neighbours' load as
much as this code); the medians are kept beside them:

- `json_0`: no request constrained (the baseline);
- `json_25` / `json_100`: 25% / 100% of the requests constrained by a JSON schema
  (xgrammar token masks inside the batched sampler);
- `n4`: a quarter as many requests with n = 4 (the same number of sequences; the
  prompt is computed once per request and its KV blocks shared by the four choices).

Constrained requests end when their JSON does, so every run is counted in generated
tokens per second. Beside wall-clock tokens/s (the fastest repeat), each run reports
tokens per CPU-second of this process (the median), which a shared machine's load moves
far less; `extra_cpu_us_per_constrained_token` is the extra CPU time of the 100% run
over the baseline, per constrained token.

Usage: python bench/structured.py [--quick] [--requests 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import BenchRun, Figure
from services.worker.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from services.worker.engine.request import GuideSpec
from services.worker.engine.scheduler import SchedulerLimits

SMOLLM = Path(__file__).resolve().parents[1] / ".loraplane" / "cache" / "models" / \
    "SmolLM2-135M-Instruct"
SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 40}, "confidence": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "kind": {"enum": ["fact", "opinion"]}},
    "required": ["answer", "confidence", "kind"], "additionalProperties": False}


def build_model(path: Path) -> str:
    """A random Llama over a real tokenizer; returns which tokenizer."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    if (SMOLLM / "tokenizer.json").is_file():
        shutil.copy(SMOLLM / "tokenizer.json", path / "tokenizer.json")
        vocab, eos, which = 49152, 2, "SmolLM2 (49,152 tokens)"
    else:
        from tests.worker.engine.tiny_bpe import write_bpe_tokenizer

        vocab = write_bpe_tokenizer(path)
        eos, which = 1, f"tests' BPE ({vocab} tokens)"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1408,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=2048, eos_token_id=eos, bos_token_id=1,
                      pad_token_id=0, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    return which


def workload(requests: int, constrained: float, n: int, vocab: int) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(7)
    guide = GuideSpec("json_schema", json.dumps(SCHEMA))
    count = requests // n
    picked = round(count * constrained)
    return [GenerationRequest(
        prompt_token_ids=torch.randint(3, vocab, (32,), generator=g).tolist(),
        sampling=SamplingParams(max_tokens=32, temperature=1.0, seed=i, n=n,
                                guide=guide if i < picked else None))
            for i in range(count)]


def run(engine: Engine, requests: list[GenerationRequest]) -> tuple[int, int, float, float]:
    """(tokens, constrained tokens, seconds, CPU seconds of this process), in a thread as
    the worker's loop runs it."""
    results: list = []
    runner = threading.Thread(target=lambda: results.extend(engine.generate(requests)))
    started, cpu = time.perf_counter(), time.process_time()
    runner.start()
    runner.join()
    took, cpu = time.perf_counter() - started, time.process_time() - cpu
    tokens = sum(len(c.token_ids) for r in results for c in r.choices)
    constrained = sum(len(c.token_ids) for r, q in zip(results, requests, strict=True)
                      for c in r.choices if q.sampling.guide is not None)
    return tokens, constrained, took, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="8 requests, 1 run each")
    parser.add_argument("--requests", type=int, default=None, help="default 16")
    parser.add_argument("--repeats", type=int, default=None, help="default 3")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "structured.json"))
    args = parser.parse_args()
    record = BenchRun("structured", quick=args.quick)
    requests = args.requests or (8 if args.quick else 16)
    repeats = args.repeats or (1 if args.quick else 3)
    with tempfile.TemporaryDirectory(prefix="structured-") as tmp:
        tokenizer = build_model(Path(tmp) / "base")
        engine = Engine.from_pretrained(Path(tmp) / "base", EngineConfig(
            block_size=16, num_kv_blocks=2048, limits=SchedulerLimits(
                max_running=64, max_tokens_per_step=2048), prefix_cache=False))
        vocab = engine.model.cfg.vocab_size
        runs = {"json_0": (0.0, 1), "json_25": (0.25, 1), "json_100": (1.0, 1), "n4": (0.0, 4)}
        run(engine, workload(4, 1.0, 1, vocab))  # warm-up, the schema compiled once
        measured: dict[str, list[tuple[int, int, float, float]]] = {k: [] for k in runs}
        for _ in range(repeats):
            for name, (share, n) in runs.items():
                measured[name].append(run(engine, workload(requests, share, n, vocab)))
    report: dict = {"settings": {
        "model": "random Llama, hidden 512, 4 layers, 8 heads / 2 KV heads, fp32, CPU",
        "tokenizer": tokenizer, "requests": requests, "prompt_tokens": 32,
        "max_tokens": 32, "temperature": 1.0, "repeats": repeats,
        "schema": SCHEMA}, "runs": {}}
    for name, samples in measured.items():
        rates = [t / s for t, _, s, _ in samples]
        per_cpu = [t / c for t, _, _, c in samples]
        best = samples[rates.index(max(rates))]
        report["runs"][name] = {
            "tokens_per_s": round(max(rates), 1),
            "tokens_per_s_median": round(statistics.median(rates), 1),
            "tokens_per_cpu_s": round(statistics.median(per_cpu), 1),
            "tokens": best[0], "constrained_tokens": best[1],
            "seconds": [round(s, 3) for _, _, s, _ in samples],
            "cpu_seconds": [round(c, 3) for _, _, _, c in samples]}
    base = report["runs"]["json_0"]["tokens_per_s"]
    median_base = report["runs"]["json_0"]["tokens_per_s_median"]
    cpu_base = report["runs"]["json_0"]["tokens_per_cpu_s"]
    for name in runs:
        entry = report["runs"][name]
        entry["ratio_to_json_0"] = round(entry["tokens_per_s"] / base, 3)
        entry["median_ratio_to_json_0"] = round(entry["tokens_per_s_median"] / median_base, 3)
        entry["cpu_ratio_to_json_0"] = round(entry["tokens_per_cpu_s"] / cpu_base, 3)
    full = report["runs"]["json_100"]
    report["extra_cpu_us_per_constrained_token"] = round(
        (1 / full["tokens_per_cpu_s"] - 1 / cpu_base) * 1e6, 1)
    record.save(args.out, report, [
        Figure(name=f"tokens/s, {label}", value=report["runs"][name]["tokens_per_s"],
               unit="tokens/s", baseline="no request constrained, n = 1, same process",
               baseline_value=base,
               settings=f"{requests} requests, 32+32 tokens, {tokenizer}; fastest of "
                        f"{repeats} alternating repeats (median ratio "
                        f"{report['runs'][name]['median_ratio_to_json_0']})")
        for name, label in (("json_25", "25% JSON-schema constrained"),
                            ("json_100", "100% JSON-schema constrained"),
                            ("n4", "n = 4 (a quarter of the requests)"))] + [
        Figure(name=f"tokens per CPU-second, {label}",
               value=report["runs"][name]["tokens_per_cpu_s"], unit="tokens/CPU-s",
               baseline="no request constrained, n = 1, same process",
               baseline_value=cpu_base,
               settings=f"{requests} requests, 32+32 tokens, {tokenizer}; median of "
                        f"{repeats} alternating repeats, CPU time of the process")
        for name, label in (("json_25", "25% JSON-schema constrained"),
                            ("json_100", "100% JSON-schema constrained"),
                            ("n4", "n = 4 (a quarter of the requests)"))])


if __name__ == "__main__":
    main()
