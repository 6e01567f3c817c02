"""Where one decode step of the engine spends its time, per component.

Usage: python bench/profile_step.py [--dtype bfloat16] [--steps 24] [--label NAME]
                                    [--out bench/results/profile.json]

SmolLM2-135M-Instruct with the three demo adapters, the worker's engine settings, prefix
cache off, 2 threads; two scenarios, each profiled over `--steps` decode steps after its
prefill:
- single: one stream on the base model, 128-token prompt;
- mix: 32 requests round-robin over base + the 3 adapters (prompts of 32-96 tokens), all
  decoding (the peer bench's multi-tenant batch).

Each step is first timed bare (median wall ms per step), then again under torch.profiler
with ranges around the LoRA pass (`AdapterPool.apply`), decode attention
(`paged_attention` and the compiled kernel's own entry), the compiled layer ops
(`loraplane_kernels.cpu_layer`), the logits (`DecoderModel._logits`), the sampler (`sample`)
and the scheduler plus batch building. The profiled time splits into: base GEMMs
(top-level `aten::mm` / `aten::addmm` / `mkldnn::_linear_pointwise` in the forward,
outside LoRA and attention, and the few-row kernel `cpu_decode.linear_rows_arrays` there), the
LM head (the final norm and the logits), LoRA, attention,
other ops in the forward (norms, rope, SwiGLU, the KV write, the embedding), the sampler,
schedule + batch build, and Python (the forward's and the step's own time outside any
op). Each bare step's process CPU time is recorded beside its wall time: on a shared
machine whose load exceeds its cores, wall time is mostly waiting for a core. The
profiler adds a few microseconds per op, so the shares, not its milliseconds, carry
over; the bare median is the step's real cost. The greedy tokens of both scenarios are
digested so that a change can show it kept the outputs.

`--label` names the run in the results (e.g. "before" / "after"); runs of other labels
already in `--out` are kept, so one file holds a before and an after side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import BenchRun, Figure  # noqa: E402
from loraplane_kernels import cpu_decode, cpu_layer  # noqa: E402
from services.config import Settings  # noqa: E402
from services.stack.models import ensure_smollm2  # noqa: E402
from services.worker.engine import (  # noqa: E402
    Engine,
    GenerationRequest,
    SamplingParams,
    checkpoint_digest,
)
from services.worker.engine import engine as engine_mod  # noqa: E402
from services.worker.engine import model as model_mod  # noqa: E402
from services.worker.engine.adapter_pool import AdapterPool  # noqa: E402

THREADS = 2
RANGES = {"lora": "LoRA pass", "attention": "decode attention", "sampler": "sampler",
          "schedule": "schedule + batch build", "layer_ops": "other ops", "logits": "LM head"}
COMPONENTS = ("base GEMMs", "LM head", "LoRA pass", "decode attention", "other ops",
              "sampler", "schedule + batch build", "Python")


def labelled(name: str, fn):
    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return wrapper


def instrument() -> None:
    """Ranges around the components the forward and the step call (profiling only)."""
    AdapterPool.apply = labelled("lora", AdapterPool.apply)  # type: ignore[method-assign]
    model_mod.paged_attention = labelled("attention", model_mod.paged_attention)
    cpu_decode.decode_attention_arrays = labelled("attention",
                                                  cpu_decode.decode_attention_arrays)
    kernels = cpu_layer.kernels()  # the compiled elementwise ops of small steps
    for name in ("residual_norm", "rope_cache", "gated"):
        setattr(kernels, name, labelled("layer_ops", getattr(kernels, name)))
    cpu_decode.linear_rows_arrays = labelled("row_linear", cpu_decode.linear_rows_arrays)
    model_mod.DecoderModel._logits = labelled(  # type: ignore[method-assign]
        "logits", model_mod.DecoderModel._logits)
    engine_mod.sample = labelled("sampler", engine_mod.sample)
    Engine._build_batch = labelled("schedule", Engine._build_batch)  # type: ignore[method-assign]


def make_engine(model_dir: Path, dtype: str, adapters: list[Path]) -> tuple[Engine, list]:
    from services.worker.app import engine_config

    cfg = dataclasses.replace(engine_config(Settings()), dtype=dtype, device="cpu",
                              prefix_cache=False)
    eng = Engine.from_pretrained(model_dir, cfg)
    digests = [None] + [eng.load_adapter(d).digest for d in adapters]
    return eng, digests


def requests(scenario: str, vocab: int, digests: list, new: int) -> list[GenerationRequest]:
    rng = random.Random(0)
    if scenario == "single":
        prompts = [([rng.randrange(3, vocab) for _ in range(128)], None)]
    else:
        prompts = [([rng.randrange(3, vocab) for _ in range(rng.randint(32, 96))],
                    digests[i % len(digests)]) for i in range(32)]
    return [GenerationRequest(prompt_token_ids=p, adapter_digest=d,
                              sampling=SamplingParams(max_tokens=new, min_tokens=new,
                                                      ignore_eos=True))
            for p, d in prompts]


def decoding(eng: Engine, reqs: list[GenerationRequest]) -> list[str]:
    """Submit and step until every request has its first token (prefill done)."""
    ids = [eng.submit(r) for r in reqs]
    started: set[str] = set()
    while len(started) < len(ids):
        for ev in eng.step():
            started.add(ev.request_id)
    return ids


def categorise(prof) -> dict[str, float]:
    """Milliseconds per component over the profiled steps (see the module docstring)."""
    ms: dict[str, float] = dict.fromkeys(COMPONENTS, 0.0)
    step = forward = 0.0
    for e in prof.events():
        dur = e.time_range.elapsed_us() / 1e3
        if e.name == "step":
            step += dur
        elif e.name == "forward":
            forward += dur
        elif e.name == "row_linear":  # the one-row kernel: a base projection or the head
            parent = e.cpu_parent
            while parent is not None and parent.name not in ("logits", "forward"):
                parent = parent.cpu_parent
            if parent is not None and parent.name == "forward":  # the head's is in "logits"
                ms["base GEMMs"] += dur
        elif e.name in RANGES:
            ms[RANGES[e.name]] += dur
        elif e.name.startswith(("aten::", "mkldnn::")):
            parent, inside = e.cpu_parent, None
            top = True
            while parent is not None:
                if parent.name.startswith(("aten::", "mkldnn::")):
                    top = False
                    break
                if parent.name in RANGES or parent.name in ("forward", "step"):
                    inside = parent.name
                    break
                parent = parent.cpu_parent
            if not top or inside != "forward":
                continue
            if e.name in ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"):
                ms["base GEMMs"] += dur
            elif e.name == "aten::linear":
                ms["LM head"] += dur
            else:
                ms["other ops"] += dur
    in_forward = ms["base GEMMs"] + ms["LM head"] + ms["LoRA pass"] + \
        ms["decode attention"] + ms["other ops"]
    # schedule + batch build runs in the step, outside the forward
    ms["Python"] = (forward - in_forward) + (step - forward - ms["sampler"]
                                             - ms["schedule + batch build"])
    ms["step total"] = step
    return ms


def scenario(eng: Engine, digests: list, name: str, steps: int) -> dict[str, Any]:
    vocab = eng.model.cfg.vocab_size
    # bare: median wall time of decode steps
    ids = decoding(eng, requests(name, vocab, digests, steps + 2))
    bare, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        eng.step()
        bare.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    while eng.has_work:
        eng.step()
    tokens = [eng.pop_result(i).token_ids for i in ids]
    # profiled
    ids = decoding(eng, requests(name, vocab, digests, steps + 2))
    forward = eng.model.forward
    eng.model.forward = labelled("forward", forward)  # type: ignore[method-assign]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("step"):
                eng.step()
    del eng.model.forward
    while eng.has_work:
        eng.step()
    for i in ids:
        eng.pop_result(i)
    ms = categorise(prof)
    total = ms.pop("step total")
    return {
        "decodes_per_step": 1 if name == "single" else 32,
        "bare_step_ms_median": round(statistics.median(bare), 3),
        "bare_step_ms_all": [round(x, 2) for x in bare],
        "bare_step_cpu_ms_median": round(statistics.median(cpu), 3),
        "profiled_step_ms": round(total / steps, 3),
        "components_ms_per_step": {k: round(v / steps, 3) for k, v in ms.items()},
        "components_share": {k: round(v / total, 3) for k, v in ms.items()},
        "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
        "load_after": round(__import__("os").getloadavg()[0], 2),
    }


def tables(runs: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name in ("single", "mix"):
        header = ["component", *[f"{label}: ms/step (share)" for label in runs]]
        rows = []
        for comp in COMPONENTS:
            rows.append([comp, *[
                f"{r[name]['components_ms_per_step'][comp]:.3f} "
                f"({r[name]['components_share'][comp]:.0%})" for r in runs.values()]])
        rows.append(["profiled step", *[f"{r[name]['profiled_step_ms']:.3f}"
                                        for r in runs.values()]])
        rows.append(["bare step, median", *[f"**{r[name]['bare_step_ms_median']:.3f}**"
                                            for r in runs.values()]])
        rows.append(["bare step, median CPU ms (both threads)", *[
            f"{r[name].get('bare_step_cpu_ms_median', 'n/a')}" for r in runs.values()]])
        rows.append(["load after", *[f"{r[name]['load_after']}" for r in runs.values()]])
        rows.append(["greedy tokens digest", *[r[name]["tokens_sha256"]
                                               for r in runs.values()]])
        what = "one stream on base, 128-token prompt" if name == "single" else \
            "32 requests over base + 3 adapters, all decoding"
        out.append({"title": f"One {runs[next(iter(runs))]['dtype']} decode step, "
                             f"{what} (SmolLM2-135M-Instruct)", "header": header,
                    "rows": rows})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--label", default="current")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "profile.json")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    record = BenchRun("profile_step", quick=False)
    settings = Settings()
    model_dir = ensure_smollm2(settings.cache_dir)
    from services.demo_adapters import demo_adapters

    adapters = [a.directory for a in demo_adapters(
        model_dir, settings.cache_dir, base_digest=checkpoint_digest(model_dir))]
    eng, digests = make_engine(model_dir, args.dtype, adapters)
    instrument()
    decoding(eng, requests("mix", eng.model.cfg.vocab_size, digests, 4))  # warm-up
    eng.run_until_idle()
    run = {"dtype": args.dtype, "steps": args.steps,
           "single": scenario(eng, digests, "single", args.steps),
           "mix": scenario(eng, digests, "mix", args.steps)}
    try:
        previous = json.loads(args.out.read_text())
        runs = {k: v for k, v in previous.get("runs", {}).items() if k != args.label}
    except (OSError, ValueError):
        runs = {}
    runs[args.label] = run
    figs = []
    for label, r in runs.items():
        for name in ("single", "mix"):
            figs.append(Figure(f"{label}: {r['dtype']} decode step, {name}",
                               r[name]["bare_step_ms_median"], "ms", better="lower",
                               model="SmolLM2-135M-Instruct",
                               settings=f"median of {r['steps']} bare steps; "
                                        f"{r[name]['decodes_per_step']} decodes per step",
                               load_average=[r[name]["load_after"]]))
    record.save(args.out, {"runs": runs, "tables": tables(runs)}, figs)


if __name__ == "__main__":
    main()
