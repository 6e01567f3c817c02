"""Compiled (numba) CPU elementwise ops of a layer for small steps: the residual add with
the next RMSNorm, rope with the KV-cache write, and the gated activation (SwiGLU, GeGLU),
each one call over every row instead of five to fifteen torch ops.

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

__all__ = ["AVAILABLE", "DTYPES", "GATED_ACTIVATIONS", "as_array", "kernels"]

GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
"""transformers' ACT2FN names the compiled gated activation computes, by the index its
kernel takes (`tests/kernels/test_cpu_layer.py` checks each index against torch's op of
that name)."""


@functools.cache
def kernels() -> Any:
    """The compiled kernels (`residual_norm`, `rope_cache`, `gated`), imported on first
    use as `cpu_decode`'s are."""
    from loraplane_kernels import _cpu_decode_numba

    return _cpu_decode_numba
