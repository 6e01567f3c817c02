"""The numba code of `loraplane_kernels.cpu_decode`, in a module of its own so that importing
the kernels does not import numba (about half a second) where nothing decodes on the CPU.

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

import math
from typing import Any

import numba
import numpy as np
from llvmlite import ir as llvm_ir
from numba.core import cgutils

from loraplane_kernels.cpu_layer import NORM_COPY, NORM_NONE, NORM_RMS, QK_FULL, QK_NONE

_FAST = {"reassoc", "nsz", "contract"}
_NO_CONTRACT = {"reassoc", "nsz"}
"""For ops that round between a product and a sum, as torch's do (no fused multiply-add)."""
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
    """Element `j` of a bf16-bits, fp32 or int8 row, as fp32."""
    raise NotImplementedError  # compiled through the overload below


@numba.extending.overload(value, inline="always")
def _value(row: Any, j: Any) -> Any:
    if row.dtype == numba.types.float32:
        def same(row: Any, j: Any) -> Any:
            return row[j]
        return same
    if row.dtype == numba.types.int8:  # int8 weights (`loraplane_kernels.int8`): exact
        def integer(row: Any, j: Any) -> Any:
            return np.float32(row[j])
        return integer

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


@numba.njit(inline="always", fastmath=_FAST)
def one_run(x: Any, y: Any, pool: Any, col0: int, in_f: int, out_f: int, table: Any,
            scales: Any, slot: Any, s0: Any, n: Any, xs: Any, h: Any, d: Any) -> None:
    """One run's ``y[s0:s0+n, col0:+out_f] += ((x[rows] @ A.T) @ Bt) * scale`` through the
    scratch rows `xs`, `h`, `d`."""
    rank = table[2, slot]
    for i in range(n):
        load(xs[i], x[s0 + i])
    for k in range(rank):  # shrink: h = x @ A.T, one row of A at a time
        a0 = table[0, slot] + k * in_f
        for i in range(n):
            h[i, k] = rounded_like(pool, dot(xs[i], pool[a0:a0 + in_f]))
    d[:n] = 0.0
    for k in range(rank):  # expand: d = h @ Bt, one row of Bt at a time
        b0 = table[1, slot] + k * out_f
        for i in range(n):
            axpy(d[i], h[i, k], pool[b0:b0 + out_f])
    scale = scales[slot]
    for i in range(n):
        row, delta = y[s0 + i, col0:col0 + out_f], d[i]
        for c in range(out_f):
            part = rounded_like(row, delta[c])
            part = rounded_like(row, part * scale)
            put(row, c, value(row, c) + part)


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def runs(x: Any, y: Any, pool: Any, col0: int, in_f: int, out_f: int, table: Any,
         scales: Any, slots: Any, starts: Any, ends: Any, rows_max: int) -> None:
    """Every run's ``y[rows, col0:+out_f] += ((x[rows] @ A.T) @ Bt) * scale``, fp32 or
    bf16 bits throughout (one signature each), the run's slot looked up in `table` (A
    offset, Bt offset, rank; rank 0: not adapted here, skipped) and `scales`. In bf16,
    weights are widened as they are read and the shrink output, the expand output, its
    product with the scale and the sum into `y` are rounded to bf16 where PEFT's bf16 ops
    round; in fp32 rounding is the identity."""
    max_rank = 0
    for run in range(slots.shape[0]):
        max_rank = max(max_rank, table[2, slots[run]])
    if max_rank == 0:
        return
    xs = np.empty((rows_max, in_f), np.float32)
    h = np.empty((rows_max, max_rank), np.float32)
    d = np.empty((rows_max, out_f), np.float32)
    for run in range(slots.shape[0]):
        slot = slots[run]
        if table[2, slot] == 0:
            continue
        one_run(x, y, pool, col0, in_f, out_f, table, scales, slot, starts[run],
                ends[run] - starts[run], xs, h, d)


@numba.njit(cache=True, nogil=True, fastmath=_FAST, parallel=True)
def runs_shares(x: Any, y: Any, pool: Any, col0: int, in_f: int, out_f: int, table: Any,
                scales: Any, slots: Any, starts: Any, ends: Any, rows_max: int,
                parts: int) -> None:
    """`runs` cut into `parts` shares of about equal work (rows x rank), the shares on
    numba's threads. Each run writes its own rows of `y`, so the results are `runs`' bits.
    One core read a step's adapters from memory at about 24 GB/s, two at 46 (32 adapters
    of rank 32 over 40 projections, 94 MB)."""
    count = slots.shape[0]
    work = np.zeros(count + 1, np.int64)
    max_rank = 0
    for run in range(count):
        rank = table[2, slots[run]]
        max_rank = max(max_rank, rank)
        work[run + 1] = work[run] + rank * (ends[run] - starts[run])
    if max_rank == 0:
        return
    cuts = np.empty(parts + 1, np.int64)
    cuts[0], cuts[parts] = 0, count
    run = 0
    for i in range(1, parts):
        while run < count and work[run] * parts < work[count] * i:
            run += 1
        cuts[i] = run
    for share in numba.prange(parts):
        xs = np.empty((rows_max, in_f), np.float32)
        h = np.empty((rows_max, max_rank), np.float32)
        d = np.empty((rows_max, out_f), np.float32)
        for r in range(cuts[share], cuts[share + 1]):
            slot = slots[r]
            if table[2, slot] == 0:
                continue
            one_run(x, y, pool, col0, in_f, out_f, table, scales, slot, starts[r],
                    ends[r] - starts[r], xs, h, d)


