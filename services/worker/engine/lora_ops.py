"""The multi-LoRA ops the engine calls, from `kernels/` (SGMV for prefill, BGMV for decode).

Model code goes through `AdapterPool.apply` only, so it never names a kernel; `kernels`
dispatches per device (Triton on GPU, its torch reference on CPU).
"""

from __future__ import annotations

from kernels import PagedLora, Runs, Segments, lora_apply_paged

__all__ = ["PagedLora", "Runs", "Segments", "lora_apply_paged"]
