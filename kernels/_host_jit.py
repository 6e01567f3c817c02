"""The numba code of `kernels.host`, in a module of its own so that importing the kernels
does not import numba (about half a second) where nothing decodes on the CPU.

Module-level functions, so numba caches their machine code across processes. Loops run
over 1-D slices: indexing with computed offsets keeps numba's negative-index checks in
the inner loops and stops their vectorisation (3.6 against 25 GFLOP/s measured).
"reassoc" lets LLVM vectorise the dot products (BLAS reorders them too); every rounding
to bf16 is explicit, so no other result depends on the flags.

One kernel serves fp32 and bf16 (numba compiles a signature for each): the overloads
below are the identity in fp32 and, in bf16, widen each element as it is read (a bf16 is
the top half of an fp32) or round it where PEFT's ops round. Widening in the loop that
uses the element, rather than into a scratch row first, made the bf16 LoRA pass of a
64-decode SmolLM2 step about a quarter faster, with the same bits.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir as llvm_ir

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


@numba.extending.intrinsic
def f32_of(typingctx: Any, bits: Any) -> Any:
    """fp32 bits as the fp32 they encode (a register move, no memory)."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], llvm_ir.FloatType())
    return numba.types.float32(numba.types.uint32), codegen


@numba.extending.intrinsic
def bits_of(typingctx: Any, value: Any) -> Any:
    """An fp32's bits."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], llvm_ir.IntType(32))
    return numba.types.uint32(numba.types.float32), codegen


def value(row: Any, j: Any) -> Any:
    """Element `j` of a bf16-bits or fp32 row, as fp32."""
    raise NotImplementedError  # compiled through the overload below


@numba.extending.overload(value, inline="always")
def _value(row: Any, j: Any) -> Any:
    if row.dtype == numba.types.float32:
        def same(row: Any, j: Any) -> Any:
            return row[j]
        return same

    def widened(row: Any, j: Any) -> Any:
        return f32_of(np.uint32(row[j]) << _U16)
    return widened


def rounded_like(row: Any, v: Any) -> Any:
    """`v` rounded to the precision of `row`'s elements (bf16: ties to even), as fp32."""
    raise NotImplementedError  # compiled through the overload below


@numba.extending.overload(rounded_like, inline="always")
def _rounded_like(row: Any, v: Any) -> Any:
    if row.dtype == numba.types.float32:
        def same(row: Any, v: Any) -> Any:
            return v
        return same

    def to_bf16(row: Any, v: Any) -> Any:
        return f32_of(rounded(bits_of(v)))
    return to_bf16


def put(row: Any, j: Any, v: Any) -> None:
    """Element `j` of a bf16-bits (rounded, ties to even) or fp32 row set to fp32 `v`."""
    raise NotImplementedError  # compiled through the overload below


@numba.extending.overload(put, inline="always")
def _put(row: Any, j: Any, v: Any) -> Any:
    if row.dtype == numba.types.float32:
        def same(row: Any, j: Any, v: Any) -> None:
            row[j] = v
        return same

    def to_bf16(row: Any, j: Any, v: Any) -> None:
        row[j] = np.uint16(rounded(bits_of(v)) >> _U16)
    return to_bf16


@numba.njit(inline="always", fastmath=_FAST)
def dot(a: Any, b: Any) -> Any:
    """fp32 `a` . `b`, `b` fp32 or bf16 bits (widened as it is read)."""
    acc = np.float32(0.0)
    for j in range(a.shape[0]):
        acc += a[j] * value(b, j)
    return acc


@numba.njit(inline="always", fastmath=_FAST)
def axpy(y: Any, a: Any, x: Any) -> None:
    """fp32 `y` += `a` * `x`, `x` fp32 or bf16 bits."""
    for c in range(y.shape[0]):
        y[c] += a * value(x, c)


@numba.njit(inline="always")
def load(dst: Any, src: Any) -> None:
    """A bf16-bits or fp32 row into an fp32 row."""
    for j in range(dst.shape[0]):
        dst[j] = value(src, j)


@numba.njit(inline="always")
def store(dst: Any, src: Any) -> None:
    """An fp32 row into a bf16-bits (rounded, ties to even) or fp32 row."""
    for j in range(dst.shape[0]):
        put(dst, j, src[j])


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def runs(x: Any, y: Any, pool: Any, col0: int, in_f: int, out_f: int, a_off: Any,
         b_off: Any, ranks: Any, scales: Any, starts: Any, ends: Any,
         rows_max: int, max_rank: int) -> None:
    """Every run's ``y[rows, col0:+out_f] += ((x[rows] @ A.T) @ Bt) * scale``, fp32 or
    bf16 bits throughout (one signature each). In bf16, weights are widened as they are
    read and the shrink output, the expand output, its product with the scale and the sum
    into `y` are rounded to bf16 where PEFT's bf16 ops round; in fp32 rounding is the
    identity."""
    xs = np.empty((rows_max, in_f), np.float32)
    h = np.empty((rows_max, max_rank), np.float32)
    d = np.empty((rows_max, out_f), np.float32)
    for run in range(ranks.shape[0]):
        rank, s0 = ranks[run], starts[run]
        n = ends[run] - s0
        for i in range(n):
            load(xs[i], x[s0 + i])
        for k in range(rank):  # shrink: h = x @ A.T, one row of A at a time
            a0 = a_off[run] + k * in_f
            for i in range(n):
                h[i, k] = rounded_like(pool, dot(xs[i], pool[a0:a0 + in_f]))
        d[:n] = 0.0
        for k in range(rank):  # expand: d = h @ Bt, one row of Bt at a time
            b0 = b_off[run] + k * out_f
            for i in range(n):
                axpy(d[i], h[i, k], pool[b0:b0 + out_f])
        scale = scales[run]
        for i in range(n):
            row, delta = y[s0 + i, col0:col0 + out_f], d[i]
            for c in range(out_f):
                part = rounded_like(row, delta[c])
                part = rounded_like(row, part * scale)
                put(row, c, value(row, c) + part)


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
    for b in range(lo, hi):
        row, n = rows[b], lens[b]
        for h in range(kv_heads):
            keys, values = k_cache[h], v_cache[h]
            for j in range(group):
                load(qs[j], q[row, h * group + j])
            for pos in range(n):
                key = keys[tables[b, pos // block_size] * block_size + pos % block_size]
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
                cached = values[tables[b, pos // block_size] * block_size + pos % block_size]
                for j in range(group):
                    axpy(acc[j], scores[j, pos], cached)
            for j in range(group):
                store(out[row, h * group + j], acc[j])
