"""Base-model configuration parsed from a Hugging Face `config.json`.

Only the Llama-family fields the engine implements are read; anything that would change
the maths but is not implemented is refused here, before weights are loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2"})
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "llama3"})


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (both the transformers v4 and v5 spellings map here)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    qkv_bias: bool = False
    """q, k and v projections carry biases (Qwen2; Llama's `attention_bias`)."""
    o_bias: bool = False
    mlp_bias: bool = False
    layer_windows: tuple[int | None, ...] = ()
    """Per layer, the sliding window (a query at p sees keys after p - window) or None for
    full attention; empty means full attention everywhere."""

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def kv_window(self) -> int | None:
        """The window when every layer slides by the same one: then no layer reads a block
        that ends before it, and those blocks can be freed."""
        windows = set(self.layer_windows)
        if len(windows) == 1 and len(self.layer_windows) == self.num_hidden_layers:
            return windows.pop()
        return None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse and validate a `config.json` mapping."""
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(f"model_type {model_type!r} is not a Llama-family model")
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {raw.get('hidden_act')!r} is not supported")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            cfg = cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                rope=_parse_rope(raw),
                eos_token_ids=_eos_ids(raw.get("eos_token_id")),
                model_type=model_type,
                qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias")),
                o_bias=model_type == "llama" and bool(raw.get("attention_bias")),
                mlp_bias=model_type == "llama" and bool(raw.get("mlp_bias")),
                layer_windows=_layer_windows(raw, model_type, int(raw["num_hidden_layers"])),
            )
        except KeyError as exc:
            raise CheckpointError(f"config.json lacks required field {exc.args[0]!r}") from exc
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")
        return cfg

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a model directory."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise CheckpointError(f"{file.name} not found in model directory")
        return cls.from_dict(json.loads(file.read_text()))


def _layer_windows(raw: dict[str, Any], model_type: str, layers: int
                   ) -> tuple[int | None, ...]:
    """transformers' rules: Mistral slides every layer by `sliding_window` when it is set;
    Qwen2 only with `use_sliding_window`, on the layers `layer_types` names (by default
    those from `max_window_layers` on)."""
    window = raw.get("sliding_window")
    if model_type == "mistral":
        return (int(window),) * layers if window is not None else ()
    if model_type == "qwen2":
        if not raw.get("use_sliding_window") or window is None:
            return ()
        types = raw.get("layer_types") or [
            "sliding_attention" if i >= int(raw.get("max_window_layers", 28))
            else "full_attention" for i in range(layers)]
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    return ()


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Accept `rope_theta` + `rope_scaling` (transformers 4) and `rope_parameters` (5)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported (supported: {sorted(SUPPORTED_ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    orig = params.get("original_max_position_embeddings")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig is not None else None,
    )
