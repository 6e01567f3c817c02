"""BGMV: one adapter slot per token, the decode case.

Each program serves one token (and one block of rank or output columns), so tokens with
different adapters never wait on each other and no sorting is needed. Decode is bound by
reading the adapters' weights, so the kernels keep every read masked to the slot's real rank:
masked lanes issue no memory traffic, and rank blocks past a slot's rank exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from loraplane_kernels.rank_pool import PooledLora
from loraplane_kernels.triton.operands import a_operand, b_operand
from loraplane_kernels.triton.tiles import slot_rank


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, a_ptr, h_ptr, ranks_ptr, idx_ptr,
    K,
    stride_xt, stride_xk,
    a_off_ptr, stride_ar, stride_ak,
    stride_ht, stride_hr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    t = tl.program_id(0)
    r0 = tl.program_id(1) * BLOCK_R
    split = tl.program_id(2)
    slot, rank = slot_rank(idx_ptr, ranks_ptr, t)
    if r0 >= rank:
        return
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    a_base = a_ptr + tl.load(a_off_ptr + slot)
    x_base = x_ptr + t.to(tl.int64) * stride_xt
    k_chunk = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = split * k_chunk
    k_end = tl.minimum(k_start + k_chunk, K)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        xv = tl.load(x_base + offs_k * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
        av = tl.load(
            a_base + offs_r[:, None] * stride_ar + offs_k[None, :] * stride_ak,
            mask=r_mask[:, None] & k_mask[None, :], other=0.0,
        ).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    h_ptrs = h_ptr + t.to(tl.int64) * stride_ht + offs_r * stride_hr
    if SPLIT_K == 1:
        tl.store(h_ptrs, acc, mask=r_mask)
    else:
        tl.atomic_add(h_ptrs, acc, mask=r_mask)


@triton.jit
def _bgmv_expand_kernel(
    y_ptr, h_ptr, b_ptr, ranks_ptr, scales_ptr, idx_ptr,
    N, out_offset,
    stride_yt, stride_yn,
    stride_ht, stride_hr,
    b_off_ptr, stride_bn, stride_br,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot, rank = slot_rank(idx_ptr, ranks_ptr, t)
    if rank == 0:
        return
    scale = tl.load(scales_ptr + slot)
    n_mask = offs_n < N
    b_base = b_ptr + tl.load(b_off_ptr + slot)
    h_base = h_ptr + t.to(tl.int64) * stride_ht
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        hv = tl.load(h_base + offs_r * stride_hr, mask=r_mask, other=0.0)
        bv = tl.load(
            b_base + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
            mask=n_mask[:, None] & r_mask[None, :], other=0.0,
        ).to(tl.float32)
        acc += tl.sum(bv * hv[None, :], axis=1)
    y_ptrs = y_ptr + t.to(tl.int64) * stride_yt + (out_offset + offs_n) * stride_yn
    yv = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (yv + scale * acc).to(y_ptr.dtype.element_ty), mask=n_mask)


def bgmv_shrink(x: Tensor, a_slab: Tensor | PooledLora, ranks: Tensor, indices: Tensor, *,
                block_r: int = 16, block_k: int = 256, split_k: int = 1) -> Tensor:
    """``h[t, :r] = x[t] @ A_slot[:r].T`` per token; ``split_k > 1`` adds parallelism for
    small batches by splitting the reduction and accumulating with atomics."""
    num_tokens, k = x.shape
    a = a_operand(a_slab)
    max_rank = a.max_rank
    h = torch.zeros(num_tokens, max_rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or max_rank == 0:
        return h
    grid = (num_tokens, triton.cdiv(max_rank, block_r), split_k)
    _bgmv_shrink_kernel[grid](
        x, a.data, h, ranks, indices,
        k,
        x.stride(0), x.stride(1),
        a.offsets, a.stride_r, a.stride_f,
        h.stride(0), h.stride(1),
        BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=split_k,
    )
    return h


def bgmv_expand(y: Tensor, h: Tensor, b_slab: Tensor | PooledLora, ranks: Tensor, scales: Tensor,
                indices: Tensor, *, out_offset: int = 0, block_n: int = 128,
                block_r: int = 16) -> None:
    """``y[t, off:off+N] += scale * h[t, :r] @ B_slot[:, :r].T`` in place, per token."""
    num_tokens = y.shape[0]
    b = b_operand(b_slab)
    n = b.features
    if num_tokens == 0 or n == 0:
        return
    grid = (num_tokens, triton.cdiv(n, block_n))
    _bgmv_expand_kernel[grid](
        y, h, b.data, ranks, scales, indices,
        n, out_offset,
        y.stride(0), y.stride(1),
        h.stride(0), h.stride(1),
        b.offsets, b.stride_f, b.stride_r,
        BLOCK_N=block_n, BLOCK_R=block_r,
    )
