"""The serving-dtype rule: bf16 only where the hardware says it runs it natively."""

from __future__ import annotations

import torch

from services.worker.engine.precision import cpu_has_bf16, serving_dtype


def test_cpu_bf16_follows_the_flags() -> None:
    assert cpu_has_bf16(frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert cpu_has_bf16(frozenset({"amx_bf16", "amx_tile"}))
    assert not cpu_has_bf16(frozenset({"avx2", "avx512f", "fma"}))


def test_auto_on_this_cpu_matches_its_flags() -> None:
    want = torch.bfloat16 if cpu_has_bf16() else torch.float32
    assert serving_dtype("auto", "cpu") == want


def test_explicit_dtypes_are_kept() -> None:
    assert serving_dtype("fp32") == torch.float32
    assert serving_dtype("bfloat16", "cpu") == torch.bfloat16
