"""The public API forced onto the Triton path, fused and separate, both families."""

from __future__ import annotations

import pytest
import torch
from lora_cases import CASES, DTYPES, TOLERANCE, build, naive_apply, pooled, relative_error

from loraplane_kernels import dispatch, lora_apply, lora_apply_pooled, lora_shrink
from loraplane_kernels.tuning_table import TuningFallbackWarning


@pytest.fixture(autouse=True)
def force_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")


@pytest.mark.filterwarnings("ignore", category=TuningFallbackWarning)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fused", [True, False, None], ids=["fused", "separate", "table"])
@pytest.mark.parametrize("segmented", [False, True], ids=["bgmv", "sgmv"])
def test_lora_apply_on_triton(dtype, fused, segmented: bool) -> None:
    p = build(CASES[5], seed=21, shuffle_tokens=not segmented).to(dtype)
    want = naive_apply(p.to(torch.float64))
    y = p.y.clone()
    lora_apply(y, p.x, p.a_slab, p.b_slab, p.ranks, p.scales, p.indices,
               out_offset=p.out_offset, segments=p.segments if segmented else None,
               fused=fused)
    assert relative_error(y, want) < TOLERANCE[dtype]


def test_triton_path_rejects_float64_naming_x() -> None:
    p = build(CASES[0], seed=22)
    with pytest.raises(ValueError, match=r"^x\b"):
        lora_shrink(p.x, p.a_slab, p.ranks, p.indices)


@pytest.mark.filterwarnings("ignore", category=TuningFallbackWarning)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
@pytest.mark.parametrize("segmented", [False, True], ids=["bgmv", "sgmv"])
def test_rank_pool_on_triton(dtype, fused, segmented: bool) -> None:
    """Every kernel reads slots at their pool offsets with B stored transposed."""
    p = build(CASES[5], seed=23, shuffle_tokens=not segmented).to(dtype)
    want = naive_apply(p.to(torch.float64))
    y = p.y.clone()
    lora_apply_pooled(y, p.x, pooled(p), p.indices, out_offset=p.out_offset,
                     segments=p.segments if segmented else None, fused=fused)
    assert relative_error(y, want) < TOLERANCE[dtype]
