"""The compiled elementwise ops of a layer (`loraplane_kernels.cpu_layer`) against the torch
ops of the model's own path: rope and the cache write bit for bit (the same products and
sums), the norm and SwiGLU within an ulp or two (their sums and exp differ in order only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane_kernels import cpu_layer
from services.worker.engine.model import ACTIVATIONS, rms_norm
from services.worker.engine.rope import apply_rotary

pytest.importorskip("numba")

DTYPES = (torch.float32, torch.bfloat16)
ULPS = {torch.float32: 4 * 2.0**-23, torch.bfloat16: 2.0**-7}
"""Relative distance allowed where the order of a sum may differ: a few fp32 ulps, and one
bf16 ulp (a value near a rounding boundary can land on either side)."""


def arr(t: torch.Tensor) -> np.ndarray:
    return cpu_layer.as_array(t)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype,
          scale: torch.Tensor | None = None) -> None:
    """Within `ULPS` of `want`, or of `scale` where given: an activation's tail
    (``0.5 x (1 + tanh(...))`` at large negative x) cancels, so its error is a few ulps of
    the operands' magnitude, not of the tiny result."""
    g, w = got.float(), want.float()
    ref = w.abs() if scale is None else torch.maximum(w.abs(), scale.float().abs())
    assert torch.all((g - w).abs() <= ULPS[dtype] * ref + 1e-30), (g - w).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weigh_in_fp32", [False, True])
@pytest.mark.parametrize("add", [False, True])
@given(rows=st.integers(1, 9), width=st.sampled_from([8, 64, 576, 1000]),
       seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 300.0]),
       multiplier=st.sampled_from([1.0, 0.5, 0.22]))
@settings(max_examples=15, deadline=None)
def test_residual_norm_is_the_add_and_the_norm(dtype: torch.dtype, weigh_in_fp32: bool,
                                               add: bool, rows: int, width: int, seed: int,
                                               scale: float, multiplier: float) -> None:
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, width, generator=g) * scale).to(dtype)
    delta = (torch.randn(rows, width, generator=g) * scale).to(dtype)
    weight = (torch.randn(width, generator=g) + 1).to(torch.float32 if weigh_in_fp32 else dtype)
    want_h = h + delta.clone().mul_(multiplier) if add else h.clone()  # the model's two ops
    want = rms_norm(want_h, weight, 1e-5, weigh_in_fp32=weigh_in_fp32)
    got_h, out = h.clone(), torch.empty_like(h)
    cpu_layer.kernels().residual_norm(arr(got_h), arr(delta), add, np.float32(multiplier),
                                      arr(weight), np.float32(1e-5), weigh_in_fp32, arr(out))
    assert torch.equal(got_h, want_h)  # the residual sum is one rounded add: exact
    close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "rot"),
                         [(9, 3, 64, 64), (4, 4, 32, 32), (8, 2, 16, 8)])
def test_rope_cache_rotates_and_writes_the_cache_bit_for_bit(dtype: torch.dtype, heads: int,
                                                             kv_heads: int, dim: int,
                                                             rot: int) -> None:
    g = torch.Generator().manual_seed(heads * dim + rot)
    t, slots_total = 5, 40
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 17, 1000, 31], dtype=torch.float32)
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.tensor([7, 0, 39, 12, 13])
    q_src = qkv[:, :heads * dim].view(t, heads, dim)
    k_src = qkv[:, heads * dim:(heads + kv_heads) * dim].view(t, kv_heads, dim)
    v_src = qkv[:, (heads + kv_heads) * dim:].view(t, kv_heads, dim)
    want_q, want_k = apply_rotary(q_src, cos, sin), apply_rotary(k_src, cos, sin)
    want_kc = torch.zeros(kv_heads, slots_total, dim, dtype=dtype)
    want_vc = torch.zeros_like(want_kc)
    want_kc.index_copy_(1, slots, want_k.transpose(0, 1))
    want_vc.index_copy_(1, slots, v_src.transpose(0, 1))
    q, k = torch.empty(t, heads, dim, dtype=dtype), torch.empty(t, kv_heads, dim, dtype=dtype)
    kc, vc = torch.zeros_like(want_kc), torch.zeros_like(want_vc)
    cpu_layer.kernels().rope_cache(arr(qkv), arr(cos), arr(sin), heads, kv_heads, arr(q),
                                   arr(k), arr(kc), arr(vc), slots.numpy())
    assert torch.equal(q, want_q)
    assert torch.equal(k, want_k)
    assert torch.equal(kc, want_kc)
    assert torch.equal(vc, want_vc)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", cpu_layer.GATED_ACTIVATIONS)
def test_gated_activation_is_act_times_up(dtype: torch.dtype, activation: str) -> None:
    g = torch.Generator().manual_seed(0)
    inter = 1536
    gu = (torch.randn(6, 2 * inter, generator=g) * 6).to(dtype)
    gu[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 30.0, -30.0])
    act = ACTIVATIONS[activation]
    want = act(gu[:, :inter].clone()) * gu[:, inter:]
    out = torch.empty(6, inter, dtype=dtype)
    cpu_layer.kernels().gated(arr(gu), cpu_layer.GATED_ACTIVATIONS.index(activation), arr(out))
    close(out, want, dtype, scale=gu[:, :inter].float() * gu[:, inter:].float())


def test_the_compiled_activations_are_the_models() -> None:
    """The engine picks the kernel's activation by index into `GATED_ACTIVATIONS`, whose
    names are entries of the model's `ACTIVATIONS` (the test above checks each index)."""
    assert set(cpu_layer.GATED_ACTIVATIONS) <= set(ACTIVATIONS)
