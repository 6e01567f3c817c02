"""The PEFT LoRA format as loraplane reads it.

The registry validates uploads against it and the engine loads adapters by it; defining
the file names, target modules, tensor naming and projection shapes once means an
adapter the registry accepts is, by construction, one the engine can load.
"""

from __future__ import annotations

import re

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
PARENT = {m: "self_attn" for m in ATTENTION_MODULES} | {m: "mlp" for m in MLP_MODULES}

TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)"
    r"(?:\.[\w-]+)?\.weight$"
)
"""Groups: layer, parent (self_attn | mlp), module, A | B. An optional adapter name may
follow `lora_A` (`lora_A.default.weight`), as PEFT writes for named adapters."""


def projection_shape(module: str, *, hidden_size: int, intermediate_size: int, q_size: int,
                     kv_size: int) -> tuple[int, int]:
    """(in_features, out_features) of one Llama projection; LoRA A is [r, in], B [out, r]."""
    h, i = hidden_size, intermediate_size
    return {"q_proj": (h, q_size), "k_proj": (h, kv_size), "v_proj": (h, kv_size),
            "o_proj": (q_size, h), "gate_proj": (h, i), "up_proj": (h, i),
            "down_proj": (i, h)}[module]
