"""How a kernel finds slot s's A and B: a base tensor, per-slot offsets and two strides.

Two layouts reach the kernels. Slabs (``a_slab[S, max_rank, in]``, ``b_slab[S, out,
max_rank]``) put slot s at ``s * stride(0)``; the rank pool (:class:`loraplane_kernels.rank_pool.
PooledLora`) puts it at a per-slot offset with ``A`` as ``[rank, in]`` and ``B`` stored as
``B.T`` ``[rank, out]``. Both become an :class:`Operand`, so every kernel has one code path:
``base = data + offsets[slot]``, then rank and feature strides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from loraplane_kernels.rank_pool import PooledLora

_OFFSETS: dict[tuple[int, int, torch.device], Tensor] = {}


@dataclass(frozen=True)
class Operand:
    data: Tensor
    offsets: Tensor  # [S] int64 element offsets
    stride_r: int
    stride_f: int  # along in_features for A, out_features for B
    max_rank: int
    features: int


def slab_offsets(num_slots: int, stride: int, device: torch.device) -> Tensor:
    """``arange(num_slots) * stride`` on ``device``, made once per shape."""
    key = (num_slots, stride, device)
    if key not in _OFFSETS:
        _OFFSETS[key] = torch.arange(num_slots, dtype=torch.int64, device=device) * stride
    return _OFFSETS[key]


def a_operand(a: Tensor | PooledLora) -> Operand:
    if isinstance(a, PooledLora):
        return Operand(a.pool, a.a_offsets, a.in_features, 1, a.max_rank, a.in_features)
    return Operand(a, slab_offsets(a.shape[0], a.stride(0), a.device), a.stride(1), a.stride(2),
                   a.shape[1], a.shape[2])


def b_operand(b: Tensor | PooledLora) -> Operand:
    if isinstance(b, PooledLora):
        return Operand(b.pool, b.b_offsets, b.out_features, 1, b.max_rank, b.out_features)
    return Operand(b, slab_offsets(b.shape[0], b.stride(0), b.device), b.stride(2), b.stride(1),
                   b.shape[2], b.shape[1])
