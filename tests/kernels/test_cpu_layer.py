"""The compiled elementwise ops of a layer (`loraplane_kernels.cpu_layer`) against the torch
ops of the model's own path: rope and the cache write bit for bit (the same products and
sums), the norm and SwiGLU within an ulp or two (their sums and exp differ in order only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane_kernels import cpu_decode, cpu_layer
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
       multiplier=st.sampled_from([1.0, 0.5, 0.22]), out_norm=st.booleans(),
       mode=st.sampled_from([cpu_layer.NORM_RMS, cpu_layer.NORM_COPY, cpu_layer.NORM_NONE]))
@settings(max_examples=15, deadline=None)
def test_residual_norm_is_the_add_and_the_norm(dtype: torch.dtype, weigh_in_fp32: bool,
                                               add: bool, rows: int, width: int, seed: int,
                                               scale: float, multiplier: float,
                                               out_norm: bool, mode: int) -> None:
    """With `out_norm`, the delta is RMSNormed first (Gemma 2 and 3, OLMo 2: the norm
    after attention or the MLP); `mode` writes h's norm, h itself, or nothing."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, width, generator=g) * scale).to(dtype)
    delta = (torch.randn(rows, width, generator=g) * scale).to(dtype)
    weight_dtype = torch.float32 if weigh_in_fp32 else dtype
    weight = (torch.randn(width, generator=g) + 1).to(weight_dtype)
    delta_weight = (torch.randn(width, generator=g) + 1).to(weight_dtype) if out_norm \
        else torch.empty(0, dtype=weight_dtype)
    # the model's ops: the norm after (its own rounded buffer), the scale, the add
    normed = rms_norm(delta, delta_weight, 1e-5, weigh_in_fp32=weigh_in_fp32) if out_norm \
        else delta.clone()
    want_h = h + normed.mul_(multiplier) if add else h.clone()
    got_h, out = h.clone(), torch.zeros_like(h)
    cpu_layer.kernels().residual_norm(arr(got_h), arr(delta), add, np.float32(multiplier),
                                      arr(delta_weight), arr(weight), mode, np.float32(1e-5),
                                      weigh_in_fp32, arr(out))
    if out_norm and add:
        # the normed delta's sum of squares differs in order only, so the kernel's normed
        # delta may sit an ulp from torch's; its product with the multiplier and its sum
        # with h each round once more, to either side: an ulp of the product for the
        # first, of the product and of the sum for the others (hypothesis found the sum
        # two ulps apart), so within an ulp of |h| + 3 |multiplier x normed delta|
        close(got_h, want_h, dtype, scale=h.float().abs() + 3 * normed.float().abs())
        want_h = got_h
    else:
        assert torch.equal(got_h, want_h)  # the residual sum is one rounded add: exact
    if mode == cpu_layer.NORM_RMS:
        close(out, rms_norm(want_h, weight, 1e-5, weigh_in_fp32=weigh_in_fp32), dtype)
    elif mode == cpu_layer.NORM_COPY:
        assert torch.equal(out, want_h)
    else:
        assert not out.any()


def rope_case(dtype: torch.dtype, heads: int, kv_heads: int, dim: int, rot: int):
    g = torch.Generator().manual_seed(heads * dim + rot)
    t = 5
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 17, 1000, 31], dtype=torch.float32)
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    return g, qkv, emb.cos().to(dtype), emb.sin().to(dtype), torch.tensor([7, 0, 39, 12, 13])


def run_rope_cache(qkv, cos, sin, heads, kv_heads, dim, slots, qk_norm=cpu_layer.QK_NONE,
                   q_weight=None, k_weight=None, weigh_in_fp32=False):
    t, dtype = qkv.shape[0], qkv.dtype
    q, k = torch.empty(t, heads, dim, dtype=dtype), torch.empty(t, kv_heads, dim, dtype=dtype)
    kc = torch.zeros(kv_heads, 40, dim, dtype=dtype)
    vc = torch.zeros_like(kc)
    empty = torch.empty(0, dtype=dtype)
    cpu_layer.kernels().rope_cache(
        arr(qkv), arr(cos), arr(sin), heads, kv_heads, arr(q), arr(k), arr(kc), arr(vc),
        slots.numpy(), qk_norm, arr(empty if q_weight is None else q_weight),
        arr(empty if k_weight is None else k_weight), np.float32(1e-6), weigh_in_fp32)
    return q, k, kc, vc


