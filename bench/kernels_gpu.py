"""GPU benchmark of the multi-LoRA kernels: correctness first, then timings against a
torch gather+bmm baseline, as fractions of measured HBM bandwidth.

Run on a CUDA machine from the repository root::

    python bench/kernels_gpu.py            # ~1-3 minutes on an H200
    TRITON_INTERPRET=1 python bench/kernels_gpu.py --smoke --out DIR   # tiny, on the CPU

``--smoke`` runs one tiny case of every op through the Triton interpreter (host timings,
meaningless as speed) so the script is exercised end to end where no GPU is lent.

It checks each case on fresh random inputs against the torch reference, then times every op
with CUDA events (median of many runs after warm-up, rotating through enough input copies
to exceed L2 so weights come from HBM), measures HBM bandwidth with a large device copy, and
writes ``bench/results/kernels_gpu_<GPU>.json``. Targets (from the kernels issue): BGMV
batch 64 / hidden 4096 / rank 16 / 64 adapters under 20 us; batch 256 / hidden 8192 /
rank 64 / 256 adapters at >= 60% of HBM bandwidth; SGMV prefill >= 2x gather+bmm; mixed
ranks costing about the average rank, not the maximum. The int8 weight-only kernel
(``loraplane_kernels/triton/int8_mm.py``) is timed at 4096 x 4096 for 1, 16 and 256 rows
against dequantising into a buffer then multiplying, and against the dense weight; its
target is a one-row product faster than dequantise-then-multiply.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loraplane_kernels import PooledLora, Segments, reference  # noqa: E402
from loraplane_kernels.int8 import quantize_int8  # noqa: E402
from loraplane_kernels.triton import bgmv, fused, fused_base, int8_mm, sgmv  # noqa: E402
from loraplane_kernels.tuning_table import table_file_name  # noqa: E402

DTYPE = torch.float16
L2_FLUSH_BYTES = 256 << 20  # rotate inputs until this many bytes separate reuses
TOLERANCE = 5e-3            # fp16, max|err| / max|ref|
DEVICE = "cuda"             # a module global so the case builders can be smoke-run elsewhere


def time_cuda(fns: list[Callable[[], object]], warmup: int = 10, iters: int = 100) -> float:
    """Median microseconds of one call, cycling through ``fns`` (one per input copy)."""
    if DEVICE != "cuda":  # --smoke: host clock, a couple of calls
        samples = []
        for i in range(2):
            t0 = time.perf_counter()
            fns[i % len(fns)]()
            samples.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(samples)
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fns[i % len(fns)]()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) * 1e3


def hbm_bandwidth_gbps() -> float:
    """Read+write bandwidth of a 4 GiB device-to-device copy: the ceiling for these ops."""
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_cuda([lambda: dst.copy_(src)], warmup=3, iters=20)
    return 2 * n / (us * 1e-6) / 1e9


@dataclass
class Problem:
    x: torch.Tensor
    y: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    indices: torch.Tensor
    segments: Segments | None

    def weight_bytes(self) -> int:
        """Bytes of A and B the op must read: each used slot once, its real rank only."""
        used = torch.unique(self.indices[self.indices >= 0])
        k, n = self.a.shape[2], self.b.shape[1]
        return int(self.ranks[used].sum()) * (k + n) * self.a.element_size()

    def bytes_moved(self) -> int:
        """Weights plus activations read and written (x once, y twice, h twice)."""
        t = self.x.shape[0]
        act = self.x.numel() * self.x.element_size() + 2 * self.y.numel() * self.y.element_size()
        return self.weight_bytes() + act + 2 * t * self.a.shape[1] * 4


def make_problem(tokens: int, hidden: int, ranks: list[int], indices: torch.Tensor,
                 segments: Segments | None = None, max_rank: int | None = None) -> Problem:
    slots = len(ranks)
    max_rank = max_rank or max(ranks)
    dev = DEVICE
    return Problem(
        x=torch.randn(tokens, hidden, dtype=DTYPE, device=dev),
        y=torch.randn(tokens, hidden, dtype=DTYPE, device=dev),
        a=torch.randn(slots, max_rank, hidden, dtype=DTYPE, device=dev) / hidden**0.5,
        b=torch.randn(slots, hidden, max_rank, dtype=DTYPE, device=dev) / max_rank**0.5,
        ranks=torch.tensor(ranks, dtype=torch.int32, device=dev),
        scales=torch.full((slots,), 0.5, dtype=torch.float32, device=dev),
        indices=indices.to(device=dev, dtype=torch.int32),
        segments=segments,
    )


def copies(make: Callable[[], Problem], footprint: int) -> list[Problem]:
    """Enough independent problems that cycling through them defeats L2."""
    count = max(2, -(-L2_FLUSH_BYTES // max(footprint, 1)))
    return [make() for _ in range(min(count, 16))]


# --- the ops -----------------------------------------------------------------------------

def run_separate(p: Problem) -> None:
    if p.segments is None:
        h = bgmv.bgmv_shrink(p.x, p.a, p.ranks, p.indices, split_k=4)
        bgmv.bgmv_expand(p.y, h, p.b, p.ranks, p.scales, p.indices)
    else:
        h = sgmv.sgmv_shrink(p.x, p.a, p.ranks, p.segments)
        sgmv.sgmv_expand(p.y, h, p.b, p.ranks, p.scales, p.segments)


def run_fused(p: Problem) -> None:
    if p.segments is None:
        fused.bgmv_fused(p.y, p.x, p.a, p.b, p.ranks, p.scales, p.indices, n_split=4)
    else:
        fused.sgmv_fused(p.y, p.x, p.a, p.b, p.ranks, p.scales, p.segments)


def run_gather_bmm(p: Problem) -> None:
    """The baseline: gather each token's padded A and B, then two batched matmuls."""
    idx = p.indices.clamp_min(0).long()
    a = p.a[idx]                                   # [T, R, K]
    b = p.b[idx]                                   # [T, N, R]
    h = torch.bmm(a, p.x.unsqueeze(2))             # [T, R, 1]
    delta = torch.bmm(b, h).squeeze(2)             # [T, N]
    keep = (p.indices >= 0).unsqueeze(1).to(delta.dtype)
    p.y.add_(delta * (p.scales[idx].unsqueeze(1).to(delta.dtype) * keep))


