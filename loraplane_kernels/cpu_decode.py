"""Compiled (numba) CPU paths of a decode step: the LoRA pass, every small run of one
projection in one call instead of two BLAS or oneDNN calls per adapter; and decode
attention, read from the paged KV cache in place.

A decode step has a shrink and an expand per adapter, projection and layer, each over the
one or two rows of that adapter's sequences: work of a few microseconds, buried under
per-call costs. torch's bf16 matmuls on the CPU go to oneDNN, about 15 us a call before
any work; its fp32 ones to BLAS, a few. At SmolLM2's shapes, 32 adapters' two-row runs
took 0.9-1.2 ms per projection in bf16 through the nested `bmm` pair (0.16-0.36 ms here)
and 0.34-0.60 ms in fp32 (0.10-0.22 ms here). The kernel reads each weight row once and
streams it through every row of its run.

It computes PEFT's ops in PEFT's order: ``((x @ A.T) @ B.T) * scale`` added to the output.
In bf16 it widens the pool's weights to fp32 (a bf16 is the top half of an fp32) and
rounds to bf16 where PEFT's bf16 ops round: the shrink output, the expand output, its
product with the scale and the sum into the output row. Only the order of the fp32
accumulations inside the dot products differs from BLAS's, so a last bit can differ
(tests/kernels pin the pass to the torch path).

Decode attention: the torch path gathers every decode's K and V out of the paged cache
into a padded batch (a copy of the whole context, per layer), then runs a masked batched
matmul, a softmax and a second batched matmul. The kernel walks each decode's block table
and reads each cached row once, in the thread that owns that decode; a step's decodes are
cut into one share per torch intra-op thread, balanced by context length, and the
shares run on numba's threads.

numba compiles with LLVM from its wheel (no C compiler at run time) and caches the machine
code beside its module, or in the user's cache where that is read-only.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import Tensor

AVAILABLE = importlib.util.find_spec("numba") is not None
"""Without numba, decodes take the torch path (same results, slower)."""

DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def kernel() -> Callable[..., None]:
    """The compiled LoRA pass (one signature per dtype), built or loaded from numba's cache
    on first use: importing numba costs about half a second, which processes that never
    decode on the CPU do not pay."""
    from loraplane_kernels._cpu_decode_numba import runs

    return runs


@functools.cache
def _attention() -> Callable[..., None]:
    from loraplane_kernels._cpu_decode_numba import decode_attention as compiled

    return compiled


_PARALLEL = [True]


def threadsafe() -> bool:
    """Whether kernels may run on numba's own (OpenMP or TBB) threads: only the thread-safe
    layers, since numba's fallback (workqueue) aborts the process when two threads launch
    kernels at once. False once a launch found neither layer."""
    if _PARALLEL[0]:
        import numba

        if numba.config.THREADING_LAYER == "default":
            numba.config.THREADING_LAYER = "threadsafe"
    return _PARALLEL[0]


def _no_threads() -> None:
    """A parallel launch found no thread-safe layer: serial kernels from now on."""
    _PARALLEL[0] = False
    _shares.cache_clear()
    _runs_shares.cache_clear()
    _linear_shares.cache_clear()
    _dequantize_shares.cache_clear()


def on_threads(shared: Callable[..., None] | None, *args: Any) -> bool:
    """Run a kernel's shares on numba's threads (`shared(*args)`). False where they cannot
    run: `shared` is None (no thread-safe layer), or this launch found none, after which
    every kernel here runs serial. The caller then runs its serial kernel."""
    if shared is None:
        return False
    try:
        shared(*args)
        return True
    except ValueError:
        _no_threads()
        return False


@functools.cache
def _shares() -> Callable[..., None] | None:
    """The attention kernel with a step's shares on numba's threads, or None where they
    cannot run. Handing a share to a Python helper thread cost about as much as the share
    itself here: waking the thread took tens of microseconds, and 32 SmolLM2 decodes a
    layer ran in 142 us on two threads against 145 us on one; numba's threads ran them in
    81 us."""
    if not threadsafe():
        return None
    from loraplane_kernels._cpu_decode_numba import decode_attention_shares

    return decode_attention_shares


@functools.cache
def _runs_shares() -> Callable[..., None] | None:
    """The LoRA pass with its runs in shares on numba's threads, or None where they cannot
    run."""
    if not threadsafe():
        return None
    from loraplane_kernels._cpu_decode_numba import runs_shares

    return runs_shares


@functools.cache
def _linear() -> Callable[..., None]:
    from loraplane_kernels._cpu_decode_numba import linear_rows

    return linear_rows


@functools.cache
def _linear_shares() -> Callable[..., None] | None:
    """The few-row linear with its output columns in shares on numba's threads, or None
    where they cannot run."""
    if not threadsafe():
        return None
    from loraplane_kernels._cpu_decode_numba import linear_rows_shares

    return linear_rows_shares


LINEAR_ROWS = 2
"""Steps of at most this many rows may take `linear_rows` for the base projections
(`services.worker.engine.model.DecoderModel.keep_row_weights`). Over SmolLM2's 30 layers
and LM head in bf16 on the peer bench's 2-core AMD EPYC, against oneDNN's packed weights,
in alternating rounds: 0.87x its time for one row, 0.84-0.86x for two (both rows take
each weight element in one pass), 1.12x for three and 1.23x for four. One or two rows are
bound by memory, which the kernel reads at full speed; from three on, by its fp32 dot
products, which oneDNN's blocked GEMM does better."""


