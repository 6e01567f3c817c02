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

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .threads import one_thread

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

    @classmethod
    def zeros(cls, rows: int, num_slots: int, device: torch.device) -> SlotTables:
        """Rows are padded to a multiple of 4 slots, so every row starts 16-byte aligned
        as a table of its own would (the kernels' pointer arguments)."""
        width = -(-num_slots // 4) * 4

        def table(dtype: torch.dtype) -> Tensor:
            return torch.zeros(rows, width, dtype=dtype, device=device)

        return cls(table(torch.int64), table(torch.int64), table(torch.int32),
                   table(torch.float32))

    def write(self, slot: int, rows: list[int], a_offsets: list[int], b_offsets: list[int],
              ranks: list[int], scales: list[float]) -> None:
        """Point `slot` of each row at its weights (the rows' `PagedLora.point` is the host
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
class PagedLora:
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
    a_views: list[Tensor | None] = field(init=False)
    """``A`` [rank, in] of each slot (a view into the pool), None where rank is 0."""
    bt_views: list[Tensor | None] = field(init=False)
    """``B.T`` [rank, out] of each slot, None where rank is 0."""

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
        self.a_views[slot] = self.pool[a_offset:a_offset + rank * k].view(rank, k)
        self.bt_views[slot] = self.pool[b_offset:b_offset + rank * n].view(rank, n)

    def clear(self, slot: int) -> None:
        self.ranks[slot] = 0
        self.scales[slot] = 0.0
        self.unpoint(slot)

    def unpoint(self, slot: int) -> None:
        """The host side of `clear` only (`SlotTables.clear` does the device side)."""
        self.host_ranks[slot] = 0
        self.host_scales[slot] = 0.0
        self.a_views[slot] = None
        self.bt_views[slot] = None

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


def apply_runs(y: Tensor, x: Tensor, w: PagedLora, runs: Runs, out_offset: int = 0) -> None:
    """The torch path: per run of one slot, ``y += scale * (x @ A.T) @ Bt`` in place.

    Two BLAS calls per run: the shrink into a small ``[t, rank]`` tensor and an ``addmm_``
    that scales and accumulates into the output slice, so no temporary of the output's
    size is made. Computed in the activations' dtype (float32 accumulation inside BLAS).
    Small runs go first, in one thread (`SMALL_RUN_ROWS`); runs cover disjoint rows, so
    the order does not change the result.
    """
    live = [r for r in runs if r[0] >= 0 and r[2] > r[1] and w.a_views[r[0]] is not None]
    small = [r for r in live if r[2] - r[1] < SMALL_RUN_ROWS]
    if small:
        with one_thread():
            _apply(y, x, w, small, out_offset)
    if len(small) < len(live):
        _apply(y, x, w, [r for r in live if r[2] - r[1] >= SMALL_RUN_ROWS], out_offset)


def _apply(y: Tensor, x: Tensor, w: PagedLora, runs: list[tuple[int, int, int]],
           out_offset: int) -> None:
    out = y[:, out_offset:out_offset + w.out_features]
    for slot, start, end in runs:
        h = torch.mm(x[start:end], w.a_views[slot].T)  # type: ignore[union-attr]
        out[start:end].addmm_(h, w.bt_views[slot], alpha=w.host_scales[slot])