def check(p: Problem, op: Callable[[Problem], None]) -> float:
    """Relative error of ``op`` against the torch reference (fp32 on the GPU)."""
    y0 = p.y.clone()
    want = y0.float()
    reference.lora_apply(want, p.x.float(), p.a.float(), p.b.float(), p.ranks, p.scales,
                         p.indices)
    op(p)
    err = ((p.y.float() - want).abs().max() / want.abs().max()).item()
    p.y.copy_(y0)
    return err


def bench_case(name: str, make: Callable[[], Problem], ops: dict[str, Callable[[Problem], None]],
               hbm_gbps: float, iters: int = 200) -> dict[str, object]:
    probe = make()
    errors = {op: check(probe, fn) for op, fn in ops.items()}
    problems = copies(make, probe.bytes_moved())
    result: dict[str, object] = {
        "tokens": probe.x.shape[0], "hidden": probe.x.shape[1],
        "ranks": sorted(set(probe.ranks.tolist())), "distinct_adapters":
            int(torch.unique(probe.indices[probe.indices >= 0]).numel()),
        "weight_bytes": probe.weight_bytes(), "bytes_moved": probe.bytes_moved(),
        "max_rel_err": errors, "correct": all(e < TOLERANCE for e in errors.values()),
        "us": {}, "fraction_of_hbm": {},
    }
    for op, fn in ops.items():
        us = time_cuda([lambda p=p, fn=fn: fn(p) for p in problems], iters=iters)
        result["us"][op] = round(us, 2)
        result["fraction_of_hbm"][op] = round(probe.bytes_moved() / (us * 1e-6) / 1e9
                                              / hbm_gbps, 3)
    print(f"{name}: " + ", ".join(
        f"{op} {us:.1f} us ({result['fraction_of_hbm'][op]:.0%} HBM, err "
        f"{errors[op]:.1e})" for op, us in result["us"].items()), flush=True)
    return result


def distinct(tokens: int) -> torch.Tensor:
    return torch.arange(tokens, dtype=torch.int32)


