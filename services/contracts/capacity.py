"""One capacity rule: what the registry accepts, every worker holds.

The registry's upload validation (`services/registry/validation.py`) and the worker's
adapter loader (`services/worker/engine/adapter.py`, `adapter_pool.py`) check an adapter's
rank and dtype with these functions (its target modules by the base model's family
description, `services.families.adapters`, which both call too), and a regression set's
cases with `check_context` against the context a worker serves (`serving_context`). The limits come
from settings the registry shares with the workers (one `LORAPLANE_*` environment, as
`loraplane up` and the compose file give it): the rank is the workers' own pool size
(`worker_max_lora_rank`), the dtypes `allowed_dtypes` (within what the engine holds), the
context the workers' `worker_max_model_len` and KV cache over the registered base model's
`max_position_embeddings`. So the registry refuses (422, naming the limit) exactly what a
worker could not load, rather than publishing it for every worker to fail on.

No torch here: the registry does not load tensors, and the worker maps its own dtypes
to these names.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from services.config import Settings

ENGINE_DTYPES = ("float16", "bfloat16", "float32")
"""Adapter dtypes a worker's pool holds (the engine's `HOST_DTYPES`); `allowed_dtypes`
may narrow them, never widen them."""
DEFAULT_MAX_POSITIONS = 2048
"""A base config.json without `max_position_embeddings`: what the engine assumes."""

Limit = Literal["max_lora_rank", "dtype", "target_modules", "context"]


class OverCapacity(ValueError):
    """An adapter or request past a limit of the fleet; `limit` names which."""

    def __init__(self, limit: Limit, message: str) -> None:
        super().__init__(message)
        self.limit = limit
        self.message = message


@dataclass(frozen=True)
class AdapterLimits:
    """What every worker's adapter pool holds."""

    max_rank: int
    dtypes: tuple[str, ...] = ENGINE_DTYPES

    @classmethod
    def of(cls, settings: Settings) -> AdapterLimits:
        """The fleet's limits, from the settings the registry shares with the workers."""
        return cls(settings.worker_max_lora_rank, tuple(settings.allowed_dtypes))

    def check_rank(self, rank: int) -> None:
        if rank > self.max_rank:
            raise OverCapacity("max_lora_rank", f"r={rank} exceeds the maximum rank "
                               f"{self.max_rank} a worker's adapter pool holds "
                               "(LORAPLANE_WORKER_MAX_LORA_RANK)")

    def check_dtypes(self, dtypes: Collection[str]) -> str:
        """The adapter's one dtype; refuses one a worker does not hold, or a mix."""
        refused = sorted(set(dtypes) - set(self.dtypes))
        if refused:
            raise OverCapacity("dtype", f"dtype {', '.join(refused)} is not one a worker "
                               f"holds: {list(self.dtypes)} (LORAPLANE_ALLOWED_DTYPES)")
        if len(set(dtypes)) != 1:
            raise OverCapacity("dtype", f"an adapter has one dtype; this one mixes "
                               f"{sorted(set(dtypes))}")
        return next(iter(dtypes))


def serving_context(settings: Settings, base_config: Mapping[str, Any]) -> int:
    """Prompt + completion tokens a worker serves per request on this base model: its
    `worker_max_model_len` (default the model's `max_position_embeddings`), at most what
    its KV cache holds."""
    positions = int(base_config.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS)
    kv_tokens = settings.worker_kv_blocks * settings.worker_block_size
    return min(settings.worker_max_model_len or positions, kv_tokens)


def check_context(prompt_tokens: int, max_tokens: int, context: int) -> None:
    """A request of `prompt_tokens` asking `max_tokens` (at least 1) fits the context."""
    if prompt_tokens + max_tokens > context:
        raise OverCapacity("context", f"{prompt_tokens} prompt tokens + max_tokens "
                           f"{max_tokens} exceed the context of {context} tokens a worker "
                           "serves for this base model")
