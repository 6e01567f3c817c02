"""Compiled (numba) CPU elementwise ops of a layer for small steps: the residual add (with
the norm after attention or the MLP, where the family has one) and the next RMSNorm, the
q/k norm with rope and the KV-cache write, and the gated activation (SwiGLU, GeGLU), each
one call over every row instead of five to fifteen torch ops.

A SmolLM2 decode step ran about 4,000 torch ops, 120 small ones per layer for each of the
four matmuls; at one or a few rows each op's work is a few hundred nanoseconds and its
dispatch a few microseconds. The kernels take numpy views (`cpu_decode.as_array`) made
once per step, so a layer's elementwise work costs three calls. They do the torch ops'
roundings (bf16 rounded where each torch op rounds); sums inside the norm and the exp,
tanh or erf of the activation are within an ulp or two of torch's, not bit-identical
(tests/kernels).
"""

from __future__ import annotations

import functools
from typing import Any

from loraplane_kernels.cpu_decode import AVAILABLE, DTYPES, as_array

__all__ = ["AVAILABLE", "DTYPES", "GATED_ACTIVATIONS", "NORM_COPY", "NORM_NONE", "NORM_RMS",
           "QK_FULL", "QK_HEAD", "QK_NONE", "QK_NORMS", "as_array", "kernels"]

GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
"""transformers' ACT2FN names the compiled gated activation computes, by the index its
kernel takes (`tests/kernels/test_cpu_layer.py` checks each index against torch's op of
that name)."""


NORM_NONE, NORM_COPY, NORM_RMS = 0, 1, 2
"""What `residual_norm` writes to its `out` after the add: nothing (the last layer), h
itself (no norm before attention or the MLP: OLMo 2), or h's RMSNorm."""

QK_NONE, QK_HEAD, QK_FULL = 0, 1, 2
"""`rope_cache`'s q/k norm: none, per head over head_dim (Qwen3, Gemma 3), or over the
whole q and k projections (OLMo 2)."""

QK_NORMS = {None: QK_NONE, "head": QK_HEAD, "full": QK_FULL}
"""A family's `qk_norm` (`services.families`) as `rope_cache` takes it."""


@functools.cache
def kernels() -> Any:
    """The compiled kernels (`residual_norm`, `rope_cache`, `gated`), imported on first
    use as `cpu_decode`'s are."""
    from loraplane_kernels import _cpu_decode_numba

    return _cpu_decode_numba