def prefill(lengths: list[int], hidden: int, rank: int) -> Callable[[], Problem]:
    segments = Segments.from_lengths(lengths, list(range(len(lengths))), device=DEVICE)
    return lambda: make_problem(sum(lengths), hidden, [rank] * len(lengths),
                                segments.token_indices(), segments)


@dataclass
class BucketProblem:
    """Adapter buckets of one projection: base weight plus rank-granular LoRA weights."""

    x: torch.Tensor
    y: torch.Tensor
    weight: torch.Tensor
    lora: PooledLora
    segments: Segments


def make_buckets(bucket: int, buckets: int, hidden: int, rank: int) -> BucketProblem:
    """``buckets`` adapters with ``bucket`` tokens each, on a [hidden, hidden] projection."""
    k = n = hidden
    pool = torch.randn(buckets * rank * (k + n), dtype=DTYPE, device=DEVICE) / hidden**0.5
    lora = PooledLora(pool, k, n, buckets)
    for s in range(buckets):
        base = s * rank * (k + n)
        lora.place(s, base, base + rank * k, rank, 0.5)
    return BucketProblem(
        x=torch.randn(bucket * buckets, k, dtype=DTYPE, device=DEVICE),
        y=torch.empty(bucket * buckets, n, dtype=DTYPE, device=DEVICE),
        weight=torch.randn(n, k, dtype=DTYPE, device=DEVICE) / k**0.5,
        lora=lora,
        segments=Segments.from_lengths([bucket] * buckets, list(range(buckets)),
                                       device=DEVICE),
    )


def run_base_separate(p: BucketProblem) -> None:
    """The separate path: base GEMM over every token, then SGMV shrink + expand."""
    torch.mm(p.x, p.weight.T, out=p.y)
    h = sgmv.sgmv_shrink(p.x, p.lora, p.lora.ranks, p.segments)
    sgmv.sgmv_expand(p.y, h, p.lora, p.lora.ranks, p.lora.scales, p.segments)


def run_base_fused(p: BucketProblem) -> None:
    fused_base.sgmv_base_fused(p.y, p.x, p.weight, p.lora, p.segments)


def bucket_error(p: BucketProblem, op: Callable[[BucketProblem], None]) -> float:
    want = torch.nn.functional.linear(p.x.float(), p.weight.float())
    w32 = PooledLora(p.lora.pool.float(), p.lora.in_features, p.lora.out_features,
                    p.lora.num_slots)
    for s in range(p.lora.num_slots):
        w32.place(s, int(p.lora.a_offsets[s]), int(p.lora.b_offsets[s]),
                  p.lora.host_ranks[s], p.lora.host_scales[s])
    for s, (lo, hi) in enumerate(zip(p.segments.starts[:-1].tolist(),
                                     p.segments.starts[1:].tolist(), strict=True)):
        a, bt = w32.a_views[s], w32.bt_views[s]
        want[lo:hi] += w32.host_scales[s] * ((p.x[lo:hi].float() @ a.T) @ bt)
    op(p)
    return ((p.y.float() - want).abs().max() / want.abs().max()).item()


def bench_fused_base(bucket: int, buckets: int, hidden: int, rank: int,
                     iters: int = 100) -> dict[str, object]:
    """Fused base + LoRA against the separate path, for one bucket size."""
    probe = make_buckets(bucket, buckets, hidden, rank)
    errors = {op: bucket_error(probe, fn) for op, fn in
              (("fused", run_base_fused), ("separate", run_base_separate))}
    ps = [probe] + [make_buckets(bucket, buckets, hidden, rank) for _ in range(3)]
    us = {op: round(time_cuda([lambda p=p, fn=fn: fn(p) for p in ps], iters=iters), 2)
          for op, fn in (("fused", run_base_fused), ("separate", run_base_separate))}
    print(f"fused base b{bucket}x{buckets} h{hidden} r{rank}: fused {us['fused']} us, "
          f"separate {us['separate']} us (err {errors})", flush=True)
    return {"bucket": bucket, "buckets": buckets, "hidden": hidden, "rank": rank, "us": us,
            "max_rel_err": errors, "correct": all(e < TOLERANCE for e in errors.values())}


