"""Plain torch multi-LoRA ops: the production CPU path and the test oracle.

Tokens are grouped by slot and each distinct slot costs one matmul over only its first
``rank`` rows of A and columns of B, so the work is proportional to the real ranks and to
the number of distinct adapters, never to the slab's padded ``max_rank`` and never a Python
loop per token. Run with float64 inputs it is the oracle the Triton kernels are tested
against; the compute dtype is ``float32`` for 16/32-bit inputs and ``float64`` for float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from loraplane_kernels.segments import Segments
from loraplane_kernels.validation import REFERENCE_DTYPES, check_expand, check_shrink


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _token_indices(indices: Tensor, segments: Segments | None) -> Tensor:
    return indices if segments is None else segments.token_indices()


Rows = slice | Tensor
SlotGroup = tuple[int, int, Rows]


def _slot_groups(indices: Tensor, ranks: Tensor) -> list[SlotGroup]:
    """``(slot, rank, rows)`` for every slot that has tokens and a rank > 0.

    One stable sort finds every slot's tokens at once. A slot whose tokens are contiguous
    (every prefill segment, and decode batches the scheduler grouped by adapter) gets a
    slice, so its matmuls read and write views instead of gathering and scattering rows.
    """
    if indices.numel() == 0:
        return []
    ordered, order = torch.sort(indices, stable=True)
    slots, counts = torch.unique_consecutive(ordered, return_counts=True)
    rank_of = ranks.tolist()
    groups: list[SlotGroup] = []
    start = 0
    for slot, count in zip(slots.tolist(), counts.tolist(), strict=True):
        rows = order[start:start + count]
        start += count
        if slot < 0 or rank_of[slot] == 0:
            continue
        first, last = int(rows[0]), int(rows[-1])
        groups.append((slot, rank_of[slot],
                       slice(first, first + count) if last - first + 1 == count else rows))
    return groups


def _shrink(x: Tensor, a_slab: Tensor, groups: list[SlotGroup]) -> Tensor:
    cd = _compute_dtype(x.dtype)
    h = torch.zeros(x.shape[0], a_slab.shape[1], dtype=cd, device=x.device)
    for slot, rank, rows in groups:
        h[rows, :rank] = x[rows].to(cd) @ a_slab[slot, :rank].to(cd).T
    return h


def _expand(y: Tensor, h: Tensor, b_slab: Tensor, scales: Tensor, groups: list[SlotGroup],
            out_offset: int) -> None:
    cd = _compute_dtype(y.dtype)
    out = y[:, out_offset:out_offset + b_slab.shape[1]]
    for slot, rank, rows in groups:
        delta = h[rows, :rank].to(cd) @ b_slab[slot, :, :rank].to(cd).T
        out[rows] = (out[rows].to(cd) + scales[slot].to(cd) * delta).to(y.dtype)


def lora_shrink(x: Tensor, a_slab: Tensor, ranks: Tensor, indices: Tensor, *,
                segments: Segments | None = None) -> Tensor:
    """Return ``h[T, max_rank]`` with ``h[t, :r] = x[t] @ A_slot[:r].T`` and zeros elsewhere."""
    check_shrink(x, a_slab, ranks, indices, segments, REFERENCE_DTYPES)
    return _shrink(x, a_slab, _slot_groups(_token_indices(indices, segments), ranks))


def lora_expand(y: Tensor, h: Tensor, b_slab: Tensor, ranks: Tensor, scales: Tensor,
                indices: Tensor, *, out_offset: int = 0,
                segments: Segments | None = None) -> None:
    """``y[t, off:off+N] += scale * h[t, :r] @ B_slot[:, :r].T`` in place, fp32 accumulation."""
    check_expand(y, h, b_slab, ranks, scales, indices, out_offset, segments, REFERENCE_DTYPES)
    _expand(y, h, b_slab, scales, _slot_groups(_token_indices(indices, segments), ranks),
            out_offset)


def lora_apply(y: Tensor, x: Tensor, a_slab: Tensor, b_slab: Tensor, ranks: Tensor,
               scales: Tensor, indices: Tensor, *, out_offset: int = 0,
               segments: Segments | None = None) -> None:
    """Shrink then expand over one grouping of the tokens; fusing gains nothing on torch."""
    check_shrink(x, a_slab, ranks, indices, segments, REFERENCE_DTYPES)
    groups = _slot_groups(_token_indices(indices, segments), ranks)
    h = _shrink(x, a_slab, groups)
    check_expand(y, h, b_slab, ranks, scales, indices, out_offset, segments, REFERENCE_DTYPES)
    _expand(y, h, b_slab, scales, groups, out_offset)
