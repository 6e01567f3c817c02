"""Shrink and expand in one launch.

For small batches the two separate launches of a LoRA layer cost more in launch latency and
in the round trip of ``h`` through memory than in arithmetic. The fused kernels keep ``h`` in
registers: each program computes its tokens' ``h`` over the full input width, then adds
``scale * h @ B.T`` into its share of the output columns. ``N_SPLIT`` programs per token
(or tile) each recompute ``h`` so that few tokens can still fill the GPU; the recomputation
rereads A from L2, not HBM. Whether fusing pays is a function of batch size and GPU, which
is why ``loraplane_kernels.dispatch`` reads the crossover from the tuning table.

``R_PAD`` (the slab's max rank rounded up to a power of two, at least 16) sizes the
register tile, but every weight load is masked to the slot's own rank, so the bytes read
follow the real rank.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from loraplane_kernels.rank_pool import PooledLora
from loraplane_kernels.segments import Segments
from loraplane_kernels.triton.operands import a_operand, b_operand
from loraplane_kernels.triton.sgmv import dot_precision, upcast_dot_operands
from loraplane_kernels.triton.tiles import load_tile, segment_tile, segment_tiles, slot_rank


def rank_tile(max_rank: int) -> int:
    """Register tile for ``h``: a power of two, and at least 16 so ``tl.dot`` accepts it."""
    return max(16, triton.next_power_of_2(max_rank))


@triton.jit
def _bgmv_fused_kernel(
    y_ptr, x_ptr, a_ptr, b_ptr, ranks_ptr, scales_ptr, idx_ptr,
    K, N, out_offset,
    stride_yt, stride_yn,
    stride_xt, stride_xk,
    a_off_ptr, stride_ar, stride_ak,
    b_off_ptr, stride_bn, stride_br,
    R_PAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, N_SPLIT: tl.constexpr,
):
    t = tl.program_id(0)
    split = tl.program_id(1)
    slot, rank = slot_rank(idx_ptr, ranks_ptr, t)
    if rank == 0:
        return
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < rank
    a_base = a_ptr + tl.load(a_off_ptr + slot)
    x_base = x_ptr + t.to(tl.int64) * stride_xt
    h = tl.zeros([R_PAD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xv = tl.load(x_base + offs_k * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
        av = load_tile(a_base, offs_r, stride_ar, r_mask, offs_k, stride_ak, k_mask).to(tl.float32)
        h += tl.sum(av * xv[None, :], axis=1)
    h = h * tl.load(scales_ptr + slot)
    b_base = b_ptr + tl.load(b_off_ptr + slot)
    y_base = y_ptr + t.to(tl.int64) * stride_yt
    n_chunk = tl.cdiv(N, N_SPLIT * BLOCK_N) * BLOCK_N
    n_start = split * n_chunk
    n_end = tl.minimum(n_start + n_chunk, N)
    for n0 in range(n_start, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_end
        bv = load_tile(b_base, offs_n, stride_bn, n_mask, offs_r, stride_br, r_mask).to(tl.float32)
        delta = tl.sum(bv * h[None, :], axis=1)
        y_ptrs = y_base + (out_offset + offs_n) * stride_yn
        yv = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (yv + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _sgmv_fused_kernel(
    y_ptr, x_ptr, a_ptr, b_ptr, ranks_ptr, scales_ptr, starts_ptr, slots_ptr, tile_seg_ptr,
    first_tile_ptr,
    K, N, out_offset, num_segments,
    stride_yt, stride_yn,
    stride_xt, stride_xk,
    a_off_ptr, stride_ar, stride_ak,
    b_off_ptr, stride_bn, stride_br,
    BLOCK_M: tl.constexpr, R_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, N_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    seg = tl.load(tile_seg_ptr + pid)
    if seg >= num_segments:
        return
    slot, rank, offs_m, m_mask = segment_tile(pid, seg, starts_ptr, first_tile_ptr, slots_ptr,
                                              ranks_ptr, BLOCK_M)
    if rank == 0:
        return
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < rank
    a_base = a_ptr + tl.load(a_off_ptr + slot)
    h = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xv = load_tile(x_ptr, offs_m, stride_xt, m_mask, offs_k, stride_xk, k_mask)
        av = load_tile(a_base, offs_k, stride_ak, k_mask, offs_r, stride_ar, r_mask)
        if UPCAST:
            h = tl.dot(xv.to(tl.float32), av.to(tl.float32), h, input_precision="ieee")
        else:
            h = tl.dot(xv, av, h, input_precision=DOT_PRECISION)
    scale = tl.load(scales_ptr + slot)
    b_base = b_ptr + tl.load(b_off_ptr + slot)
    hb = h.to(b_ptr.dtype.element_ty)
    n_chunk = tl.cdiv(N, N_SPLIT * BLOCK_N) * BLOCK_N
    n_start = split * n_chunk
    n_end = tl.minimum(n_start + n_chunk, N)
    for n0 in range(n_start, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_end
        bv = load_tile(b_base, offs_r, stride_br, r_mask, offs_n, stride_bn, n_mask)
        if UPCAST:
            delta = tl.dot(hb.to(tl.float32), bv.to(tl.float32), input_precision="ieee")
        else:
            delta = tl.dot(hb, bv, input_precision=DOT_PRECISION)
        y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_yt \
            + (out_offset + offs_n[None, :]) * stride_yn
        y_mask = m_mask[:, None] & n_mask[None, :]
        yv = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (yv + scale * delta).to(y_ptr.dtype.element_ty), mask=y_mask)


def bgmv_fused(y: Tensor, x: Tensor, a_slab: Tensor | PooledLora, b_slab: Tensor | PooledLora,
               ranks: Tensor, scales: Tensor, indices: Tensor, *, out_offset: int = 0,
               block_k: int = 128, block_n: int = 64, n_split: int = 1) -> None:
    """Per-token shrink+expand in one launch (decode)."""
    num_tokens, k = x.shape
    a, b = a_operand(a_slab), b_operand(b_slab)
    n = b.features
    if num_tokens == 0 or n == 0 or a.max_rank == 0:
        return
    _bgmv_fused_kernel[(num_tokens, n_split)](
        y, x, a.data, b.data, ranks, scales, indices,
        k, n, out_offset,
        y.stride(0), y.stride(1),
        x.stride(0), x.stride(1),
        a.offsets, a.stride_r, a.stride_f,
        b.offsets, b.stride_f, b.stride_r,
        R_PAD=rank_tile(a.max_rank), BLOCK_K=block_k, BLOCK_N=block_n, N_SPLIT=n_split,
    )


def sgmv_fused(y: Tensor, x: Tensor, a_slab: Tensor | PooledLora, b_slab: Tensor | PooledLora,
               ranks: Tensor, scales: Tensor, segments: Segments, *, out_offset: int = 0,
               block_m: int = 16, block_k: int = 64, block_n: int = 64,
               n_split: int = 1) -> None:
    """Per-segment-tile shrink+expand in one launch (short prefills, mixed batches)."""
    num_tokens, k = x.shape
    a, b = a_operand(a_slab), b_operand(b_slab)
    n = b.features
    if num_tokens == 0 or n == 0 or a.max_rank == 0 or segments.num_segments == 0:
        return
    tiles = segment_tiles(segments.starts, num_tokens, block_m)
    _sgmv_fused_kernel[(tiles.num_programs, n_split)](
        y, x, a.data, b.data, ranks, scales, segments.starts, segments.slots, tiles.segment,
        tiles.first_tile,
        k, n, out_offset, segments.num_segments,
        y.stride(0), y.stride(1),
        x.stride(0), x.stride(1),
        a.offsets, a.stride_r, a.stride_f,
        b.offsets, b.stride_f, b.stride_r,
        BLOCK_M=block_m, R_PAD=rank_tile(a.max_rank), BLOCK_K=block_k, BLOCK_N=block_n,
        N_SPLIT=n_split, DOT_PRECISION=dot_precision(x.dtype),
        UPCAST=upcast_dot_operands(_sgmv_fused_kernel, x.dtype),
    )
