"""Device slots for LoRA adapters, held in per-layer slab tensors.

One slab per (layer, projection) holds every resident adapter zero-padded to `max_rank`
(S-LoRA's unified pool, simplified), so a forward pass mixes adapters by passing a slot
index per token to the multi-LoRA kernels. Slots are keyed by content digest, never by
adapter name: a same-name reload is a different digest and gets a different key, so
nothing cached under the old version can be served for the new one.

Projections that read the same input share a slab (q|k|v, gate|up) as far as the kernels'
widest rank allows: their A matrices are stacked along the rank axis and their B matrices
placed block-diagonally, so one kernel call adds all of them into the fused base output.
On the CPU path, whose cost is per call and per distinct adapter, that is 5 calls per
layer instead of 7 at max_rank 64 (4 at max_rank <= 42); the price is multiplying the
(small) expand by zeros off the diagonal. PEFT gives every module of an
adapter the same rank and scale (rank/alpha patterns are refused), which is what makes
one scale per slot valid for the stacked slab.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from .adapter import AdapterFiles, LoraAdapter, module_shape, parse_adapter
from .config import ModelConfig
from .errors import AdapterError, AdapterNotLoadedError, AdapterPoolFullError
from .lora_ops import Segments, lora_apply


@dataclass(frozen=True)
class AdapterSlotInfo:
    """What the worker reports about a resident adapter."""

    digest: str
    slot: int
    rank: int
    target_modules: tuple[str, ...]
    pinned: bool
    active_sequences: int
    num_parameters: int


SHARED_INPUT_FAMILIES: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("o_proj",),
    ("gate_proj", "up_proj"),
    ("down_proj",),
)
"""Projections that read the same input, in the fused base output's column order."""

KERNEL_MAX_STACK_RANK = 128
"""Widest slab rank the multi-LoRA kernels accept; stacking never exceeds it."""


@dataclass(frozen=True)
class SlabGroup:
    """Projections stacked into one slab, adding into `[out_offset, out_offset + out)`."""

    name: str
    modules: tuple[str, ...]
    family: int
    """Index into the forward's fused outputs: 0 qkv, 1 o, 2 gate|up, 3 down."""
    out_offset: int
    module_offsets: tuple[int, ...]
    """Column offset of each module inside the group's output range."""


