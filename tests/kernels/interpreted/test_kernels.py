"""Every Triton kernel, run by the interpreter, against the float64 torch reference."""

from __future__ import annotations

import pytest
import torch
from lora_cases import (
    CASE_IDS,
    CASES,
    DTYPES,
    TOLERANCE,
    Problem,
    build,
    pooled,
    relative_error,
)

from loraplane_kernels import reference
from loraplane_kernels.triton import bgmv, fused, fused_base, sgmv


def oracle(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``h`` and updated ``y`` from the same (already rounded) inputs."""
    q = p.to(torch.float64)
    h = reference.lora_shrink(q.x, q.a_slab, q.ranks, q.indices)
    y = q.y.clone()
    reference.lora_expand(y, h, q.b_slab, q.ranks, q.scales, q.indices, out_offset=q.out_offset)
    return h, y


def assert_matches(p: Problem, y: torch.Tensor, want_y: torch.Tensor, dtype) -> None:
    n = p.b_slab.shape[1]
    inside = slice(p.out_offset, p.out_offset + n)
    # Columns outside the output slice and rows with slot -1 / rank 0 stay bit-identical.
    assert torch.equal(y[:, :p.out_offset], p.y[:, :p.out_offset])
    assert torch.equal(y[:, inside.stop:], p.y[:, inside.stop:])
    untouched = [t for t, s in enumerate(p.indices.tolist()) if s < 0 or p.ranks[s] == 0]
    assert torch.equal(y[untouched], p.y[untouched])
    assert relative_error(y[:, inside], want_y[:, inside]) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", CASES, ids=CASE_IDS)
def test_bgmv_shrink_expand(spec, dtype) -> None:
    p = build(spec, seed=11, shuffle_tokens=True).to(dtype)
    want_h, want_y = oracle(p)
    h = bgmv.bgmv_shrink(p.x, p.a_slab, p.ranks, p.indices, block_k=16)
    assert h.dtype == torch.float32
    assert relative_error(h, want_h) < TOLERANCE[torch.float32]
    assert torch.all(h[p.indices < 0] == 0)
    y = p.y.clone()
    bgmv.bgmv_expand(y, h, p.b_slab, p.ranks, p.scales, p.indices, out_offset=p.out_offset,
                     block_n=32)
    assert_matches(p, y, want_y, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", CASES, ids=CASE_IDS)
def test_sgmv_shrink_expand(spec, dtype) -> None:
    p = build(spec, seed=12).to(dtype)
    want_h, want_y = oracle(p)
    h = sgmv.sgmv_shrink(p.x, p.a_slab, p.ranks, p.segments, block_m=16, block_k=16)
    # h itself is fp32 from dot products of already-rounded inputs: fp32-tight.
    assert relative_error(h, want_h) < TOLERANCE[torch.float32]
    y = p.y.clone()
    sgmv.sgmv_expand(y, h, p.b_slab, p.ranks, p.scales, p.segments, out_offset=p.out_offset,
                     block_m=16, block_n=32)
    assert_matches(p, y, want_y, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", CASES, ids=CASE_IDS)
def test_fused_bgmv(spec, dtype) -> None:
    p = build(spec, seed=13, shuffle_tokens=True).to(dtype)
    _, want_y = oracle(p)
    y = p.y.clone()
    fused.bgmv_fused(y, p.x, p.a_slab, p.b_slab, p.ranks, p.scales, p.indices,
                     out_offset=p.out_offset, block_k=16, block_n=32)
    assert_matches(p, y, want_y, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", CASES, ids=CASE_IDS)
def test_fused_sgmv(spec, dtype) -> None:
    p = build(spec, seed=14).to(dtype)
    _, want_y = oracle(p)
    y = p.y.clone()
    fused.sgmv_fused(y, p.x, p.a_slab, p.b_slab, p.ranks, p.scales, p.segments,
                     out_offset=p.out_offset, block_m=16, block_k=16, block_n=32)
    assert_matches(p, y, want_y, dtype)


@pytest.mark.parametrize("split", [2, 3])
def test_split_k_and_n_split_variants(split: int) -> None:
    """The atomics (split-K shrink) and the recomputing N splits give the same result."""
    p = build(CASES[2], seed=15).to(torch.float32)
    want_h, want_y = oracle(p)
    h = bgmv.bgmv_shrink(p.x, p.a_slab, p.ranks, p.indices, block_k=16, split_k=split)
    assert relative_error(h, want_h) < TOLERANCE[torch.float32]
    h = sgmv.sgmv_shrink(p.x, p.a_slab, p.ranks, p.segments, block_m=16, block_k=16,
                         split_k=split)
    assert relative_error(h, want_h) < TOLERANCE[torch.float32]
    for launch in (fused.bgmv_fused, fused.sgmv_fused):
        y = p.y.clone()
        routing = p.indices if launch is fused.bgmv_fused else p.segments
        launch(y, p.x, p.a_slab, p.b_slab, p.ranks, p.scales, routing,
               out_offset=p.out_offset, block_k=16, block_n=16, n_split=split)
        assert_matches(p, y, want_y, torch.float32)


def test_non_contiguous_packed_output() -> None:
    """y as a strided view (a column slice of a wider qkv buffer) is updated in place."""
    p = build(CASES[1], seed=16, shuffle_tokens=True).to(torch.float16)
    _, want_y = oracle(p)
    wide = torch.zeros(p.y.shape[0], p.y.shape[1] + 7, dtype=torch.float16)
    wide[:, 3:3 + p.y.shape[1]] = p.y
    y = wide[:, 3:3 + p.y.shape[1]]
    h = bgmv.bgmv_shrink(p.x, p.a_slab, p.ranks, p.indices)
    bgmv.bgmv_expand(y, h, p.b_slab, p.ranks, p.scales, p.indices, out_offset=p.out_offset)
    assert_matches(p, y, want_y, torch.float16)
    assert torch.all(wide[:, :3] == 0) and torch.all(wide[:, 3 + p.y.shape[1]:] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", CASES, ids=CASE_IDS)
def test_fused_base_and_lora(spec, dtype) -> None:
    """One launch per bucket tile: base product plus the bucket's delta, slot -1 and
    rank-0 buckets get the base product alone, columns outside the slice stay as they were."""
    p = build(spec, seed=17).to(dtype)
    k, n = p.a_slab.shape[2], p.b_slab.shape[1]
    weight = (torch.randn(n, k, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
              / k**0.5).to(dtype)
    q = p.to(torch.float64)
    want = q.y.clone()
    want[:, p.out_offset:p.out_offset + n] = q.x @ weight.double().T
    h = reference.lora_shrink(q.x, q.a_slab, q.ranks, q.indices)
    reference.lora_expand(want, h, q.b_slab, q.ranks, q.scales, q.indices,
                          out_offset=q.out_offset)
    y = p.y.clone()
    fused_base.sgmv_base_fused(y, p.x, weight, pooled(p), p.segments, out_offset=p.out_offset,
                               block_m=16, block_n=32, block_k=16)
    inside = slice(p.out_offset, p.out_offset + n)
    assert torch.equal(y[:, :p.out_offset], p.y[:, :p.out_offset])
    assert torch.equal(y[:, inside.stop:], p.y[:, inside.stop:])
    assert relative_error(y[:, inside], want[:, inside]) < TOLERANCE[dtype]