def cache_of(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    kc = torch.zeros(k.shape[1], 40, k.shape[2], dtype=k.dtype)
    vc = torch.zeros_like(kc)
    kc.index_copy_(1, slots, k.transpose(0, 1))
    vc.index_copy_(1, slots, v.transpose(0, 1))
    return kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "rot"),
                         [(9, 3, 64, 64), (4, 4, 32, 32), (8, 2, 16, 8)])
def test_rope_cache_rotates_and_writes_the_cache_bit_for_bit(dtype: torch.dtype, heads: int,
                                                             kv_heads: int, dim: int,
                                                             rot: int) -> None:
    _, qkv, cos, sin, slots = rope_case(dtype, heads, kv_heads, dim, rot)
    t = qkv.shape[0]
    q_src = qkv[:, :heads * dim].view(t, heads, dim)
    k_src = qkv[:, heads * dim:(heads + kv_heads) * dim].view(t, kv_heads, dim)
    v_src = qkv[:, (heads + kv_heads) * dim:].view(t, kv_heads, dim)
    want_q, want_k = apply_rotary(q_src, cos, sin), apply_rotary(k_src, cos, sin)
    q, k, kc, vc = run_rope_cache(qkv, cos, sin, heads, kv_heads, dim, slots)
    assert torch.equal(q, want_q)
    assert torch.equal(k, want_k)
    want_kc, want_vc = cache_of(want_k, v_src, slots)
    assert torch.equal(kc, want_kc)
    assert torch.equal(vc, want_vc)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weigh_in_fp32", [False, True])
@pytest.mark.parametrize("qk_norm", ["head", "full"])
def test_rope_cache_norms_q_and_k_first(dtype: torch.dtype, weigh_in_fp32: bool,
                                        qk_norm: str) -> None:
    """Qwen3 and Gemma 3 norm each head of q and k, OLMo 2 the whole q and k projections,
    before rope: the model's `rms_norm` then `apply_rotary`, within the norm's ulp."""
    heads, kv_heads, dim = 4, 2, 32
    g, qkv, cos, sin, slots = rope_case(dtype, heads, kv_heads, dim, dim)
    t = qkv.shape[0]
    width = dim if qk_norm == "head" else None
    weight_dtype = torch.float32 if weigh_in_fp32 else dtype
    q_weight = (torch.randn(width or heads * dim, generator=g) + 1).to(weight_dtype)
    k_weight = (torch.randn(width or kv_heads * dim, generator=g) + 1).to(weight_dtype)
    q_src, k_src = qkv[:, :heads * dim], qkv[:, heads * dim:(heads + kv_heads) * dim]
    if qk_norm == "full":
        q_src = rms_norm(q_src, q_weight, 1e-6, weigh_in_fp32=weigh_in_fp32)
        k_src = rms_norm(k_src, k_weight, 1e-6, weigh_in_fp32=weigh_in_fp32)
    q_src, k_src = q_src.reshape(t, heads, dim), k_src.reshape(t, kv_heads, dim)
    if qk_norm == "head":
        q_src = rms_norm(q_src, q_weight, 1e-6, weigh_in_fp32=weigh_in_fp32)
        k_src = rms_norm(k_src, k_weight, 1e-6, weigh_in_fp32=weigh_in_fp32)
    want_q, want_k = apply_rotary(q_src, cos, sin), apply_rotary(k_src, cos, sin)
    q, k, kc, vc = run_rope_cache(qkv, cos, sin, heads, kv_heads, dim, slots,
                                  cpu_layer.QK_NORMS[qk_norm], q_weight, k_weight,
                                  weigh_in_fp32)
    # a normed value an ulp off moves its rotated products by about an ulp of the inputs
    bound = q_src.float().abs().amax(-1, keepdim=True).expand_as(q_src)
    close(q, want_q, dtype, scale=2 * bound)
    close(k, want_k, dtype, scale=2 * k_src.float().abs().amax(-1, keepdim=True)
          .expand_as(k_src))
    want_kc, want_vc = cache_of(k, qkv[:, (heads + kv_heads) * dim:].view(t, kv_heads, dim),
                                slots)
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


