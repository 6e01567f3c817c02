"""Multi-LoRA kernels: many adapters of different ranks applied in one batch.

Public API (what the engine calls)::

    lora_shrink(x, a_slab, ranks, indices, *, segments=None) -> h
    lora_expand(y, h, b_slab, ranks, scales, indices, *, out_offset=0, segments=None)
    lora_apply(y, x, a_slab, b_slab, ranks, scales, indices, *, out_offset=0,
               segments=None, fused=None)

Weights live in per-module slot slabs, ``a_slab[num_slots, max_rank, in]`` and
``b_slab[num_slots, out, max_rank]``; only each slot's first ``ranks[s]`` rows/columns are
read. ``indices[t]`` is token t's slot (-1: no LoRA); ``segments`` switches to SGMV.

The engine's adapter pool uses the rank-granular layout instead, ``lora_apply_pooled(y, x,
weights: PooledLora, indices, ...)``: every slot's A and B at per-slot offsets in one flat
pool, no padding to a max rank (see :mod:`loraplane_kernels.rank_pool`).
"""

from loraplane_kernels.dispatch import lora_apply, lora_apply_pooled, lora_expand, lora_shrink
from loraplane_kernels.rank_pool import PooledLora, Runs, SlotTables
from loraplane_kernels.segments import Segments

__all__ = [
    "PooledLora",
    "Runs",
    "Segments",
    "SlotTables",
    "lora_apply",
    "lora_apply_pooled",
    "lora_expand",
    "lora_shrink",
]
