"""Test adapters: PEFT-format files for a tiny Llama-like base model, built in memory."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from safetensors.torch import save

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": 256,
}
LLAMA_DIGEST = hashlib.sha256(json.dumps(LLAMA_CONFIG, sort_keys=True).encode()).hexdigest()

_SHAPES = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
           "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def tensor_name(layer: int, module: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}.lora_{which}.weight"


@dataclass(frozen=True)
class AdapterFiles:
    config: bytes
    weights: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.weights).hexdigest()


def build_adapter(
    *, rank: int = 4, targets: Sequence[str] = ("q_proj", "v_proj"), layers: int = 2,
    dtype: torch.dtype = torch.float16, seed: int = 0,
    edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
    config_edit: Callable[[dict[str, object]], None] | None = None,
) -> AdapterFiles:
    """A valid PEFT LoRA adapter unless `edit` / `config_edit` break it on purpose."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in targets:
            fin, fout = _SHAPES[module]
            tensors[tensor_name(layer, module, "A")] = torch.randn(rank, fin, generator=gen).to(
                dtype)
            tensors[tensor_name(layer, module, "B")] = torch.randn(fout, rank, generator=gen).to(
                dtype)
    if edit:
        edit(tensors)
    config: dict[str, object] = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                 "target_modules": list(targets), "bias": "none",
                                 "base_model_name_or_path": "tiny-llama", "seed": seed}
    if config_edit:
        config_edit(config)
    return AdapterFiles(json.dumps(config).encode(), save(tensors))


def tarball(members: dict[str, bytes], links: dict[str, str] | None = None,
            hardlinks: dict[str, str] | None = None) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
        for name, target in (hardlinks or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.LNKTYPE
            info.linkname = target
            tar.addfile(info)
    return out.getvalue()


def adapter_tarball(files: AdapterFiles, prefix: str = "my-adapter/") -> bytes:
    return tarball({f"{prefix}adapter_config.json": files.config,
                    f"{prefix}adapter_model.safetensors": files.weights})
