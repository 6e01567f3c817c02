"""Weight-only int8 matmul on the GPU: ``y = (x @ q.T) * scale`` with int8 ``q`` read as
stored.

The format is :mod:`loraplane_kernels.int8`'s (per-row symmetric int8, one scale per
output row). Dequantising the weight into a buffer first, as the CPU does for big batches,
reads the int8 bytes, writes the wide copy and reads it again: three passes over memory
where a decode step is bound by one. Here each tile of ``q`` is widened in registers (an
int8 is exact in bf16, fp16 and fp32), the products are summed in fp32, and the row scale
is applied once per output element before the single rounding to ``x``'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from loraplane_kernels.triton.sgmv import dot_precision, upcast_dot_operands
from loraplane_kernels.triton.tiles import load_tile

BLOCK_N = 64
BLOCK_K = 64


def block_m(rows: int) -> int:
    """A decode's few rows fill a 16-row tile (the smallest `tl.dot` takes); a prefill's
    take 64, so each weight tile is reused across more rows."""
    return 16 if rows <= 16 else 64


@triton.jit
def _int8_mm_kernel(
    y_ptr, x_ptr, q_ptr, scale_ptr,
    M, N, K,
    stride_ym, stride_yn,
    stride_xm, stride_xk,
    stride_qn, stride_qk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xv = load_tile(x_ptr, offs_m, stride_xm, m_mask, offs_k, stride_xk, k_mask)
        qv = load_tile(q_ptr, offs_k, stride_qk, k_mask, offs_n, stride_qn, n_mask)
        if UPCAST:
            acc = tl.dot(xv.to(tl.float32), qv.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xv, qv.to(x_ptr.dtype.element_ty), acc, input_precision=DOT_PRECISION)
    scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    acc = acc * scale[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def int8_mm(x: Tensor, q: Tensor, scale: Tensor, out: Tensor | None = None) -> Tensor:
    """``(x @ q.T) * scale`` in `x`'s dtype: x [M, K]; q [N, K] int8; scale [N]."""
    if q.dtype != torch.int8 or x.dim() != 2 or q.dim() != 2 or x.shape[1] != q.shape[1]:
        raise ValueError(f"int8_mm: x [M, K] and int8 q [N, K] expected, got x "
                         f"{tuple(x.shape)} {x.dtype} and q {tuple(q.shape)} {q.dtype}")
    if scale.shape != (q.shape[0],):
        raise ValueError(f"int8_mm: scale must be [{q.shape[0]}], got {tuple(scale.shape)}")
    m, n = x.shape[0], q.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0 or n == 0:
        return y
    bm = block_m(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, BLOCK_N))
    _int8_mm_kernel[grid](
        y, x, q, scale, m, n, x.shape[1],
        y.stride(0), y.stride(1), x.stride(0), x.stride(1), q.stride(0), q.stride(1),
        BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_PRECISION=dot_precision(x.dtype),
        UPCAST=upcast_dot_operands(_int8_mm_kernel, x.dtype),
    )
    return y
