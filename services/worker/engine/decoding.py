"""What a step does with its logits beyond one token per sequence: the rows it asks the
model for, prompt logprobs, and the n choices of a request.

Choices (n > 1, best_of) fork from the request's sequence when its prompt is computed,
right before the first token is sampled: each child takes a reference on every full
block of the prompt (shared, refcounted, never written again) and a private copy of the
last, partial block, the one its own tokens will be written into (copy-on-write at the
fork), so the prompt is computed and stored once for all choices. Each choice draws
from its own generator (`seed + i`, vLLM's rule) and has its own grammar matcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .compat import CacheScope
from .request import ChoiceResult, GenerationRequest
from .sampling import make_generator
from .sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from .scheduler import ScheduledChunk


@dataclass
class ChoiceGroup:
    """A request's sequences and the results of those that ended."""

    request: GenerationRequest
    seqs: list[Sequence]
    results: dict[int, ChoiceResult] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.request.sampling.n

    @property
    def done(self) -> bool:
        return len(self.results) == self.size


@dataclass
class PromptRows:
    """Logits rows of prompt positions whose next prompt token's logprob is wanted."""

    seq: Sequence
    first: int
    """Logits row index (in the step's logits) of the first position."""
    targets: list[int]
    """The prompt tokens those rows predict."""


@dataclass
class LogitsPlan:
    rows: list[int] = field(default_factory=list)
    """Token rows of the batch to compute logits for: sampling rows first, in order."""
    sampling: list[ScheduledChunk] = field(default_factory=list)
    prompt: list[PromptRows] = field(default_factory=list)


def logits_plan(plan: list[ScheduledChunk]) -> LogitsPlan:
    """Which rows need logits: each sampling chunk's last token, and the prompt positions
    of chunks whose request asked for prompt logprobs (`chunk.row`: the chunk's first
    token row in the batch)."""
    out = LogitsPlan()
    for chunk in plan:
        if chunk.samples:
            out.rows.append(chunk.row + chunk.num_tokens - 1)
            out.sampling.append(chunk)
    for chunk in plan:
        seq = chunk.seq
        if seq.request.sampling.prompt_logprobs is None or seq.choice:
            continue
        last = len(seq.prompt_ids) - 1  # its logits are the first token's, a sampling row
        start = max(seq.num_computed, len(seq.prompt_logprobs or ()))
        end = min(seq.num_computed + chunk.num_tokens, last)
        if end <= start:
            continue
        out.prompt.append(PromptRows(seq, len(out.rows), seq.prompt_ids[start + 1:end + 1]))
        out.rows.extend(chunk.row + p - seq.num_computed for p in range(start, end))
    return out


def fork(parent: Sequence, engine: object) -> list[Sequence]:
    """The request's other choices, sharing the parent's computed prompt blocks."""
    from .engine import Engine

    assert isinstance(engine, Engine)
    request = parent.request
    params = request.sampling
    bs = engine.config.block_size
    computed = parent.num_computed
    full = computed // bs
    children = []
    for i in range(1, params.n):
        seed = None if params.seed is None else params.seed + i
        child = Sequence(
            request=request, prompt_ids=parent.prompt_ids,
            scope=CacheScope(parent.scope.base_digest, parent.scope.adapter_digest,
                             parent.scope.tenant_key, parent.scope.sharing_scope),
            arrival=parent.arrival, generator=make_generator(seed), slot=parent.slot,
            publish_blocks=False, choice=i)
        child.guide = parent.guide.fork() if parent.guide is not None else None
        child.cached_prompt_tokens = parent.cached_prompt_tokens
        if request.adapter_digest is not None:
            engine.adapters.acquire(request.adapter_digest)
        tail = parent.block_table[full] if computed % bs else None
        copy = engine.blocks.allocate() if tail is not None else None
        if tail is not None and copy is None:  # no block to copy into: prefill it later
            engine.scheduler.add(child)
            children.append(child)
            continue
        for bid in parent.block_table[:full]:
            if bid >= 0:  # a block released outside a sliding window stays released
                engine.blocks.retain(bid)
            child.block_table.append(bid)
        if tail is not None and copy is not None:
            src = slice(tail * bs, (tail + 1) * bs)
            dst = slice(copy * bs, (copy + 1) * bs)
            engine.kv.k[:, :, dst] = engine.kv.k[:, :, src]
            engine.kv.v[:, :, dst] = engine.kv.v[:, :, src]
            child.block_table.append(copy)
        child.num_computed = computed
        child.status = SequenceStatus.RUNNING
        engine.scheduler.running.append(child)
        children.append(child)
    return children
