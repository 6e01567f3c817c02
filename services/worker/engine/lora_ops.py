"""The multi-LoRA ops the engine calls, from `loraplane_kernels/` (SGMV for prefill, BGMV
for decode).

Model code goes through `AdapterPool.apply` only, so it never names a kernel; `loraplane_kernels`
dispatches per device (Triton on GPU, its torch reference on CPU).
"""

from __future__ import annotations

from loraplane_kernels import PooledLora, Runs, Segments, SlotTables, lora_apply_pooled
from loraplane_kernels.cpu_decode import SmallRuns, apply_small_runs_arrays
from loraplane_kernels.dispatch import base_fusion_threshold, base_lora_fused
from loraplane_kernels.rank_pool import host_pass_dtype, step_runs

__all__ = [
    "PooledLora",
    "Runs",
    "Segments",
    "SlotTables",
    "SmallRuns",
    "apply_small_runs_arrays",
    "base_fusion_threshold",
    "base_lora_fused",
    "host_pass_dtype",
    "lora_apply_pooled",
    "step_runs",
]
