"""A model's config.json read through its family's description into what the engine
computes (`ModelConfig`), or refused naming the family or field.

Every key of the family's transformers config class is classified (`description.py`):
implemented ones are read here with the class's own default when absent, harmless ones
are skipped, and refused ones are refused at any value the engine does not compute. Keys
the config class does not have are ignored, as transformers' model ignores them. No torch
here: the registry reads configs with this module too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .description import Family, Refused
from .errors import ConfigError, UnsupportedModel
from .served import FAMILIES, FULL, SLIDING, family_of

ACTIVATIONS = frozenset({"silu", "gelu", "gelu_pytorch_tanh"})
"""transformers' ACT2FN names the engine computes (gelu is exact, the other two are
`F.silu` and `F.gelu(approximate="tanh")`, as transformers maps them)."""

ROPE_KEYS = frozenset({
    "rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings", "partial_rotary_factor", "attention_factor",
    "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "short_factor",
    "long_factor",
})
"""Rope parameters the engine implements; any other key inside them is refused."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (transformers 4 and 5 spellings both map here)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    partial_rotary_factor: float = 1.0
    attention_factor: float | None = None
    """yarn / longrope: cos and sin are multiplied by it (None: derived from the factor)."""
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder of one of the served families."""

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
    """The rope of full-attention layers (of every layer, for most families)."""
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    qkv_bias: bool = False
    """q, k and v projections carry biases (Qwen2; `attention_bias` elsewhere)."""
    o_bias: bool = False
    mlp_bias: bool = False
    layer_windows: tuple[int | None, ...] = ()
    """Per layer, the sliding window (a query at p sees keys after p - window) or None for
    full attention; empty means full attention everywhere."""
    local_rope: RopeConfig | None = None
    """Gemma 3's rope of sliding layers (another base); None: `rope` everywhere."""
    rope_layers: tuple[bool, ...] = ()
    """Per layer, whether it applies rope (SmolLM3's NoPE layers); empty means all do."""
    hidden_act: str = "silu"
    attention_scale: float | None = None
    """Multiplies q K^T; None is head_dim ** -0.5."""
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embedding_scale: float | None = None
    """The embeddings are multiplied by it (Gemma: sqrt(hidden), Granite: a multiplier)."""
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    """The logits are divided by it (Granite)."""

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale

    def packed_shape(self, packed: str) -> tuple[int, int]:
        """(in_features, out_features) of one of the engine's packed projections: "qkv"
        (q|k|v), "o", "gate_up" (gate|up) or "down"."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * i),
                "down": (i, h)}[packed]

    def lora_rows(self, module: str) -> tuple[str, int, int]:
        """(packed projection, first row, end row) a PEFT target module's delta lands on,
        by the family's description (`Family.lora`)."""
        target = self.family.lora[module]
        q, kv, i = self.q_size, self.kv_size, self.intermediate_size
        out = self.packed_shape(target.packed)[1]
        lo, hi = {"all": (0, out), "q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv),
                  "gate": (0, i), "up": (i, 2 * i)}[target.part]
        return target.packed, lo, hi

    def lora_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a PEFT target module: LoRA A is [r, in], B is
        [out, r]."""
        packed, lo, hi = self.lora_rows(module)
        return self.packed_shape(packed)[0], hi - lo

    @property
    def rope_depends_on_length(self) -> bool:
        """A token's rope depends on how long its sequence is (dynamic, longrope): K/V of
        the same tokens differ between sequences, so no block may be shared."""
        ropes = [r for r in (self.rope, self.local_rope) if r is not None]
        return any(r.rope_type in ("dynamic", "longrope") for r in ropes)

    @property
    def recompute_past(self) -> int | None:
        """Phi-3 with longrope: a sequence whose cache ends at or before this position and
        that grows past it is recomputed whole (see `Family.longrope_recompute`)."""
        if self.family.longrope_recompute and self.rope.rope_type == "longrope":
            return self.rope.original_max_position_embeddings
        return None

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

    def rope_of(self, layer: int) -> RopeConfig | None:
        """The rope a layer applies (None: none)."""
        if self.rope_layers and not self.rope_layers[layer]:
            return None
        if self.local_rope is not None and self.window(layer) is not None:
            return self.local_rope
        return self.rope

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Parse and check a `config.json` mapping; `ConfigError` for a broken one,
        `UnsupportedModel` naming the family or field the engine does not compute."""
        if not isinstance(raw, Mapping):
            raise ConfigError("config.json must be a JSON object")
        family = family_of(raw)
        for key, rule in family.all_keys.items():
            if isinstance(rule, Refused) and key in raw and raw[key] not in rule.allowed:
                raise UnsupportedModel(f"{family.model_type}: {key}={raw[key]!r} is not "
                                       f"supported ({rule.why})")
        conf = {**family.defaults, **raw}
        hidden = _positive(conf, "hidden_size")
        heads = _positive(conf, "num_attention_heads")
        kv_heads = _positive(conf, "num_key_value_heads", conf.get("num_key_value_heads")
                             or heads)
        head_dim = _positive(conf, "head_dim", conf.get("head_dim") or hidden // heads or None)
        layers = _positive(conf, "num_hidden_layers")
        if heads % kv_heads:
            raise ConfigError("config.json: num_attention_heads must be a multiple of "
                              "num_key_value_heads")
        max_pos = _positive(conf, "max_position_embeddings", conf.get(
            "max_position_embeddings", 2048))
        act = conf.get(family.activation_key, family.activation_default)
        act = family.activation_aliases.get(act, act)
        if act not in ACTIVATIONS:
            raise UnsupportedModel(f"{family.model_type}: {family.activation_key}="
                                   f"{conf.get(family.activation_key)!r} is not supported "
                                   f"(supported: {sorted(ACTIVATIONS)})")
        rope, local = _parse_rope(conf, family, head_dim, max_pos)
        windows = family.windows(conf, layers)
        scale = None
        if family.attention_scale == "query_pre_attn_scalar":
            scale = _number(conf, "query_pre_attn_scalar", positive=True) ** -0.5
        elif family.attention_scale == "attention_multiplier":
            scale = _number(conf, "attention_multiplier", 1.0)
        embed = None
        if family.embedding_scale == "sqrt_hidden":
            embed = hidden ** 0.5
        elif family.embedding_scale is not None:
            embed = _number(conf, family.embedding_scale, 1.0)
        return cls(
            vocab_size=_positive(conf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive(conf, "intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_number(conf, "rms_norm_eps", 1e-6, positive=True),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(conf.get("tie_word_embeddings", False)),
            rope=rope,
            eos_token_ids=_eos_ids(conf.get("eos_token_id")),
            model_type=family.model_type,
            qkv_bias=_flag(conf, family.qkv_bias),
            o_bias=_flag(conf, family.o_bias),
            mlp_bias=_flag(conf, family.mlp_bias),
            layer_windows=windows,
            local_rope=local,
            rope_layers=family.nope_layers(conf, layers) if family.nope_layers else (),
            hidden_act=act,
            attention_scale=scale,
            attn_softcap=_softcap(conf, family.attn_softcap_key),
            final_softcap=_softcap(conf, family.final_softcap_key),
            embedding_scale=embed,
            residual_multiplier=_number(conf, family.residual_multiplier_key, 1.0)
            if family.residual_multiplier_key else 1.0,
            logits_scaling=_number(conf, family.logits_scaling_key, 1.0, positive=True)
            if family.logits_scaling_key else 1.0,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a model directory."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ConfigError(f"{file.name} not found in model directory")
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"config.json is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)


def _positive(conf: Mapping[str, Any], key: str, value: Any = None) -> int:
    raw = conf.get(key) if value is None else value
    if raw is None and key not in conf:
        raise ConfigError(f"config.json lacks required field {key!r}")
    if isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0:
        raise ConfigError(f"config.json: {key} must be a positive integer, got {raw!r}")
    return raw


def _number(conf: Mapping[str, Any], key: str, default: float | None = None, *,
            positive: bool = False) -> float:
    raw = conf.get(key, default)
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw) \
            or (positive and raw <= 0):
        raise ConfigError(f"config.json: {key} must be a {'positive ' if positive else ''}"
                          f"number, got {raw!r}")
    return float(raw)


def _softcap(conf: Mapping[str, Any], key: str | None) -> float | None:
    if key is None or conf.get(key) is None:
        return None
    return _number(conf, key, positive=True)


def _flag(conf: Mapping[str, Any], rule: bool | str) -> bool:
    return rule if isinstance(rule, bool) else bool(conf.get(rule, False))


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _parse_rope(conf: Mapping[str, Any], family: Family, head_dim: int, max_pos: int
                ) -> tuple[RopeConfig, RopeConfig | None]:
    """The global rope and, for families whose rope is nested by layer type, the local
    one; transformers' `convert_rope_params_to_dict` / `standardize_rope_params` rules."""
    if family.rope_by_layer_type:
        nested = dict(conf.get("rope_parameters") or {})
        if nested and not set(nested) <= {FULL, SLIDING}:
            raise UnsupportedModel(f"{family.model_type}: rope_parameters must be nested by "
                                   f"layer type ({FULL!r}, {SLIDING!r})")
        theta = family.default_theta
        assert isinstance(theta, Mapping)
        full = dict(nested.get(FULL) or {"rope_type": "default"})
        if conf.get("rope_scaling"):
            full.update(conf["rope_scaling"])
        full.setdefault("rope_theta", conf.get("rope_theta", theta[FULL]))
        local = dict(nested.get(SLIDING) or {"rope_type": "default"})
        local.setdefault("rope_theta", conf.get("rope_local_base_freq", theta[SLIDING]))
        return (_rope(full, conf, family, head_dim, max_pos, "rope_parameters.full_attention"),
                _rope(local, conf, family, head_dim, max_pos,
                      "rope_parameters.sliding_attention"))
    params = conf.get("rope_scaling") or conf.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise ConfigError("config.json: rope_parameters must be an object")
    params = dict(params)
    if set(params) & {FULL, SLIDING}:
        raise UnsupportedModel(f"{family.model_type}: rope_parameters nested by layer type "
                               "are not supported for this family")
    theta = family.default_theta
    assert not isinstance(theta, Mapping)
    params.setdefault("rope_theta", conf.get("rope_theta", theta))
    if conf.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", conf["partial_rotary_factor"])
    if family.legacy_rope is not None:
        if params.get("rope_type", params.get("type")) in ("su", "yarn"):
            params["rope_type"] = "longrope"
            params.pop("type", None)
        params.update(family.legacy_rope(conf))
    return _rope(params, conf, family, head_dim, max_pos, "rope_parameters"), None


def _rope(params: dict[str, Any], conf: Mapping[str, Any], family: Family, head_dim: int,
          max_pos: int, where: str) -> RopeConfig:
    """One rope parameter set, checked key by key."""
    unknown = sorted(set(params) - ROPE_KEYS)
    if unknown:
        raise UnsupportedModel(f"{family.model_type}: {where} {unknown} are not supported")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in family.rope_types:
        raise UnsupportedModel(f"{family.model_type}: rope type {rope_type!r} is not "
                               f"supported (supported: {sorted(family.rope_types)})")
    partial = _number(params, "partial_rotary_factor", 1.0, positive=True)
    if partial > 1 or int(head_dim * partial) % 2:
        raise ConfigError(f"config.json: partial_rotary_factor {partial} must leave an even "
                          "number of rotated dimensions, at most head_dim")
    orig = params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn", "longrope") and orig is None:
        orig = max_pos
    factor = params.get("factor")
    if factor is None and rope_type in ("yarn", "longrope"):
        factor = max_pos / orig
    if factor is None and rope_type in ("linear", "dynamic", "llama3"):
        raise ConfigError(f"config.json: rope type {rope_type!r} needs a factor")
    rotated = int(head_dim * partial) // 2
    short, long = (tuple(float(x) for x in params.get(k) or ()) for k in ("short_factor",
                                                                            "long_factor"))
    if rope_type == "longrope" and not (len(short) == len(long) == rotated):
        raise ConfigError(f"config.json: longrope short_factor and long_factor must have "
                          f"{rotated} entries")
    attention = params.get("attention_factor")
    return RopeConfig(
        theta=_number(params, "rope_theta", positive=True),
        rope_type=rope_type,
        factor=float(factor) if factor is not None else 1.0,
        low_freq_factor=_number(params, "low_freq_factor", 1.0),
        high_freq_factor=_number(params, "high_freq_factor", 4.0),
        original_max_position_embeddings=int(orig) if orig is not None else None,
        partial_rotary_factor=partial,
        attention_factor=float(attention) if attention is not None else None,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params["mscale"]) if params.get("mscale") is not None else None,
        mscale_all_dim=float(params["mscale_all_dim"])
        if params.get("mscale_all_dim") is not None else None,
        truncate=bool(params.get("truncate", True)),
        short_factor=short,
        long_factor=long,
    )
