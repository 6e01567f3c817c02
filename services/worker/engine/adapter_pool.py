"""Device memory for LoRA adapters: one flat pool, each adapter exactly its own size.

S-LoRA's unified pool, rank-granular: an adapter occupies one contiguous extent of a
single 1-D tensor holding, for every (layer, projection) it adapts, ``A`` [rank, in] and
``B.T`` [rank, out]. Nothing is padded to a maximum rank and nothing is reserved for
projections an adapter does not target, so a budget of mixed ranks holds as many adapters
as their real bytes allow (slabs of `max_rank` rows per slot held about half as many).
When the free space is fragmented the pool compacts (moves extents down, re-points the
offset tables) between steps; when it is short it evicts idle, unpinned adapters in LRU
order. Slots are small integer ids the kernels index per token; they are keyed by content
digest, never by adapter name, so nothing cached under an old version can serve a new one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.contracts.capacity import AdapterLimits, OverCapacity
from services.families.adapters import EMBED, LM_HEAD

from .adapter import (
    REPLACED,
    AdapterDigest,
    AdapterFiles,
    LoraAdapter,
    module_shape,
    parse_adapter,
)
from .config import ModelConfig
from .errors import AdapterError, AdapterNotLoadedError, AdapterPoolFullError
from .extent import aligned, one_thread
from .lora_ops import (
    PooledLora,
    Runs,
    Segments,
    SlotTables,
    SmallRuns,
    apply_small_runs_arrays,
    base_lora_fused,
    host_pass_dtype,
    lora_apply_pooled,
    step_runs,
)

MAX_SLOTS = 4096
"""Slot ids when only a byte budget is given: the pool's bytes, not ids, are the limit."""


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
    bytes: int = 0
    """Device bytes the adapter occupies in the pool (its real ranks, no padding)."""


@dataclass
class _Resident:
    """Where a resident adapter lives; its weights are only in the pool, never twice."""

    rank: int
    target_modules: tuple[str, ...]
    num_parameters: int
    start: int
    length: int
    layout: dict[tuple[int, str], tuple[int, int, int, float]]
    """(layer, module) -> (A offset, B.T offset relative to `start`, rank, scale)."""


