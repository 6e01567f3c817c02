"""The PEFT LoRA format's file names, and Llama's target modules and shapes for the tools
that build Llama-shaped adapters (benches, the demo).

The rules an adapter is accepted by, for every family, are `services.families.adapters`:
the registry validates uploads and the engine loads adapters by them.
"""

from __future__ import annotations

from services.families.adapters import CONFIG_FILE, WEIGHTS_FILE
from services.families.description import LLAMA_LORA

__all__ = ["CONFIG_FILE", "PARENT", "TARGET_MODULES", "WEIGHTS_FILE", "projection_shape"]

TARGET_MODULES = tuple(LLAMA_LORA)
PARENT = {m: target.path.split(".")[0] for m, target in LLAMA_LORA.items()}


def projection_shape(module: str, *, hidden_size: int, intermediate_size: int, q_size: int,
                     kv_size: int) -> tuple[int, int]:
    """(in_features, out_features) of one Llama projection; LoRA A is [r, in], B [out, r]."""
    h, i = hidden_size, intermediate_size
    return {"q_proj": (h, q_size), "k_proj": (h, kv_size), "v_proj": (h, kv_size),
            "o_proj": (q_size, h), "gate_proj": (h, i), "up_proj": (h, i),
            "down_proj": (i, h)}[module]
