"""The int8 weight-only base: the format's round trip, and the engine serving it next to
the dense base (same tokens mostly, logits close) with LoRA in the serving dtype."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane_kernels.int8 import (
    DEQUANT_ROWS,
    INT8PACK_MAX_ROWS,
    Int8Weight,
    dequant_buffer_shape,
    int8_linear,
    quantize_int8,
)
from services.worker.engine import (
    Engine,
    EngineConfig,
    GenerationRequest,
    RequestError,
    SamplingParams,
)

PROMPTS = [[5, 7, 9, 11, 13, 17, 19, 23, 29], [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]


def make_engine(tiny, weights: str, dtype: str = "float32") -> Engine:
    return Engine.from_pretrained(tiny.path, EngineConfig(
        num_kv_blocks=64, block_size=4, adapter_slots=4, max_lora_rank=16, dtype=dtype,
        weights=weights))


@given(rows=st.integers(1, 40), cols=st.integers(1, 70), seed=st.integers(0, 2**16),
       spread=st.sampled_from([1e-3, 1.0, 50.0]))
@settings(max_examples=40, deadline=None)
def test_round_trip_is_within_half_a_step_of_each_row(rows, cols, seed, spread):
    """Every element comes back within half a quantisation step (max|row| / 254) of its
    value, plus the rounding of the scale to bf16 (2^-8 relative, times 127 steps)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * spread).to(torch.bfloat16)
    w[0] = 0  # an all-zero row: scale 0, exact zeros
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8 and int(q.q.abs().max()) <= 127
    back = q.dequantize().float()
    amax = w.float().abs().amax(dim=1, keepdim=True)
    bound = amax / 254 * (1 + 127 * 2**-8) + amax * 2**-8  # + the bf16 rounding of back
    assert torch.all((back - w.float()).abs() <= bound + 1e-30)
    assert torch.equal(back[0], torch.zeros(cols))


@given(rows=st.integers(0, 40), cols=st.integers(1, 90), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]))
@settings(max_examples=40, deadline=None)
def test_the_one_pass_dequantisation_is_torchs_copy_and_multiply(rows, cols, seed, dtype):
    """`Int8Weight.dequantize` (one compiled pass over memory where numba runs) gives the
    bits of torch's int8 copy and row-scale multiply."""
    g = torch.Generator().manual_seed(seed)
    w = quantize_int8((torch.randn(rows, cols, generator=g) * 3).to(dtype))
    want = torch.empty(rows, cols, dtype=dtype).copy_(w.q).mul_(w.scale[:, None])
    assert torch.equal(w.dequantize(), want)
    assert torch.equal(w.dequantize(torch.full((rows, cols), float("nan"), dtype=dtype)),
                       want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, INT8PACK_MAX_ROWS, INT8PACK_MAX_ROWS + 1, 64])
def test_int8_linear_matches_the_dequantised_product(dtype, rows):
    """Both CPU paths (the int8 kernel for few rows, dequantise + dense matmul above) give
    the dense product of the dequantised weight, to the serving dtype's rounding."""
    g = torch.Generator().manual_seed(rows)
    w = quantize_int8(torch.randn(48, 96, generator=g).to(dtype))
    x = torch.randn(rows, 96, generator=g).to(dtype)
    bias = torch.randn(48, generator=g).to(dtype)
    ref = x.float() @ w.dequantize().float().t() + bias.float()
    got = int8_linear(x, w, bias=bias, scratch=torch.empty(48, 96, dtype=dtype))
    assert got.dtype == dtype and got.shape == (rows, 48)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@given(out=st.integers(1, 300), width=st.integers(1, 200), piece=st.integers(1, 300),
       rows=st.integers(INT8PACK_MAX_ROWS + 1, 80), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans())
