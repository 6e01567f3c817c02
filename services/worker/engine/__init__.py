"""Inference engine: the served families' base models (`services.families`), multi-LoRA
batching, paged KV, scheduler.

The worker service drives it through `Engine` (requests, steps, streaming, adapter and
KV control) and reads `TokenEvent` / `GenerationResult` values back.
"""

from .adapter import AdapterDigest, AdapterFiles, LoraAdapter, parse_adapter
from .adapter_pool import AdapterPool, AdapterSlotInfo
from .checkpoint import checkpoint_digest
from .compat import CacheScope, KvReuse, SharingPolicy, decide
from .config import ModelConfig
from .engine import Engine, EngineConfig, EngineStats
from .errors import (
    AdapterDigestMismatch,
    AdapterError,
    AdapterNotLoadedError,
    AdapterPoolFullError,
    CheckpointError,
    EngineError,
    RequestError,
    UnsupportedModelError,
)
from .kv_cache import InvalidationResult
from .model import DecoderModel, LlamaModel
from .precision import cpu_has_bf16, serving_dtype
from .request import (
    ChoiceResult,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    QosTier,
    SamplingParams,
    TokenEvent,
)
from .scheduler import SchedulerLimits

__all__ = [
    "AdapterDigest",
    "AdapterDigestMismatch",
    "AdapterError",
    "AdapterFiles",
    "AdapterNotLoadedError",
    "AdapterPool",
    "AdapterPoolFullError",
    "AdapterSlotInfo",
    "CacheScope",
    "CheckpointError",
    "ChoiceResult",
    "DecoderModel",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "InvalidationResult",
    "KvReuse",
    "LlamaModel",
    "LoraAdapter",
    "ModelConfig",
    "QosTier",
    "RequestError",
    "SamplingParams",
    "SchedulerLimits",
    "SharingPolicy",
    "TokenEvent",
    "UnsupportedModelError",
    "checkpoint_digest",
    "cpu_has_bf16",
    "decide",
    "parse_adapter",
    "serving_dtype",
]
