"""The fused path: base projection and LoRA delta of an adapter bucket in one launch.

The separate path runs the base GEMM over every token of the step, then SGMV/BGMV adds
each bucket's delta: three launches per projection, and ``x`` and ``y`` cross memory
twice. For a small bucket (few tokens of one adapter) the base GEMM tile is mostly idle
and the launches dominate, so this kernel computes ``y = x @ W.T + scale * (x @ A.T) @ B``
per tile of one bucket: each ``x`` tile is loaded once and feeds both the base product and
the shrink, and the expand is added before the single store. Each N tile recomputes its
tokens' shrink (``rank x K`` extra work per tile), which is why the fused path only pays
below a bucket size the tuner measures per GPU model (``fused_base_max_tokens`` in the
tuning table; no global default).

Weights come from the rank-granular pool (:class:`loraplane_kernels.rank_pool.PooledLora`); a bucket
whose slot is -1 (or whose adapter does not adapt this projection) gets the base product.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from loraplane_kernels.rank_pool import PooledLora
from loraplane_kernels.segments import Segments
from loraplane_kernels.triton.fused import rank_tile
from loraplane_kernels.triton.sgmv import dot_precision, upcast_dot_operands
from loraplane_kernels.triton.tiles import load_tile, segment_tile, segment_tiles


@triton.jit
def _sgmv_base_fused_kernel(
    y_ptr, x_ptr, w_ptr, pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr, scales_ptr,
    starts_ptr, slots_ptr, tile_seg_ptr, first_tile_ptr,
    K, N, out_offset, num_segments,
    stride_yt, stride_yn,
    stride_xt, stride_xk,
    stride_wn, stride_wk,
    stride_ar, stride_ak,
    stride_bn, stride_br,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    R_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seg = tl.load(tile_seg_ptr + pid)
    if seg >= num_segments:
        return
    slot, rank, offs_m, m_mask = segment_tile(pid, seg, starts_ptr, first_tile_ptr, slots_ptr,
                                              ranks_ptr, BLOCK_M)
    safe_slot = tl.maximum(slot, 0)
    n_mask = offs_n < N
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < rank
    a_base = pool_ptr + tl.load(a_off_ptr + safe_slot)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    h = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xv = load_tile(x_ptr, offs_m, stride_xt, m_mask, offs_k, stride_xk, k_mask)
        wv = load_tile(w_ptr, offs_k, stride_wk, k_mask, offs_n, stride_wn, n_mask)
        av = load_tile(a_base, offs_k, stride_ak, k_mask, offs_r, stride_ar, r_mask)
        if UPCAST:
            acc = tl.dot(xv.to(tl.float32), wv.to(tl.float32), acc, input_precision="ieee")
            h = tl.dot(xv.to(tl.float32), av.to(tl.float32), h, input_precision="ieee")
        else:
            acc = tl.dot(xv, wv, acc, input_precision=DOT_PRECISION)
            h = tl.dot(xv, av, h, input_precision=DOT_PRECISION)
    if rank > 0:
        b_base = pool_ptr + tl.load(b_off_ptr + safe_slot)
        bv = load_tile(b_base, offs_r, stride_br, r_mask, offs_n, stride_bn, n_mask)
        hb = h.to(pool_ptr.dtype.element_ty)
        if UPCAST:
            delta = tl.dot(hb.to(tl.float32), bv.to(tl.float32), input_precision="ieee")
        else:
            delta = tl.dot(hb, bv, input_precision=DOT_PRECISION)
        acc += tl.load(scales_ptr + safe_slot) * delta
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_yt \
        + (out_offset + offs_n[None, :]) * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def sgmv_base_fused(y: Tensor, x: Tensor, weight: Tensor, lora: PooledLora, segments: Segments,
                    *, out_offset: int = 0, block_m: int = 16, block_n: int = 64,
                    block_k: int = 32) -> None:
    """``y[t, off:off+N] = x[t] @ weight.T + scale_s * (x[t] @ A_s.T) @ B_s.T`` per bucket.

    ``weight`` is the projection's ``[N, K]`` base weight (a row slice of a packed q|k|v
    or gate|up matrix is fine); ``y``'s slice is overwritten, not accumulated.
    """
    num_tokens, k = x.shape
    n = weight.shape[0]
    if num_tokens == 0 or n == 0 or segments.num_segments == 0:
        return
    tiles = segment_tiles(segments.starts, num_tokens, block_m)
    grid = (tiles.num_programs, triton.cdiv(n, block_n))
    _sgmv_base_fused_kernel[grid](
        y, x, weight, lora.pool, lora.a_offsets, lora.b_offsets, lora.ranks, lora.scales,
        segments.starts, segments.slots, tiles.segment, tiles.first_tile,
        k, n, out_offset, segments.num_segments,
        y.stride(0), y.stride(1),
        x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1),
        lora.in_features, 1,
        1, lora.out_features,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, R_PAD=rank_tile(lora.max_rank),
        DOT_PRECISION=dot_precision(x.dtype),
        UPCAST=upcast_dot_operands(_sgmv_base_fused_kernel, x.dtype),
    )

