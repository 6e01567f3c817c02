"""The one entry point the engine calls: picks a backend, then fused or separate launches.

Model code never names a kernel. On CUDA tensors the Triton kernels run; on CPU the torch
reference runs (it is the production CPU path, not a stub). ``LORAPLANE_KERNELS_BACKEND``
overrides the choice: ``torch`` always uses the reference; ``triton`` forces the kernels,
which on CPU only works under ``TRITON_INTERPRET=1`` (set before
``loraplane_kernels.triton`` is first imported), the way the tests run them. The Triton
modules are imported lazily so a CPU-only install without a working Triton still serves.

Fused versus separate launches is decided per call from the GPU model's tuning table
(:mod:`loraplane_kernels.tuning_table`) by batch size; ``fused=True/False`` overrides it.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from prometheus_client import Gauge
from torch import Tensor

from loraplane_kernels import reference
from loraplane_kernels.rank_pool import PooledLora, Runs, apply_runs, runs_of
from loraplane_kernels.segments import Segments
from loraplane_kernels.tuning_table import (
    TuningEntry,
    TuningFallbackWarning,
    TuningTable,
    load_table,
)
from loraplane_kernels.validation import (
    KERNEL_DTYPES,
    check_expand,
    check_pooled,
    check_routing,
    check_shrink,
    check_slab_pair,
)

BACKEND_ENV = "LORAPLANE_KERNELS_BACKEND"
Backend = Literal["torch", "triton"]

UNTUNED = Gauge(
    "loraplane_kernels_untuned",
    "1 while this GPU model has no measured fused/separate threshold, so every adapter "
    "bucket takes the separate path (run bench/tune_kernels.py on it)",
    ["device"],
)


def triton_interpreted() -> bool:
    """Whether the imported Triton kernels run in the CPU interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    from loraplane_kernels.triton import bgmv

    return isinstance(bgmv._bgmv_shrink_kernel, InterpretedFunction)


def select_backend(device: torch.device) -> Backend:
    """Triton for CUDA tensors, torch otherwise, unless ``LORAPLANE_KERNELS_BACKEND`` says."""
    choice = os.environ.get(BACKEND_ENV, "auto")
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"{BACKEND_ENV}: expected auto, torch or triton, got {choice!r}")
    if choice == "torch":
        return "torch"
    if choice == "triton":
        if device.type != "cuda" and not triton_interpreted():
            raise RuntimeError(
                f"{BACKEND_ENV}=triton on {device.type} tensors needs TRITON_INTERPRET=1 set "
                "before loraplane_kernels.triton is first imported")
        return "triton"
    return "triton" if device.type == "cuda" else "torch"


