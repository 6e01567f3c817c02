"""The engine: base model + adapter pool + paged KV + scheduler, one `step()` at a time.

Not thread-safe by design: the worker runs `step()` in one loop thread and relays
`TokenEvent`s (returned, or pushed through `GenerationRequest.on_token`) to its streams.
Control operations (adapter load/unload, invalidation) are called from that same thread
between steps, which is what makes "in-flight sequences" a well-defined set for acks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .adapter import AdapterDigest, AdapterFiles
from .adapter_pool import AdapterPool, AdapterSlotInfo
from .attention import AttentionMetadata, PrefillSpan
from .compat import CacheScope, SharingPolicy
from .decoding import ChoiceGroup, fork, logits_plan
from .errors import AdapterNotLoadedError, RequestError
from .grammar import GrammarCache
from .kv_cache import BlockPool, InvalidationResult, KVStorage
from .lora_ops import Segments, base_fusion_threshold, lora_apply_pooled
from .model import DecoderModel, ForwardBatch
from .precision import serving_dtype
from .request import (
    ChoiceResult,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    TokenEvent,
)
from .sampling import (
    SamplerRow,
    find_stop,
    held_back,
    make_generator,
    prompt_logprobs,
    sample,
    take_rows,
)
from .scheduler import NULL_BLOCK, ScheduledChunk, Scheduler, SchedulerLimits
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class EngineConfig:
    """Sizing of the engine's memory and batching."""

    dtype: str = "float32"
    """"float32" / "bfloat16" / "float16", or "auto" (`precision.serving_dtype`: bf16 where
    the hardware runs it natively, else fp32)."""
    device: str = "cpu"
    """Where weights, KV cache and adapter slabs live ("cuda" runs the Triton kernels)."""
    weights: str = "dense"
    """Base projections "dense" (in `dtype`) or "int8" (per-channel int8, the LoRA pass and
    activations in `dtype`; see `loraplane_kernels.int8`). int8 serves no merged mode."""
    block_size: int = 16
    num_kv_blocks: int = 2048
    max_lora_rank: int = 64
    adapter_slots: int | None = 8
    adapter_byte_budget: int | None = None
    """When set (and adapter_slots is None), sizes the adapter pool by bytes."""
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    sharing_policy: SharingPolicy = SharingPolicy.STRICT
    prefix_cache: bool = True
    """Off: no block is looked up or published (benchmarks' baseline; nothing is shared)."""
    row_weights_bytes: int = 1 << 30
    """bf16 on the CPU: most bytes of plain projection weights kept beside oneDNN's packed
    ones for one-row steps (`DecoderModel.keep_row_weights`); 0 keeps none."""


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    free_kv_blocks: int
    total_kv_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    adapter_slots_free: int
    adapter_padding_fraction: float
    steps: int
    prefix_cache_cross_tenant_hits: int = 0
    """Blocks served to a tenant that another tenant computed (0 under the strict policy)."""
    prefix_cache_hits_by_tenant: dict[str, int] = field(default_factory=dict)
    deferred_admissions: int = 0
    """Admissions postponed because a running request was computing the same prefix."""
    workspace_bytes: int = 0
    """Step scratch buffers kept between steps (`Workspace`): memory the KV budget does not
    count, so it is reported beside it."""


