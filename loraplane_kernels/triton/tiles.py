"""Map SGMV programs to (segment, tile) pairs without a device-to-host sync.

Segment lengths live on the device. Reading them back to size the grid would stall the
stream on every layer (and break CUDA-graph capture), so the grid is launched at the upper
bound ``cdiv(T, BLOCK_M) + G`` tiles, which no segmentation can exceed, and each program
looks up its segment here; programs past the real tile count exit at once.
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
def load_tile(base, rows, row_stride, row_mask, cols, col_stride, col_mask):
    """The masked tile ``base[rows[:, None] * row_stride + cols[None, :] * col_stride]``
    (zeros where masked): the one addressing every SGMV-family kernel uses."""
    return tl.load(base + rows[:, None].to(tl.int64) * row_stride + cols[None, :] * col_stride,
                   mask=row_mask[:, None] & col_mask[None, :], other=0.0)
