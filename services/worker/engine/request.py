"""The small values that cross the engine boundary: requests in, token events out.

The gRPC worker builds `GenerationRequest`s and relays `TokenEvent`s; nothing else of the
engine's internals needs to be visible to it.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import RequestError

if TYPE_CHECKING:
    from .adapter import AdapterDigest


class QosTier(enum.IntEnum):
    """The tenant's paid tier, by the names the contracts and the proto use.

    Lower value is served (and kept under preemption) first.
    """

    PLATINUM = 0
    GOLD = 1
    SILVER = 2
    BRONZE = 3

    @classmethod
    def of(cls, name: str) -> QosTier:
        """From the contracts' spelling ("platinum", …, as in `AdapterVersionPublished`)."""
        try:
            return cls[name.upper()]
        except KeyError:
            raise RequestError(f"unknown QoS tier {name!r} (platinum, gold, silver, bronze)") \
                from None

    @property
    def label(self) -> str:
        return self.name.lower()


class FinishReason(enum.Enum):
    LENGTH = "length"
    """max_tokens reached."""
    STOP = "stop"
    """An EOS token or a stop string."""
    ABORT = "abort"
    """Cancelled by the caller, by an adapter unload, or by a hard tenant purge."""


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings. temperature 0 means greedy."""

    max_tokens: int = 16
    min_tokens: int = 0
    """End-of-sequence tokens cannot be sampled until this many tokens exist (what
    transformers' `min_new_tokens` does); stop strings still end the output earlier."""
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    """Keep decoding past end-of-sequence tokens, to exactly `max_tokens` (benchmarks,
    fixed-length outputs); EOS may still be sampled and is returned as a token."""
    top_k: int = 0
    """0 (or -1): off."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    """End the choice like end-of-sequence does (the token counts, its text is not shown)."""
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    """Set: the prompt tokens' logprobs with that many alternatives (the prompt is then
    computed, never taken from the prefix cache, which holds no logits)."""
    n: int = 1
    """Sequences generated from the prompt, sharing its KV blocks (best_of counts here)."""
    seed_stride: bool = True
    """Choice i draws from `seed + i` (vLLM's rule), so each has a stream of its own."""
    guide: GuideSpec | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError("max_tokens must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError("min_tokens must be within [0, max_tokens]")
        if self.temperature < 0:
            raise RequestError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p must be in (0, 1]")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty")
        if self.n < 1:
            raise RequestError("n must be >= 1")
        if self.repetition_penalty <= 0:
            raise RequestError("repetition_penalty must be > 0")
        if not 0 <= self.min_p <= 1:
            raise RequestError("min_p must be in [0, 1]")
        if self.top_logprobs < 0:
            raise RequestError("top_logprobs must be >= 0")

    @property
    def wants_logprob(self) -> bool:
        """The chosen tokens' logprobs are computed (asked for, or ranking best_of)."""
        return self.logprobs or self.top_logprobs > 0 or self.n > 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GuideSpec:
    """Structured output asked for: `kind` is json_schema, json_object, regex, choice,
    grammar (EBNF) or structural (tool calls: `grammar.tool_call_guide`); compiled once per
    spec and tokenizer by the engine's grammar cache."""

    kind: str
    value: str = ""


_ids = itertools.count()


@dataclass
class GenerationRequest:
    """One generation. Give `prompt_token_ids`, or `prompt` text when a tokenizer exists.

    `adapter_digest` names a resident adapter by its registry digests (None = base model);
    `tenant_key` is the tenant isolation key and `sharing_scope` its compliance scope for
    cross-tenant base-prefix sharing (None: shares with nobody). `on_token`, if set, is
    called with each `TokenEvent` from inside `Engine.step`.
    """

    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter_digest: AdapterDigest | None = None
    tenant_key: str = "default"
    sharing_scope: str | None = None
    qos_tier: QosTier = QosTier.SILVER
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    on_token: Callable[[TokenEvent], None] | None = None


@dataclass(frozen=True)
class TokenEvent:
    """One streamed step of a request: a token (or none, when finishing on abort)."""

    request_id: str
    token_id: int | None
    text: str
    """Newly releasable text. Text that could start a stop string is held back until it
    is known not to be one."""
    index: int
    finished: bool = False
    """The whole request ended (every choice)."""
    finish_reason: FinishReason | None = None
    """Set on the event that ends this choice."""
    choice: int = 0
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the choice (None for end-of-sequence)."""
    prompt_logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None = None
    """On choice 0's first event when asked for: one entry per prompt token after the first."""


@dataclass
class GenerationResult:
    """The whole output of a finished request."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    cached_prompt_tokens: int
    """Prompt tokens served from the prefix cache (first admission only)."""
    preemptions: int = 0
    choices: list[ChoiceResult] = field(default_factory=list)
    """Every generated sequence (the first is the one above)."""


@dataclass
class ChoiceResult:
    """One generated sequence of a request."""

    choice: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stop_reason: str | int | None = None
    cumulative_logprob: float = 0.0
