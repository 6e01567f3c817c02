"""The multi-LoRA ops the engine calls, from `kernels/` (SGMV for prefill, BGMV for decode).

Model code goes through `AdapterPool.apply` only, so it never names a kernel.
"""

from __future__ import annotations

try:
    from kernels import Segments, lora_apply
except ImportError:  # kernels package exports not published yet: use its torch reference
    from kernels.reference import lora_apply
    from kernels.segments import Segments

__all__ = ["Segments", "lora_apply"]
