"""Which dtype the engine serves in: the one rule the worker's `dtype` setting calls.

bf16 halves the bytes every step moves and, on CPUs with bf16 dot-product instructions
(AVX512-BF16, AMX), runs matmuls several times faster than fp32. Without those
instructions bf16 is emulated through fp32 conversions and is slower than fp32, so the
rule checks the CPU's flags and never assumes them. fp32 stays the choice wherever exact
token parity with a float32 reference matters (the oracle tests pin it explicitly).
"""

from __future__ import annotations

import torch

from services.hostcpu import cpu_flags

from .checkpoint import parse_dtype

BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_has_bf16(flags: frozenset[str] | None = None) -> bool:
    """Native bf16 arithmetic on this CPU (AVX512-BF16 or AMX-BF16)."""
    return bool(BF16_CPU_FLAGS & (cpu_flags() if flags is None else flags))


def serving_dtype(requested: str | torch.dtype = "auto",
                  device: str | torch.device = "cpu") -> torch.dtype:
    """Resolve a dtype setting: an explicit dtype as given, "auto" by the hardware.

    "auto" is bf16 on a CUDA GPU that supports it (fp16 on one that does not) and on a
    CPU with native bf16; fp32 on every other CPU.
    """
    if requested != "auto":
        return parse_dtype(requested)
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32
