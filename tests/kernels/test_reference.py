"""The torch reference (production CPU path and test oracle) against the definition."""

from __future__ import annotations

import re

import pytest
import torch
from lora_cases import (
    CASE_IDS,
    CASES,
    DTYPES,
    TOLERANCE,
    build,
    naive_apply,
    pooled,
    relative_error,
)

from loraplane_kernels import (
    Segments,
    lora_apply,
    lora_apply_pooled,
    lora_expand,
    lora_shrink,
    reference,
)
from loraplane_kernels.rank_pool import runs_of


@pytest.mark.parametrize("spec", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("segmented", [False, True], ids=["bgmv", "sgmv"])
def test_reference_matches_per_token_loop(spec, segmented: bool) -> None:
    p = build(spec, seed=1, shuffle_tokens=not segmented)
    y = p.y.clone()
    reference.lora_apply(y, p.x, p.a_slab, p.b_slab, p.ranks, p.scales, p.indices,
                         out_offset=p.out_offset, segments=p.segments if segmented else None)
    torch.testing.assert_close(y, naive_apply(p), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec", CASES, ids=CASE_IDS)
def test_shrink_is_zero_past_rank_and_for_minus_one(spec) -> None:
    p = build(spec, seed=2, shuffle_tokens=True)
    h = reference.lora_shrink(p.x, p.a_slab, p.ranks, p.indices)
    for t, s in enumerate(p.indices.tolist()):
        r = 0 if s < 0 else int(p.ranks[s])
        assert torch.all(h[t, r:] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_public_api_on_cpu_uses_reference_in_low_precision(dtype: torch.dtype) -> None:
    p64 = build(CASES[2], seed=3, shuffle_tokens=True)
    p = p64.to(dtype)
    y = p.y.clone()
    lora_apply(y, p.x, p.a_slab, p.b_slab, p.ranks, p.scales, p.indices, out_offset=p.out_offset)
    want = naive_apply(p.to(torch.float64))
    assert y.dtype == dtype
    assert relative_error(y, want) < TOLERANCE[dtype]
    h = lora_shrink(p.x, p.a_slab, p.ranks, p.indices)
    assert h.dtype == torch.float32
    y2 = p.y.clone()
    lora_expand(y2, h, p.b_slab, p.ranks, p.scales, p.indices, out_offset=p.out_offset)
    torch.testing.assert_close(y2, y)


def test_segments_expand_to_token_indices() -> None:
    seg = Segments.from_lengths([2, 0, 3], [4, 1, -1])
    assert seg.token_indices().tolist() == [4, 4, -1, -1, -1]
    assert seg.num_segments == 3


def _args():
    p = build(CASES[1], seed=4)
    return p, dict(x=p.x, a_slab=p.a_slab, ranks=p.ranks, indices=p.indices)


@pytest.mark.parametrize(
    ("argument", "bad"),
    [
        ("x", lambda p: p.x[:, :-1]),
        ("x", lambda p: p.x.to(torch.int32)),
        ("a_slab", lambda p: p.a_slab.to(torch.float32)),
        ("a_slab", lambda p: p.a_slab[0]),
        ("ranks", lambda p: p.ranks.to(torch.int64)),
        ("ranks", lambda p: p.ranks[:-1]),
        ("ranks", lambda p: torch.full_like(p.ranks, 999)),
        ("indices", lambda p: p.indices.to(torch.int64)),
        ("indices", lambda p: p.indices[:-1]),
        ("indices", lambda p: torch.full_like(p.indices, 17)),
    ],
)
def test_shrink_rejects_bad_arguments_naming_them(argument: str, bad) -> None:
    p, kwargs = _args()
    kwargs[argument] = bad(p)
    target = "a_slab" if argument == "x" and kwargs["x"].shape[1] != p.x.shape[1] else argument
    with pytest.raises(ValueError, match=rf"^{re.escape(target)}\b"):
        lora_shrink(**kwargs)


@pytest.mark.parametrize(
    ("argument", "bad"),
    [
        ("h", lambda p, h: h[:, :-1]),
        ("h", lambda p, h: h.to(torch.float16)),
        ("b_slab", lambda p, h: p.b_slab.to(torch.float32)),
        ("scales", lambda p, h: p.scales.double()),
        ("scales", lambda p, h: p.scales[:1]),
        ("out_offset", lambda p, h: 10_000),
        ("out_offset", lambda p, h: -1),
    ],
)
def test_expand_rejects_bad_arguments_naming_them(argument: str, bad) -> None:
    p, _ = _args()
    h = reference.lora_shrink(p.x, p.a_slab, p.ranks, p.indices)
    kwargs = dict(y=p.y.clone(), h=h, b_slab=p.b_slab, ranks=p.ranks, scales=p.scales,
                  indices=p.indices, out_offset=p.out_offset)
    kwargs[argument] = bad(p, h)
    with pytest.raises(ValueError, match=rf"^{re.escape(argument)}\b"):
        lora_expand(**kwargs)


@pytest.mark.parametrize(
    ("argument", "segments"),
    [
        ("segments.starts", Segments(torch.tensor([0, 2], dtype=torch.int32),
                                     torch.tensor([0], dtype=torch.int32))),
        ("segments.starts", Segments(torch.tensor([0, 9, 5, 14], dtype=torch.int32),
                                     torch.tensor([0, 1, 2], dtype=torch.int32))),
        ("segments.slots", Segments(torch.tensor([0, 14], dtype=torch.int32),
                                    torch.tensor([7], dtype=torch.int32))),
        ("segments.starts", Segments(torch.tensor([0, 14], dtype=torch.int64),
                                     torch.tensor([0], dtype=torch.int32))),
    ],
)
def test_bad_segments_are_rejected(argument: str, segments: Segments) -> None:
    _, kwargs = _args()
    with pytest.raises(ValueError, match=rf"^{re.escape(argument)}\b"):
        lora_shrink(**kwargs, segments=segments)


def test_apply_rejects_unpaired_slabs() -> None:
    p, _ = _args()
    with pytest.raises(ValueError, match=r"^b_slab\b"):
        lora_apply(p.y.clone(), p.x, p.a_slab, p.b_slab[:, :, :-1], p.ranks, p.scales,
                   p.indices)


@pytest.mark.parametrize("spec", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES], ids=str)
def test_rank_pool_matches_per_token_loop(spec, dtype) -> None:
    """The rank-granular pool (no padding, slots at arbitrary offsets) on the torch path,
    routed by indices, by segments and by host runs."""
    p = build(spec, seed=5).to(dtype)
    w = pooled(p)
    want = naive_apply(p.to(torch.float64))
    tol = 1e-12 if dtype == torch.float64 else TOLERANCE[dtype]
    for routing in ({"segments": p.segments}, {"runs": runs_of(p.indices)}, {}):
        y = p.y.clone()
        lora_apply_pooled(y, p.x, w, p.indices, out_offset=p.out_offset, **routing)
        assert relative_error(y, want) < max(tol, 1e-12), routing


def test_rank_pool_rejects_mismatched_activations() -> None:
    p = build(CASES[1], seed=6)
    w = pooled(p)
    with pytest.raises(ValueError, match=r"^x\b"):
        lora_apply_pooled(p.y.clone(), p.x[:, :-1], w, p.indices)
    with pytest.raises(ValueError, match=r"^out_offset\b"):
        lora_apply_pooled(p.y.clone(), p.x, w, p.indices, out_offset=10_000)
