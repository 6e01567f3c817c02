"""Device slots for LoRA adapters, held in per-layer slab tensors.

One slab per (layer, projection) holds every resident adapter zero-padded to `max_rank`
(S-LoRA's unified pool, simplified), so a forward pass mixes adapters by passing a slot
index per token to the multi-LoRA kernels. Slots are keyed by content digest, never by
adapter name: a same-name reload is a different digest and gets a different key, so
nothing cached under the old version can be served for the new one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from services.contracts.peft import TARGET_MODULES

from .adapter import AdapterDigest, AdapterFiles, LoraAdapter, module_shape, parse_adapter
from .config import ModelConfig
from .errors import AdapterError, AdapterNotLoadedError, AdapterPoolFullError
from .lora_ops import Segments, lora_apply


@dataclass(frozen=True)
class AdapterSlotInfo:
    """What the worker reports about a resident adapter."""

    digest: AdapterDigest
    slot: int
    rank: int
    target_modules: tuple[str, ...]
    pinned: bool
    active_sequences: int
    num_parameters: int


@dataclass
class _Slab:
    a: torch.Tensor  # [slots, max_rank, in]
    b: torch.Tensor  # [slots, out, max_rank]
    ranks: torch.Tensor  # [slots] int32; 0 = slot does not adapt this module
    scales: torch.Tensor  # [slots] float32
    host_ranks: list[int]  # host copy of `ranks`: no device sync to decide skipping a call


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
        device: str | torch.device = "cpu",
    ) -> None:
        self.cfg = cfg
        self.max_rank = max_rank
        self.dtype = dtype
        elem = torch.empty((), dtype=dtype).element_size()
        per_layer = sum(max_rank * sum(module_shape(cfg, m)) for m in TARGET_MODULES)
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
            for m in TARGET_MODULES:
                fin, fout = module_shape(cfg, m)
                layer[m] = _Slab(
                    a=torch.zeros(self.num_slots, max_rank, fin, dtype=dtype, device=device),
                    b=torch.zeros(self.num_slots, fout, max_rank, dtype=dtype, device=device),
                    ranks=torch.zeros(self.num_slots, dtype=torch.int32, device=device),
                    scales=torch.zeros(self.num_slots, dtype=torch.float32, device=device),
                    host_ranks=[0] * self.num_slots,
                )
            self.slabs.append(layer)
        self._by_digest: OrderedDict[AdapterDigest, int] = OrderedDict()  # LRU order, oldest first
        self._adapters: dict[int, LoraAdapter] = {}
        self._pinned: set[AdapterDigest] = set()
        self._active: dict[AdapterDigest, int] = {}
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.evictions = 0

    @property
    def byte_budget(self) -> int:
        return self.bytes_per_slot * self.num_slots

    # -- control surface (driven by the worker's adapter state machine) --------------------

    def load(
        self, source: AdapterFiles | str | Path, digest: AdapterDigest | None = None, *,
        pin: bool = False
    ) -> AdapterSlotInfo:
        """Validate and place an adapter; idempotent for a digest already resident.

        `digest` is what the registry published for this version: the files are checked
        against it (`AdapterDigestMismatch`) before anything is parsed. Without one, the
        files' own digests are the key.
        """
        files = source if isinstance(source, AdapterFiles) else AdapterFiles.from_dir(source)
        if digest is not None:
            files.verify(digest)
        key = digest or files.digest()
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

    def unload(self, digest: AdapterDigest) -> None:
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

    def pin(self, digest: AdapterDigest, pinned: bool = True) -> None:
        """Pinned adapters are never evicted (high-SLA tenants' adapters stay resident)."""
        if digest not in self._by_digest:
            raise AdapterNotLoadedError(f"adapter {digest} is not loaded")
        if pinned:
            self._pinned.add(digest)
        else:
            self._pinned.discard(digest)

    def is_loaded(self, digest: AdapterDigest) -> bool:
        return digest in self._by_digest

    def info(self, digest: AdapterDigest) -> AdapterSlotInfo:
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

    def acquire(self, digest: AdapterDigest) -> int:
        """A sequence starts using the adapter: returns its slot and blocks eviction."""
        if digest not in self._by_digest:
            raise AdapterNotLoadedError(f"adapter {digest} is not loaded")
        self._by_digest.move_to_end(digest)
        self._active[digest] = self._active.get(digest, 0) + 1
        return self._by_digest[digest]

    def release(self, digest: AdapterDigest) -> None:
        n = self._active.get(digest, 0) - 1
        if n <= 0:
            self._active.pop(digest, None)
        else:
            self._active[digest] = n

    def apply(
        self,
        layer: int,
        module: str,
        y: torch.Tensor,
        x: torch.Tensor,
        indices: torch.Tensor,
        segments: Segments | None,
        out_offset: int = 0,
    ) -> None:
        """Add every token's adapter delta for one projection into `y` in place."""
        s = self.slabs[layer][module]
        lora_apply(y, x, s.a, s.b, s.ranks, s.scales, indices, out_offset=out_offset,
                   segments=segments)

    def layer_has_lora(self, layer: int, module: str, slots: list[int]) -> bool:
        """Skip the kernel call when no adapter in the batch adapts this projection."""
        ranks = self.slabs[layer][module].host_ranks
        return any(ranks[s] > 0 for s in slots if s >= 0)

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
        for (layer, module), w in adapter.weights.items():
            s = self.slabs[layer][module]
            r = w.rank
            s.a[slot, :r].copy_(w.a)
            s.b[slot, :, :r].copy_(w.b)
            s.ranks[slot] = r
            s.host_ranks[slot] = r
            s.scales[slot] = w.scale

    def _clear(self, slot: int) -> None:
        for layer in self.slabs:
            for s in layer.values():
                s.a[slot].zero_()
                s.b[slot].zero_()
                s.ranks[slot] = 0
                s.host_ranks[slot] = 0
                s.scales[slot] = 0.0
