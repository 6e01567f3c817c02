"""Measure where fusing stops paying on this GPU; write its tuning table.

Run on a CUDA machine from the repository root::

    python bench/tune_kernels.py [--out PATH] [--quick]
    TRITON_INTERPRET=1 python bench/tune_kernels.py --smoke --out PATH   # tiny, on the CPU

For each op (bgmv, sgmv), hidden size and rank bucket it times, at growing batch sizes, the
separate launches over ``shrink_split_k`` choices and the fused launch over ``fused_n_split``
choices, keeps the best of each, and records ``fused_max_tokens`` as the largest batch up to
which fused wins without interruption. For sgmv it also times the fused base + LoRA kernel
against base GEMM + SGMV per adapter bucket size and records ``fused_base_max_tokens``, the
two-level batching threshold. Writes ``loraplane_kernels/tuning/<GPU_MODEL>.json`` (the file
``loraplane_kernels.dispatch`` looks up by ``torch.cuda.get_device_name()``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import kernels_gpu  # noqa: E402
from kernels_gpu import (  # noqa: E402
    L2_FLUSH_BYTES,
    Problem,
    make_buckets,
    make_problem,
    run_base_fused,
    run_base_separate,
    time_cuda,
)

from loraplane_kernels import Segments  # noqa: E402
from loraplane_kernels.triton import bgmv, fused, sgmv  # noqa: E402
from loraplane_kernels.tuning_table import TUNING_DIR, read_table, table_file_name  # noqa: E402

SPLITS = (1, 2, 4, 8)
SMOKE_SPLITS = (1, 2)


def splits() -> tuple[int, ...]:
    return SMOKE_SPLITS if kernels_gpu.DEVICE != "cuda" else SPLITS


def problems(op: str, tokens: int, hidden: int, rank: int) -> list[Problem]:
    adapters = min(tokens, 64)
    if op == "bgmv":
        idx = torch.arange(tokens, dtype=torch.int32) % adapters
        make = lambda: make_problem(tokens, hidden, [rank] * adapters, idx)  # noqa: E731
    else:
        seqs = max(1, min(8, tokens // 16))
        lengths = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
        seg = Segments.from_lengths(lengths, list(range(seqs)), device=kernels_gpu.DEVICE)
        make = lambda: make_problem(tokens, hidden, [rank] * seqs,  # noqa: E731
                                    seg.token_indices(), seg)
    first = make()
    count = max(2, min(8, -(-L2_FLUSH_BYTES // max(first.bytes_moved(), 1))))
    return [first] + [make() for _ in range(count - 1)]


def best_separate(op: str, ps: list[Problem]) -> tuple[float, int]:
    timings = {}
    for split in splits():
        if op == "bgmv":
            def run(p: Problem, s: int = split) -> None:
                h = bgmv.bgmv_shrink(p.x, p.a, p.ranks, p.indices, split_k=s)
                bgmv.bgmv_expand(p.y, h, p.b, p.ranks, p.scales, p.indices)
        else:
            def run(p: Problem, s: int = split) -> None:
                h = sgmv.sgmv_shrink(p.x, p.a, p.ranks, p.segments, split_k=s)
                sgmv.sgmv_expand(p.y, h, p.b, p.ranks, p.scales, p.segments)
        timings[split] = time_cuda([lambda p=p, r=run: r(p) for p in ps], iters=50)
    split = min(timings, key=timings.__getitem__)
    return timings[split], split


def best_fused(op: str, ps: list[Problem]) -> tuple[float, int]:
    timings = {}
    for split in splits():
        launch = fused.bgmv_fused if op == "bgmv" else fused.sgmv_fused

        def run(p: Problem, s: int = split, f=launch) -> None:
            routing = p.indices if op == "bgmv" else p.segments
            f(p.y, p.x, p.a, p.b, p.ranks, p.scales, routing, n_split=s)
        timings[split] = time_cuda([lambda p=p, r=run: r(p) for p in ps], iters=50)
    split = min(timings, key=timings.__getitem__)
    return timings[split], split


def fused_base_threshold(hidden: int, rank: int, buckets: tuple[int, ...],
                         iters: int) -> int:
    """Largest bucket size up to which fused base + LoRA beats base GEMM + SGMV."""
    best = 0
    for bucket in buckets:
        ps = [make_buckets(bucket, 8, hidden, rank) for _ in range(4)]
        fused_us = time_cuda([lambda p=p: run_base_fused(p) for p in ps], iters=iters)
        sep_us = time_cuda([lambda p=p: run_base_separate(p) for p in ps], iters=iters)
        print(f"base+lora h{hidden} r{rank} bucket {bucket}: fused {fused_us:.1f} us, "
              f"separate {sep_us:.1f} us", flush=True)
        if fused_us > sep_us:
            break
        best = bucket
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes through the Triton interpreter (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.smoke:
        kernels_gpu.DEVICE, kernels_gpu.DTYPE = "cpu", torch.float32
        gpu = "cpu (smoke)"
        hiddens, ranks, batches = (64,), (16,), (1, 4)
    elif not torch.cuda.is_available():
        print("bench/tune_kernels.py needs a CUDA GPU; none is visible.", file=sys.stderr)
        return 2
    else:
        gpu = torch.cuda.get_device_name()
        hiddens = (4096,) if args.quick else (4096, 8192)
        ranks = (16, 64) if args.quick else (16, 32, 64, 128)
        batches = (1, 4, 16, 64) if args.quick else (1, 2, 4, 8, 16, 32, 64, 128, 256)
    entries: dict[str, dict[str, dict[str, dict[str, int]]]] = {}
    for op in ("bgmv", "sgmv"):
        for hidden in hiddens:
            for rank in ranks:
                fused_max, split_k, n_split, fused_streak = 0, None, 1, True
                for tokens in batches:
                    ps = problems(op, tokens, hidden, rank)
                    sep_us, sep_split = best_separate(op, ps)
                    fus_us, fus_split = best_fused(op, ps)
                    print(f"{op} h{hidden} r{rank} T{tokens}: separate {sep_us:.1f} us "
                          f"(split_k {sep_split}), fused {fus_us:.1f} us (n_split {fus_split})",
                          flush=True)
                    if fused_streak and fus_us <= sep_us:
                        fused_max, n_split = tokens, fus_split
                    else:
                        fused_streak = False
                        # separate launches serve batches past the fused range: keep the
                        # split that was best at the first of them
                        split_k = sep_split if split_k is None else split_k
                    del ps
                split_k = split_k or 1
                entry = {"fused_max_tokens": fused_max, "shrink_split_k": split_k,
                         "fused_n_split": n_split}
                if op == "sgmv":
                    entry["fused_base_max_tokens"] = fused_base_threshold(
                        hidden, rank, batches, iters=2 if args.smoke else 50)
                entries.setdefault(op, {}).setdefault(str(hidden), {})[str(rank)] = entry
    out = args.out or TUNING_DIR / table_file_name(gpu)
    out.write_text(json.dumps({
        "device": gpu,
        "source": f"bench/tune_kernels.py{' --quick' if args.quick else ''}"
                  f"{' --smoke (interpreter, not a measurement)' if args.smoke else ''}, torch "
                  f"{torch.__version__}, {kernels_gpu.DTYPE}, median timings",
        "entries": entries,
    }, indent=2) + "\n")
    read_table(out)  # refuse to leave a file dispatch cannot load
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