def device_model(device: torch.device) -> str:
    """The name tuning tables are keyed by: the GPU model, or ``cpu`` (interpreter runs)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@dataclass(frozen=True)
class LaunchPlan:
    """What :func:`lora_apply` will launch, and which table entry decided it."""

    op: Literal["bgmv", "sgmv"]
    fused: bool
    entry: TuningEntry
    table: TuningTable


def plan_apply(num_tokens: int, hidden: int, max_rank: int, *, segmented: bool,
               table: TuningTable, fused: bool | None = None) -> LaunchPlan:
    """Decide fused vs separate launches: fuse while ``num_tokens <= fused_max_tokens``."""
    op: Literal["bgmv", "sgmv"] = "sgmv" if segmented else "bgmv"
    entry = table.lookup(op, hidden, max_rank)
    if fused is None:
        fused = num_tokens <= entry.fused_max_tokens
    return LaunchPlan(op=op, fused=fused, entry=entry, table=table)


def base_fusion_threshold(device: torch.device, hidden: int, max_rank: int) -> int | None:
    """Largest adapter bucket that takes the fused base + LoRA kernel on this device.

    None means every bucket takes the separate path: on the torch backend (measured on
    CPUs: fusing gains nothing there, see bench/multi_lora.py) and on any GPU model whose
    tuning table has no measured ``fused_base_max_tokens``. There is no global default:
    an untuned GPU says so in a warning (once) and the ``loraplane_kernels_untuned``
    metric.
    """
    if select_backend(device) == "torch":
        return None
    name = device_model(device)
    return fusion_threshold(load_table(name), name, hidden, max_rank)


def fusion_threshold(table: TuningTable, name: str, hidden: int, max_rank: int) -> int | None:
    """The measured bucket threshold in ``table`` (None: untuned, warned and metered)."""
    threshold = None if table.is_fallback else (
        table.lookup("sgmv", hidden, max_rank).fused_base_max_tokens)
    UNTUNED.labels(device=name).set(1 if threshold is None else 0)
    if threshold is None and name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"no measured fused_base_max_tokens for {name!r} "
                      f"({table.path.name}): every adapter bucket takes the separate path",
                      TuningFallbackWarning, stacklevel=2)
    return threshold


_WARNED: set[str] = set()


def lora_shrink(x: Tensor, a_slab: Tensor, ranks: Tensor, indices: Tensor, *,
                segments: Segments | None = None) -> Tensor:
    """``h[T, max_rank]`` (float32): ``h[t, :r] = x[t] @ A_slot[:r].T``, zeros elsewhere and
    for tokens whose slot is -1. With ``segments`` (SGMV), ``indices`` is not read."""
    if select_backend(x.device) == "torch":
        return reference.lora_shrink(x, a_slab, ranks, indices, segments=segments)
    check_shrink(x, a_slab, ranks, indices, segments, KERNEL_DTYPES)
    ranks = ranks.contiguous()
    if segments is not None:
        from loraplane_kernels.triton.sgmv import sgmv_shrink

        return sgmv_shrink(x, a_slab, ranks, _contiguous(segments))
    from loraplane_kernels.triton.bgmv import bgmv_shrink

    entry = load_table(device_model(x.device)).lookup("bgmv", x.shape[1], a_slab.shape[1])
    return bgmv_shrink(x, a_slab, ranks, indices.contiguous(), split_k=entry.shrink_split_k)


def lora_expand(y: Tensor, h: Tensor, b_slab: Tensor, ranks: Tensor, scales: Tensor,
                indices: Tensor, *, out_offset: int = 0,
                segments: Segments | None = None) -> None:
    """In place: ``y[t, out_offset:out_offset+N] += scales[s] * h[t, :r] @ B_s[:, :r].T``,
    accumulated in fp32 and stored in ``y``'s dtype."""
    if select_backend(y.device) == "torch":
        reference.lora_expand(y, h, b_slab, ranks, scales, indices, out_offset=out_offset,
                              segments=segments)
        return
    check_expand(y, h, b_slab, ranks, scales, indices, out_offset, segments, KERNEL_DTYPES)
    ranks, scales = ranks.contiguous(), scales.contiguous()
    if segments is not None:
        from loraplane_kernels.triton.sgmv import sgmv_expand

        sgmv_expand(y, h, b_slab, ranks, scales, _contiguous(segments), out_offset=out_offset)
        return
    from loraplane_kernels.triton.bgmv import bgmv_expand

    bgmv_expand(y, h, b_slab, ranks, scales, indices.contiguous(), out_offset=out_offset)


