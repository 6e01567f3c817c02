"""The GPU's int8 weight-only matmul, in the interpreter, against float64 and against the
CPU's int8 path on the same weights."""

from __future__ import annotations

import pytest
import torch
from lora_cases import TOLERANCE, relative_error

from loraplane_kernels import dispatch
from loraplane_kernels.int8 import int8_linear, needs_dequant_buffer, quantize_int8
from loraplane_kernels.triton.int8_mm import int8_mm

SHAPES = [(1, 64, 32), (3, 70, 130), (17, 96, 64), (65, 40, 200)]
"""(rows, in, out): a decode row, tiles cut in K and N, both row tiles (16 and 64)."""


def _case(rows: int, k: int, n: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = quantize_int8((torch.randn(n, k, generator=g) * 0.05).to(dtype))
    want = (x.double() @ w.q.double().T) * w.scale.double()
    return x, w, want


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_int8_mm_is_the_scaled_product_of_the_stored_bytes(dtype, shape) -> None:
    x, w, want = _case(*shape, dtype, seed=sum(shape))
    got = int8_mm(x, w.q, w.scale)
    assert got.dtype == dtype and got.shape == want.shape
    assert relative_error(got, want) < TOLERANCE[dtype]


def test_int8_mm_writes_into_a_strided_output_and_refuses_wrong_operands() -> None:
    x, w, want = _case(5, 64, 48, torch.float32, seed=3)
    packed = torch.zeros(5, 100)
    int8_mm(x, w.q, w.scale, out=packed[:, 10:58])
    assert relative_error(packed[:, 10:58], want) < TOLERANCE[torch.float32]
    assert not packed[:, :10].any() and not packed[:, 58:].any()
    with pytest.raises(ValueError, match="int8 q"):
        int8_mm(x, w.q.float(), w.scale)
    with pytest.raises(ValueError, match="scale must be"):
        int8_mm(x, w.q, w.scale[:-1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_int8_linear_takes_the_kernel_where_the_lora_kernels_run(
        monkeypatch: pytest.MonkeyPatch, dtype) -> None:
    """On the Triton backend no dequantised copy is asked for, and the answer (with the
    bias added after the scale, as on the CPU) is the CPU int8 path's within rounding."""
    x, w, _ = _case(24, 64, 40, dtype, seed=9)
    bias = torch.randn(40).to(dtype)
    cpu = int8_linear(x, w, bias=bias, scratch=torch.empty(w.shape, dtype=dtype))
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    assert not needs_dequant_buffer(x)
    got = int8_linear(x, w, bias=bias)
    assert relative_error(got, cpu.double()) < TOLERANCE[dtype]
