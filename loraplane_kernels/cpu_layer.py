"""Compiled (numba) CPU elementwise ops of a layer, for steps of any size (`step_kernels`:
in row shares from `SHARE_ROWS` rows): the residual add (with the norm after attention or
the MLP, where the family has one) and the next RMSNorm, the q/k norm with rope and the
KV-cache write, and the gated activation (SwiGLU, GeGLU), each one call over every row
instead of five to fifteen torch ops.

A SmolLM2 decode step ran about 4,000 torch ops, 120 small ones per layer for each of the
four matmuls; at one or a few rows each op's work is a few hundred nanoseconds and its
dispatch a few microseconds. The kernels take numpy views (`cpu_decode.as_array`) made
once per step, so a layer's elementwise work costs four calls of three kernels. They do
the torch ops' roundings (bf16 rounded where each torch op rounds); sums inside the norm
and the exp, tanh or erf of the activation are within an ulp or two of torch's, not
bit-identical (tests/kernels).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from loraplane_kernels import cpu_decode
from loraplane_kernels.cpu_decode import AVAILABLE, DTYPES, as_array

__all__ = ["AVAILABLE", "DTYPES", "GATED_ACTIVATIONS", "NORM_COPY", "NORM_NONE", "NORM_RMS",
           "QK_FULL", "QK_HEAD", "QK_NONE", "QK_NORMS", "SHARE_ROWS", "as_array", "kernels",
           "step_kernels"]

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


SHARE_ROWS = 8
"""Steps of at least this many rows run the three ops in row shares on numba's threads
(`step_kernels`). At SmolLM2's shapes in bf16 on 2 cores of a Xeon, a layer's four calls
took 31.7 us serial and 25.1 in shares at 8 rows, 117 and 68 at 32, and 17.3 and 18.2 at
4, where a launch on the threads costs about what a share saves; a 4,096-token prefill's
went from 630 to 330 ms a step."""


def step_kernels(rows: int) -> tuple[Callable[..., None], Callable[..., None],
                                     Callable[..., None]]:
    """`residual_norm`, `rope_cache` and `gated` for a step of `rows` rows, each call's
    rows in one share per intra-op thread from `SHARE_ROWS` rows on. Smaller steps take
    the same kernels in one share, as `cpu_decode.linear_rows` does: one compiled body for
    every step size and thread count, so a row's bits do not depend on what shares its
    step (the serial kernels, compiled apart, summed an fp32 norm in another order). One
    share costs about 1.3 us a call more than the serial kernel. Where numba has no
    thread-safe threading layer, the serial kernels."""
    k = kernels()
    serial = (k.residual_norm, k.rope_cache, k.gated)
    if not cpu_decode.threadsafe():
        return serial
    parts = torch.get_num_threads() if rows >= SHARE_ROWS else 1
    shared = (k.residual_norm_shares, k.rope_cache_shares, k.gated_shares)
    return tuple(_in_shares(p, s, parts) for p, s in zip(shared, serial, strict=True))  # type: ignore[return-value]


def _in_shares(shared: Callable[..., None], serial: Callable[..., None],
               parts: int) -> Callable[..., None]:
    def run(*args: Any) -> None:
        if not cpu_decode.on_threads(shared, *args, parts):
            serial(*args)
    return run


def layer_stack_rows() -> Callable[..., None] | None:
    """The kernel that runs every layer of a few-row decode step, its adapters' deltas
    included, in one call (`_cpu_decode_numba.layer_stack_rows`), or None where numba's
    threads cannot run (it launches the shared kernels from compiled code, with no serial
    fallback)."""
    if not cpu_decode.threadsafe():
        return None
    return kernels().layer_stack_rows