def lora_apply(y: Tensor, x: Tensor, a_slab: Tensor, b_slab: Tensor, ranks: Tensor,
               scales: Tensor, indices: Tensor, *, out_offset: int = 0,
               segments: Segments | None = None, fused: bool | None = None) -> None:
    """``y[:, out_offset:out_offset+N] += scale * (x @ A.T) @ B.T`` per token's slot.

    ``fused=None`` lets the GPU model's tuning table decide by batch size; the torch path
    ignores it (it has no launches to save).
    """
    check_slab_pair(a_slab, b_slab)
    if select_backend(x.device) == "torch":
        reference.lora_apply(y, x, a_slab, b_slab, ranks, scales, indices,
                             out_offset=out_offset, segments=segments)
        return
    check_shrink(x, a_slab, ranks, indices, segments, KERNEL_DTYPES)
    check_expand(y, None, b_slab, ranks, scales, indices, out_offset, segments, KERNEL_DTYPES)
    plan = plan_apply(x.shape[0], x.shape[1], a_slab.shape[1], segmented=segments is not None,
                      table=load_table(device_model(x.device)), fused=fused)
    if not plan.fused:
        h = lora_shrink(x, a_slab, ranks, indices, segments=segments)
        lora_expand(y, h, b_slab, ranks, scales, indices, out_offset=out_offset,
                    segments=segments)
        return
    ranks, scales = ranks.contiguous(), scales.contiguous()
    if segments is not None:
        from loraplane_kernels.triton.fused import sgmv_fused

        sgmv_fused(y, x, a_slab, b_slab, ranks, scales, _contiguous(segments),
                   out_offset=out_offset, n_split=plan.entry.fused_n_split)
        return
    from loraplane_kernels.triton.fused import bgmv_fused

    bgmv_fused(y, x, a_slab, b_slab, ranks, scales, indices.contiguous(),
               out_offset=out_offset, n_split=plan.entry.fused_n_split)


def lora_apply_pooled(y: Tensor, x: Tensor, w: PooledLora, indices: Tensor, *,
                     out_offset: int = 0, segments: Segments | None = None,
                     runs: Runs | None = None, fused: bool | None = None) -> None:
    """:func:`lora_apply` over the rank-granular pool
    (:class:`loraplane_kernels.rank_pool.PooledLora`).

    ``runs`` (host ``(slot, start, end)`` groups, which a scheduler that sorts tokens by
    adapter already has) spares the torch path from reading the indices back.
    """
    check_pooled(y, x, w, out_offset)
    if select_backend(x.device) == "torch":
        if runs is None:
            runs = runs_of(indices if segments is None else segments.token_indices())
        apply_runs(y, x, w, runs, out_offset)
        return
    check_routing(indices, segments, x.shape[0], w.num_slots, x.device)
    plan = plan_apply(x.shape[0], x.shape[1], w.max_rank, segmented=segments is not None,
                      table=load_table(device_model(x.device)), fused=fused)
    if plan.fused:
        if segments is not None:
            from loraplane_kernels.triton.fused import sgmv_fused

            sgmv_fused(y, x, w, w, w.ranks, w.scales, _contiguous(segments),
                       out_offset=out_offset, n_split=plan.entry.fused_n_split)
            return
        from loraplane_kernels.triton.fused import bgmv_fused

        bgmv_fused(y, x, w, w, w.ranks, w.scales, indices.contiguous(), out_offset=out_offset,
                   n_split=plan.entry.fused_n_split)
        return
    if segments is not None:
        from loraplane_kernels.triton.sgmv import sgmv_expand, sgmv_shrink

        seg = _contiguous(segments)
        h = sgmv_shrink(x, w, w.ranks, seg)
        sgmv_expand(y, h, w, w.ranks, w.scales, seg, out_offset=out_offset)
        return
    from loraplane_kernels.triton.bgmv import bgmv_expand, bgmv_shrink

    idx = indices.contiguous()
    h = bgmv_shrink(x, w, w.ranks, idx, split_k=plan.entry.shrink_split_k)
    bgmv_expand(y, h, w, w.ranks, w.scales, idx, out_offset=out_offset)


def base_lora_fused(y: Tensor, x: Tensor, weight: Tensor, w: PooledLora, segments: Segments, *,
                    out_offset: int = 0) -> None:
    """The fused path: ``y[:, off:off+N] = x @ weight.T + delta`` per adapter bucket, in one
    Triton launch (callers take it only below :func:`base_fusion_threshold`)."""
    check_pooled(y, x, w, out_offset)
    from loraplane_kernels.triton.fused_base import sgmv_base_fused

    sgmv_base_fused(y, x, weight, w, _contiguous(segments), out_offset=out_offset)


def _contiguous(segments: Segments) -> Segments:
    return Segments(starts=segments.starts.contiguous(), slots=segments.slots.contiguous())
