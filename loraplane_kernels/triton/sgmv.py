"""SGMV: contiguous token segments per slot, the prefill case.

A program owns a tile of up to ``BLOCK_M`` tokens from one segment, so it loads each block
of the adapter's weights once for the whole tile and multiplies on tensor cores
(``tl.dot``); that reuse is what a gather of per-token weight copies followed by ``bmm``
cannot have. Rank is handled in ``BLOCK_R`` chunks up to the slot's own rank: shrink
programs whose rank block lies past the slot's rank exit, and expand loops only over the
chunks the rank covers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from loraplane_kernels.rank_pool import PooledLora
from loraplane_kernels.segments import Segments
from loraplane_kernels.triton.operands import a_operand, b_operand
from loraplane_kernels.triton.tiles import load_tile, segment_tile, segment_tiles


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get full-precision products; TF32 would cost ~1e-3 relative error."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dot_operands(kernel: object, dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands must be widened to fp32 before the product.

    Only under ``TRITON_INTERPRET=1``: the interpreter multiplies bf16 operands as their raw
    16-bit integer patterns (numpy has no bf16), so its results are garbage. bf16 x bf16
    products are exact in fp32, so widening keeps the GPU kernel's numerics.
    """
    return dtype == torch.bfloat16 and isinstance(kernel, InterpretedFunction)


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, h_ptr, ranks_ptr, starts_ptr, slots_ptr, tile_seg_ptr, first_tile_ptr,
    K, num_segments,
    stride_xt, stride_xk,
    a_off_ptr, stride_ar, stride_ak,
    stride_ht, stride_hr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    r0 = tl.program_id(1) * BLOCK_R
    split = tl.program_id(2)
    seg = tl.load(tile_seg_ptr + pid)
    if seg >= num_segments:
        return
    slot, rank, offs_m, m_mask = segment_tile(pid, seg, starts_ptr, first_tile_ptr, slots_ptr,
                                              ranks_ptr, BLOCK_M)
    if r0 >= rank:
        return
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    a_base = a_ptr + tl.load(a_off_ptr + slot)
    k_chunk = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = split * k_chunk
    k_end = tl.minimum(k_start + k_chunk, K)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        xv = load_tile(x_ptr, offs_m, stride_xt, m_mask, offs_k, stride_xk, k_mask)
        av = load_tile(a_base, offs_k, stride_ak, k_mask, offs_r, stride_ar, r_mask)
        if UPCAST:
            acc = tl.dot(xv.to(tl.float32), av.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xv, av, acc, input_precision=DOT_PRECISION)
    h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_ht + offs_r[None, :] * stride_hr
    h_mask = m_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(h_ptrs, acc, mask=h_mask)
    else:
        tl.atomic_add(h_ptrs, acc, mask=h_mask)


@triton.jit
def _sgmv_expand_kernel(
    y_ptr, h_ptr, b_ptr, ranks_ptr, scales_ptr, starts_ptr, slots_ptr, tile_seg_ptr,
    first_tile_ptr,
    N, out_offset, num_segments,
    stride_yt, stride_yn,
    stride_ht, stride_hr,
    b_off_ptr, stride_bn, stride_br,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seg = tl.load(tile_seg_ptr + pid)
    if seg >= num_segments:
        return
    slot, rank, offs_m, m_mask = segment_tile(pid, seg, starts_ptr, first_tile_ptr, slots_ptr,
                                              ranks_ptr, BLOCK_M)
    if rank == 0:
        return
    scale = tl.load(scales_ptr + slot)
    n_mask = offs_n < N
    b_base = b_ptr + tl.load(b_off_ptr + slot)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        hv = load_tile(h_ptr, offs_m, stride_ht, m_mask, offs_r, stride_hr, r_mask)
        bv = load_tile(b_base, offs_r, stride_br, r_mask, offs_n, stride_bn, n_mask)
        hv = hv.to(bv.dtype)
        if UPCAST:
            acc = tl.dot(hv.to(tl.float32), bv.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(hv, bv, acc, input_precision=DOT_PRECISION)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_yt \
        + (out_offset + offs_n[None, :]) * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    yv = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (yv + scale * acc).to(y_ptr.dtype.element_ty), mask=y_mask)


def sgmv_shrink(x: Tensor, a_slab: Tensor | PooledLora, ranks: Tensor, segments: Segments, *,
                block_m: int = 32, block_r: int = 16, block_k: int = 64,
                split_k: int = 1) -> Tensor:
    """``h[t, :r] = x[t] @ A_slot[:r].T`` for every token of every segment."""
    num_tokens, k = x.shape
    a = a_operand(a_slab)
    max_rank = a.max_rank
    h = torch.zeros(num_tokens, max_rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or max_rank == 0 or segments.num_segments == 0:
        return h
    tiles = segment_tiles(segments.starts, num_tokens, block_m)
    grid = (tiles.num_programs, triton.cdiv(max_rank, block_r), split_k)
    _sgmv_shrink_kernel[grid](
        x, a.data, h, ranks, segments.starts, segments.slots, tiles.segment, tiles.first_tile,
        k, segments.num_segments,
        x.stride(0), x.stride(1),
        a.offsets, a.stride_r, a.stride_f,
        h.stride(0), h.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=split_k,
        DOT_PRECISION=dot_precision(x.dtype),
        UPCAST=upcast_dot_operands(_sgmv_shrink_kernel, x.dtype),
    )
    return h


def sgmv_expand(y: Tensor, h: Tensor, b_slab: Tensor | PooledLora, ranks: Tensor, scales: Tensor,
                segments: Segments, *, out_offset: int = 0, block_m: int = 32,
                block_n: int = 64, block_r: int = 16) -> None:
    """``y[t, off:off+N] += scale * h[t, :r] @ B_slot[:, :r].T`` for every segment's tokens.

    ``h`` is rounded to the weights' dtype before the tensor-core product, as vLLM and Punica
    do; the products and the sum stay in fp32.
    """
    num_tokens = y.shape[0]
    b = b_operand(b_slab)
    n = b.features
    if num_tokens == 0 or n == 0 or segments.num_segments == 0:
        return
    tiles = segment_tiles(segments.starts, num_tokens, block_m)
    grid = (tiles.num_programs, triton.cdiv(n, block_n))
    _sgmv_expand_kernel[grid](
        y, h, b.data, ranks, scales, segments.starts, segments.slots, tiles.segment,
        tiles.first_tile,
        n, out_offset, segments.num_segments,
        y.stride(0), y.stride(1),
        h.stride(0), h.stride(1),
        b.offsets, b.stride_f, b.stride_r,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        DOT_PRECISION=dot_precision(b.data.dtype),
        UPCAST=upcast_dot_operands(_sgmv_expand_kernel, b.data.dtype),
    )
