"""The CPU kernels compiled into numba's on-disk cache before a worker starts."""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path

import torch

from loraplane_kernels import cpu_decode
from services.worker.engine.engine import Engine, EngineConfig

FORMATS: tuple[tuple[str, str], ...] = (
    ("float32", "dense"), ("bfloat16", "dense"), ("float32", "int8"), ("bfloat16", "int8"))
"""(activation dtype, base weights) pairs a CPU worker can serve: numba compiles a kernel
once per set of argument types, and each of these passes its own."""

MODELS: tuple[str, ...] = ("llama", "gemma", "gemma2", "gemma3_text")
"""Model types of tiny models whose steps pass the kernels different types, each built in
every format: Llama's stand for every family that norms in the activations' dtype
(Mistral, Qwen, Phi-3, OLMo 2, Granite, SmolLM3); Gemma 1-3 weigh their norms in fp32,
and Gemma 2 and 3 add post-norms, query-key norms and two ropes. Each over int8 weights
passes the one-kernel decode step (`layer_stack_rows`) yet other types again."""


def compile_kernels(models: tuple[str, ...] = MODELS
                    ) -> list[tuple[str, str, str, float]]:
    """Build an engine on a tiny random model of each kind in each format, which
    steps it through every compiled CPU path (`Engine._warm_up`), so that numba writes
    each kernel to its cache (the package's ``__pycache__``, or ``NUMBA_CACHE_DIR``). A
    worker built afterwards loads them in about a second instead of compiling them while
    its first heartbeats wait: 18-26 s a format (fp32, bf16) on a 2-core Xeon from a cold
    cache. The kernels depend on the types of their arguments, not on the model's shapes,
    so a tiny model compiles what a large one of its kind runs. Returns (model type,
    dtype, weights, seconds) per engine; nothing where numba is not installed."""
    if not cpu_decode.AVAILABLE:
        return []
    from numba.core.errors import NumbaIRAssumptionWarning

    done = []
    with tempfile.TemporaryDirectory(prefix="loraplane-kernels-") as tmp, \
            warnings.catch_warnings():
        # numba's own check of the IR it inlines, a page per kernel and nothing to act on
        warnings.simplefilter("ignore", NumbaIRAssumptionWarning)
        for model_type in models:
            path = Path(tmp) / model_type
            _write_tiny(path, model_type)
            for dtype, weights in FORMATS:
                t0 = time.perf_counter()
                Engine.from_pretrained(path, EngineConfig(dtype=dtype, device="cpu",
                                                          weights=weights))
                done.append((model_type, dtype, weights, time.perf_counter() - t0))
    return done


def _write_tiny(path: Path, model_type: str) -> None:
    """A random two-layer checkpoint of `model_type` (safetensors and config, no
    tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        model_type, vocab_size=96, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)
