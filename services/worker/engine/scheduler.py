"""Continuous batching: which sequences run in the next step, and with how many tokens.

Every step re-plans from scratch: running sequences continue (decode = 1 token, prefill =
a chunk), then waiting requests are admitted while the limits allow, so new requests join
between decode steps. Priority is (QoS tier, arrival). When KV blocks run out, the least
important running sequence is preempted by recompute: its blocks are released (full ones
stay in the prefix cache) and it re-enters the waiting queue.

With a sliding window on every layer (`window`), a sequence's blocks that end before the
window of its next query are released as it goes (`NULL_BLOCK` keeps their place in the
block table), and a prefix match needs only the blocks inside the window of the position
it resumes from: earlier blocks may have been evicted from the cache meanwhile.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .compat import SharingPolicy
from .kv_cache import ROOT_HASH, BlockPool, block_hash
from .sequence import Sequence, SequenceStatus

NULL_BLOCK = -1
"""A block-table entry released because it lies wholly before a sliding window."""


@dataclass(frozen=True)
class SchedulerLimits:
    """Per-step limits."""

    max_running: int = 64
    """Sequences in flight at once."""
    max_tokens_per_step: int = 2048
    """Prefill + decode tokens in one forward."""
    max_adapters_per_step: int = 32
    """Distinct adapters among running sequences (bounds the per-step LoRA groups)."""

    def __post_init__(self) -> None:
        if self.max_tokens_per_step < self.max_running:
            raise ValueError("max_tokens_per_step must be >= max_running (one decode each)")


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int
    row: int = 0
    """The chunk's first token row in the step's batch (set when the batch is built)."""

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the sequence's last token, so it yields logits."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


class Scheduler:
    """Owns the waiting/running queues and the block pool's per-sequence bookkeeping."""

    def __init__(
        self,
        blocks: BlockPool,
        block_size: int,
        limits: SchedulerLimits,
        policy: SharingPolicy = SharingPolicy.STRICT,
        window: int | None = None,
        recompute_past: int | None = None,
    ) -> None:
        self.blocks = blocks
        self.window = window
        """Every layer's sliding window (None: some layer attends to the whole context)."""
        self.recompute_past = recompute_past
        """A running sequence whose cache ends at or before this position and that has
        grown past it is recomputed whole (Phi-3's longrope, `ModelConfig.recompute_past`)."""
        self.block_size = block_size
        self.limits = limits
        self.policy = policy
        self.waiting: list[Sequence] = []  # sorted by priority
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._inflight: dict[bytes, Sequence] = {}
        """Hash of the next full block each prefilling sequence will publish -> that
        sequence: a request whose prefix continues into that block waits for it."""
        self.deferred_admissions = 0

    # -- queue operations -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        keys = [s.priority for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.priority), seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and release its blocks."""
        self._untrack(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.free_blocks(seq)

    def free_blocks(self, seq: Sequence) -> None:
        for bid in seq.block_table:
            if bid != NULL_BLOCK:
                self.blocks.release(bid)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning ---------------------------------------------------------------------------

    def _blocks_needed(self, seq: Sequence, new_tokens: int) -> int:
        total = -(-(seq.num_computed + new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def grow(self, seq: Sequence, new_tokens: int) -> bool:
        need = self._blocks_needed(seq, new_tokens)
        if need > self.blocks.num_available:
            return False
        for _ in range(need):
            bid = self.blocks.allocate()
            assert bid is not None
            seq.block_table.append(bid)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._untrack(seq)
        self.running.remove(seq)
        self.free_blocks(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self.add(seq)

    def _match_prefix(self, seq: Sequence) -> bytes | None:
        """Reuse cached full blocks of the sequence's tokens (all but the last token).

        Returns the hash of the first full block not reused, if any: the block this
        sequence would compute next.
        """
        tokens = seq.tokens
        key = seq.scope.partition_key(self.policy)
        parent = ROOT_HASH
        bs = self.block_size
        miss = None
        if seq.publish_blocks and self.window is not None:
            miss = self._match_window(seq, key)
        elif seq.publish_blocks:
            for j in range((len(tokens) - 1) // bs):
                h = block_hash(parent, tokens[j * bs : (j + 1) * bs], key)
                bid = self.blocks.lookup(h, seq.scope)
                if bid is None:
                    miss = h
                    break
                self.blocks.retain(bid)
                seq.block_table.append(bid)
                seq.block_hashes.append(h)
                parent = h
        seq.num_computed = len(seq.block_table) * bs
        return miss

    def _match_window(self, seq: Sequence, key: bytes) -> bytes | None:
        """The longest prefix whose blocks inside the window of its next position are all
        cached; the blocks before that window are not needed and stay `NULL_BLOCK`."""
        tokens, bs, window = seq.tokens, self.block_size, self.window
        assert window is not None
        hashes: list[bytes] = []
        parent = ROOT_HASH
        for j in range((len(tokens) - 1) // bs):
            parent = block_hash(parent, tokens[j * bs : (j + 1) * bs], key)
            hashes.append(parent)
        present = [self.blocks.peek(h, seq.scope) for h in hashes]
        best = 0
        for k in range(len(hashes), 0, -1):
            if all(present[j] is not None
                   for j in range(self.first_visible_block(k * bs), k)):
                best = k
                break
        first = self.first_visible_block(best * bs)
        for j in range(best):
            if j < first:
                seq.block_table.append(NULL_BLOCK)
                continue
            bid = self.blocks.lookup(hashes[j], seq.scope)
            assert bid is not None
            self.blocks.retain(bid)
            seq.block_table.append(bid)
        seq.block_hashes.extend(hashes[:best])
        if best < len(hashes):
            self.blocks.queries += 1
            return hashes[best]
        return None

    def first_visible_block(self, position: int) -> int:
        """The first block a query at `position` (or later) still sees: every block before
        it lies wholly outside the window (0 without one)."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // self.block_size

    def release_outside_window(self, seq: Sequence) -> None:
        """After a step: release the blocks no later query of the sequence can see."""
        dead = min(self.first_visible_block(seq.num_computed), len(seq.block_table))
        for j in range(dead):
            bid = seq.block_table[j]
            if bid != NULL_BLOCK:
                self.blocks.release(bid)
                seq.block_table[j] = NULL_BLOCK

    def _track(self, seq: Sequence) -> None:
        """Register the next full prompt block a prefilling sequence will publish."""
        self._untrack(seq)
        bs = self.block_size
        j = len(seq.block_hashes)
        if not seq.publish_blocks or (j + 1) * bs > seq.num_tokens - 1:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
        h = block_hash(parent, seq.tokens[j * bs:(j + 1) * bs],
                       seq.scope.partition_key(self.policy))
        seq.inflight_hash = h
        self._inflight.setdefault(h, seq)

    def _untrack(self, seq: Sequence) -> None:
        h = seq.inflight_hash
        if h is not None and self._inflight.get(h) is seq:
            del self._inflight[h]
        seq.inflight_hash = None

    def schedule(self) -> list[ScheduledChunk]:
        """Plan one step: continue running sequences, then admit waiting ones."""
        lim = self.limits
        budget = lim.max_tokens_per_step
        plan: list[ScheduledChunk] = []
        planned: set[int] = set()
        # decodes before prefill chunks, each in priority order, so decodes are never starved
        order = sorted(self.running, key=lambda s: (s.num_tokens - s.num_computed > 1, s.priority))
        for seq in order:
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            past = self.recompute_past
            if past is not None and not seq.recomputed_past and past < seq.num_tokens:
                seq.recomputed_past = True
                if seq.num_computed <= past:
                    self.free_blocks(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self.grow(seq, n):
                victims = [s for s in self.running if id(s) not in planned and s is not seq]
                victim = max(victims, key=lambda s: s.priority, default=None)
                if victim is None or victim.priority < seq.priority:
                    victim = seq
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            plan.append(ScheduledChunk(seq, n))
            planned.add(id(seq))
            budget -= n
        adapters = {s.scope.adapter_digest for s in self.running} - {None}
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < lim.max_running:
            seq = self.waiting[i]
            digest = seq.scope.adapter_digest
            if (digest is not None and digest not in adapters
                    and len(adapters) >= lim.max_adapters_per_step):
                i += 1  # adapter-aware: let a request whose adapter is already batched pass
                continue
            miss = self._match_prefix(seq)
            owner = self._inflight.get(miss) if miss is not None else None
            if owner is not None and owner is not seq:
                # Another running sequence of the same cache scope is computing this very
                # block: wait for it to be published instead of computing it twice.
                self.blocks.forget_hits(seq.scope,
                                        sum(b != NULL_BLOCK for b in seq.block_table))
                self.free_blocks(seq)
                self.deferred_admissions += 1
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.grow(seq, n):
                self.free_blocks(seq)
                break
            if seq.cached_prompt_tokens is None:
                seq.cached_prompt_tokens = seq.num_computed
            if self.recompute_past is not None and seq.num_tokens > self.recompute_past:
                seq.recomputed_past = True  # its prefill is past the length already
            self.waiting.pop(i)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._track(seq)
            if digest is not None:
                adapters.add(digest)
            plan.append(ScheduledChunk(seq, n))
            budget -= n
        # adapter-aware grouping: contiguous token runs per slot (SGMV segments)
        plan.sort(key=lambda c: (c.seq.slot, c.seq.arrival))
        return plan

    def publish_full_blocks(self, seq: Sequence) -> None:
        """After a step: put newly completed blocks into the prefix cache."""
        if not seq.publish_blocks:
            self._untrack(seq)
            return
        bs = self.block_size
        full = seq.num_computed // bs
        tokens = seq.tokens
        key = seq.scope.partition_key(self.policy)
        for j in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
            h = block_hash(parent, tokens[j * bs : (j + 1) * bs], key)
            self.blocks.publish(seq.block_table[j], h, seq.scope)
            seq.block_hashes.append(h)
        if seq.inflight_hash is not None:
            self._track(seq)
