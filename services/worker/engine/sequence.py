"""Per-request state the scheduler and engine share while a request is in flight."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from .compat import CacheScope
from .request import FinishReason, GenerationRequest


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request being served: its tokens, KV blocks and decoding state.

    Tokens `[0, num_computed)` have K/V in the blocks of `block_table`. Preemption by
    recompute drops the blocks and resets `num_computed`; the generated tokens are kept and
    re-prefilled together with the prompt on re-admission.
    """

    request: GenerationRequest
    prompt_ids: list[int]
    scope: CacheScope
    arrival: int
    generator: torch.Generator
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    publish_blocks: bool = True
    """False once the sequence's scope was invalidated: its blocks must not be cached."""
    cached_prompt_tokens: int | None = None
    inflight_hash: bytes | None = None
    """Hash of the next full block this sequence will publish (see `Scheduler._track`)."""
    preemptions: int = 0
    recomputed_past: bool = False
    """Recomputed whole once it grew past `Scheduler.recompute_past` (it happens once)."""
    text: str = ""
    emitted_chars: int = 0
    finish_reason: FinishReason | None = None
    choice: int = 0
    """Which of the request's n choices (0 computes the prompt; the others fork from it)."""
    guide: Any = None
    """The choice's `grammar.GuideState` when the request asked for structured output."""
    cumulative_logprob: float = 0.0
    stop_reason: str | int | None = None
    prompt_logprobs: list[Any] | None = None
    """Prompt tokens' logprobs gathered so far (prompt_logprobs requests, choice 0)."""
    prompt_logprobs_sent: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def priority(self) -> tuple[int, int]:
        """Sort key: lower is more important (QoS tier, then arrival)."""
        return (int(self.request.qos_tier), self.arrival)