@settings(max_examples=60, deadline=None)
def test_a_weight_dequantised_in_pieces_gives_the_whole_product(
        out, width, piece, rows, seed, dtype, bias):
    """A buffer of fewer rows than the weight (an LM head past `DEQUANT_ROWS`) is filled
    and multiplied a piece at a time: the product of the whole dequantised weight for any
    piece size, to the serving dtype's rounding (the dense kernel may block its sums by
    the piece's width: 82 of 1,500 bf16 cases searched differed in the last bits, none at
    SmolLM2's LM head), and the buffer is what `dequant_buffer_shape` asks."""
    g = torch.Generator().manual_seed(seed)
    w = quantize_int8(torch.randn(out, width, generator=g).to(dtype))
    x = torch.randn(rows, width, generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    whole = int8_linear(x, w, bias=b, scratch=torch.empty(out, width, dtype=dtype))
    got = int8_linear(x, w, bias=b, scratch=torch.empty(min(piece, out), width, dtype=dtype))
    ref = x.double() @ w.dequantize().double().t() + (0 if b is None else b.double())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert got.dtype == dtype and got.shape == (rows, out)
    torch.testing.assert_close(got.double(), ref, atol=tol * width ** 0.5, rtol=tol)
    torch.testing.assert_close(got.double(), whole.double(), atol=tol * width ** 0.5, rtol=tol)
    assert dequant_buffer_shape(w) == (min(out, DEQUANT_ROWS), width)


def test_int8_engine_follows_the_dense_one_on_a_tiny_model(tiny):
    """Greedy tokens: at least 80% agree position by position with the dense base (the
    tiny random model's logits are close together, so a flip early can change the rest);
    teacher-forced logits off the dense ones by at most 5% of their spread in RMS and 40%
    at the worst element (measured: 2-3% and up to 30%; the tiny model's 64-wide rows
    give coarser scales than a real model's), with and without an adapter (the LoRA pass
    stays in the serving dtype)."""
    dense, int8 = make_engine(tiny, "dense"), make_engine(tiny, "int8")
    assert isinstance(int8.model.layers[0].qkv, Int8Weight) and int8.base_weights == "int8"
    assert int8.base_digest == dense.base_digest  # the checkpoint's digest either way
    agree = total = 0
    for name in (None, "all_r16_rs"):
        dig = {e: None if name is None else e.load_adapter(tiny.adapters[name]).digest
               for e in (dense, int8)}
        for prompt in PROMPTS:
            outs = [e.generate([GenerationRequest(
                prompt_token_ids=prompt, adapter_digest=dig[e],
                sampling=SamplingParams(max_tokens=12, min_tokens=12))])[0].token_ids
                for e in (dense, int8)]
            agree += sum(a == b for a, b in zip(*outs, strict=True))
            total += len(outs[0])
            a, b = (e.score(prompt + outs[0], dig[e]) for e in (dense, int8))
            err, spread = a - b, a.std()
            assert err.pow(2).mean().sqrt() <= 0.05 * spread, (name, err, spread)
            assert err.abs().max() <= 0.4 * spread, (name, err.abs().max(), spread)
    assert agree / total >= 0.8, f"{agree}/{total} greedy tokens agree"


def test_int8_in_bf16_serves_a_batch_of_many_rows(tiny):
    """A prefill longer than the int8 kernel's row limit takes the dequantise path; the
    step's tokens still match the same engine's one-token-at-a-time decode closely."""
    eng = make_engine(tiny, "int8", "bfloat16")
    long = list(range(3, 3 + 3 * INT8PACK_MAX_ROWS))
    out = eng.generate([GenerationRequest(prompt_token_ids=long, sampling=SamplingParams(
        max_tokens=4, min_tokens=4))])[0].token_ids
    assert len(out) == 4
    full = eng.score(long + out)
    assert torch.isfinite(full).all()


def test_merging_into_int8_weights_is_refused(tiny):
    eng = make_engine(tiny, "int8")
    x = eng.load_adapter(tiny.adapters["attn_r4"]).digest
    with pytest.raises(RequestError, match="merged mode needs dense base weights"):
        eng.merge_adapter(x)
    assert eng.merged_adapter is None


def test_an_unknown_weights_format_is_refused_by_name(tiny):
    with pytest.raises(ValueError, match="weights 'int4'"):
        make_engine(tiny, "int4")