@pytest.mark.parametrize("dtype", DTYPES)
@given(rows=st.integers(1, 40), parts=st.integers(2, 5), qk_norm=st.sampled_from(
    [cpu_layer.QK_NONE, cpu_layer.QK_HEAD, cpu_layer.QK_FULL]), seed=st.integers(0, 2**16))
@settings(max_examples=12, deadline=None)
def test_row_shares_give_one_shares_bits(dtype: torch.dtype, rows: int, parts: int,
                                         qk_norm: int, seed: int) -> None:
    """A step runs the three ops in row shares on numba's threads, a small one in a single
    share (`cpu_layer.step_kernels`): any number of shares, more than the rows included,
    writes every row, the cache and h exactly as one share does."""
    k = cpu_layer.kernels()
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, hidden, inter = 4, 2, 16, 48, 40

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    h, delta, weight = rand(rows, hidden), rand(rows, hidden), rand(hidden)
    qkv, cos, sin = rand(rows, (heads + 2 * kv_heads) * dim), rand(rows, dim), rand(rows, dim)
    gate_up = rand(rows, 2 * inter)
    slots = torch.randperm(64, generator=g)[:rows].numpy()
    q_w, k_w = (rand(dim), rand(dim)) if qk_norm == cpu_layer.QK_HEAD else (
        rand(heads * dim), rand(kv_heads * dim))
    eps = np.float32(1e-6)
    got = []
    for shares in (1, parts):
        hs, out = h.clone(), torch.empty(rows, hidden, dtype=dtype)
        q, kk = torch.empty(rows, heads, dim, dtype=dtype), torch.empty(rows, kv_heads, dim,
                                                                         dtype=dtype)
        kc, vc = torch.zeros(kv_heads, 64, dim, dtype=dtype), torch.zeros(kv_heads, 64, dim,
                                                                          dtype=dtype)
        act = torch.empty(rows, inter, dtype=dtype)
        k.residual_norm_shares(arr(hs), arr(delta), True, np.float32(0.5), arr(weight),
                               arr(weight), cpu_layer.NORM_RMS, eps, False, arr(out), shares)
        k.rope_cache_shares(arr(qkv), arr(cos), arr(sin), heads, kv_heads, arr(q), arr(kk),
                            arr(kc), arr(vc), slots, qk_norm, arr(q_w), arr(k_w), eps, False,
                            shares)
        k.gated_shares(arr(gate_up), 0, arr(act), shares)
        got.append((hs, out, q, kk, kc, vc, act))
    for one, many in zip(*got, strict=True):
        assert torch.equal(one.view(torch.uint8), many.view(torch.uint8))


def test_step_kernels_take_shares_from_share_rows(monkeypatch) -> None:
    """From `SHARE_ROWS` rows a step's calls go in one share per thread, below it in one
    share; with no thread-safe threading layer, the serial kernels."""
    k = cpu_layer.kernels()
    calls: list[int] = []
    monkeypatch.setattr(k, "gated_shares", lambda *args: calls.append(args[-1]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for rows in (1, cpu_layer.SHARE_ROWS - 1, cpu_layer.SHARE_ROWS):
            cpu_layer.step_kernels(rows)[2](None, 0, None)
        torch.set_num_threads(1)
        cpu_layer.step_kernels(4096)[2](None, 0, None)
    finally:
        torch.set_num_threads(threads)
    if cpu_decode.threadsafe():
        assert calls == [1, 1, 2, 1]
    monkeypatch.setattr(cpu_decode, "_PARALLEL", [False])
    assert cpu_layer.step_kernels(4096)[2] is k.gated