@numba.extending.intrinsic
def prefetch_at(typingctx: Any, array: Any, index: Any) -> Any:
    """Ask for the cache line holding flat element `index` of a C-contiguous array to be
    brought into every cache level: a hint, with no fault (past the end too) and no
    result."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        at = builder.gep(data, [context.cast(builder, args[1], signature.args[1],
                                             numba.types.intp)])
        bytes_ptr = llvm_ir.IntType(8).as_pointer()
        i32 = llvm_ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, llvm_ir.FunctionType(llvm_ir.VoidType(),
                                                 [bytes_ptr, i32, i32, i32]),
            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(at, bytes_ptr), llvm_ir.Constant(i32, 0),
                          llvm_ir.Constant(i32, 3), llvm_ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return numba.types.void(array, index), codegen


@numba.njit(inline="always")
def prefetch_run(array: Any, start: Any, count: Any) -> None:
    """`prefetch_at` each cache line of flat elements ``start:start + count``."""
    for index in range(start, start + count, 64 // array.itemsize):
        prefetch_at(array, index)


_LINEAR_TILE = 16
"""Weight rows `linear_part` streams through every row of x before the next ones: 16 rows
of 576 to 2,048 bf16s stay in L1 while each x row passes."""

_LINEAR_AHEAD = 8192
"""Bytes past the tile it starts that `linear_part` asks the memory for a tile's worth of
weights. SmolLM2's single-stream bf16 step on a 2-core Xeon, alternating in one process
with the kernel that does not ask: 8 KB ahead 24.5 -> 23.1 ms, 16 KB 23.5 -> 22.4, 32 KB
25.7 -> 24.8, 64 KB no gain. The hardware prefetcher alone lags the stream; a hint for
every cache level (locality 3) did this, a non-temporal one took the step to 58 ms."""


@numba.njit(inline="always", fastmath=_FAST)
def linear_part(xs: Any, w: Any, scale: Any, bias: Any, y: Any, lo: Any, hi: Any) -> None:
    """``y[:, lo:hi] = xs @ w[lo:hi].T (+ bias[lo:hi])``, each weight row read from memory
    once, a tile at a time, and passed over the rows of `xs` (fp32) from L1, two at a time
    where it can (each weight element widened once for both). Dense weights: one rounding
    per output, after the bias, as oneDNN's linear rounds. int8 weights (`scale` per row,
    else empty): the scaled sum rounded, then the bias added and rounded, as `int8_linear`
    does. An output's sum is the same whether its row is paired or not.

    One `put` site only: numba's IR check warns where its inlined overloads meet twice."""
    in_f, n = xs.shape[1], xs.shape[0]
    scaled, biased = scale.shape[0] > 0, bias.shape[0] > 0
    ahead = _LINEAR_AHEAD // w.itemsize
    for t0 in range(lo, hi, _LINEAR_TILE):
        t1 = min(t0 + _LINEAR_TILE, hi)
        start = t1 * in_f + ahead
        prefetch_run(w, start, max(0, min(w.shape[0], start + (t1 - t0) * in_f) - start))
        i = 0
        while i < n:
            pair = i + 1 < n
            x0 = xs[i]
            x1 = xs[i + 1] if pair else x0
            for o in range(t0, t1):
                row = w[o * in_f:(o + 1) * in_f]
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                if pair:
                    for j in range(in_f):
                        v = value(row, j)
                        a0 += x0[j] * v
                        a1 += x1[j] * v
                else:
                    a0 = dot(x0, row)
                for r in range(2 if pair else 1):
                    yr, acc = y[i + r], a0 if r == 0 else a1
                    if scaled:
                        acc = rounded_like(yr, acc * value(scale, o))
                    put(yr, o, acc + value(bias, o) if biased else acc)
            i += 2 if pair else 1


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def linear_rows(x: Any, w: Any, scale: Any, bias: Any, y: Any) -> None:
    """``y = x @ W.T (+ bias)`` for a few rows `x` [T, in] (fp32 or bf16 bits) over a plain
    [out, in] weight flattened to `w` (fp32, bf16 bits, or int8 with a `scale` per row);
    `scale` and `bias` empty for none."""
    xs = np.empty((x.shape[0], x.shape[1]), np.float32)
    for i in range(x.shape[0]):
        load(xs[i], x[i])
    linear_part(xs, w, scale, bias, y, 0, y.shape[1])


