"""The int8 weight-only base (`LORAPLANE_WORKER_WEIGHTS=int8`) against bf16 on SmolLM2:
quality and speed, in one run.

Quality, teacher-forced on the bf16 base's own text: each demo question
(`services.demo_adapters.DEMO_QUESTIONS`, in SmolLM2's chat template) is answered
greedily by the bf16 engine (base, and each trained demo adapter), `--answer-tokens` at
most; every form then scores that prompt + answer in one pass (`Engine.score`):

- top-1 agreement: over the answer's positions, how often a form's argmax is the bf16
  form's (1.0 = it would have written the same answer token by token);
- perplexity of the answer under each form (the bf16 form's is low: it wrote the text);
- forms: bf16 dense (the reference), int8 with lm_head quantised too (what `int8`
  serves), int8 with a dense lm_head (the choice `INT8_LM_HEAD` was made on), and fp32
  dense (the bf16 reference's own distance from full precision, for scale).

Speed, the bf16 dense engine and the int8 engine in the same process, in interleaved
rounds (dense, int8, dense, int8, ...; the median per form is reported, each round's
figures kept), greedy, `ignore_eos`:

- single stream: one request, a 128-token prompt, `--single-tokens` new tokens:
  inter-token latency (mean gap after the first token) and TTFT;
- mixed batch: `--requests` requests round-robin over the base and the 3 demo adapters,
  submitted at once, 128-token prompts, `--batch-tokens` new tokens each: tokens/s from
  submission to the last token.

Usage: python bench/int8.py [--quick] [--rounds 3] [--out bench/results/int8.json]
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.record import RESULTS, BenchRun, Figure, load_average
from loraplane_kernels.int8 import INT8PACK_MAX_ROWS
from services.config import Settings
from services.demo import chat_prompt
from services.demo_adapters import DEMO_QUESTIONS, demo_adapters
from services.stack.models import ensure_smollm2
from services.worker.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from services.worker.engine.checkpoint import load_checkpoint, load_tokenizer
from services.worker.engine.model import DecoderModel

MODEL = "SmolLM2-135M-Instruct"
PROMPT_TOKENS = 128


def engine(ckpt: Any, tokenizer: Any, dtype: torch.dtype, weights: str,
           int8_lm_head: bool | None = None, blocks: int = 512) -> Engine:
    """An engine over an already-loaded checkpoint (one read of the files for all forms;
    the model copies what it quantises or concatenates, never writes the tensors)."""
    tensors = {k: v.to(dtype) for k, v in ckpt.tensors.items()}
    model = DecoderModel(ckpt.config, tensors, ckpt.digest, tokenizer, weights=weights,
                         int8_lm_head=int8_lm_head)
    return Engine(model, EngineConfig(dtype=str(dtype).removeprefix("torch."),
                                      num_kv_blocks=blocks, block_size=16, adapter_slots=4,
                                      max_lora_rank=64, weights=weights))


def quality(forms: dict[str, Engine], adapters: dict[str, Path], model_dir: Path,
            answer_tokens: int) -> dict[str, Any]:
    ref = forms["bf16"]
    tok = ref.tokenizer
    digests = {name: {a: e.load_adapter(d).digest for a, d in adapters.items()}
               for name, e in forms.items()}
    rows = []
    for adapter in (None, *adapters):
        for question in DEMO_QUESTIONS:
            prompt = tok.encode(chat_prompt(model_dir, question), add_special_tokens=False).ids
            dig = None if adapter is None else digests["bf16"][adapter]
            answer = ref.generate([GenerationRequest(
                prompt_token_ids=prompt, adapter_digest=dig,
                sampling=SamplingParams(max_tokens=answer_tokens))])[0].token_ids
            ids = prompt + answer
            targets = torch.tensor(answer)
            row: dict[str, Any] = {"adapter": adapter or "base", "question": question,
                                   "answer_tokens": len(answer)}
            ref_top = None
            for name, e in forms.items():
                d = None if adapter is None else digests[name][adapter]
                logits = e.score(ids, d)[len(prompt) - 1:len(ids) - 1].float()
                top = logits.argmax(-1)
                if ref_top is None:
                    ref_top = top
                nll = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
                row[name] = {"top1_agree": int((top == ref_top).sum()),
                             "nll": float(nll)}
            rows.append(row)
    summary = {}
    n = sum(r["answer_tokens"] for r in rows)
    for name in forms:
        agree = sum(r[name]["top1_agree"] for r in rows)
        nll = sum(r[name]["nll"] for r in rows)
        summary[name] = {"top1_agreement": round(agree / n, 4),
                         "perplexity": round(math.exp(nll / n), 4)}
        for part in ("base", "adapters"):
            sel = [r for r in rows if (r["adapter"] == "base") == (part == "base")]
            m = sum(r["answer_tokens"] for r in sel)
            if m:
                summary[name][f"{part}_top1_agreement"] = round(
                    sum(r[name]["top1_agree"] for r in sel) / m, 4)
                summary[name][f"{part}_perplexity"] = round(
                    math.exp(sum(r[name]["nll"] for r in sel) / m), 4)
    return {"positions": n, "sequences": len(rows), "summary": summary, "rows": rows}


def single_stream(e: Engine, new_tokens: int) -> dict[str, float]:
    stamps: list[float] = []
    prompt = [(7 * i + 3) % 40000 + 100 for i in range(PROMPT_TOKENS)]
    t0 = time.perf_counter()
    e.generate([GenerationRequest(
        prompt_token_ids=prompt, on_token=lambda _ev: stamps.append(time.perf_counter()),
        sampling=SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens,
                                ignore_eos=True))])
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft_ms": round((stamps[0] - t0) * 1e3, 2),
            "itl_ms": round(statistics.fmean(gaps) * 1e3, 2)}


def mixed_batch(e: Engine, digests: list[str | None], requests: int, new_tokens: int
                ) -> dict[str, float]:
    reqs = [GenerationRequest(
        prompt_token_ids=[(11 * i + 5 * r) % 40000 + 100 for i in range(PROMPT_TOKENS)],
        adapter_digest=digests[r % len(digests)],
        sampling=SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens,
                                ignore_eos=True)) for r in range(requests)]
    t0 = time.perf_counter()
    out = e.generate(reqs)
    took = time.perf_counter() - t0
    made = sum(len(o.token_ids) for o in out)
    return {"tokens_per_s": round(made / took, 2), "seconds": round(took, 3), "tokens": made}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="fewer tokens and rounds (what `make bench` runs)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--single-tokens", type=int, default=None)
    ap.add_argument("--batch-tokens", type=int, default=None)
    ap.add_argument("--answer-tokens", type=int, default=None)
    ap.add_argument("--out", default=str(RESULTS / "int8.json"))
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 3)
    single_tokens = args.single_tokens or (32 if args.quick else 64)
    batch_tokens = args.batch_tokens or (16 if args.quick else 64)
    answer_tokens = args.answer_tokens or (48 if args.quick else 96)
    run = BenchRun("int8", quick=args.quick)

    settings = Settings()
    model_dir = ensure_smollm2(settings.cache_dir)
    ckpt = load_checkpoint(model_dir, torch.float32, "cpu")
    tokenizer = load_tokenizer(model_dir)
    adapters = {a.adapter_id: a.directory
                for a in demo_adapters(model_dir, settings.cache_dir, base_digest=ckpt.digest)}
    forms = {"bf16": engine(ckpt, tokenizer, torch.bfloat16, "dense"),
             "int8": engine(ckpt, tokenizer, torch.bfloat16, "int8"),
             "int8_dense_lm_head": engine(ckpt, tokenizer, torch.bfloat16, "int8",
                                          int8_lm_head=False),
             "fp32": engine(ckpt, tokenizer, torch.float32, "dense")}
    print(f"[int8] quality on {len(DEMO_QUESTIONS)} questions x (base + {len(adapters)} "
          "adapters)", flush=True)
    q = quality(forms, adapters, model_dir, answer_tokens)
    for name, s in q["summary"].items():
        print(f"[int8]   {name}: {s}", flush=True)
    speed_forms = {"bf16": forms["bf16"], "int8": forms["int8"]}
    del forms  # the two other forms are not timed: free their memory
    digests: dict[str, list[str | None]] = {
        name: [None, *(e.load_adapter(d).digest for d in adapters.values())]
        for name, e in speed_forms.items()}
    for name, e in speed_forms.items():  # warm: workspace buffers, first-touch pages
        single_stream(e, 4)
        mixed_batch(e, digests[name], 8, 2)
    rounds_out: list[dict[str, Any]] = []
    for r in range(rounds):
        for name, e in speed_forms.items():
            s = single_stream(e, single_tokens)
            b = mixed_batch(e, digests[name], args.requests, batch_tokens)
            rounds_out.append({"round": r, "form": name, "single": s, "batch": b,
                               "load_average": load_average()})
            print(f"[int8] round {r} {name}: single {s} batch {b}", flush=True)

    def med(form: str, part: str, key: str) -> float:
        return statistics.median(x[part][key] for x in rounds_out if x["form"] == form)

    speed = {form: {"itl_ms": med(form, "single", "itl_ms"),
                    "ttft_ms": med(form, "single", "ttft_ms"),
                    "batch_tokens_per_s": med(form, "batch", "tokens_per_s")}
             for form in speed_forms}
    loads = [x["load_average"] for x in rounds_out]
    peak = [max(col) for col in zip(*loads, strict=True)]
    qs, base_q = q["summary"]["int8"], q["summary"]["bf16"]
    setting = (f"{MODEL}, CPU, bf16 activations and LoRA; {rounds} interleaved rounds, median; "
               f"int8 kernel up to {INT8PACK_MAX_ROWS} rows per matmul")
    figures = [
        Figure("int8 teacher-forced top-1 agreement with bf16", qs["top1_agreement"], "",
               baseline="fp32 dense against bf16 (the bf16 reference's own distance)",
               baseline_value=q["summary"]["fp32"]["top1_agreement"],
               settings=f"{q['positions']} answer positions: bf16's greedy answers to the "
               f"demo questions, base + 3 demo adapters", model=MODEL),
        Figure("int8 perplexity of bf16's answers", qs["perplexity"], "",
               baseline="bf16 dense", baseline_value=base_q["perplexity"], better="lower",
               settings="same positions", model=MODEL),
        Figure("int8 (dense lm_head) top-1 agreement with bf16",
               q["summary"]["int8_dense_lm_head"]["top1_agreement"], "",
               baseline="int8 with int8 lm_head (served)", baseline_value=qs["top1_agreement"],
               settings="same positions", model=MODEL),
        Figure("single stream inter-token latency, int8", speed["int8"]["itl_ms"], "ms",
               baseline="bf16 dense, same run", baseline_value=speed["bf16"]["itl_ms"],
               better="lower", settings=f"{PROMPT_TOKENS}-token prompt, {single_tokens} new "
               f"tokens; {setting}", load_average=peak, model=MODEL),
        Figure("single stream TTFT, int8", speed["int8"]["ttft_ms"], "ms",
               baseline="bf16 dense, same run", baseline_value=speed["bf16"]["ttft_ms"],
               better="lower", settings=f"{PROMPT_TOKENS}-token prompt; {setting}",
               load_average=peak, model=MODEL),
        Figure(f"{args.requests}-request mixed batch, int8", speed["int8"]["batch_tokens_per_s"],
               "tok/s", baseline="bf16 dense, same run",
               baseline_value=speed["bf16"]["batch_tokens_per_s"],
               settings=f"round-robin over base + 3 demo adapters, {PROMPT_TOKENS}-token "
               f"prompts, {batch_tokens} new tokens each, all submitted at once; {setting}",
               load_average=peak, model=MODEL),
    ]
    run.save(args.out, {"model": MODEL, "quality": q, "speed": speed, "rounds": rounds_out,
                        "threads": torch.get_num_threads()}, figures)


if __name__ == "__main__":
    main()
