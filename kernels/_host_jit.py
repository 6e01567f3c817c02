"""The numba code of `kernels.host`, in a module of its own so that importing the kernels
does not import numba (about half a second) where nothing decodes on the CPU.

Module-level functions, so numba caches their machine code across processes. Loops run
over 1-D slices: indexing with computed offsets keeps numba's negative-index checks in
the inner loops and stops their vectorisation (3.6 against 25 GFLOP/s measured).
"reassoc" lets LLVM vectorise the dot products (BLAS reorders them too); every rounding
to bf16 is explicit, so no other result depends on the flags.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

_FAST = {"reassoc", "nsz", "contract"}
_U16 = np.uint32(16)
_HI = np.uint32(0xFFFF0000)
_HALF = np.uint32(0x7FFF)
_ONE = np.uint32(1)
_MAGNITUDE = np.uint32(0x7FFFFFFF)
_INF = np.uint32(0x7F800000)
_QUIET = np.uint32(0x400000)


@numba.njit(inline="always")
def rounded(u: Any) -> Any:
    """fp32 bits -> the fp32 bits of the nearest bf16, ties to even; NaN stays NaN."""
    if (u & _MAGNITUDE) > _INF:
        return (u | _QUIET) & _HI
    return (u + _HALF + ((u >> _U16) & _ONE)) & _HI


@numba.njit(inline="always")
def widen(dst: Any, src: Any) -> None:
    """bf16 bits -> fp32 bits (a bf16 is the top half of an fp32)."""
    for j in range(src.shape[0]):
        dst[j] = np.uint32(src[j]) << _U16


@numba.njit(inline="always", fastmath=_FAST)
def dot(a: Any, b: Any) -> Any:
    acc = np.float32(0.0)
    for j in range(a.shape[0]):
        acc += a[j] * b[j]
    return acc


@numba.njit(inline="always", fastmath=_FAST)
def axpy(y: Any, a: Any, x: Any) -> None:
    for c in range(y.shape[0]):
        y[c] += a * x[c]


def as_f32(src: Any, scratch: Any) -> Any:
    """A bf16-bits or fp32 row as fp32: the row itself, or widened into `scratch`."""
    raise NotImplementedError  # compiled through the overload below


@numba.extending.overload(as_f32, inline="always")
def _as_f32(src: Any, scratch: Any) -> Any:
    if src.dtype == numba.types.float32:
        def same(src: Any, scratch: Any) -> Any:
            return src
        return same

    def impl(src: Any, scratch: Any) -> Any:
        widen(scratch.view(np.uint32), src)
        return scratch
    return impl


def store(dst: Any, src: Any) -> None:
    """An fp32 row into a bf16-bits (rounded, ties to even) or fp32 row."""
    raise NotImplementedError  # compiled through the overload below


@numba.extending.overload(store, inline="always")
def _store(dst: Any, src: Any) -> Any:
    if dst.dtype == numba.types.float32:
        def copy(dst: Any, src: Any) -> None:
            for d in range(dst.shape[0]):
                dst[d] = src[d]
        return copy

    def impl(dst: Any, src: Any) -> None:
        bits = src.view(np.uint32)
        for d in range(dst.shape[0]):
            dst[d] = np.uint16(rounded(bits[d]) >> _U16)
    return impl


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def runs_f32(x: Any, y: Any, pool: Any, col0: int, in_f: int, out_f: int, a_off: Any,
             b_off: Any, ranks: Any, scales: Any, starts: Any, ends: Any,
             rows_max: int, max_rank: int) -> None:
    h = np.empty(rows_max * max_rank, np.float32)
    d = np.empty(rows_max * out_f, np.float32)
    for run in range(ranks.shape[0]):
        rank, s0 = ranks[run], starts[run]
        n = ends[run] - s0
        for k in range(rank):  # shrink: h = x @ A.T, one row of A at a time
            a0 = a_off[run] + k * in_f
            for i in range(n):
                h[i * max_rank + k] = dot(x[s0 + i], pool[a0:a0 + in_f])
        d[:n * out_f] = 0.0
        for k in range(rank):  # expand: d = h @ Bt, one row of Bt at a time
            b0 = b_off[run] + k * out_f
            for i in range(n):
                axpy(d[i * out_f:(i + 1) * out_f], h[i * max_rank + k], pool[b0:b0 + out_f])
        scale = scales[run]
        for i in range(n):
            row, delta = y[s0 + i, col0:col0 + out_f], d[i * out_f:(i + 1) * out_f]
            for c in range(out_f):
                row[c] = row[c] + delta[c] * scale


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def runs_bf16(x: Any, y: Any, pool: Any, col0: int, in_f: int, out_f: int, a_off: Any,
              b_off: Any, ranks: Any, scales: Any, starts: Any, ends: Any,
              rows_max: int, max_rank: int) -> None:
    """`runs_f32` over bf16 bits: weights and activations widened, results rounded."""
    xu = np.empty(rows_max * in_f, np.uint32)
    xf = xu.view(np.float32)
    wu = np.empty(max(in_f, out_f), np.uint32)
    wf = wu.view(np.float32)
    hu = np.empty(rows_max * max_rank, np.uint32)
    hf = hu.view(np.float32)
    du = np.empty(rows_max * out_f, np.uint32)
    df = du.view(np.float32)
    for run in range(ranks.shape[0]):
        rank, s0 = ranks[run], starts[run]
        n = ends[run] - s0
        for i in range(n):
            widen(xu[i * in_f:(i + 1) * in_f], x[s0 + i])
        for k in range(rank):
            a0 = a_off[run] + k * in_f
            widen(wu[:in_f], pool[a0:a0 + in_f])
            for i in range(n):
                hf[i * max_rank + k] = dot(xf[i * in_f:(i + 1) * in_f], wf[:in_f])
        for i in range(n):
            for k in range(rank):
                hu[i * max_rank + k] = rounded(hu[i * max_rank + k])
        df[:n * out_f] = 0.0
        for k in range(rank):
            b0 = b_off[run] + k * out_f
            widen(wu[:out_f], pool[b0:b0 + out_f])
            for i in range(n):
                axpy(df[i * out_f:(i + 1) * out_f], hf[i * max_rank + k], wf[:out_f])
        scale = scales[run]
        for i in range(n):
            d_u, d_f = du[i * out_f:(i + 1) * out_f], df[i * out_f:(i + 1) * out_f]
            row = y[s0 + i, col0:col0 + out_f]
            for c in range(out_f):
                d_u[c] = rounded(d_u[c])
            for c in range(out_f):
                d_f[c] = d_f[c] * scale
            for c in range(out_f):
                d_u[c] = rounded(d_u[c])
            widen(wu[:out_f], row)
            for c in range(out_f):
                wf[c] = wf[c] + d_f[c]
            store(row, wf)


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def decode_attention(q: Any, k_cache: Any, v_cache: Any, out: Any, rows: Any, tables: Any,
                     lens: Any, block_size: int, scale: Any, lo: int, hi: int) -> None:
    """Decodes `lo:hi` of a step: for each, softmax(scale * q K^T) V over its context,
    read from the paged cache in place (no gathered copy of K and V). q, out [T, H, D];
    caches [KVH, slots, D]; tables [B, blocks]. Scores, softmax and the weighted sum are
    fp32 (bf16 inputs widened, the output rounded once)."""
    kv_heads, _, dim = k_cache.shape
    group = q.shape[1] // kv_heads
    longest = 1
    for b in range(lo, hi):
        longest = max(longest, lens[b])
    scores = np.empty((group, longest), np.float32)
    acc = np.empty((group, dim), np.float32)
    qs = np.empty((group, dim), np.float32)
    row_f = np.empty(dim, np.float32)
    for b in range(lo, hi):
        row, n = rows[b], lens[b]
        for h in range(kv_heads):
            keys, values = k_cache[h], v_cache[h]
            for j in range(group):
                qs[j] = as_f32(q[row, h * group + j], row_f)
            for pos in range(n):
                key = as_f32(keys[tables[b, pos // block_size] * block_size
                                  + pos % block_size], row_f)
                for j in range(group):
                    scores[j, pos] = dot(qs[j], key) * scale
            for j in range(group):
                s = scores[j, :n]
                top = s.max()
                total = np.float32(0.0)
                for pos in range(n):
                    s[pos] = np.exp(s[pos] - top)
                    total += s[pos]
                s *= np.float32(1.0) / total
            acc[:] = 0.0
            for pos in range(n):
                value = as_f32(values[tables[b, pos // block_size] * block_size
                                      + pos % block_size], row_f)
                for j in range(group):
                    axpy(acc[j], scores[j, pos], value)
            for j in range(group):
                store(out[row, h * group + j], acc[j])