def bench_int8(rows: int, n: int, k: int, hbm_gbps: float,
               iters: int = 100) -> dict[str, object]:
    """The int8 weight-only kernel against dequantising into a buffer and the dense matmul
    (the CPU's path for big batches), and against the dense weight itself."""
    ws = [quantize_int8((torch.randn(n, k, device=DEVICE) * 0.05).to(DTYPE))
          for _ in range(max(1, min(8, L2_FLUSH_BYTES // (n * k))))]
    x = torch.randn(rows, k, device=DEVICE).to(DTYPE)
    dense = [w.dequantize() for w in ws]
    scratch = torch.empty(n, k, dtype=DTYPE, device=DEVICE)
    want = x.double() @ (ws[0].q.double().T) * ws[0].scale.double()
    got = int8_mm.int8_mm(x, ws[0].q, ws[0].scale)
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    ops = {"int8_kernel": [lambda w=w: int8_mm.int8_mm(x, w.q, w.scale) for w in ws],
           "dequantize_then_mm": [lambda w=w: x @ w.dequantize(scratch).t() for w in ws],
           "dense_weight": [lambda d=d: x @ d.t() for d in dense]}
    us = {op: round(time_cuda(fns, iters=iters), 2) for op, fns in ops.items()}
    moved = n * k + n * 2 + 2 * rows * (n + k)  # int8 weight, scales, x and y
    fraction = round(moved / (us["int8_kernel"] * 1e-6) / 1e9 / hbm_gbps, 3)
    print(f"int8 m{rows} n{n} k{k}: " + ", ".join(f"{op} {t:.1f} us" for op, t in us.items())
          + f" ({fraction:.0%} HBM, err {err:.1e})", flush=True)
    return {"rows": rows, "n": n, "k": k, "us": us, "int8_fraction_of_hbm": fraction,
            "max_rel_err": err, "correct": err < TOLERANCE}


def smoke(out_dir: Path) -> int:
    """Every op once on tiny shapes through the Triton interpreter (no speed meaning)."""
    global DEVICE, DTYPE
    DEVICE, DTYPE = "cpu", torch.float32
    torch.manual_seed(0)
    ops = {"fused": run_fused, "separate": run_separate, "gather_bmm": run_gather_bmm}
    cases = {
        "bgmv": bench_case("bgmv smoke", lambda: make_problem(4, 64, [8] * 4, distinct(4)),
                           ops, 1.0, iters=2),
        "sgmv": bench_case("sgmv smoke", prefill([8, 8], 64, 8), ops, 1.0, iters=2),
        "fused_base": bench_fused_base(4, 2, 64, 8, iters=2),
        "int8": bench_int8(3, 40, 70, 1.0, iters=2),
    }
    correct = all(c["correct"] for c in cases.values())
    out = out_dir / "kernels_gpu_smoke.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": "cpu (TRITON_INTERPRET=1)", "smoke": True,
                               "cases": cases, "all_correct": correct}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if correct else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes through the Triton interpreter (TRITON_INTERPRET=1)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    if args.smoke:
        return smoke(args.out)
    if not torch.cuda.is_available():
        print("bench/kernels_gpu.py needs a CUDA GPU; none is visible (torch.cuda."
              "is_available() is False). Nothing was measured.", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    hbm = hbm_bandwidth_gbps()
    print(f"{gpu}: measured HBM copy bandwidth {hbm:.0f} GB/s", flush=True)
    decode_ops = {"fused": run_fused, "separate": run_separate, "gather_bmm": run_gather_bmm}
    cases: dict[str, dict[str, object]] = {}

    cases["bgmv_b64_h4096_r16_a64"] = bench_case(
        "bgmv b64 h4096 r16 x64", lambda: make_problem(64, 4096, [16] * 64, distinct(64)),
        decode_ops, hbm)
    cases["bgmv_b256_h8192_r64_a256"] = bench_case(
        "bgmv b256 h8192 r64 x256", lambda: make_problem(256, 8192, [64] * 256, distinct(256)),
        decode_ops, hbm, iters=50)

    prefill_ops = {"sgmv": run_separate, "sgmv_fused": run_fused,
                   "gather_bmm": run_gather_bmm}
    cases["sgmv_prefill_8x512_h4096_r16"] = bench_case(
        "sgmv prefill 8x512 h4096 r16", prefill([512] * 8, 4096, 16), prefill_ops, hbm,
        iters=30)

    # Mixed ranks: the same 256 tokens over 64 adapters with ranks 8..128, against every slot
    # padded to rank 128 (what padding slabs to the max does) and a uniform average rank.
    mixed = [8, 16, 32, 64, 128, 24, 40, 96] * 8
    avg = round(sum(mixed) / len(mixed))
    idx = torch.arange(256, dtype=torch.int32) % 64
    variants = {"mixed": mixed, "padded_to_max": [128] * 64, "uniform_average": [avg] * 64}
    mixed_result: dict[str, object] = {"average_rank": avg}
    for label, ranks in variants.items():
        mixed_result[label] = bench_case(
            f"bgmv b256 h4096 {label}",
            lambda ranks=ranks: make_problem(256, 4096, ranks, idx, max_rank=128),
            {"fused": run_fused, "separate": run_separate}, hbm)
    cases["mixed_ranks_b256_h4096"] = mixed_result
    cases["fused_base_h4096_r16"] = {
        str(b): bench_fused_base(b, 8, 4096, 16) for b in (1, 4, 16, 64, 256)}
    cases["int8_n4096_k4096"] = {str(m): bench_int8(m, 4096, 4096, hbm) for m in (1, 16, 256)}

    best = lambda case, ops: min(case["us"][o] for o in ops)  # noqa: E731
    small, large = cases["bgmv_b64_h4096_r16_a64"], cases["bgmv_b256_h8192_r64_a256"]
    pre = cases["sgmv_prefill_8x512_h4096_r16"]
    mixed_best = best(mixed_result["mixed"], ["fused", "separate"])
    padded_best = best(mixed_result["padded_to_max"], ["fused", "separate"])
    avg_best = best(mixed_result["uniform_average"], ["fused", "separate"])
    large_best = max(large["fraction_of_hbm"][o] for o in ("fused", "separate"))
    targets = {
        "bgmv_b64_under_20us": {"us": best(small, ["fused", "separate"]), "met":
                                best(small, ["fused", "separate"]) < 20.0},
        "bgmv_b256_at_least_60pct_hbm": {"fraction": large_best, "met": large_best >= 0.6},
        "sgmv_prefill_2x_gather_bmm": {
            "speedup": round(pre["us"]["gather_bmm"] / best(pre, ["sgmv", "sgmv_fused"]), 2),
            "met": pre["us"]["gather_bmm"] >= 2 * best(pre, ["sgmv", "sgmv_fused"])},
        "mixed_ranks_cost_average_not_max": {
            "mixed_over_average": round(mixed_best / avg_best, 2),
            "mixed_over_padded": round(mixed_best / padded_best, 2),
            "met": mixed_best <= 1.25 * avg_best and mixed_best < padded_best},
        "all_correct": all(c.get("correct", True) for c in cases.values() if "correct" in c)
        and all(mixed_result[v]["correct"] for v in variants)
        and all(c["correct"] for c in cases["fused_base_h4096_r16"].values())
        and all(c["correct"] for c in cases["int8_n4096_k4096"].values()),
        "int8_decode_beats_dequantize": {
            "ratio": round(cases["int8_n4096_k4096"]["1"]["us"]["int8_kernel"]
                           / cases["int8_n4096_k4096"]["1"]["us"]["dequantize_then_mm"], 3),
            "met": cases["int8_n4096_k4096"]["1"]["us"]["int8_kernel"]
            < cases["int8_n4096_k4096"]["1"]["us"]["dequantize_then_mm"]},
    }
    for name, t in targets.items():
        print(f"target {name}: {t}", flush=True)
    out = args.out / f"kernels_gpu_{table_file_name(gpu)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "gpu": gpu, "torch": torch.__version__,
        "triton": __import__("triton").__version__, "dtype": str(DTYPE),
        "hbm_copy_gbps": round(hbm, 1), "cases": cases, "targets": targets,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