def slab_groups(cfg: ModelConfig, max_rank: int,
                max_stack_rank: int = KERNEL_MAX_STACK_RANK) -> tuple[SlabGroup, ...]:
    """Chunk each shared-input family into groups no wider than the kernels allow."""
    per_group = max(1, max_stack_rank // max_rank)
    groups = []
    for fi, family in enumerate(SHARED_INPUT_FAMILIES):
        outs = [module_shape(cfg, m)[1] for m in family]
        starts = [sum(outs[:i]) for i in range(len(family))]
        # chunk from the end so a lone leftover is the first (q) projection
        bounds = [*range(len(family), 0, -per_group), 0]
        for lo, hi in reversed(list(zip(bounds[1:], bounds[:-1], strict=True))):
            mods = family[lo:hi]
            groups.append(SlabGroup(
                name="+".join(mods),
                modules=mods,
                family=fi,
                out_offset=starts[lo],
                module_offsets=tuple(starts[i] - starts[lo] for i in range(lo, hi)),
            ))
    return tuple(groups)


@dataclass
class _Slab:
    a: torch.Tensor  # [slots, max_rank * len(modules), in]
    b: torch.Tensor  # [slots, sum(out of modules), max_rank * len(modules)]
    group: SlabGroup
    ranks: torch.Tensor  # [slots] int32; 0 = slot does not adapt this module
    scales: torch.Tensor  # [slots] float32


class AdapterPool:
    """Fixed set of adapter slots with LRU eviction of unpinned, idle adapters.

    The worker's adapter state machine drives `load` / `unload` / `pin`; the engine calls
    `acquire` / `release` per sequence so an adapter in use is never evicted under it.
    Either `num_slots` or `byte_budget` sizes the pool.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_rank: int = 64,
        num_slots: int | None = None,
        byte_budget: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.cfg = cfg
        self.max_rank = max_rank
        self.dtype = dtype
        elem = torch.empty((), dtype=dtype).element_size()
        self.groups = slab_groups(cfg, max_rank)
        per_layer = sum(
            max_rank * len(g.modules) * (module_shape(cfg, g.modules[0])[0]
                                         + sum(module_shape(cfg, m)[1] for m in g.modules))
            for g in self.groups
        )
        self.bytes_per_slot = per_layer * cfg.num_hidden_layers * elem
        if num_slots is None:
            if byte_budget is None:
                raise ValueError("give num_slots or byte_budget")
            num_slots = byte_budget // self.bytes_per_slot
        if num_slots < 1:
            raise AdapterPoolFullError(
                f"byte budget fits no slot (one slot needs {self.bytes_per_slot} bytes)"
            )
        self.num_slots = int(num_slots)
        self.slabs: list[dict[str, _Slab]] = []
        for _ in range(cfg.num_hidden_layers):
            layer: dict[str, _Slab] = {}
            for g in self.groups:
                fin = module_shape(cfg, g.modules[0])[0]
                out = sum(module_shape(cfg, m)[1] for m in g.modules)
                width = max_rank * len(g.modules)
                layer[g.name] = _Slab(
                    a=torch.zeros(self.num_slots, width, fin, dtype=dtype),
                    b=torch.zeros(self.num_slots, out, width, dtype=dtype),
                    group=g,
                    ranks=torch.zeros(self.num_slots, dtype=torch.int32),
                    scales=torch.zeros(self.num_slots, dtype=torch.float32),
                )
            self.slabs.append(layer)
        self._by_digest: OrderedDict[str, int] = OrderedDict()  # LRU order, oldest first
        self._adapters: dict[int, LoraAdapter] = {}
        self._pinned: set[str] = set()
        self._active: dict[str, int] = {}
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.evictions = 0

    @property
    def byte_budget(self) -> int:
        return self.bytes_per_slot * self.num_slots

    # -- control surface (driven by the worker's adapter state machine) --------------------

    def load(
        self, source: AdapterFiles | str | Path, digest: str | None = None, *, pin: bool = False
    ) -> AdapterSlotInfo:
        """Validate and place an adapter; idempotent for a digest already resident.

        `digest` is the registry's content digest of this adapter version; without one, the
        sha256 of the two files is used.
        """
        files = source if isinstance(source, AdapterFiles) else AdapterFiles.from_dir(source)
        key = digest or files.content_digest()
        if key in self._by_digest:
            self._by_digest.move_to_end(key)
            if pin:
                self._pinned.add(key)
            return self.info(key)
        adapter = parse_adapter(files, self.cfg, key)
        if adapter.rank > self.max_rank:
            raise AdapterError(f"adapter rank {adapter.rank} exceeds the pool's max_rank "
                               f"{self.max_rank}")
        slot = self._take_slot()
        self._write(slot, adapter)
        self._by_digest[key] = slot
        self._adapters[slot] = adapter
        if pin:
            self._pinned.add(key)
        return self.info(key)

    def unload(self, digest: str) -> None:
        """Free a slot and zero its weights (no stale adapter stays in device memory).

        The engine aborts or drains sequences using it first; unloading an adapter that
        sequences still hold is an error.
        """
        if digest not in self._by_digest:
            raise AdapterNotLoadedError(f"adapter {digest} is not loaded")
        if self._active.get(digest):
            raise AdapterError(f"adapter {digest} is used by {self._active[digest]} sequences")
        slot = self._by_digest.pop(digest)
        self._pinned.discard(digest)
        self._clear(slot)
        del self._adapters[slot]
        self._free.append(slot)

    def pin(self, digest: str, pinned: bool = True) -> None:
        """Pinned adapters are never evicted (high-SLA tenants' adapters stay resident)."""
        if digest not in self._by_digest:
            raise AdapterNotLoadedError(f"adapter {digest} is not loaded")
        if pinned:
            self._pinned.add(digest)
        else:
            self._pinned.discard(digest)

    def is_loaded(self, digest: str) -> bool:
        return digest in self._by_digest

    def info(self, digest: str) -> AdapterSlotInfo:
        slot = self._by_digest[digest]
        a = self._adapters[slot]
        return AdapterSlotInfo(
            digest=digest,
            slot=slot,
            rank=a.rank,
            target_modules=a.target_modules,
            pinned=digest in self._pinned,
            active_sequences=self._active.get(digest, 0),
            num_parameters=a.num_parameters,
        )

    def list(self) -> list[AdapterSlotInfo]:
        return [self.info(d) for d in self._by_digest]

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def padding_fraction(self) -> float:
        """Share of the resident slabs' rank rows that are zero padding.

        Counted over the (layer, module) pairs each resident adapter adapts: 0.0 when every
        adapter has rank `max_rank`, approaching 1.0 for tiny ranks in a wide pool.
        """
        used = padded = 0
        for adapter in self._adapters.values():
            for key in adapter.weights:
                fin, fout = module_shape(self.cfg, key[1])
                used += adapter.rank * (fin + fout)
                padded += self.max_rank * (fin + fout)
        return 0.0 if padded == 0 else 1.0 - used / padded

    # -- engine side ------------------------------------------------------------------------

    def acquire(self, digest: str) -> int:
        """A sequence starts using the adapter: returns its slot and blocks eviction."""
        if digest not in self._by_digest:
            raise AdapterNotLoadedError(f"adapter {digest} is not loaded")
        self._by_digest.move_to_end(digest)
        self._active[digest] = self._active.get(digest, 0) + 1
        return self._by_digest[digest]

    def release(self, digest: str) -> None:
        n = self._active.get(digest, 0) - 1
        if n <= 0:
            self._active.pop(digest, None)
        else:
            self._active[digest] = n

    def apply(
        self,
        layer: int,
        family: int,
        y: torch.Tensor,
        x: torch.Tensor,
        indices: torch.Tensor,
        segments: Segments | None,
        slots: tuple[int, ...],
    ) -> None:
        """Add every token's adapter deltas for one shared-input family into its fused `y`.

        `family` indexes SHARED_INPUT_FAMILIES; `slots` are the distinct slots in the
        batch, and a group's kernel call is skipped when none of them adapts it here.
        """
        for s in self.slabs[layer].values():
            if s.group.family != family:
                continue
            if not any(int(s.ranks[i]) > 0 for i in slots if i >= 0):
                continue
            lora_apply(y, x, s.a, s.b, s.ranks, s.scales, indices,
                       out_offset=s.group.out_offset, segments=segments)

    # -- internals --------------------------------------------------------------------------

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        for digest in self._by_digest:  # oldest first
            if digest not in self._pinned and not self._active.get(digest):
                slot = self._by_digest.pop(digest)
                self._clear(slot)
                del self._adapters[slot]
                self.evictions += 1
                return slot
        raise AdapterPoolFullError(
            f"all {self.num_slots} adapter slots are pinned or in use"
        )

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        """Stack the adapted projections of each group: A rows and B's diagonal blocks."""
        for li, layer in enumerate(self.slabs):
            for s in layer.values():
                row = 0
                for module, off in zip(s.group.modules, s.group.module_offsets, strict=True):
                    w = adapter.weights.get((li, module))
                    if w is None:
                        continue
                    r = w.rank
                    s.a[slot, row : row + r].copy_(w.a)
                    s.b[slot, off : off + w.b.shape[0], row : row + r].copy_(w.b)
                    s.scales[slot] = w.scale
                    row += r
                s.ranks[slot] = row

    def _clear(self, slot: int) -> None:
        for layer in self.slabs:
            for s in layer.values():
                s.a[slot].zero_()
                s.b[slot].zero_()
                s.ranks[slot] = 0
                s.scales[slot] = 0.0
