"""Reading a Hugging Face model directory: config, safetensors shards, tokenizer, digest.

Validation happens against the shapes the config implies, so a wrong or partial
checkpoint fails at load time with the name of the first missing or mis-shaped tensor
instead of producing garbage tokens later.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .config import ModelConfig
from .errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Accept 'float32' / 'bfloat16' / 'float16' (or fp32/bf16/fp16) or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise CheckpointError(f"dtype {dtype} is not supported")
        return dtype
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    name = aliases.get(dtype, dtype)
    if name not in _DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported (use fp32, bf16 or fp16)")
    return _DTYPES[name]


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine needs, by Hugging Face name, with its shape: the family's
    description says which projections are fused, which biases and norms exist."""
    fam = cfg.family
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.q_size, cfg.kv_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        if fam.fused_qkv:
            shapes[p + fam.fused_qkv + ".weight"] = (q + 2 * kv, h)
        else:
            shapes |= {p + "self_attn.q_proj.weight": (q, h),
                       p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h)}
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if fam.fused_gate_up:
            shapes[p + fam.fused_gate_up + ".weight"] = (2 * i, h)
        else:
            shapes |= {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h)}
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        for norm in fam.norms.values():
            if norm is not None:
                shapes[p + norm + ".weight"] = (h,)
        if fam.qk_norm is not None:
            per_head = fam.qk_norm == "head"
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,) if per_head else (q,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,) if per_head else (kv,)
        if cfg.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.mlp_bias:
            shapes |= {p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,),
                       p + "mlp.down_proj.bias": (h,)}
    return shapes


def _shard_files(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> shard file, from the index or the single file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{INDEX_FILE} has no weight_map")
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        for shard in set(files.values()):
            if not shard.is_file():
                raise CheckpointError(f"shard {shard.name} named in {INDEX_FILE} is missing")
        return files
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"neither {SINGLE_FILE} nor {INDEX_FILE} found in model directory")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 - safe_open is not a dict


@dataclass
class Checkpoint:
    """Validated weights of a base model, converted to the serving dtype."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    digest: str
    """Hex sha256 over tensor names, dtypes, shapes and bytes in name order: independent of
    how the checkpoint is sharded, so re-sharding does not invalidate KV. The digest an
    admin registers (`BaseModelRegistered.digest`) and workers check at start."""


def load_checkpoint(
    model_dir: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> Checkpoint:
    """Load and validate `config.json` and the safetensors weights of a model directory."""
    root = _model_root(model_dir)
    cfg = ModelConfig.from_dir(root)
    target = parse_dtype(dtype)
    digest = hashlib.sha256()
    tensors: dict[str, torch.Tensor] = {}
    for name, t in _checked_tensors(root, cfg):
        _digest_tensor(digest, name, t)
        tensors[name] = t.to(device=device, dtype=target)
    return Checkpoint(config=cfg, tensors=tensors, digest=digest.hexdigest())


def checkpoint_digest(model_dir: str | Path) -> str:
    """The base digest of a model directory without loading it for serving: what an admin
    registers (`BaseModelRegistered.digest`) so that workers on this model become ready.

    Same bytes and rule as `Checkpoint.digest`; one tensor is in memory at a time.
    """
    root = _model_root(model_dir)
    digest = hashlib.sha256()
    for name, t in _checked_tensors(root, ModelConfig.from_dir(root)):
        _digest_tensor(digest, name, t)
    return digest.hexdigest()


def _model_root(model_dir: str | Path) -> Path:
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError("model directory does not exist")
    return root


def _checked_tensors(root: Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor the config implies, in name order (the digest's order), shape-checked;
    a missing one is refused before anything is read."""
    files = _shard_files(root)
    shapes = expected_shapes(cfg)
    for name, shape in shapes.items():
        if name not in files:
            raise CheckpointError(f"missing tensor {name} (expected shape {list(shape)})")
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for name in sorted(shapes):
            if files[name] not in handles:
                handles[files[name]] = stack.enter_context(
                    safe_open(str(files[name]), framework="pt"))
            t = handles[files[name]].get_tensor(name)
            if tuple(t.shape) != shapes[name]:
                raise CheckpointError(
                    f"tensor {name} has shape {list(t.shape)}, expected {list(shapes[name])}")
            yield name, t.contiguous()


def _digest_tensor(digest: hashlib._Hash, name: str, t: torch.Tensor) -> None:
    digest.update(f"{name}|{t.dtype}|{list(t.shape)}\n".encode())
    digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def load_tokenizer(model_dir: str | Path):  # -> tokenizers.Tokenizer | None
    """Load `tokenizer.json` with the `tokenizers` library; None when the file is absent."""
    from tokenizers import Tokenizer

    file = Path(model_dir) / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception subclass
        raise CheckpointError(f"tokenizer.json could not be parsed: {exc}") from exc