class AdapterPool:
    """Resident adapters in one byte budget, LRU eviction of unpinned, idle ones.

    The worker's adapter state machine drives `load` / `unload` / `pin`; the engine calls
    `acquire` / `release` per sequence so an adapter in use is never evicted under it.
    `byte_budget` sizes the pool; without it, `num_slots` adapters of `max_rank` on every
    projection fit (what a slab pool of that many slots held), and `num_slots` also caps
    how many adapters are resident at once.
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
        self.limits = AdapterLimits(max_rank)
        """What this pool holds, checked as the registry checks it at publish."""
        self.dtype = dtype
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.modules = tuple(cfg.family.lora)
        """The family's PEFT target modules (its description), one pool row per layer each."""
        self.shapes = {m: module_shape(cfg, m) for m in (*self.modules, EMBED, LM_HEAD)}
        """(in_features, out_features) of each target module."""
        per_layer = sum(aligned(max_rank * fin) + aligned(max_rank * fout)
                        for m, (fin, fout) in self.shapes.items() if m in self.modules)
        self.bytes_per_slot = per_layer * cfg.num_hidden_layers * self.element_size
        """Bytes of one max-rank adapter on every projection: a slab pool's slot size."""
        if byte_budget is None:
            if num_slots is None:
                raise ValueError("give num_slots or byte_budget")
            byte_budget = num_slots * self.bytes_per_slot
        capacity = byte_budget // self.element_size
        smallest = aligned(1) * 2
        if capacity < smallest:
            raise AdapterPoolFullError(f"byte budget {byte_budget} fits no adapter")
        self.num_slots = int(num_slots if num_slots is not None
                             else min(MAX_SLOTS, capacity // smallest))
        if self.num_slots < 1:
            raise AdapterPoolFullError("the pool needs at least one slot")
        self.capacity = int(capacity)
        self.pool = torch.zeros(self.capacity, dtype=dtype, device=device)
        self.tables = SlotTables.zeros(cfg.num_hidden_layers * len(self.modules) + 2,
                                       self.num_slots, self.pool.device)
        self.weights: list[dict[str, PooledLora]] = [
            {m: PooledLora(self.pool, *self.shapes[m], self.num_slots, self.tables,
                          self._row(layer, m))
             for m in self.modules}
            for layer in range(cfg.num_hidden_layers)
        ]
        self.vocab_lora = {m: PooledLora(self.pool, *self.shapes[m], self.num_slots,
                                        self.tables, self._row(-1, m))
                           for m in (EMBED, LM_HEAD)}
        """LoRA on embed_tokens (A [r, vocab], B.T [r, hidden]) and lm_head, by slot."""
        self.base_vocab: dict[str, torch.Tensor] = {}
        """The served embed_tokens and lm_head (set by the engine): replacement weights
        equal to them are dropped when an adapter is parsed (`parse_adapter`'s `base`)."""
        self.replaced: dict[int, dict[str, torch.Tensor]] = {}
        """Slot -> the embed_tokens / lm_head weights its adapter replaces (pool views)."""
        self._by_digest: OrderedDict[AdapterDigest, int] = OrderedDict()  # LRU, oldest first
        self._resident: dict[int, _Resident] = {}
        self._pinned: set[AdapterDigest] = set()
        self._active: dict[AdapterDigest, int] = {}
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.evictions = 0
        self.compactions = 0
        self._side_stream: torch.cuda.Stream | None = None

    @property
    def byte_budget(self) -> int:
        return self.capacity * self.element_size

    @property
    def used_bytes(self) -> int:
        return sum(r.length for r in self._resident.values()) * self.element_size

    @property
    def free_bytes(self) -> int:
        return self.byte_budget - self.used_bytes

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
        return self.place(parse_adapter(files, self.cfg, key, self.limits, self.base_vocab),
                          pin=pin)

    def place(self, adapter: LoraAdapter, *, pin: bool = False) -> AdapterSlotInfo:
        """Put an already parsed, checked adapter (e.g. from a host-memory tier) into the
        pool, evicting idle unpinned adapters (LRU) if its bytes do not fit.

        On CUDA the copies run on a side stream and the compute stream waits for them, so
        the engine thread only pays for queueing them.
        """
        key = adapter.digest
        if key in self._by_digest:
            self._by_digest.move_to_end(key)
            if pin:
                self._pinned.add(key)
            return self.info(key)
        try:
            self.limits.check_rank(adapter.rank)
        except OverCapacity as exc:
            raise AdapterError(exc.message) from None
        vocab = (self.cfg.vocab_size, self.cfg.hidden_size)
        for (layer, module), w in adapter.weights.items():
            shape = (int(w.a.shape[1]), int(w.b.shape[0]))
            if layer == REPLACED:
                ok = tuple(w.a.shape) == vocab and module in (EMBED, LM_HEAD)
                shape, want = tuple(w.a.shape), vocab
            else:
                want = self.shapes.get(module)
                ok = shape == want and (-1 <= layer < self.cfg.num_hidden_layers) and (
                    (layer == -1) == (module in (EMBED, LM_HEAD)))
            if not ok:
                raise AdapterError(f"layer {layer} {module}: (in, out) {shape} is not this "
                                   f"model's {want}")
        need = adapter.layout.length
        if need > self.capacity:
            raise AdapterPoolFullError(
                f"adapter needs {need * self.element_size} bytes, the whole pool has "
                f"{self.byte_budget}")
        slot, start = self._make_room(need)
        if self.pool.device.type == "cuda":
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self.pool.device)
            with torch.cuda.stream(self._side_stream):
                self._write(slot, start, need, adapter)
            torch.cuda.current_stream(self.pool.device).wait_stream(self._side_stream)
        else:
            with one_thread():
                self._write(slot, start, need, adapter)
        self._by_digest[key] = slot
        if pin:
            self._pinned.add(key)
        return self.info(key)

    def fits(self, adapter: LoraAdapter) -> bool:
        """Whether `place` would succeed now without evicting anything (compacting the
        free space if it has to)."""
        need = adapter.layout.length
        return bool(self._free) and self.capacity - self.used_elements >= need

    def unload(self, digest: AdapterDigest) -> None:
        """Free an adapter's extent and zero it (no stale weights stay in device memory).

        The engine aborts or drains sequences using it first; unloading an adapter that
        sequences still hold is an error.
        """
        if digest not in self._by_digest:
            raise AdapterNotLoadedError(f"adapter {digest} is not loaded")
        if self._active.get(digest):
            raise AdapterError(f"adapter {digest} is used by {self._active[digest]} sequences")
        self._remove(self._by_digest.pop(digest))
        self._pinned.discard(digest)

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
        res = self._resident[slot]
        return AdapterSlotInfo(
            digest=digest,
            slot=slot,
            rank=res.rank,
            target_modules=res.target_modules,
            pinned=digest in self._pinned,
            active_sequences=self._active.get(digest, 0),
            num_parameters=res.num_parameters,
            bytes=res.length * self.element_size,
        )

    def list(self) -> list[AdapterSlotInfo]:
        return [self.info(d) for d in self._by_digest]

    @property
    def free_slots(self) -> int:
        """Unused slot ids. Whether an adapter fits also depends on `free_bytes`."""
        return len(self._free)

    def padding_fraction(self) -> float:
        """Share of the resident adapters' bytes that is not weights (alignment only)."""
        used = sum(r.length for r in self._resident.values())
        real = sum(r.num_parameters for r in self._resident.values())
        return 0.0 if used == 0 else 1.0 - real / used

    def weights_of(self, digest: AdapterDigest) -> dict[tuple[int, str], tuple[torch.Tensor,
                                                                             torch.Tensor, float]]:
        """(layer, module) -> (A [r, in], B.T [r, out], scale): views into the pool."""
        slot = self._by_digest[digest]
        out = {}
        for layer, module in self._resident[slot].layout:
            if layer < 0:
                continue
            w = self.weights[layer][module]
            a, bt = w.a_views[slot], w.bt_views[slot]
            assert a is not None and bt is not None
            out[(layer, module)] = (a, bt, w.host_scales[slot])
        return out

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
        runs: Runs | None = None,
    ) -> None:
        """Add every token's adapter delta for one projection into `y` in place."""
        lora_apply_pooled(y, x, self.weights[layer][module], indices, out_offset=out_offset,
                         segments=segments, runs=runs)

    def direct_runs(self, runs: Runs | None, dtype: torch.dtype,
                    device: torch.device) -> SmallRuns | None:
        """A step's runs as the compiled pass's arrays when every adapted run of the step
        takes that pass (`apply_runs`: small runs, a CPU dtype it compiles), else None.
        With them the caller adds each projection's deltas with `apply_direct`, over
        arrays it made once for the step, instead of `apply` (a few-row step's layer loop,
        `DecoderModel._compiled_layer_loop`: the calls' own Python was most of what an
        adapter added to a single stream's token)."""
        if runs is None or not self.weights or not self.weights[0] or not host_pass_dtype(
                next(iter(self.weights[0].values())), dtype, device):
            return None
        split = step_runs(runs)
        return split.small if not split.large else None

    def apply_direct(self, layer: int, module: str, y: object, x: object, out_offset: int,
                     runs: SmallRuns, slots: list[int]) -> None:
        """`apply` over numpy views of the step's buffers (`direct_runs` said the step
        takes the compiled pass); the same sums into `y`."""
        if self.layer_has_lora(layer, module, slots):
            w = self.weights[layer][module]
            apply_small_runs_arrays(x, y, w.host_pool(), out_offset, w.in_features,
                                    w.out_features, w.host_table, w.host_scale_table, runs)

    def direct_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """What `apply_direct` reads, for every layer and module at once (the one-call layer
        stack, `cpu_layer.layer_stack_rows`): the pool, every projection's host table and
        scales (module m of layer l on row ``l * modules + m``) and the module count."""
        return (self.weights[0][self.modules[0]].host_pool(), self.tables.host,
                self.tables.host_scales, len(self.modules))

    def apply_fused_base(self, layer: int, module: str, y: torch.Tensor, x: torch.Tensor,
                         weight: torch.Tensor, segments: Segments, out_offset: int = 0) -> None:
        """The fused path: write ``x @ weight.T`` plus each bucket's delta into `y`."""
        base_lora_fused(y, x, weight, self.weights[layer][module], segments,
                        out_offset=out_offset)

    def adapts_vocab(self, slots: list[int]) -> bool:
        """Whether an adapter of the step adapts or replaces embed_tokens or lm_head (the
        forward skips that work otherwise)."""
        embed, head = self.vocab_lora[EMBED], self.vocab_lora[LM_HEAD]
        return any(s in self.replaced or embed.adapts(s) or head.adapts(s)
                   for s in slots if s >= 0)

    def has_vocab_parts(self, digest: AdapterDigest) -> bool:
        """The adapter adapts or replaces embed_tokens or lm_head (it cannot be merged)."""
        slot = self._by_digest[digest]
        return any(layer < 0 for layer, _ in self._resident[slot].layout)

    def replace_embeddings(self, h: torch.Tensor, ids: torch.Tensor, runs: Runs) -> None:
        """Rows of adapters that replace embed_tokens take their own weight's rows."""
        for slot, lo, hi in runs:
            weight = self.replaced.get(slot, {}).get(EMBED)
            if weight is not None:
                h[lo:hi] = weight.index_select(0, ids[lo:hi])

    def add_embedding_lora(self, h: torch.Tensor, ids: torch.Tensor, runs: Runs,
                           scale: torch.Tensor | None = None) -> None:
        """PEFT's embedding LoRA: ``h += (A.T[ids] @ B.T) * scaling`` (times the embedding
        scale, where the family's embedding module applies one inside)."""
        w = self.vocab_lora[EMBED]
        for slot, lo, hi in runs:
            if not w.adapts(slot):
                continue
            after_a = torch.nn.functional.embedding(ids[lo:hi], w.a_views[slot].T)  # type: ignore[union-attr]
            delta = (after_a @ w.bt_views[slot]) * w.host_scales[slot]
            if scale is not None:
                delta = delta * scale
            h[lo:hi] += delta

    def apply_lm_head(self, logits: torch.Tensor, hidden: torch.Tensor,
                      row_slots: list[int]) -> None:
        """Logit rows of adapters that replace lm_head are recomputed with their weight;
        lm_head LoRA adds ``(x @ A.T @ B.T) * scaling`` (PEFT's order)."""
        w = self.vocab_lora[LM_HEAD]
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        for slot, rows in by_slot.items():
            weight = self.replaced.get(slot, {}).get(LM_HEAD)
            adapts = w.adapts(slot)
            if weight is None and not adapts:
                continue
            index = torch.tensor(rows, device=logits.device)
            x = hidden.index_select(0, index)
            out = torch.nn.functional.linear(x, weight) if weight is not None else \
                logits.index_select(0, index)
            if adapts:
                out = out + (x @ w.a_views[slot].T @ w.bt_views[slot]) * w.host_scales[slot]  # type: ignore[union-attr]
            logits.index_copy_(0, index, out)

    def layer_has_lora(self, layer: int, module: str, slots: list[int]) -> bool:
        """Skip the kernel call when no adapter in the batch adapts this projection."""
        ranks = self.weights[layer][module].host_ranks
        return any(ranks[s] > 0 for s in slots if s >= 0)

    # -- internals --------------------------------------------------------------------------

    def _gaps(self) -> list[tuple[int, int]]:
        """Free (start, length) extents in address order."""
        gaps, cursor = [], 0
        for r in sorted(self._resident.values(), key=lambda r: r.start):
            if r.start > cursor:
                gaps.append((cursor, r.start - cursor))
            cursor = r.start + r.length
        if cursor < self.capacity:
            gaps.append((cursor, self.capacity - cursor))
        return gaps

    def _make_room(self, need: int) -> tuple[int, int]:
        """A free slot id and the start of a free extent of `need` elements."""
        while True:
            if self._free:
                fit = next((s for s, n in self._gaps() if n >= need), None)
                if fit is not None:
                    return self._free.pop(), fit
                if self.capacity - self.used_elements >= need:
                    self._compact()
                    continue
            if not self._evict_one():
                raise AdapterPoolFullError(
                    f"no room for {need * self.element_size} bytes: "
                    f"{self.free_bytes} bytes and {len(self._free)} slots free, the rest "
                    "pinned or in use")

    @property
    def used_elements(self) -> int:
        return sum(r.length for r in self._resident.values())

    def _evict_one(self) -> bool:
        for digest in self._by_digest:  # oldest first
            if digest not in self._pinned and not self._active.get(digest):
                self._remove(self._by_digest.pop(digest))
                self.evictions += 1
                return True
        return False

    def _compact(self) -> None:
        """Move every extent down to close the gaps; offsets are re-pointed in place."""
        cursor = 0
        for slot, r in sorted(self._resident.items(), key=lambda kv: kv[1].start):
            if r.start != cursor:
                self.pool[cursor:cursor + r.length] = self.pool[r.start:r.start + r.length].clone()
                r.start = cursor
                self._place(slot, r)
            cursor += r.length
        self.pool[cursor:].zero_()
        self.compactions += 1

    def _write(self, slot: int, start: int, length: int, adapter: LoraAdapter) -> None:
        """One copy of the adapter's packed extent (converting dtype on the fly)."""
        packed = adapter.pack().packed
        extent = adapter.layout
        assert packed is not None and extent.length == length == packed.numel()
        self.pool[start:start + length].copy_(packed, non_blocking=True)
        layout = {key: (*extent.offsets[key], w.rank, w.scale)
                  for key, w in adapter.weights.items()}
        res = _Resident(rank=adapter.rank, target_modules=adapter.target_modules,
                        num_parameters=adapter.num_parameters, start=start, length=length,
                        layout=layout)
        self._resident[slot] = res
        self._place(slot, res)

    def _row(self, layer: int, module: str) -> int:
        """A module's row in `tables` (embed_tokens and lm_head after every layer's)."""
        if layer < 0:
            return self.cfg.num_hidden_layers * len(self.modules) + (module == LM_HEAD)
        return layer * len(self.modules) + self.modules.index(module)

    def _pooled(self, layer: int, module: str) -> PooledLora:
        return self.vocab_lora[module] if layer < 0 else self.weights[layer][module]

    def _place(self, slot: int, res: _Resident) -> None:
        rows, a_offsets, b_offsets, ranks, scales = [], [], [], [], []
        self.replaced.pop(slot, None)
        for (layer, module), (a_off, b_off, rank, scale) in res.layout.items():
            if layer == REPLACED:
                size = self.cfg.vocab_size * self.cfg.hidden_size
                start = res.start + a_off
                self.replaced.setdefault(slot, {})[module] = self.pool[start:start + size].view(
                    self.cfg.vocab_size, self.cfg.hidden_size)
                continue
            self._pooled(layer, module).point(slot, res.start + a_off, res.start + b_off,
                                             rank, scale)
            rows.append(self._row(layer, module))
            a_offsets.append(res.start + a_off)
            b_offsets.append(res.start + b_off)
            ranks.append(rank)
            scales.append(scale)
        if rows:
            self.tables.write(slot, rows, a_offsets, b_offsets, ranks, scales)

    def _remove(self, slot: int) -> None:
        res = self._resident.pop(slot)
        self.replaced.pop(slot, None)
        for layer, module in res.layout:
            if layer != REPLACED:
                self._pooled(layer, module).unpoint(slot)
        self.tables.clear(slot)
        self.pool[res.start:res.start + res.length].zero_()
        self._free.append(slot)

