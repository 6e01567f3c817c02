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
once per argument types, and these four are every type set an engine's steps pass."""


def compile_kernels(formats: tuple[tuple[str, str], ...] = FORMATS
                    ) -> list[tuple[str, str, float]]:
    """Build an engine on a tiny random Llama in each format, which steps it through every
    compiled CPU path (`Engine._warm_up`), so that numba writes each kernel to its cache
    (the package's ``__pycache__``, or ``NUMBA_CACHE_DIR``). A worker built afterwards
    loads them in about a second instead of compiling them while its first heartbeats
    wait: 18-26 s a format (fp32, bf16) on a 2-core Xeon from a cold cache. The kernels
    depend on the types of their arguments, not on the model's shapes, so a tiny model
    compiles what a large one runs. Returns (dtype, weights, seconds) per format; nothing
    where numba is not installed."""
    if not cpu_decode.AVAILABLE:
        return []
    from numba.core.errors import NumbaIRAssumptionWarning

    done = []
    with tempfile.TemporaryDirectory(prefix="loraplane-kernels-") as tmp, \
            warnings.catch_warnings():
        # numba's own check of the IR it inlines, a page per kernel and nothing to act on
        warnings.simplefilter("ignore", NumbaIRAssumptionWarning)
        path = Path(tmp)
        _write_tiny_llama(path)
        for dtype, weights in formats:
            t0 = time.perf_counter()
            Engine.from_pretrained(path, EngineConfig(dtype=dtype, device="cpu",
                                                      weights=weights))
            done.append((dtype, weights, time.perf_counter() - t0))
    return done


def _write_tiny_llama(path: Path) -> None:
    """A random two-layer Llama checkpoint (safetensors and config, no tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