def linear_rows(x: Tensor, weight: np.ndarray, scale: np.ndarray, bias: np.ndarray,
                out: Tensor) -> Tensor:
    """``out = x @ W.T (+ bias)`` for the few rows of `x` ([T, in], contiguous) over a plain
    [out, in] weight given flat (`as_array`): in the serving dtype, or int8 with one
    `scale` per row (`loraplane_kernels.int8`; empty for dense); `bias` empty for none.
    fp32 sums, rounded where oneDNN's linear or `int8_linear` rounds. On the 2-core AMD
    EPYC of the peer bench, oneDNN's one-row kernel read SmolLM2's packed bf16 projections
    at about 39 GB/s and this reads them at the memory's 47-49, with no per-call set-up
    (120 calls a step); over int8 weights a SmolLM2-shaped step took 3.0-3.2 ms against
    4.3-4.5 in `torch._weight_int8pack_mm`."""
    linear_rows_arrays(as_array(x), weight, scale, bias, as_array(out))
    return out


def linear_rows_arrays(x: np.ndarray, weight: np.ndarray, scale: np.ndarray,
                       bias: np.ndarray, out: np.ndarray) -> None:
    """`linear_rows` over numpy views (`as_array`) the caller made once for many calls."""
    # one thread in shares too: one compiled body, so every thread count gives the same
    # bits (LLVM may fuse a bias add elsewhere)
    if not on_threads(_linear_shares(), x, weight, scale, bias, out, torch.get_num_threads()):
        _linear()(x, weight, scale, bias, out)


@functools.cache
def _dequantize_shares() -> Callable[..., None] | None:
    if not threadsafe():
        return None
    from loraplane_kernels._cpu_decode_numba import dequantize_shares

    return dequantize_shares


def dequantize_int8(q: Tensor, scale: Tensor, out: Tensor) -> bool:
    """``out = q * scale[:, None]`` in one pass over memory, the bits of torch's
    ``out.copy_(q).mul_(scale[:, None])`` (an int8 is exact in bf16 and fp32, and the
    product is rounded once either way); False where it cannot run (no numba, another
    dtype, a strided tensor), and the caller takes torch's two passes. Over SmolLM2's
    int8 weights (a step of more than 16 rows dequantises every one), torch's copy and
    multiply took 15 ms on the peer bench's 2-core AMD EPYC."""
    if not (AVAILABLE and out.dtype in DTYPES and scale.dtype == out.dtype
            and q.is_contiguous() and out.is_contiguous() and scale.is_contiguous()
            and q.device.type == "cpu"):
        return False
    args = (q.numpy(), as_array(scale), as_array(out))
    if not on_threads(_dequantize_shares(), *args, torch.get_num_threads()):
        from loraplane_kernels._cpu_decode_numba import dequantize

        dequantize(*args)
    return True


_HELPERS: dict[int, ThreadPoolExecutor] = {}


def _helper_threads(count: int) -> ThreadPoolExecutor:
    """Threads that run the shares of a step's decodes besides the calling thread's: the
    kernel releases the GIL, so they compute in parallel."""
    if count not in _HELPERS:
        _HELPERS[count] = ThreadPoolExecutor(count, thread_name_prefix="decode-attention")
    return _HELPERS[count]


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor,
                     plan: DecodePlan, scale: float, window: int | None = None,
                     softcap: float | None = None) -> None:
    """``out[rows] = softmax(scale * q[rows] K^T) V`` for every decode of `plan`, with K and
    V read from the layer's paged cache ([KVH, slots, D]); q and out are [T, H, D].

    `window`: a sliding-window layer's decodes see only their last `window` positions;
    `softcap`: ``cap * tanh(s / cap)`` on the scaled scores before the softmax."""
    decode_attention_arrays(as_array(q), as_array(k_cache), as_array(v_cache), as_array(out),
                            plan, scale, window, softcap)


