"""Rank-granular LoRA weights: every slot's A and B packed in one flat pool, no padding.

Slab layouts (``a_slab[num_slots, max_rank, in]``) reserve ``max_rank`` rows for every
slot, so a pool of mixed ranks is mostly zeros and holds half as many adapters as its
bytes allow. Here each slot's ``A`` (``[rank, in]``, row-major) and ``B`` stored transposed
(``Bt = B.T``, ``[rank, out]``, row-major) start at per-slot element offsets into one 1-D
pool shared by every projection and layer (S-LoRA's unified pool), so an adapter costs
exactly its own ``rank * (in + out)`` elements and the strides never depend on the rank.
The kernels read a slot's weights at ``pool + offset``; the torch path takes views at the
same offsets, built once when the adapter is written, not per call.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from . import cpu_decode
from .threads import one_thread

warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors",
                        category=UserWarning)
"""torch warns (once) that nested tensors are a prototype API; the two ops used here,
a view from a buffer and `bmm`, are tested against per-run products (tests/kernels)."""

Runs = tuple[tuple[int, int, int], ...]
"""Host-side ``(slot, start, end)`` token runs, one per contiguous group of a slot."""


@dataclass
class SlotTables:
    """The device tables of many projections, one row each, in one tensor per table.

    An adapter spans every layer and projection: pointing a slot at it through per-table
    scalar writes cost four tensor writes per projection (616 for 22 layers of 7, about
    4 ms on CPU and as many host-to-device copies on CUDA). With the rows of one tensor,
    `write` is one indexed write per table.
    """

    a_offsets: Tensor
    """[rows, slots (padded)] int64"""
    b_offsets: Tensor
    ranks: Tensor
    """[rows, slots (padded)] int32"""
    scales: Tensor
    """[rows, slots (padded)] float32"""
    host: np.ndarray
    """[rows, 3, slots] int64: each row's `PooledLora.host_table` is a view of its row, so
    one array carries every projection's into compiled code (the one-call layer stack)."""
    host_scales: np.ndarray
    """[rows, slots] float32: the rows' `PooledLora.host_scale_table`."""

    @classmethod
    def zeros(cls, rows: int, num_slots: int, device: torch.device) -> SlotTables:
        """Rows are padded to a multiple of 4 slots, so every row starts 16-byte aligned
        as a table of its own would (the kernels' pointer arguments)."""
        width = -(-num_slots // 4) * 4

        def table(dtype: torch.dtype) -> Tensor:
            return torch.zeros(rows, width, dtype=dtype, device=device)

        return cls(table(torch.int64), table(torch.int64), table(torch.int32),
                   table(torch.float32), np.zeros((rows, 3, num_slots), dtype=np.int64),
                   np.zeros((rows, num_slots), dtype=np.float32))

    def write(self, slot: int, rows: list[int], a_offsets: list[int], b_offsets: list[int],
              ranks: list[int], scales: list[float]) -> None:
        """Point `slot` of each row at its weights (the rows' `PooledLora.point` is the host
        side of the same change)."""
        dev = self.ranks.device
        index = torch.tensor(rows, dtype=torch.int64, device=dev)
        for table, values in ((self.a_offsets, a_offsets), (self.b_offsets, b_offsets),
                              (self.ranks, ranks), (self.scales, scales)):
            table[index, slot] = torch.tensor(values, dtype=table.dtype, device=dev)

    def clear(self, slot: int) -> None:
        self.ranks[:, slot] = 0
        self.scales[:, slot] = 0.0


@dataclass
class PooledLora:
    """One projection's LoRA weights for every slot, as offsets into a shared pool.

    ``ranks[s] == 0`` means slot s does not adapt this projection. The device tables
    (``a_offsets``, ``b_offsets``, ``ranks``, ``scales``) feed the Triton kernels; the host
    lists mirror them so the torch path and the dispatch decisions never read the device.
    Given `tables`, the device tables are row `row` of those (see `SlotTables`).
    """

    pool: Tensor
    in_features: int
    out_features: int
    num_slots: int
    tables: SlotTables | None = None
    row: int = 0
    a_offsets: Tensor = field(init=False)
    b_offsets: Tensor = field(init=False)
    ranks: Tensor = field(init=False)
    scales: Tensor = field(init=False)
    host_ranks: list[int] = field(init=False)
    host_scales: list[float] = field(init=False)
    host_table: np.ndarray = field(init=False)
    """[3, slots] int64: each slot's A offset, Bt offset and rank (0: not adapted). The
    compiled pass reads a slot's entry inside the kernel, so one step-wide array of runs
    serves every projection and nothing is rebuilt per projection when a slot moves."""
    host_scale_table: np.ndarray = field(init=False)
    """[slots] float32 scales (torch's opmath for a scalar), beside `host_table`."""
    a_views: list[Tensor | None] = field(init=False)
    """``A`` [rank, in] of each slot (a view into the pool), None where rank is 0."""
    bt_views: list[Tensor | None] = field(init=False)
    """``B.T`` [rank, out] of each slot, None where rank is 0."""
    _grouped: tuple[tuple[int, ...], Tensor, Tensor] | None = field(init=False, default=None)
    """The last `grouped_views` answer (a decode step's slots recur layer after layer and
    step after step); dropped whenever a slot is re-pointed."""
    _pool_array: tuple[Tensor, np.ndarray] | None = field(init=False, default=None)
    """`pool` as the numpy array the compiled pass takes, made once (see `host_pool`)."""

    def __post_init__(self) -> None:
        n = self.num_slots
        tables = self.tables or SlotTables.zeros(1, n, self.pool.device)
        row = self.row if self.tables is not None else 0
        self.a_offsets = tables.a_offsets[row, :n]
        self.b_offsets = tables.b_offsets[row, :n]
        self.ranks = tables.ranks[row, :n]
        self.scales = tables.scales[row, :n]
        self.host_ranks = [0] * n
        self.host_scales = [0.0] * n
        self.host_table = tables.host[row]
        self.host_scale_table = tables.host_scales[row]
        self.a_views = [None] * n
        self.bt_views = [None] * n

    @property
    def max_rank(self) -> int:
        """The largest rank placed (sizes register tiles; no memory is reserved for it)."""
        return max(self.host_ranks, default=0)

    def place(self, slot: int, a_offset: int, b_offset: int, rank: int, scale: float) -> None:
        """Point slot ``slot`` at weights already written into the pool."""
        self.a_offsets[slot] = a_offset
        self.b_offsets[slot] = b_offset
        self.ranks[slot] = rank
        self.scales[slot] = scale
        self.point(slot, a_offset, b_offset, rank, scale)

    def point(self, slot: int, a_offset: int, b_offset: int, rank: int, scale: float) -> None:
        """The host side of `place` only: the caller writes the device tables (in one go
        for many projections, `SlotTables.write`)."""
        k, n = self.in_features, self.out_features
        self.host_ranks[slot] = rank
        self.host_scales[slot] = scale
        self.host_table[:, slot] = (a_offset, b_offset, rank)
        self.host_scale_table[slot] = scale
        self.a_views[slot] = self.pool[a_offset:a_offset + rank * k].view(rank, k)
        self.bt_views[slot] = self.pool[b_offset:b_offset + rank * n].view(rank, n)
        self._grouped = None

    def clear(self, slot: int) -> None:
        self.ranks[slot] = 0
        self.scales[slot] = 0.0
        self.unpoint(slot)

    def unpoint(self, slot: int) -> None:
        """The host side of `clear` only (`SlotTables.clear` does the device side)."""
        self.host_ranks[slot] = 0
        self.host_scales[slot] = 0.0
        self.host_table[2, slot] = 0
        self.host_scale_table[slot] = 0.0
        self.a_views[slot] = None
        self.bt_views[slot] = None
        self._grouped = None

    def grouped_views(self, slots: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """``A.T`` [in, rank] and ``B.T`` [rank, out] of `slots` (in that order, repeats
        allowed) as two nested tensors over the pool: ragged ranks, no copy."""
        if self._grouped is None or self._grouped[0] != slots:
            a = [self.a_views[s] for s in slots]
            bt = [self.bt_views[s] for s in slots]
            self._grouped = (slots, ragged_view(self.pool, a).transpose(1, 2),  # type: ignore[arg-type]
                             ragged_view(self.pool, bt))  # type: ignore[arg-type]
        return self._grouped[1], self._grouped[2]

    def host_pool(self) -> np.ndarray:
        """`pool` as a numpy array over its memory (bf16 as its bits), made on first use
        and again only if `pool` is replaced: 210 projections a SmolLM2 step each wrapped
        it anew."""
        if self._pool_array is None or self._pool_array[0] is not self.pool:
            self._pool_array = (self.pool, cpu_decode.as_array(self.pool))
        return self._pool_array[1]

    def adapts(self, slot: int) -> bool:
        return slot >= 0 and self.host_ranks[slot] > 0


def runs_of(indices: Tensor) -> Runs:
    """``(slot, start, end)`` runs of equal consecutive slot indices (host tensor)."""
    vals = indices.tolist()
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(vals) + 1):
        if i == len(vals) or vals[i] != vals[start]:
            runs.append((vals[start], start, i))
            start = i
    return tuple(runs)


SMALL_RUN_ROWS = 16
"""Runs of fewer rows (decodes: one or two sequences per adapter) are computed in one
thread. Measured on 2 cores with OMP_WAIT_POLICY=PASSIVE, a shrink + expand over 2 rows
took 57-114 us on two threads and 19-71 us on one (wall), and 32 such runs (SmolLM2's
MLP, 32 adapters) 3.8 ms against 2.1 ms of CPU time; from about 64 rows on, the second
thread pays for itself."""


def ragged_view(buffer: Tensor, parts: list[Tensor]) -> Tensor:
    """A nested tensor whose components are `parts`, row-major 2-D views into `buffer`'s
    storage (no copy): what lets one `torch.bmm` run many matmuls of ragged shapes."""
    sizes = torch.tensor([p.shape for p in parts], dtype=torch.int64)
    strides = torch.tensor([p.stride() for p in parts], dtype=torch.int64)
    offsets = torch.tensor([p.storage_offset() for p in parts], dtype=torch.int64)
    return torch._nested_view_from_buffer(buffer.view(-1), sizes, strides, offsets)


def apply_runs(y: Tensor, x: Tensor, w: PooledLora, runs: Runs, out_offset: int = 0) -> None:
    """The torch path: per run of one slot, ``y += scale * ((x @ A.T) @ Bt)`` in place.

    Small runs (decodes: one or two rows per adapter) go first. In bf16 and fp32 on the
    CPU they take one compiled call per projection (`loraplane_kernels.cpu_decode`), free of
    the per-call costs of BLAS and oneDNN; the step's runs are split once for all its projections
    (`step_runs`). Otherwise (fp16, or no numba) they run in one thread
    (`SMALL_RUN_ROWS`) and all in two nested-tensor `bmm` calls (`_apply_grouped`): one
    Python-level call per projection instead of two per adapter, which on a step of 32
    adapters was most of the LoRA time. Large runs (prefill chunks) keep one BLAS call pair
    each: ``torch.mm`` for the shrink and an ``addmm_`` that scales and accumulates into
    the output slice. Runs cover disjoint rows, so the order does not change the result.
    """
    if _host_pass(y, x, w):
        split = step_runs(runs)
        if split.small is not None:
            cpu_decode.apply_small_runs(y, x, w.host_pool(), out_offset, w.in_features,
                                  w.out_features, w.host_table, w.host_scale_table, split.small)
        large = [r for r in split.large if w.a_views[r[0]] is not None]
        if large:
            _apply(y, x, w, large, out_offset)
        return
    live = [r for r in runs if r[0] >= 0 and r[2] > r[1] and w.a_views[r[0]] is not None]
    small = [r for r in live if r[2] - r[1] < SMALL_RUN_ROWS]
    if small:
        with one_thread():
            if len(small) >= GROUPED_MIN_RUNS and NESTED_VIEWS and x.is_contiguous():
                _apply_grouped(y, x, w, small, out_offset, runs)
            else:
                _apply(y, x, w, small, out_offset, small=True)
    if len(small) < len(live):
        _apply(y, x, w, [r for r in live if r[2] - r[1] >= SMALL_RUN_ROWS], out_offset)


@dataclass(frozen=True)
class StepRuns:
    """A step's adapted runs split by size, once for every projection of the step."""

    small: cpu_decode.SmallRuns | None
    """Runs of fewer than `SMALL_RUN_ROWS` rows, for the compiled pass (None: there are
    none); each projection's call skips the slots it does not adapt."""
    large: Runs
    """The other runs; each projection keeps those of slots it adapts."""


_STEP_RUNS: list[tuple[Runs, StepRuns]] = []
"""The last `step_runs` answer. Every projection of a step gets the step's one `runs`
tuple, so the check is by identity, not by comparing 64 runs 210 times; the entry keeps
that tuple alive, so a later tuple cannot be mistaken for it."""


def step_runs(runs: Runs) -> StepRuns:
    """`runs` (a step's ``(slot, start, end)`` groups) split for the compiled pass."""
    if _STEP_RUNS and _STEP_RUNS[0][0] is runs:
        return _STEP_RUNS[0][1]
    adapted = [r for r in runs if r[0] >= 0 and r[2] > r[1]]
    small = [r for r in adapted if r[2] - r[1] < SMALL_RUN_ROWS]
    split = StepRuns(cpu_decode.SmallRuns(small) if small else None,
                     tuple(r for r in adapted if r[2] - r[1] >= SMALL_RUN_ROWS))
    _STEP_RUNS[:] = [(runs, split)]
    return split


HOST_PASS = cpu_decode.AVAILABLE
"""bf16 and fp32 decodes on the CPU take the compiled pass (`loraplane_kernels.cpu_decode`);
tests switch it off to pin it to the torch path."""


def _host_pass(y: Tensor, x: Tensor, w: PooledLora) -> bool:
    return (host_pass_dtype(w, x.dtype, x.device) and y.dtype == x.dtype
            and x.stride(-1) == 1 and y.stride(-1) == 1)


def host_pass_dtype(w: PooledLora, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether small runs of activations of `dtype` on `device` take the compiled pass
    (`apply_runs`), strides aside: what a caller that hands the pass contiguous arrays
    itself checks (`AdapterPool.direct_runs`)."""
    return (HOST_PASS and dtype == w.pool.dtype and dtype in cpu_decode.DTYPES
            and device.type == "cpu")


@contextlib.contextmanager
def small_shrink_gemms(dtype: torch.dtype) -> Iterator[None]:
    """Half-precision GEMMs of a few rows into a few columns (the decode shrinks) without
    oneDNN.

    On CPU, torch sends bf16/fp16 matmuls to oneDNN, whose calls cost about 15 us each
    before any work: a [2, 576] x [576, 16] bf16 shrink took 19 us with it and 4 without,
    and the nested shrink of 16 adapters at SmolLM2's shapes 270-400 us against 80-260.
    The expands are left on oneDNN: wide outputs (1,536 to 2,816 columns) ran 1.3-4x slower
    on torch's own bf16 kernel. fp32 matmuls never take oneDNN here, so they are untouched.
    The switch is process-wide: another thread's half-precision matmul in the meantime
    takes torch's own kernel too, slower and possibly rounded differently in the last bit
    (the engine computes in one thread, so its own steps are not affected).
    """
    if dtype not in (torch.bfloat16, torch.float16) or not torch._C._get_mkldnn_enabled():
        yield
        return
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(True)


GROUPED_MIN_RUNS = 4
"""From this many small runs on, the nested `bmm` pair beats a loop of BLAS call pairs (its
views cost tens of microseconds to build, a call pair about 20)."""


NESTED_VIEWS = hasattr(torch, "_nested_view_from_buffer")
"""`ragged_view` rests on a private torch function; a torch without it takes the loop of
BLAS call pairs (same results, slower decodes) instead of failing."""


def _apply(y: Tensor, x: Tensor, w: PooledLora, runs: list[tuple[int, int, int]],
           out_offset: int, small: bool = False) -> None:
    out = y[:, out_offset:out_offset + w.out_features]
    for slot, start, end in runs:
        with small_shrink_gemms(x.dtype) if small else contextlib.nullcontext():
            h = torch.mm(x[start:end], w.a_views[slot].T)  # type: ignore[union-attr]
        out[start:end].addmm_(h, w.bt_views[slot], alpha=w.host_scales[slot])


def _apply_grouped(y: Tensor, x: Tensor, w: PooledLora, runs: list[tuple[int, int, int]],
                   out_offset: int, step: Runs) -> None:
    """Every run's shrink in one ragged `bmm`, every expand in another, then one scaled
    add of the packed deltas into their rows (PEFT's order: ``(x @ A.T) @ B.T * scale``)."""
    slots = tuple(r[0] for r in runs)
    a_t, bt = w.grouped_views(slots)
    routing = _routing(x, tuple(runs), step)
    with small_shrink_gemms(x.dtype):
        h = torch.bmm(routing.x, a_t)
    delta = torch.bmm(h, bt).values().view(-1, w.out_features)
    scales = [w.host_scales[s] for s in slots]
    if scales.count(scales[0]) == len(scales):
        delta.mul_(scales[0])
    else:
        delta.mul_(torch.tensor(scales, dtype=delta.dtype, device=delta.device)
                   .repeat_interleave(routing.lengths)[:, None])
    out = y[:, out_offset:out_offset + w.out_features]
    lo, hi = runs[0][1], runs[-1][2]
    if routing.rows is None:
        out[lo:hi].add_(delta)
    elif out.is_contiguous():
        out.index_add_(0, routing.rows, delta)
    elif hi - lo <= SPAN_SCRATCH_MAX * delta.shape[0]:
        # `index_add_` into a column slice of a packed output (q|k|v, gate|up) takes a
        # scatter path 3-4x slower than into a contiguous tensor (250 against 56 us for
        # 38 rows of up_proj): scatter into a zeroed scratch over the runs' row span and
        # add that; rows outside the runs add 0.0, so every sum is the same bits
        spread = torch.zeros(hi - lo, w.out_features, dtype=delta.dtype, device=delta.device)
        out[lo:hi].add_(spread.index_add_(0, routing.span_rows, delta))
    else:
        # a span mostly of other rows (a prefill chunk between decodes): the scratch would
        # zero and add all of them; rows are distinct, so accumulating puts are the same sums
        out.index_put_((routing.rows,), delta, accumulate=True)


SPAN_SCRATCH_MAX = 2
"""Gapped runs whose row span is at most this many times their rows land through a zeroed
scratch over the span; sparser ones through an accumulating `index_put_`. Measured for 40
rows into a column slice (one thread, fp32): within 64 rows, 31 us by the scratch against
38; spread over 1,024 rows of 576 columns, 113 against 16; over 4,096 rows of 1,536,
4,000 against 38 (a mixed step's prefill chunk between its decodes)."""


@dataclass(frozen=True)
class _Routing:
    """The rows of a step's small runs as a nested view of the activations."""

    x: Tensor
    lengths: Tensor
    rows: Tensor | None
    """Row index of each packed delta row; None when the runs are one contiguous block."""
    span_rows: Tensor | None = None
    """`rows` less the first run's start (rows within the runs' span)."""


_ROUTINGS: dict[tuple[int, int, tuple[int, ...], tuple[tuple[int, int, int], ...]],
                tuple[Tensor, _Routing]] = {}
"""Routings by (activation buffer address, dtype size, shape, runs). A step's projections
read a few workspace buffers (the normed hidden state, attention output, SwiGLU output)
layer after layer, so each routing is built once per step (and kept while decodes keep
the same runs), not once per projection. An entry keeps its buffer alive, so an address
seen again is the same buffer; the table is emptied whenever the step's runs change, so it
holds at most the few buffers of one step."""

_ROUTINGS_STEP: list[Runs] = [()]
"""The step runs `_ROUTINGS` belongs to."""


def _routing(x: Tensor, runs: tuple[tuple[int, int, int], ...], step: Runs) -> _Routing:
    """`runs` (a projection's live small runs) of `step` (all the step's runs)."""
    if step != _ROUTINGS_STEP[0]:
        _ROUTINGS.clear()
        _ROUTINGS_STEP[0] = step
    key = (x.data_ptr(), x.element_size(), tuple(x.shape), runs)
    hit = _ROUTINGS.get(key)
    if hit is not None:
        return hit[1]
    parts = [x[start:end] for _, start, end in runs]
    contiguous = all(a[2] == b[1] for a, b in itertools.pairwise(runs))
    rows = None if contiguous else torch.cat(
        [torch.arange(start, end, device=x.device) for _, start, end in runs])
    routing = _Routing(ragged_view(x, parts), torch.tensor(
        [end - start for _, start, end in runs], device=x.device), rows,
        None if rows is None else rows - runs[0][1])
    _ROUTINGS[key] = (x, routing)
    return routing