@numba.njit(inline="always")
def dequantize_part(q: Any, scale: Any, out: Any, lo: Any, hi: Any) -> None:
    for i in range(lo, hi):
        s = value(scale, i)
        row, dst = q[i], out[i]
        for j in range(row.shape[0]):
            put(dst, j, np.float32(row[j]) * s)


@numba.njit(cache=True, nogil=True, parallel=True)
def dequantize_shares(q: Any, scale: Any, out: Any, parts: int) -> None:
    """``out = q * scale[:, None]`` (int8 rows times their scale, rounded once to `out`'s
    precision as torch's multiply rounds), rows cut into `parts` shares on numba's threads."""
    n = q.shape[0]
    for share in numba.prange(parts):
        dequantize_part(q, scale, out, share * n // parts, (share + 1) * n // parts)


@numba.njit(cache=True, nogil=True)
def dequantize(q: Any, scale: Any, out: Any) -> None:
    """`dequantize_shares` in the calling thread."""
    dequantize_part(q, scale, out, 0, q.shape[0])


@numba.njit(cache=True, nogil=True, fastmath=_FAST, parallel=True)
def linear_rows_shares(x: Any, w: Any, scale: Any, bias: Any, y: Any, parts: int) -> None:
    """`linear_rows` with the output columns cut into `parts` shares on numba's threads:
    each output is one share's, so the bits do not depend on `parts`."""
    xs = np.empty((x.shape[0], x.shape[1]), np.float32)
    for i in range(x.shape[0]):
        load(xs[i], x[i])
    out_f = y.shape[1]
    for share in numba.prange(parts):
        linear_part(xs, w, scale, bias, y, share * out_f // parts,
                    (share + 1) * out_f // parts)


def cached(cache: Any, h: Any, slot: Any, d: Any) -> Any:
    """Element `d` of `slot`'s row for KV head `h` of a [KVH, slots, D] fp32 or bf16-bits
    cache, as fp32. Indexing the 3-D array with unsigned indices, instead of slicing a row
    out of it, leaves numba no negative-index check and no view to build per position."""
    raise NotImplementedError  # compiled through the overload below


@numba.extending.overload(cached, inline="always")
def _cached(cache: Any, h: Any, slot: Any, d: Any) -> Any:
    if cache.dtype == numba.types.float32:
        def same(cache: Any, h: Any, slot: Any, d: Any) -> Any:
            return cache[h, slot, d]
        return same

    def widened(cache: Any, h: Any, slot: Any, d: Any) -> Any:
        return f32_of(np.uint32(cache[h, slot, d]) << _U16)
    return widened


_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_MIN = np.float32(-87.33654)
_BIAS = np.int32(127)
_MANTISSA = np.uint32(23)


@numba.njit(inline="always", fastmath=_FAST)
def exp_nonpositive(x: Any) -> Any:
    """e**x for fp32 x <= 0 (a score less its row's maximum): Cephes' expf, a degree-6
    polynomial on x reduced by multiples of ln 2, scaled by 2**n through the exponent bits.

    numba has no vector exp here (no SVML), so `np.exp` is a scalar libm call, about 4 ns
    an element: a third of the kernel's time at SmolLM2's shapes with K and V in cache.
    This is arithmetic only, so LLVM vectorises the loop that calls it (0.25 ns an
    element), and within one ulp of the exact value (tests/kernels; numpy's fp32 exp is
    within 2.5 here). Below the smallest normal result (x < -87.34) it returns that
    smallest normal (1.2e-38, to a few ulp) instead of a subnormal or 0: next to the row's
    largest weight, 1, it is lost in any sum. NaN stays NaN."""
    x = _EXP_MIN if x < _EXP_MIN else x
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    return p * f32_of(np.uint32(np.int32(n) + _BIAS) << _MANTISSA)


@numba.njit(inline="always", fastmath=_FAST)
def softmax_rows(scores: Any, rows: Any, n: Any) -> None:
    """Each of the first `rows` rows of `scores`, over its first `n` columns, in place."""
    for j in range(rows):
        top = scores[j, 0]
        for pos in range(n):
            top = max(top, scores[j, pos])
        for pos in range(n):
            scores[j, pos] = exp_nonpositive(scores[j, pos] - top)
        total = np.float32(0.0)
        for pos in range(n):
            total += scores[j, pos]
        inv = np.float32(1.0) / total
        for pos in range(n):
            scores[j, pos] *= inv


_UNROLL = np.uint64(4)


@numba.njit(inline="always")
def softcapped(scores: Any, rows: Any, n: Any, cap: Any) -> None:
    """``cap * tanh(s / cap)`` over the first `n` scores of `rows` rows, in place (Gemma 2's
    attention soft-capping, applied to the scaled scores as transformers does)."""
    inv = np.float32(1.0) / cap
    for j in range(rows):
        for pos in range(n):
            scores[j, pos] = np.tanh(scores[j, pos] * inv) * cap


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def decode_attention(q: Any, k_cache: Any, v_cache: Any, out: Any, rows: Any, tables: Any,
                     lens: Any, block_size: int, scale: Any, window: int, softcap: Any,
                     lo: int, hi: int) -> None:
    """Decodes `lo:hi` of a step: for each, softmax(scale * q K^T) V over its context,
    read from the paged cache in place (no gathered copy of K and V). q, out [T, H, D];
    caches [KVH, slots, D]; tables [B, blocks]. Scores, softmax and the weighted sum are
    fp32 (bf16 inputs widened, the output rounded once).

    `window` > 0 keeps each decode to its last `window` positions (a sliding-window layer:
    the blocks before them may be freed, and are never read); `softcap` > 0 soft-caps the
    scaled scores before the softmax.

    Each cache block's positions go four at a time: one pass over D computes a query
    head's four scores (the K rows stream through registers beside one q row), and one
    pass adds four weighted V rows into the accumulator row (a quarter of its loads and
    stores). One at a time, the per-position dot products and accumulator updates were
    two thirds of the kernel's time at SmolLM2's shapes, with K and V in cache.

    A block's rows for one head are 16 x 128 bytes of bf16 at SmolLM2's shapes, and the
    blocks of a sequence lie anywhere in the cache: too short a run for the hardware
    prefetcher to reach ahead. So the scores pass asks for the next block's K rows and
    this block's V rows (which the weighted sum reads after the softmax) while it works
    on this block. 32 decodes of 100-170 positions over 30 layers' caches on a 2-core
    Xeon, the same bits: blocks scattered over the cache (a pool that has served a while)
    812 against 566 us a layer, blocks in order (a fresh pool) 443 against 382."""
    kv_heads, _, dim = k_cache.shape
    group = q.shape[1] // kv_heads
    longest = 1
    for b in range(lo, hi):
        longest = max(longest, lens[b])
    scores = np.empty((group, longest), np.float32)
    acc = np.empty((group, dim), np.float32)
    qs = np.empty((group, dim), np.float32)
    zero = np.uint64(0)
    one = np.uint64(1)
    two = np.uint64(2)
    three = np.uint64(3)
    ud, ug, bs = np.uint64(dim), np.uint64(group), np.uint64(block_size)
    for b in range(lo, hi):
        row, n = rows[b], np.uint64(lens[b])
        first = zero
        if window > 0 and lens[b] > window:
            first = np.uint64(lens[b] - window)
        count_all = n - first
        for h in range(kv_heads):
            uh = np.uint64(h)
            plane = uh * np.uint64(k_cache.shape[1])  # head h's first row, in rows
            for j in range(group):
                load(qs[j], q[row, h * group + j])
            for blk in range(first // bs, (n + bs - one) // bs):
                p0 = np.uint64(blk) * bs
                base = np.uint64(tables[b, blk]) * bs
                count = min(bs, n - p0)
                if np.uint64(blk + 1) * bs < n:
                    prefetch_run(k_cache, (plane + np.uint64(tables[b, blk + 1]) * bs) * ud,
                                 bs * ud)
                prefetch_run(v_cache, (plane + base) * ud, bs * ud)
                i = first - p0 if first > p0 else zero
                while i + _UNROLL <= count:
                    s = base + i
                    for j in range(ug):
                        a0 = a1 = a2 = a3 = np.float32(0.0)
                        for d in range(ud):
                            qd = qs[j, d]
                            a0 += qd * cached(k_cache, uh, s, d)
                            a1 += qd * cached(k_cache, uh, s + one, d)
                            a2 += qd * cached(k_cache, uh, s + two, d)
                            a3 += qd * cached(k_cache, uh, s + three, d)
                        at = p0 + i - first
                        scores[j, at] = a0 * scale
                        scores[j, at + one] = a1 * scale
                        scores[j, at + two] = a2 * scale
                        scores[j, at + three] = a3 * scale
                    i += _UNROLL
                while i < count:
                    for j in range(ug):
                        a = np.float32(0.0)
                        for d in range(ud):
                            a += qs[j, d] * cached(k_cache, uh, base + i, d)
                        scores[j, p0 + i - first] = a * scale
                    i += one
            if softcap > 0:
                softcapped(scores, group, count_all, softcap)
            softmax_rows(scores, group, count_all)
            acc[:] = 0.0
            for blk in range(first // bs, (n + bs - one) // bs):
                p0 = np.uint64(blk) * bs
                base = np.uint64(tables[b, blk]) * bs
                count = min(bs, n - p0)
                i = first - p0 if first > p0 else zero
                while i + _UNROLL <= count:
                    s, at = base + i, p0 + i - first
                    for j in range(ug):
                        w0, w1 = scores[j, at], scores[j, at + one]
                        w2, w3 = scores[j, at + two], scores[j, at + three]
                        for d in range(ud):
                            acc[j, d] += ((w0 * cached(v_cache, uh, s, d)
                                           + w1 * cached(v_cache, uh, s + one, d))
                                          + (w2 * cached(v_cache, uh, s + two, d)
                                             + w3 * cached(v_cache, uh, s + three, d)))
                    i += _UNROLL
                while i < count:
                    for j in range(ug):
                        w = scores[j, p0 + i - first]
                        for d in range(ud):
                            acc[j, d] += w * cached(v_cache, uh, base + i, d)
                    i += one
            for j in range(group):
                store(out[row, h * group + j], acc[j])


# -- the elementwise ops of a layer (`loraplane_kernels.cpu_layer`) ------------------------

@numba.njit(inline="always")
def inverse_rms(xs: Any, eps: Any) -> Any:
    """``1 / sqrt(mean(xs**2) + eps)`` over fp32 values, as the torch norm's fp32 ops."""
    ss = np.float32(0.0)
    for j in range(xs.shape[0]):
        ss += xs[j] * xs[j]
    return np.float32(1.0) / np.sqrt(ss * (np.float32(1.0) / np.float32(xs.shape[0])) + eps)


@numba.njit(inline="always")
def put_normed(out: Any, xs: Any, inv: Any, weight: Any, weigh_in_fp32: bool) -> None:
    """``out = xs * inv * weight`` rounded as `rms_norm` rounds: Llama's order casts the
    normalised value and then multiplies by the weight (rounded again), Gemma's and OLMo
    2's multiply in fp32 and round once."""
    if weigh_in_fp32:
        for j in range(xs.shape[0]):
            put(out, j, (xs[j] * inv) * value(weight, j))
    else:
        for j in range(xs.shape[0]):
            put(out, j, value(weight, j) * rounded_like(out, xs[j] * inv))


@numba.njit(cache=True, nogil=True, fastmath=_NO_CONTRACT, error_model="numpy")
def residual_norm(h: Any, delta: Any, add: bool, multiplier: Any, delta_weight: Any,
                  weight: Any, mode: int, eps: Any, weigh_in_fp32: bool, out: Any) -> None:
    """``h += norm(delta) * multiplier`` (when `add`; the norm only with a non-empty
    `delta_weight`: the norms after attention and the MLP of Gemma 2 and 3 and OLMo 2) and
    ``out = rms_norm(h) * weight`` (or h, or nothing: `mode`), row by row, with the
    roundings of the torch ops they replace: the normed delta, the scaled delta and the sum
    each rounded to h's dtype (a multiplier of 1 is exact); the norms in fp32."""
    t, n = h.shape
    xs = np.empty(n, np.float32)
    ds = np.empty(n, np.float32)
    normed = np.empty(n, h.dtype)  # the normed delta, rounded as its torch buffer
    out_norm = delta_weight.shape[0] > 0
    for r in range(t):
        hr = h[r]
        if add:
            dr = delta[r]
            if out_norm:
                load(ds, dr)
                put_normed(normed, ds, inverse_rms(ds, eps), delta_weight, weigh_in_fp32)
                dr = normed
            for j in range(n):
                d = rounded_like(dr, value(dr, j) * multiplier)
                v = rounded_like(hr, value(hr, j) + d)
                put(hr, j, v)
                xs[j] = v
        elif mode == NORM_RMS:
            load(xs, hr)
        if mode == NORM_RMS:
            put_normed(out[r], xs, inverse_rms(xs, eps), weight, weigh_in_fp32)
        elif mode == NORM_COPY:
            out[r, :] = hr


@numba.njit(cache=True, nogil=True, error_model="numpy")  # no contraction: torch rounds
def rope_cache(qkv: Any, cos: Any, sin: Any, heads: int, kv_heads: int, q_out: Any,
               k_out: Any, k_cache: Any, v_cache: Any, slots: Any, qk_norm: int,
               q_weight: Any, k_weight: Any, eps: Any, weigh_in_fp32: bool) -> None:
    """RMSNorm each row's q and k (`qk_norm`, with the norm's roundings), rotate their heads
    out of the fused q|k|v row into `q_out` / `k_out` ([T, heads, D]) and write k and v
    into the paged cache ([KVH, slots, D]) at the row's slot. Rotate-half over the first
    ``cos.shape[1]`` dimensions (the rest pass through), with torch's roundings: ``x * cos``
    and each ``x * sin`` product rounded, then their sum (negating is exact). Each product
    rounds on its own, so no fastmath contraction."""
    t = qkv.shape[0]
    dim = q_out.shape[2]
    rot = cos.shape[1]
    half = rot // 2
    q_size, k_size = heads * dim, kv_heads * dim
    normed = np.empty(q_size + k_size, qkv.dtype)  # q|k after their norm, in qkv's dtype
    xs = np.empty(q_size + k_size, np.float32)
    for r in range(t):
        src, c, s = qkv[r], cos[r], sin[r]
        c_lo, c_hi, s_lo, s_hi = c[:half], c[half:rot], s[:half], s[half:rot]
        qk = src
        if qk_norm != QK_NONE:
            load(xs, src[:q_size + k_size])
            if qk_norm == QK_FULL:
                put_normed(normed[:q_size], xs[:q_size], inverse_rms(xs[:q_size], eps),
                           q_weight, weigh_in_fp32)
                put_normed(normed[q_size:], xs[q_size:], inverse_rms(xs[q_size:], eps),
                           k_weight, weigh_in_fp32)
            else:
                for hd in range(heads + kv_heads):
                    part = xs[hd * dim:(hd + 1) * dim]
                    put_normed(normed[hd * dim:(hd + 1) * dim], part, inverse_rms(part, eps),
                               q_weight if hd < heads else k_weight, weigh_in_fp32)
            qk = normed
        for hd in range(heads + kv_heads):
            dst = q_out[r, hd] if hd < heads else k_out[r, hd - heads]
            x = qk[hd * dim:(hd + 1) * dim]
            lo, hi, out_lo, out_hi = x[:half], x[half:rot], dst[:half], dst[half:rot]
            for d in range(half):
                a = rounded_like(x, value(lo, d) * value(c_lo, d))
                b = rounded_like(x, value(hi, d) * value(s_lo, d))
                put(out_lo, d, a - b)
                a = rounded_like(x, value(hi, d) * value(c_hi, d))
                b = rounded_like(x, value(lo, d) * value(s_hi, d))
                put(out_hi, d, a + b)
            dst[rot:] = x[rot:]
        slot = slots[r]
        v0 = q_size + k_size
        for hd in range(kv_heads):
            k_cache[hd, slot, :] = k_out[r, hd]
            v_cache[hd, slot, :] = src[v0 + hd * dim:v0 + (hd + 1) * dim]


@numba.njit(inline="always", fastmath=_FAST)
def silu(x: Any) -> Any:
    """``x / (1 + e**-x)`` in fp32, through the vectorisable exp above (e**-|x| never
    overflows; for x < 0, ``x / (1 + 1/e) = x e / (e + 1)``)."""
    e = exp_nonpositive(-abs(x))
    return (x * e if x < 0 else x) / (np.float32(1.0) + e)


_GELU_BETA = np.float32(0.7978845608028654)  # sqrt(2 / pi), as torch's tanh approximation
_GELU_KAPPA = np.float32(0.044715)
_SQRT_HALF = np.float32(0.7071067811865476)


@numba.njit(inline="always", fastmath=_FAST)
def gelu_tanh(x: Any) -> Any:
    """torch's tanh approximation ``x/2 (1 + tanh(u))``, ``u = sqrt(2/pi) (x + 0.044715
    x**3)``, as ``x sigmoid(2u)`` (the same function) through the vectorisable exp: a
    scalar `np.tanh` kept the loop from vectorising, and 16 SmolLM2-shaped decodes of a
    GELU family ran slower than torch's ops. Within a few ulps of the operands of torch's
    form, whose ``1 + tanh(u)`` cancels for large negative x."""
    u = _GELU_BETA * (x + _GELU_KAPPA * (x * x * x))
    e = exp_nonpositive(np.float32(-2.0) * abs(u))
    return (x * e if u < 0 else x) / (np.float32(1.0) + e)


@numba.njit(inline="always", fastmath=_FAST)
def gelu(x: Any) -> Any:
    """The exact GELU, ``x/2 (1 + erf(x / sqrt 2))``, in fp32 in torch's form."""
    return np.float32(0.5) * x * (np.float32(1.0) + math.erf(x * _SQRT_HALF))


# numpy's error model: Python's ZeroDivisionError check on every division stops LLVM from
# vectorising the loop (SiLU at 2.3 against 0.14 ns an element)
@numba.njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
def gated(gate_up: Any, kind: int, out: Any) -> None:
    """``out = act(gate) * up`` over the fused gate|up rows ([T, 2I] into [T, I]), each
    op rounded to the rows' dtype as torch's are; `kind` indexes
    `cpu_layer.GATED_ACTIVATIONS`."""
    t, inter = out.shape
    for r in range(t):
        g, o = gate_up[r], out[r]
        # a loop per kind: the branch-free SiLU and GELU-tanh vectorise
        if kind == 0:
            for j in range(inter):
                a = rounded_like(g, silu(value(g, j)))
                put(o, j, a * value(g, inter + j))
        elif kind == 1:
            for j in range(inter):
                a = rounded_like(g, gelu_tanh(value(g, j)))
                put(o, j, a * value(g, inter + j))
        else:
            for j in range(inter):
                a = rounded_like(g, gelu(value(g, j)))
                put(o, j, a * value(g, inter + j))


@numba.njit(cache=True, nogil=True, parallel=True)
def decode_attention_shares(q: Any, k_cache: Any, v_cache: Any, out: Any, rows: Any,
                            tables: Any, lens: Any, block_size: int, scale: Any, window: int,
                            softcap: Any, cuts: Any) -> None:
    """`decode_attention` over each share ``cuts[i]:cuts[i + 1]`` of a step's decodes, the
    shares on numba's threads."""
    for i in numba.prange(cuts.shape[0] - 1):
        decode_attention(q, k_cache, v_cache, out, rows, tables, lens, block_size, scale,
                         window, softcap, cuts[i], cuts[i + 1])


# -- a large step's elementwise ops in row shares on numba's threads -----------------------

@numba.njit(cache=True, nogil=True, parallel=True)
def residual_norm_shares(h: Any, delta: Any, add: bool, multiplier: Any, delta_weight: Any,
                         weight: Any, mode: int, eps: Any, weigh_in_fp32: bool, out: Any,
                         parts: int) -> None:
    """`residual_norm` over `parts` shares of the rows (each row's work is its own)."""
    t = h.shape[0]
    for share in numba.prange(parts):
        lo, hi = share * t // parts, (share + 1) * t // parts
        residual_norm(h[lo:hi], delta[lo:hi], add, multiplier, delta_weight, weight, mode,
                      eps, weigh_in_fp32, out[lo:hi])


@numba.njit(cache=True, nogil=True, parallel=True)
def rope_cache_shares(qkv: Any, cos: Any, sin: Any, heads: int, kv_heads: int, q_out: Any,
                      k_out: Any, k_cache: Any, v_cache: Any, slots: Any, qk_norm: int,
                      q_weight: Any, k_weight: Any, eps: Any, weigh_in_fp32: bool,
                      parts: int) -> None:
    """`rope_cache` over `parts` shares of the rows (a step's rows write distinct slots)."""
    t = qkv.shape[0]
    for share in numba.prange(parts):
        lo, hi = share * t // parts, (share + 1) * t // parts
        rope_cache(qkv[lo:hi], cos[lo:hi], sin[lo:hi], heads, kv_heads, q_out[lo:hi],
                   k_out[lo:hi], k_cache, v_cache, slots[lo:hi], qk_norm, q_weight, k_weight,
                   eps, weigh_in_fp32)


@numba.njit(cache=True, nogil=True, parallel=True)
def gated_shares(gate_up: Any, kind: int, out: Any, parts: int) -> None:
    """`gated` over `parts` shares of the rows."""
    t = out.shape[0]
    for share in numba.prange(parts):
        lo, hi = share * t // parts, (share + 1) * t // parts
        gated(gate_up[lo:hi], kind, out[lo:hi])


# -- a few-row decode step's layers in one call (`cpu_layer.layer_stack_rows`) --------------

@numba.njit(inline="always")
def _project(x: Any, weights: Any, scales: Any, biases: Any, spans: Any, layer: int,
             which: int, y: Any, parts: int, lora: Any, lora_modules: Any) -> None:
    """Projection `which` (qkv, o, gate_up, down) of `layer`: its weight, int8 scale and
    bias are ``[start, end)`` spans of the flat arrays (an empty span: none). Then the
    LoRA deltas of the step's adapters on it, as `AdapterPool.apply_direct` adds them:
    `lora_modules[which]` has a (module, column offset, in, out) row per module the
    projection packs (module -1: none), `lora` the pool, its tables and the step's runs."""
    s = spans[layer, which]
    linear_rows_shares(x, weights[s[0]:s[1]], scales[s[2]:s[3]], biases[s[4]:s[5]], y, parts)
    pool, tables, lora_scales, n_modules, step_slots, slots, starts, ends, rows_max, \
        threads = lora
    if step_slots.shape[0] == 0:  # a step on the base only
        return
    for j in range(lora_modules.shape[1]):
        entry = lora_modules[which, j]
        module, col0, in_f, out_f = entry[0], entry[1], entry[2], entry[3]
        if module < 0:
            break
        row = layer * n_modules + module
        table = tables[row]
        live = False
        for slot in step_slots:
            if slot >= 0 and table[2, slot] > 0:
                live = True
        if not live:
            continue
        if threads > 1:
            runs_shares(x, y, pool, col0, in_f, out_f, table, lora_scales[row], slots, starts,
                        ends, rows_max, threads)
        else:
            runs(x, y, pool, col0, in_f, out_f, table, lora_scales[row], slots, starts, ends,
                 rows_max)


@numba.njit(cache=True, nogil=True)
def layer_stack_rows(h: Any, x: Any, q: Any, k: Any, attn: Any, attn_flat: Any, act: Any,
                     qkv: Any, delta: Any, gate_up: Any,
                     weights: Any, scales: Any, biases: Any, spans: Any,
                     attn_in: Any, attn_in_mode: int, attn_out: Any, mlp_in: Any,
                     mlp_in_mode: int, mlp_out: Any, q_norm: Any, k_norm: Any, empty: Any,
                     cos: Any, sin: Any, rope_of: Any, no_rope: Any, k_cache: Any,
                     v_cache: Any, slots: Any, heads: int, kv_heads: int, qk_norm: int,
                     eps: Any, weigh_in_fp32: bool, multiplier: Any, kind: int, rows: Any,
                     tables: Any, lens: Any, block_size: int, scale: Any, windows: Any,
                     softcap: Any, cuts: Any, parts: int, lora: Any,
                     lora_modules: Any) -> None:
    """Every layer of a decode step of a few rows, in one call: the calls
    `DecoderModel._compiled_layer_loop` makes from Python for such a step (the same
    kernels with the same arguments, so the same bits), without a Python call and a
    dispatch per kernel (nine a layer, and one per adapted module). The norm stacks hold
    a row per layer (a width of 0 for a norm the family lacks), the caches a plane per
    layer, `cos` and `sin` a table per rope (`rope_of` the layer's; -1: none, `no_rope`'s
    zero width); `lora` and `lora_modules` as `_project` takes them."""
    last = spans.shape[0] - 1
    n = lens.shape[0]
    # values at run time, not literals: a literal argument would compile (and run) another
    # specialisation of each kernel rather than the one the loop from Python calls
    zero = n - n
    one, yes, no, no_norm = zero + 1, zero == 0, zero != 0, zero + NORM_NONE
    residual_norm_shares(h, h, no, multiplier, empty, attn_in[0], attn_in_mode, eps,
                         weigh_in_fp32, x, one)
    for li in range(spans.shape[0]):
        _project(x, weights, scales, biases, spans, li, 0, qkv, parts, lora, lora_modules)
        k_layer, v_layer = k_cache[li], v_cache[li]
        ri = rope_of[li]
        c, s = (no_rope, no_rope) if ri < 0 else (cos[ri], sin[ri])
        rope_cache_shares(qkv, c, s, heads, kv_heads, q, k, k_layer, v_layer, slots,
                          qk_norm, q_norm[li], k_norm[li], eps, weigh_in_fp32, one)
        if n == 1:
            decode_attention(q, k_layer, v_layer, attn, rows, tables, lens, block_size, scale,
                             windows[li], softcap, zero, one)
        elif cuts.shape[0] > 2:
            decode_attention_shares(q, k_layer, v_layer, attn, rows, tables, lens, block_size,
                                    scale, windows[li], softcap, cuts)
        else:
            decode_attention(q, k_layer, v_layer, attn, rows, tables, lens, block_size, scale,
                             windows[li], softcap, zero, n)
        _project(attn_flat, weights, scales, biases, spans, li, 1, delta, parts, lora,
                 lora_modules)
        residual_norm_shares(h, delta, yes, multiplier, attn_out[li], mlp_in[li],
                             mlp_in_mode, eps, weigh_in_fp32, x, one)
        _project(x, weights, scales, biases, spans, li, 2, gate_up, parts, lora,
                 lora_modules)
        gated_shares(gate_up, kind, act, one)
        _project(act, weights, scales, biases, spans, li, 3, delta, parts, lora,
                 lora_modules)
        if li < last:
            residual_norm_shares(h, delta, yes, multiplier, mlp_out[li], attn_in[li + 1],
                                 attn_in_mode, eps, weigh_in_fp32, x, one)
        else:  # the final norm is the logits' own
            residual_norm_shares(h, delta, yes, multiplier, mlp_out[li], empty, no_norm,
                                 eps, weigh_in_fp32, x, one)