def decode_attention_arrays(q: Any, k_cache: Any, v_cache: Any, out: Any, plan: DecodePlan,
                            scale: float, window: int | None = None,
                            softcap: float | None = None) -> None:
    """`decode_attention` over numpy views (`as_array`) the caller made once for many
    calls."""
    kernel_fn = _attention()
    args = (q, k_cache, v_cache, out, plan.rows, plan.tables, plan.lens, plan.block_size,
            np.float32(scale), int(window or 0), np.float32(softcap or 0.0))
    if len(plan.lens) == 1:  # one share: no cutting (a single stream's every layer)
        kernel_fn(*args, 0, 1)
        return
    cuts = plan.cuts(torch.get_num_threads())
    if len(cuts) > 2 and on_threads(_shares(), *args, np.asarray(cuts, dtype=np.int64)):
        return
    shares = list(itertools.pairwise(cuts))
    pending = [_helper_threads(len(shares) - 1).submit(kernel_fn, *args, lo, hi)
               for lo, hi in shares[1:]] if len(shares) > 1 else []
    try:
        kernel_fn(*args, *shares[0])
    finally:
        for share in pending:
            share.result()


class DecodePlan:
    """A step's decodes as the attention kernel's arrays: built once per step, used by
    every layer."""

    __slots__ = ("_cuts", "block_size", "lens", "rows", "tables")

    def __init__(self, rows: Sequence[int], tables: Sequence[Sequence[int]],
                 lens: Sequence[int], block_size: int) -> None:
        width = max(len(t) for t in tables)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.tables = np.asarray([[*t, *[0] * (width - len(t))] for t in tables],
                                 dtype=np.int64)
        self.lens = np.asarray(lens, dtype=np.int64)
        self.block_size = block_size
        self._cuts: dict[int, list[int]] = {}

    def cuts(self, threads: int) -> list[int]:
        """Decode indices cutting the step into up to `threads` shares of about equal
        context (the kernel's work is linear in it)."""
        if threads not in self._cuts:
            parts = max(1, min(threads, len(self.lens)))
            work = np.cumsum(self.lens)
            inner = np.searchsorted(work, work[-1] * np.arange(1, parts) / parts)
            self._cuts[threads] = sorted({0, *(int(i) + 1 for i in inner), len(self.lens)})
        return self._cuts[threads]


def apply_small_runs(y: Tensor, x: Tensor, pool: np.ndarray, out_offset: int,
                     in_features: int, out_features: int, table: np.ndarray,
                     scales: np.ndarray, runs: SmallRuns) -> None:
    """``y[rows, out_offset:+out] += scale * ((x[rows] @ A.T) @ Bt)`` for every run, with
    each run's slot looked up in `table` ([3, slots]: A offset, Bt offset, rank; rank 0
    skips the run) and `scales`; `pool` is the pool as `as_array` gives it."""
    apply_small_runs_arrays(as_array(x), as_array(y), pool, out_offset, in_features,
                            out_features, table, scales, runs)


def apply_small_runs_arrays(x: Any, y: Any, pool: np.ndarray, out_offset: int,
                            in_features: int, out_features: int, table: np.ndarray,
                            scales: np.ndarray, runs: SmallRuns) -> None:
    """`apply_small_runs` over numpy views (`as_array`) the caller made once for many
    calls."""
    args = (x, y, pool, out_offset, in_features, out_features, table, scales, runs.slots,
            runs.starts, runs.ends, runs.rows_max)
    threads = min(torch.get_num_threads(), len(runs.slots))
    # decodes of many adapters: their weights read on every core
    if not (threads > 1 and on_threads(_runs_shares(), *args, threads)):
        kernel()(*args)


class SmallRuns:
    """A step's small runs as the kernel's arrays: built once per step and shared by every
    projection, since the slots' weights are looked up inside the kernel. Rebuilding them
    per projection whenever a sequence joined or left (every other step of a mixed
    workload) cost about 10 ms a SmolLM2 step."""

    __slots__ = ("ends", "rows_max", "slots", "starts")

    def __init__(self, runs: Sequence[tuple[int, int, int]]) -> None:
        self.slots = np.asarray([r[0] for r in runs], dtype=np.int64)
        self.starts = np.asarray([r[1] for r in runs], dtype=np.int64)
        self.ends = np.asarray([r[2] for r in runs], dtype=np.int64)
        self.rows_max = max(r[2] - r[1] for r in runs)


def as_array(t: Tensor) -> Any:
    """A numpy array over the tensor's memory; bf16 as its bits (numpy has no bf16)."""
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()
