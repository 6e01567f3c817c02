"""Map SGMV programs to (segment, tile) pairs without a device-to-host sync.

Segment lengths live on the device. Reading them back to size the grid would stall the
stream on every layer (and break CUDA-graph capture), so the grid is launched at the upper
bound ``cdiv(T, BLOCK_M) + G`` tiles, which no segmentation can exceed, and each program
looks up its segment here; programs past the real tile count exit at once.

The kernels' shared prologue is here too, as `@triton.jit` helpers: `segment_tile` (a
program's slot, rank and token rows), `slot_rank` (a slot and its rank, 0 for no LoRA) and
`load_tile` (the masked 2-D load).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor


@dataclass(frozen=True)
class TileMap:
    """``segment[p]`` is program p's segment (``G`` = idle); ``first_tile[g]`` numbers the
    first tile of segment g, so program p handles tile ``p - first_tile[segment[p]]``."""

    segment: Tensor
    first_tile: Tensor
    num_programs: int


def segment_tiles(starts: Tensor, num_tokens: int, block_m: int) -> TileMap:
    num_segments = starts.shape[0] - 1
    lengths = (starts[1:] - starts[:-1]).to(torch.int64)
    tiles = (lengths + block_m - 1) // block_m
    ends = torch.cumsum(tiles, 0)
    num_programs = triton.cdiv(num_tokens, block_m) + num_segments
    programs = torch.arange(num_programs, device=starts.device, dtype=torch.int64)
    segment = torch.searchsorted(ends, programs, right=True).to(torch.int32)
    first_tile = (ends - tiles).to(torch.int32)
    return TileMap(segment=segment, first_tile=first_tile, num_programs=num_programs)


@triton.jit
def slot_rank(slots_ptr, ranks_ptr, i):
    """``slots[i]`` and that slot's rank for this projection; rank 0 for slot -1 (no LoRA)
    or a slot that does not adapt the projection, so one ``rank == 0`` test exits both."""
    slot = tl.load(slots_ptr + i)
    return slot, tl.where(slot >= 0, tl.load(ranks_ptr + tl.maximum(slot, 0)), 0)


@triton.jit
def segment_tile(pid, seg, starts_ptr, first_tile_ptr, slots_ptr, ranks_ptr,
                 BLOCK_M: tl.constexpr):
    """The tile prologue of every SGMV-family kernel: program ``pid``'s slot and rank, its
    ``BLOCK_M`` token rows in segment ``seg`` and which of them exist (the segment's last
    tile is partial). The caller has already exited if ``seg`` is past the segments."""
    slot, rank = slot_rank(slots_ptr, ranks_ptr, seg)
    m0 = tl.load(starts_ptr + seg) + (pid - tl.load(first_tile_ptr + seg)) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    return slot, rank, offs_m, offs_m < tl.load(starts_ptr + seg + 1)


@triton.jit
def load_tile(base, rows, row_stride, row_mask, cols, col_stride, col_mask):
    """The masked tile ``base[rows[:, None] * row_stride + cols[None, :] * col_stride]``
    (zeros where masked): the one addressing every SGMV-family kernel uses."""
    return tl.load(base + rows[:, None].to(tl.int64) * row_stride + cols[None, :] * col_stride,
                   mask=row_mask[:, None] & col_mask[None, :], other=0.0)