class Engine:
    """Multi-LoRA generation over one base model."""

    def __init__(self, model: DecoderModel, config: EngineConfig | None = None, *,
                 warm_up: bool = True) -> None:
        cfg = config or EngineConfig()
        self.config = cfg
        self.model = model
        mc = model.cfg
        self.kv = KVStorage(mc.num_hidden_layers, cfg.num_kv_blocks, cfg.block_size,
                            mc.num_key_value_heads, mc.head_dim, model.dtype, model.device)
        self.blocks = BlockPool(cfg.num_kv_blocks, cfg.sharing_policy)
        self.adapters = AdapterPool(
            mc,
            max_rank=cfg.max_lora_rank,
            num_slots=cfg.adapter_slots,
            byte_budget=cfg.adapter_byte_budget,
            dtype=model.dtype,
            device=model.device,
        )
        self.scheduler = Scheduler(self.blocks, cfg.block_size, cfg.limits, cfg.sharing_policy,
                                   window=mc.kv_window, recompute_past=mc.recompute_past)
        self.prefix_cache = cfg.prefix_cache and not mc.rope_depends_on_length
        """Blocks are shared unless turned off, or the rope depends on the sequence's length
        (the same tokens' K/V differ between sequences of other lengths)."""
        self.fusion_threshold = None if model.weights != "dense" else base_fusion_threshold(
            torch.device(model.device), mc.hidden_size, cfg.max_lora_rank)
        """Adapter buckets up to this many tokens take the fused base + LoRA kernel; None
        (CPU, int8 base weights, or a GPU model without a measured table) = always the
        separate path."""
        if self.fusion_threshold is None:
            model.keep_row_weights(cfg.row_weights_bytes)
            model.pack_weights()  # nothing else reads the plain weights per step then
        # after keep_row_weights, which moves them into its buffer
        self.adapters.base_vocab = {"embed_tokens": model.embed, "lm_head": model.lm_head}
        self._seqs: dict[str, Sequence] = {}
        self._groups: dict[str, ChoiceGroup] = {}
        self.grammars = GrammarCache(model.tokenizer, mc.vocab_size, mc.eos_token_ids)
        """Compiled structured-output grammars of this model's tokenizer, by spec."""
        self._results: dict[str, GenerationResult] = {}
        self._arrivals = itertools.count()
        self._pending: list[TokenEvent] = []
        self._merged: AdapterDigest | None = None
        self._merge_pinned = False
        """The merge pinned the adapter (it was not pinned before): unmerging unpins it."""
        self._pristine: dict[tuple[int, str], torch.Tensor] = {}
        self.steps = 0
        if warm_up and model.device.type == "cpu" and not model.warmed:
            self._warm_up()

    def _warm_up(self) -> None:
        """Step a scratch engine on this model through every compiled CPU path a step can
        take (a short prefill, one decode, decodes in shares, a lone decode beside a
        prefill, the LoRA pass whole and in shares), so numba compiles them or loads them
        from its cache here and not inside a request's step.
        From a cold cache that took about 8 s and held the GIL: a worker's first request
        stalled its heartbeats, and a benchmark counted it into the first step it timed.
        Once per model: the compiled code is the process's."""
        model = self.model
        model.warmed = True
        cfg = self.config
        scratch = Engine(model, EngineConfig(
            dtype=cfg.dtype, device=cfg.device, weights=cfg.weights, block_size=cfg.block_size,
            num_kv_blocks=32, max_lora_rank=min(8, cfg.max_lora_rank), adapter_slots=1,
            prefix_cache=False, row_weights_bytes=cfg.row_weights_bytes), warm_up=False)
        vocab = model.cfg.vocab_size
        prompt = [1 + i % (vocab - 1) for i in range(24)]
        once = SamplingParams(max_tokens=2)
        scratch.generate([GenerationRequest(prompt_token_ids=prompt, sampling=once)])
        scratch.generate([GenerationRequest(prompt_token_ids=prompt[: 4 + i], sampling=once)
                          for i in range(3)])
        # one stream decoding while another's prompt fills: a step that is not decodes
        # only, with one decode (the attention kernel whole, from Python, in bf16 too)
        scratch.submit(GenerationRequest(prompt_token_ids=prompt[:4],
                                         sampling=SamplingParams(max_tokens=3)))
        scratch.step()
        scratch.submit(GenerationRequest(prompt_token_ids=prompt, sampling=once))
        while scratch.has_work:
            scratch.step()
        weights = next(iter(scratch.adapters.weights[0].values()))
        x = torch.zeros(2, weights.in_features, dtype=model.dtype)
        y = torch.zeros(2, weights.out_features, dtype=model.dtype)
        for runs in (((0, 0, 1),), ((0, 0, 1), (0, 1, 2))):  # one run, and runs in shares
            lora_apply_pooled(y, x, weights, torch.zeros(2, dtype=torch.int32),
                              runs=runs)  # slot 0 is empty (rank 0): adds nothing
        model.drop_scratch()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: EngineConfig | None = None) -> Engine:
        cfg = config or EngineConfig()
        dtype = serving_dtype(cfg.dtype, cfg.device)
        return cls(DecoderModel.from_pretrained(model_dir, dtype, cfg.device, cfg.weights), cfg)

    @property
    def base_digest(self) -> str:
        return self.model.digest

    @property
    def base_weights(self) -> str:
        """The format the base projections are served in ("dense" or "int8"): the digest
        names the checkpoint, this how it is computed (heartbeats and traces carry both)."""
        return self.model.weights

    @property
    def tokenizer(self):  # -> tokenizers.Tokenizer | None
        return self.model.tokenizer

    # -- adapter control surface ---------------------------------------------------------

    def load_adapter(self, source: AdapterFiles | str | Path,
                     digest: AdapterDigest | None = None, *,
                     pin: bool = False) -> AdapterSlotInfo:
        """Check the files against `digest`, validate, make resident (idempotent per digest)."""
        return self.adapters.load(source, digest, pin=pin)

    def unload_adapter(self, digest: AdapterDigest) -> InvalidationResult:
        """Unload now: abort sequences using it, free its KV, zero its slot (unmerging it
        first if it is the merged adapter)."""
        result = self.invalidate_adapter(digest, hard=True, include_waiting=True)
        if digest == self._merged:
            self.unmerge()
        self.adapters.unload(digest)
        return result

    # -- merged mode ---------------------------------------------------------------------

    @property
    def merged_adapter(self) -> AdapterDigest | None:
        """The adapter currently merged into the base weights, if any."""
        return self._merged

    def merge_adapter(self, digest: AdapterDigest) -> None:
        """Serve one resident adapter merged into the base weights: ``W += scale * B @ A``.

        Merged mode is for a worker dedicated to one hot adapter: its requests then do no
        LoRA work at all, and still carry (and report) its digest; requests for anything
        else are refused until `unmerge`. The touched base weights are copied first and
        every merge starts from those pristine copies, so switching the merged adapter (a
        version switch or rollback) or unmerging restores the base bit for bit instead of
        subtracting a delta in floating point. Merged and unmerged forms round differently,
        so the adapter's cached KV is invalidated (softly) on every change. In-flight
        requests of any other adapter (the previous version included) must be drained or
        aborted first: they would otherwise finish on weights they were not admitted for.
        """
        if self.model.weights != "dense":
            raise RequestError(f"merged mode needs dense base weights; this engine serves "
                               f"{self.model.weights} weights (weights=dense to merge)")
        if not self.adapters.is_loaded(digest):
            raise AdapterNotLoadedError(f"adapter {digest} is not loaded")
        if digest == self._merged:
            return
        if self.adapters.has_vocab_parts(digest):
            raise RequestError(f"adapter {digest} adapts or replaces embed_tokens or lm_head, "
                               "which merged mode does not fold into the base weights")
        others = self.merge_blockers(digest)
        if others:
            raise RequestError(f"cannot merge adapter {digest} while {others} requests "
                               "of other adapters or the base model are in flight")
        self.unmerge()
        for (layer, module), (a, bt, scale) in self.adapters.weights_of(digest).items():
            w = self.model.projection_weight(layer, module)
            self._pristine[(layer, module)] = w.clone()
            merged = w.float() + scale * (bt.float().T @ a.float())
            self.model.set_projection_weight(layer, module, merged.to(w.dtype))
        self._merged = digest
        self._merge_pinned = not self.adapters.info(digest).pinned
        self.adapters.pin(digest)
        self.invalidate_adapter(digest)

    def merge_blockers(self, digest: AdapterDigest) -> int:
        """Requests in flight that keep `merge_adapter(digest)` from running now: those of
        other adapters (a previously merged one included) and of the bare base model."""
        return sum(1 for s in self._seqs.values() if s.request.adapter_digest != digest)

    def unmerge(self) -> AdapterDigest | None:
        """Restore the pristine base weights; returns the adapter that was merged."""
        digest = self._merged
        if digest is None:
            return None
        for (layer, module), original in self._pristine.items():
            self.model.set_projection_weight(layer, module, original)
        self._pristine.clear()
        self._merged = None
        if self._merge_pinned and self.adapters.is_loaded(digest):
            self.adapters.pin(digest, False)
        self._merge_pinned = False
        self.invalidate_adapter(digest)
        return digest

    def list_adapters(self) -> list[AdapterSlotInfo]:
        return self.adapters.list()

    # -- KV invalidation -----------------------------------------------------------------

    def invalidate_adapter(self, digest: AdapterDigest, *, hard: bool = False,
                           include_waiting: bool = False) -> InvalidationResult:
        """Drop every cached block computed with this adapter version.

        Soft (version switch): running sequences finish, and their blocks are freed then
        instead of being cached. Hard (unload): those sequences are aborted now.
        """
        return self._invalidate(lambda s: s.adapter_digest == digest, hard, include_waiting)

    def invalidate_tenant(self, tenant_key: str, *, hard: bool = True) -> InvalidationResult:
        """Purge a tenant's KV: by default aborts its sequences, waiting ones included."""
        return self._invalidate(lambda s: s.tenant_key == tenant_key, hard, hard)

    def purge_tenant(self, tenant_key: str) -> InvalidationResult:
        """Hard tenant purge: abort its sequences, free its blocks and zero their K/V.

        Every block the tenant's sequences held or its prefix cache published is zeroed
        once no one references it (under the default policy no one else ever does).
        """
        touched = {bid for bid, info in enumerate(self.blocks.blocks)
                   if info.scope is not None and info.scope.tenant_key == tenant_key}
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            if seq.scope.tenant_key == tenant_key:
                touched.update(b for b in seq.block_table if b != NULL_BLOCK)
        result = self.invalidate_tenant(tenant_key, hard=True)
        self.kv.zero_blocks([b for b in touched if self.blocks.blocks[b].ref_count == 0])
        return result

    def tenant_references(self, tenant_key: str) -> int:
        """References the engine still holds for a tenant: its sequences and the refcounts
        of blocks computed in its scope. Zero after a purge."""
        seqs = [s for s in list(self.scheduler.running) + list(self.scheduler.waiting)
                if s.scope.tenant_key == tenant_key]
        held = sum(info.ref_count for info in self.blocks.blocks
                   if info.scope is not None and info.scope.tenant_key == tenant_key)
        return len(seqs) + held

    def _invalidate(self, match: Callable[[CacheScope], bool], hard: bool,
                    include_waiting: bool) -> InvalidationResult:
        free_before = len(self.blocks.free)
        _, held = self.blocks.invalidate(match)
        held_set = set(held)
        result = InvalidationResult()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            owns = match(seq.scope)
            touches = bool(held_set.intersection(seq.block_table))
            if not (owns or touches) or seq.status is SequenceStatus.FINISHED:
                continue  # (finished: another choice of its request was aborted first)
            seq.publish_blocks = False
            waiting = seq.status is SequenceStatus.WAITING
            if hard and (not waiting or include_waiting):
                self._finish(seq, FinishReason.ABORT)
                result.sequences_aborted += 1
                result.aborted_request_ids.append(seq.request_id)
        deferred: set[int] = set()
        for seq in self.scheduler.running:
            if not seq.publish_blocks:
                deferred.update(b for b in seq.block_table
                                if b != NULL_BLOCK and self.blocks.blocks[b].ref_count)
        result.blocks_freed = len(self.blocks.free) - free_before
        result.blocks_deferred = len(deferred)
        return result

    # -- requests ------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> str:
        """Queue a request; it joins the batch at the next step."""
        if request.request_id in self._seqs:
            raise RequestError(f"duplicate request id {request.request_id}")
        ids = request.prompt_token_ids
        if ids is None:
            if request.prompt is None:
                raise RequestError("give prompt or prompt_token_ids")
            if self.tokenizer is None:
                raise RequestError("text prompts need a tokenizer.json in the model directory")
            ids = self.tokenizer.encode(request.prompt).ids
        ids = list(ids)
        if not ids:
            raise RequestError("prompt is empty")
        if any(not 0 <= t < self.model.cfg.vocab_size for t in ids):
            raise RequestError("prompt token id outside the vocabulary")
        if request.sampling.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer")
        capacity = self.config.num_kv_blocks * self.config.block_size
        if len(ids) + request.sampling.max_tokens > capacity:
            raise RequestError(f"prompt + max_tokens exceeds the KV capacity of {capacity} tokens")
        guide = (self.grammars.state(request.sampling.guide)
                 if request.sampling.guide is not None else None)
        slot = -1
        if request.adapter_digest is not None:
            if not self.adapters.is_loaded(request.adapter_digest):
                raise AdapterNotLoadedError(f"adapter {request.adapter_digest} is not loaded")
            slot = self.adapters.acquire(request.adapter_digest)
        if self._merged is not None and request.adapter_digest != self._merged:
            if request.adapter_digest is not None:
                self.adapters.release(request.adapter_digest)
            raise RequestError(f"adapter {self._merged} is merged into the base weights: "
                               "this engine serves only it until unmerged")
        seq = Sequence(
            request=request,
            prompt_ids=ids,
            scope=CacheScope(self.base_digest, request.adapter_digest, request.tenant_key,
                             request.sharing_scope),
            arrival=next(self._arrivals),
            generator=make_generator(request.sampling.seed),
            slot=slot,
            publish_blocks=self.prefix_cache
            and request.sampling.prompt_logprobs is None,
            guide=guide,
        )
        self._seqs[request.request_id] = seq
        self._groups[request.request_id] = ChoiceGroup(request, [seq])
        self.scheduler.add(seq)
        return request.request_id

    def abort(self, request_id: str) -> bool:
        group = self._groups.get(request_id)
        if group is None:
            return False
        for seq in list(group.seqs):
            self._finish(seq, FinishReason.ABORT)
        return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def result(self, request_id: str) -> GenerationResult | None:
        """The result of a finished request (kept until `pop_result`)."""
        return self._results.get(request_id)

    def pop_result(self, request_id: str) -> GenerationResult | None:
        return self._results.pop(request_id, None)

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """Schedule, run one batched forward, sample, and return the step's events."""
        plan = self.scheduler.schedule()
        events, self._pending = self._pending, []
        if not plan:
            return events
        batch = self._build_batch(plan)
        wanted = logits_plan(plan)
        batch.logits_rows = torch.tensor(wanted.rows, dtype=torch.long)
        logits = self.model.forward(batch, self.kv, self.adapters).cpu()
        self.steps += 1
        for span in wanted.prompt:
            found = prompt_logprobs(logits[span.first:span.first + len(span.targets)],
                                    span.targets, span.seq.request.sampling.prompt_logprobs or 0)
            span.seq.prompt_logprobs = (span.seq.prompt_logprobs or []) + found
        for chunk in plan:
            chunk.seq.num_computed += chunk.num_tokens
            self.scheduler.publish_full_blocks(chunk.seq)
            self.scheduler.release_outside_window(chunk.seq)
        seqs: list[Sequence] = []
        rows: list[int] = []
        for i, chunk in enumerate(wanted.sampling):
            seq = chunk.seq
            seqs.append(seq)
            rows.append(i)
            if seq.choice == 0 and not seq.output_ids and seq.request.sampling.n > 1 \
                    and len(self._groups[seq.request_id].seqs) == 1:
                children = fork(seq, self)
                self._groups[seq.request_id].seqs.extend(children)
                running = [c for c in children if c.status is SequenceStatus.RUNNING]
                seqs.extend(running)
                rows.extend([i] * len(running))
        if not seqs:
            return events
        top = max(s.request.sampling.top_logprobs for s in seqs)
        # sampled in place, in inference mode as the forward made them: the step's logits
        # are its own and read by nothing after (a copy of 32 x 49,152 fp32 rows cost
        # 1.2 ms of a SmolLM2 decode step)
        with torch.inference_mode():
            picked = sample(take_rows(logits, rows), [SamplerRow(
                params=s.request.sampling, generator=s.generator, prompt_ids=s.prompt_ids,
                output_ids=s.output_ids, guide=s.guide,
                mask_eos=len(s.output_ids) < s.request.sampling.min_tokens,
                want_logprob=s.request.sampling.wants_logprob) for s in seqs],
                self.model.cfg.eos_token_ids, top)
        for k, seq in enumerate(seqs):
            event = self._append_token(seq, picked.tokens[k], picked.logprobs[k],
                                       tuple(picked.top[k]))
            if seq.request.on_token is not None:
                seq.request.on_token(event)
            events.append(event)
        return events

    def _fused_slots(self, plan: list[ScheduledChunk]) -> set[int]:
        """Two-level batching: adapters whose bucket this step is small enough to fuse."""
        if self.fusion_threshold is None or self._merged is not None:
            return set()
        sizes: dict[int, int] = {}
        for chunk in plan:
            if chunk.seq.slot >= 0:
                sizes[chunk.seq.slot] = sizes.get(chunk.seq.slot, 0) + chunk.num_tokens
        return {s for s, n in sizes.items() if n <= self.fusion_threshold}

    def _build_batch(self, plan: list[ScheduledChunk]) -> ForwardBatch:
        fused = self._fused_slots(plan)
        if fused:  # separate buckets first, then the fused ones, each still grouped by slot
            plan = sorted(plan, key=lambda c: c.seq.slot in fused)
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        slots: list[int] = []
        lora_idx: list[int] = []
        logits_rows: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        seg_lengths: list[int] = []
        seg_slots: list[int] = []
        row = 0
        for chunk in plan:
            seq, n = chunk.seq, chunk.num_tokens
            start = seq.num_computed
            end = start + n
            toks = seq.tokens
            ids.extend(toks[start:end])
            positions.extend(range(start, end))
            # rope that depends on the length (dynamic, longrope) sees the whole sequence at
            # once in transformers' prefill: every chunk of it uses the sequence's length
            seq_lens.extend([max(end, seq.num_tokens)] * n)
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            slot = -1 if self._merged is not None else seq.slot
            lora_idx.extend([slot] * n)
            if seg_slots and seg_slots[-1] == slot:
                seg_lengths[-1] += n
            else:
                seg_lengths.append(n)
                seg_slots.append(slot)
            if n == 1 and start > 0:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                span = PrefillSpan(row_start=row, q_len=n, prefix_len=start)
                if start:
                    span.ctx_start = self.scheduler.first_visible_block(start) * bs
                    span.ctx_slots = self._slots_of(table, end, span.ctx_start)
                prefills.append(span)
            if chunk.samples:
                logits_rows.append(row + n - 1)
            chunk.row = row
            row += n
        meta = AttentionMetadata(prefills=prefills)
        meta.finalize(decode_rows, decode_tables, decode_lens, bs, self.model.dtype,
                      device=self.model.device)
        used = tuple(sorted({s for s in seg_slots if s >= 0}))
        has_prefill = bool(prefills)
        runs: list[tuple[int, int, int]] = []
        start = 0
        for n, s in zip(seg_lengths, seg_slots, strict=True):
            runs.append((s, start, start + n))
            start += n
        split = None
        fused_segments = None
        if fused:
            first = next(i for i, s in enumerate(seg_slots) if s in fused)
            split = runs[first][1]
            fused_segments = Segments.from_lengths(seg_lengths[first:], seg_slots[first:])
            seg_lengths, seg_slots = seg_lengths[:first], seg_slots[:first]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            attention=meta,
            logits_rows=torch.tensor(logits_rows, dtype=torch.long),
            lora_indices=torch.tensor(lora_idx, dtype=torch.int32) if used else None,
            lora_segments=Segments.from_lengths(seg_lengths, seg_slots)
            if used and has_prefill and seg_lengths else None,
            lora_slots=used,
            lora_runs=tuple(runs) if used else None,
            fused_from=split,
            fused_segments=fused_segments,
        )

    def _slots_of(self, table: list[int], length: int, start: int = 0) -> torch.Tensor:
        """Flat slots of positions `start` (a block boundary) to `length`."""
        bs = self.config.block_size
        t = torch.tensor(table[start // bs:], dtype=torch.long)
        return (t[:, None] * bs + torch.arange(bs)).flatten()[:length - start]

    # -- token handling ------------------------------------------------------------------

    def _append_token(self, seq: Sequence, token: int, logprob: float | None = None,
                      top: tuple[tuple[int, float], ...] = ()) -> TokenEvent:
        params = seq.request.sampling
        seq.output_ids.append(token)
        index = len(seq.output_ids) - 1
        if logprob is not None:
            seq.cumulative_logprob += logprob
        reason: FinishReason | None = None
        if len(seq.output_ids) > params.min_tokens:
            if token in params.stop_token_ids:
                reason, seq.stop_reason = FinishReason.STOP, token
            elif token in self.model.cfg.eos_token_ids and not params.ignore_eos:
                reason = FinishReason.STOP
        if seq.guide is not None and reason is None and not seq.guide.accept(token):
            reason = FinishReason.STOP  # the grammar allows nothing more (it is complete)
        text_delta = ""
        tok = self.tokenizer
        if tok is not None:
            ids = seq.output_ids[:-1] if reason is FinishReason.STOP else seq.output_ids
            prev_len = len(seq.text)
            seq.text = tok.decode(ids)
            if params.stop:
                cut = find_stop(seq.text, params.stop, prev_len - max(map(len, params.stop)))
                if cut is not None:
                    seq.text = seq.text[:cut[0]]
                    reason, seq.stop_reason = FinishReason.STOP, cut[1]
            if reason is None and len(seq.output_ids) >= params.max_tokens:
                reason = FinishReason.LENGTH
            safe = len(seq.text) if reason else len(seq.text) - held_back(seq.text, params.stop)
            safe = max(safe, seq.emitted_chars)
            text_delta = seq.text[seq.emitted_chars:safe]
            seq.emitted_chars = safe
        elif reason is None and len(seq.output_ids) >= params.max_tokens:
            reason = FinishReason.LENGTH
        prompt = None
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            seq.prompt_logprobs_sent = True
            prompt = tuple((lp, tuple(alts)) for lp, alts in seq.prompt_logprobs)
        last = False
        if reason is not None:
            last = self._finish(seq, reason, emit=False)
        return TokenEvent(seq.request_id, token, text_delta, index, last, reason,
                          choice=seq.choice, logprob=logprob, top_logprobs=top,
                          stop_reason=seq.stop_reason if reason is not None else None,
                          prompt_logprobs=prompt)

    def _end(self, seq: Sequence, reason: FinishReason, group: ChoiceGroup | None) -> None:
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.request.adapter_digest is not None:
            self.adapters.release(seq.request.adapter_digest)
        if group is not None:
            group.results[seq.choice] = ChoiceResult(
                seq.choice, list(seq.output_ids), seq.text, reason, seq.stop_reason,
                seq.cumulative_logprob)

    def _finish(self, seq: Sequence, reason: FinishReason, *, emit: bool = True) -> bool:
        """End one choice; True when that ended the request (its result is ready). An
        abort ends every choice of the request."""
        if seq.status is SequenceStatus.FINISHED:
            return False
        group = self._groups.get(seq.request_id)
        self._end(seq, reason, group)
        if group is None:  # a sequence outside the request book (`score`)
            return False
        if reason is FinishReason.ABORT:
            for other in group.seqs:
                if other.status is not SequenceStatus.FINISHED:
                    self._end(other, reason, group)
            for i in range(group.size):  # choices not forked yet
                group.results.setdefault(i, ChoiceResult(i, [], "", reason))
        if not group.done:
            return False
        del self._groups[seq.request_id]
        self._seqs.pop(seq.request_id, None)
        first = group.seqs[0]
        choices = [group.results[i] for i in sorted(group.results)]
        self._results[seq.request_id] = GenerationResult(
            request_id=seq.request_id,
            token_ids=list(first.output_ids),
            text=first.text,
            finish_reason=choices[0].finish_reason,
            prompt_tokens=len(first.prompt_ids),
            cached_prompt_tokens=first.cached_prompt_tokens or 0,
            preemptions=sum(s.preemptions for s in group.seqs),
            choices=choices,
        )
        if emit:
            ev = TokenEvent(seq.request_id, None, "", len(seq.output_ids), True, reason,
                            choice=seq.choice)
            if seq.request.on_token is not None:
                seq.request.on_token(ev)
            self._pending.append(ev)
        return True

    # -- conveniences --------------------------------------------------------------------

    def score(self, prompt_ids: list[int],
              adapter_digest: AdapterDigest | None = None) -> torch.Tensor:
        """Next-token logits at every prompt position [L, vocab], outside the batch.

        For regression sets (base vs. old vs. new adapter) and oracle checks; uses
        temporary KV blocks and never touches the prefix cache.
        """
        slot = -1 if adapter_digest is None else self.adapters.acquire(adapter_digest)
        seq = Sequence(
            request=GenerationRequest(prompt_token_ids=list(prompt_ids)),
            prompt_ids=list(prompt_ids),
            scope=CacheScope(self.base_digest, adapter_digest, "score"),
            arrival=-1,
            generator=make_generator(0),
            slot=slot,
            publish_blocks=False,
        )
        try:
            if not self.scheduler.grow(seq, len(prompt_ids)):
                raise RequestError("not enough free KV blocks to score this prompt")
            batch = self._build_batch([ScheduledChunk(seq, len(prompt_ids))])
            batch.logits_rows = torch.arange(len(prompt_ids))
            return self.model.forward(batch, self.kv, self.adapters).cpu()
        finally:
            self.scheduler.free_blocks(seq)
            if adapter_digest is not None:
                self.adapters.release(adapter_digest)

    def run_until_idle(self) -> None:
        while self.has_work:
            self.step()

    def generate(self, requests: Iterable[GenerationRequest]) -> list[GenerationResult]:
        """Submit all, run to completion, return results in request order."""
        ids = [self.submit(r) for r in requests]
        self.run_until_idle()
        out = []
        for rid in ids:
            res = self.pop_result(rid)
            assert res is not None
            out.append(res)
        return out

    def stream(self, request: GenerationRequest) -> Iterator[TokenEvent]:
        """Submit and yield this request's events, stepping the whole batch meanwhile."""
        rid = self.submit(request)
        done = False
        while not done:
            for ev in self.step():
                if ev.request_id == rid:
                    yield ev
                    done = done or ev.finished
            if not done and not self.has_work:
                break

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            free_kv_blocks=self.blocks.num_available,
            total_kv_blocks=self.blocks.num_blocks,
            prefix_cache_queries=self.blocks.queries,
            prefix_cache_hits=self.blocks.hits,
            preemptions=self.scheduler.preemptions,
            adapter_slots_free=self.adapters.free_slots,
            adapter_padding_fraction=self.adapters.padding_fraction(),
            steps=self.steps,
            prefix_cache_cross_tenant_hits=self.blocks.cross_tenant_hits,
            prefix_cache_hits_by_tenant=dict(self.blocks.hits_by_tenant),
            deferred_admissions=self.scheduler.deferred_admissions,
            workspace_bytes=self.model.workspace.nbytes,
        )
