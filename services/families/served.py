"""The families the engine serves, one description each, and the ones it refuses.

Each entry follows its transformers modular model file (and vLLM's executor of the same
name): keys the family's config class has, classified; the defaults its config class
fills in when a key is absent (a config.json without `head_dim` is a Gemma with 256, not
hidden / heads); and its layer layout. A new family is one more entry here plus its
parity test (tests/worker/engine/test_families.py), which also walks its config keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from .description import (
    HARMLESS,
    IMPLEMENTED,
    POST_NORMS,
    SANDWICH_NORMS,
    Family,
    LoraTarget,
    Refused,
    WindowRule,
)
from .errors import ConfigError, UnsupportedModel

FULL = "full_attention"
SLIDING = "sliding_attention"


def _window(raw: Mapping[str, Any], key: str = "sliding_window") -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config.json: {key} must be a positive integer or null, "
                          f"got {value!r}")
    return value


def _by_types(types: Sequence[Any], window: int | None, layers: int
              ) -> tuple[int | None, ...]:
    if not isinstance(types, list | tuple) or len(types) != layers:
        raise ConfigError(f"config.json: layer_types must list one type for each of the "
                          f"{layers} layers")
    out: list[int | None] = []
    for i, kind in enumerate(types):
        if kind not in (FULL, SLIDING):
            raise UnsupportedModel(f"layer_types[{i}]={kind!r} is not supported "
                                   f"(only {FULL!r} and {SLIDING!r})")
        if kind == SLIDING and window is None:
            raise ConfigError(f"config.json: layer {i} is {SLIDING!r} but sliding_window "
                              "is null")
        out.append(window if kind == SLIDING else None)
    return tuple(out) if any(w is not None for w in out) else ()


def no_windows(raw: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
    return ()


def every_layer(raw: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
    """Mistral, Phi-3: `sliding_window`, when set, slides every layer."""
    window = _window(raw)
    return (window,) * layers if window is not None else ()


def gated_by_use_sliding_window(raw: Mapping[str, Any], layers: int
                                ) -> tuple[int | None, ...]:
    """Qwen2, Qwen3: a window only with `use_sliding_window`, on the layers `layer_types`
    names, by default those from `max_window_layers` on."""
    window = _window(raw) if raw.get("use_sliding_window") else None
    types = raw.get("layer_types")
    if types is None:
        first = raw.get("max_window_layers", 28)
        types = [SLIDING if window is not None and i >= first else FULL
                 for i in range(layers)]
    return _by_types(types, window, layers)


def alternating(period_keys: tuple[str, ...], period: int) -> WindowRule:
    """Gemma 2 (every other layer) and Gemma 3 (five local, one global): `layer_types`, or
    every `period`-th layer global, the others sliding."""
    def rule(raw: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
        types = raw.get("layer_types")
        if types is None:
            p = next((raw[k] for k in period_keys if raw.get(k) is not None), period)
            types = [SLIDING if (i + 1) % p else FULL for i in range(layers)]
        return _by_types(types, _window(raw), layers)
    return rule


def smollm3_rope_layers(raw: Mapping[str, Any], layers: int) -> tuple[bool, ...]:
    """`no_rope_layers` (1: rope, 0: none), by default none on every fourth layer."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        every = raw.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % every != 0) for i in range(layers)]
    if not isinstance(flags, list | tuple) or len(flags) < layers:
        raise ConfigError(f"config.json: no_rope_layers must have at least {layers} entries")
    return tuple(bool(f) for f in flags[:layers])


def smollm3_windows(raw: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
    """Sliding layers are the NoPE ones, and only with `use_sliding_window`."""
    types = raw.get("layer_types")
    window = _window(raw)
    if types is None:
        rope = smollm3_rope_layers(raw, layers)
        types = [SLIDING if raw.get("use_sliding_window") and window is not None
                 and not rope[i] else FULL for i in range(layers)]
    return _by_types(types, window, layers)


def phi3_legacy_rope(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Phi-3's checkpoints name longrope "su" (and once "yarn"); transformers reads both as
    longrope, and its top-level original_max_position_embeddings wins."""
    out: dict[str, Any] = {}
    if raw.get("original_max_position_embeddings") is not None:
        out["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    return out


LLAMA_KEYS = {
    "hidden_act": IMPLEMENTED,
    "attention_bias": IMPLEMENTED,
    "mlp_bias": IMPLEMENTED,
    "pretraining_tp": HARMLESS,  # transformers 5's Llama no longer reads it
}

SLIDING_KEYS = {
    "use_sliding_window": IMPLEMENTED,
    "sliding_window": IMPLEMENTED,
    "max_window_layers": IMPLEMENTED,
    "layer_types": IMPLEMENTED,
}

BIDIRECTIONAL = Refused((None, False), "bidirectional attention (an encoder) is not served")

GEMMA2_KEYS = {
    "hidden_activation": IMPLEMENTED,
    "hidden_act": HARMLESS,  # Gemma 2/3 read hidden_activation; checkpoints carry both
    "attention_bias": IMPLEMENTED,
    "query_pre_attn_scalar": IMPLEMENTED,
    "sliding_window": IMPLEMENTED,
    "layer_types": IMPLEMENTED,
    "final_logit_softcapping": IMPLEMENTED,
    "attn_logit_softcapping": IMPLEMENTED,
    "use_bidirectional_attention": BIDIRECTIONAL,
}

PHI3_LORA: Mapping[str, LoraTarget] = {
    "qkv_proj": LoraTarget("self_attn.qkv_proj", "qkv"),
    "o_proj": LoraTarget("self_attn.o_proj", "o"),
    "gate_up_proj": LoraTarget("mlp.gate_up_proj", "gate_up"),
    "down_proj": LoraTarget("mlp.down_proj", "down"),
}

DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "eos_token_id": 2},
    "mistral": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "eos_token_id": 2,
                "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "sliding_window": 4096,
              "max_window_layers": 28},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "sliding_window": 4096,
              "max_window_layers": 28, "head_dim": 128},
    "gemma": {"max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "eos_token_id": 1,
              "head_dim": 256, "tie_word_embeddings": True,
              "hidden_act": "gelu_pytorch_tanh"},
    "gemma2": {"max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "eos_token_id": 1,
               "head_dim": 256, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0, "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3_text": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                    "eos_token_id": 1, "head_dim": 256, "tie_word_embeddings": True,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "hidden_activation": "gelu_pytorch_tanh"},
    "phi3": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "eos_token_id": 32000,
             "sliding_window": None, "original_max_position_embeddings": 4096},
    "olmo2": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "eos_token_id": 50279},
    "granite": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "eos_token_id": 2},
    "smollm3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                "eos_token_id": 128001, "tie_word_embeddings": True,
                "rope_theta": 2_000_000.0},
}
"""What each family's transformers config class fills in for an absent key (where it
differs from the engine's general defaults: no window, hidden / heads, silu, untied);
tests/families pins every one against the config class. Joined to the descriptions
below."""

FAMILIES: dict[str, Family] = {f.model_type: replace(f, defaults=DEFAULTS[f.model_type])
                               for f in (
    Family("llama", "Llama", "Llama 2, Llama 3.x, TinyLlama, SmolLM2, Mistral-style "
           "Llamas; attention/MLP biases; rope default, linear, dynamic, llama3, yarn, "
           "longrope", LLAMA_KEYS, no_windows,
           qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias"),
    Family("mistral", "Mistral", "Mistral 7B v0.1 (sliding window), v0.2/v0.3, "
           "Mistral-Nemo", {"hidden_act": IMPLEMENTED, "sliding_window": IMPLEMENTED},
           every_layer),
    Family("qwen2", "Qwen2 / Qwen2.5", "Qwen2 and Qwen2.5 0.5B-72B (q/k/v biases, tied "
           "embeddings on 0.5B-3B, sliding window when use_sliding_window)",
           {"hidden_act": IMPLEMENTED, **SLIDING_KEYS}, gated_by_use_sliding_window,
           qkv_bias=True),
    Family("qwen3", "Qwen3", "Qwen3 0.6B-32B dense (q/k norms)",
           {"hidden_act": IMPLEMENTED, "attention_bias": IMPLEMENTED, **SLIDING_KEYS},
           gated_by_use_sliding_window, qk_norm="head", qkv_bias="attention_bias",
           o_bias="attention_bias"),
    Family("gemma", "Gemma", "Gemma 2B/7B, CodeGemma (+1 norms, gelu-tanh, scaled "
           "embeddings)", {"hidden_act": IMPLEMENTED, "attention_bias": IMPLEMENTED,
                           "hidden_activation": HARMLESS,
                           "use_bidirectional_attention": BIDIRECTIONAL},
           no_windows, norm_style="gemma", activation_default="gelu_pytorch_tanh",
           activation_aliases={"gelu": "gelu_pytorch_tanh"}, qkv_bias="attention_bias",
           o_bias="attention_bias", embedding_scale="sqrt_hidden"),
    Family("gemma2", "Gemma 2", "Gemma 2 2B/9B/27B (sandwich norms, soft-capping, "
           "alternating local/global layers, query_pre_attn_scalar)", GEMMA2_KEYS,
           alternating((), 2), norms=SANDWICH_NORMS, norm_style="gemma",
           activation_key="hidden_activation", activation_default="gelu_pytorch_tanh",
           qkv_bias="attention_bias", o_bias="attention_bias",
           attention_scale="query_pre_attn_scalar",
           attn_softcap_key="attn_logit_softcapping",
           final_softcap_key="final_logit_softcapping", embedding_scale="sqrt_hidden"),
    Family("gemma3_text", "Gemma 3 (text)", "Gemma 3 1B and the text decoder of 4B-27B "
           "(q/k norms, five local layers to one global, local rope base)",
           {**GEMMA2_KEYS, "sliding_window_pattern": IMPLEMENTED,
            "_sliding_window_pattern": HARMLESS,  # layer_types is saved beside it
            "rope_local_base_freq": IMPLEMENTED,
            # transformers' Gemma 3 keeps the key but never applies it (q/k norms replaced
            # soft-capping); set, it would mean one thing here and another there
            "attn_logit_softcapping": Refused((None,), "transformers' Gemma 3 does not "
                                                       "apply attention soft-capping")},
           alternating(("sliding_window_pattern",), 6), norms=SANDWICH_NORMS,
           norm_style="gemma", qk_norm="head", activation_key="hidden_activation",
           activation_default="gelu_pytorch_tanh", qkv_bias="attention_bias",
           o_bias="attention_bias", rope_by_layer_type=True,
           default_theta={FULL: 1_000_000.0, SLIDING: 10_000.0},
           attention_scale="query_pre_attn_scalar",
           final_softcap_key="final_logit_softcapping", embedding_scale="sqrt_hidden"),
    Family("phi3", "Phi-3", "Phi-3 / Phi-3.5 mini and medium, Phi-4-mini (fused qkv and "
           "gate_up; longrope; partial rotary)",
           {"hidden_act": IMPLEMENTED, "sliding_window": IMPLEMENTED,
            "original_max_position_embeddings": IMPLEMENTED, "resid_pdrop": HARMLESS,
            "embd_pdrop": HARMLESS}, every_layer, lora=PHI3_LORA,
           fused_qkv="self_attn.qkv_proj", fused_gate_up="mlp.gate_up_proj",
           longrope_recompute=True, legacy_rope=phi3_legacy_rope),
    Family("olmo2", "OLMo 2", "OLMo 2 1B-32B (norms after attention and MLP, q/k norms "
           "over all heads)", {"hidden_act": IMPLEMENTED, "attention_bias": IMPLEMENTED},
           no_windows, norms=POST_NORMS, norm_style="olmo", qk_norm="full",
           qkv_bias="attention_bias", o_bias="attention_bias"),
    Family("granite", "Granite", "IBM Granite 3.x dense (embedding, residual, attention "
           "and logit multipliers)",
           {"hidden_act": IMPLEMENTED, "attention_bias": IMPLEMENTED,
            "mlp_bias": IMPLEMENTED, "embedding_multiplier": IMPLEMENTED,
            "logits_scaling": IMPLEMENTED, "residual_multiplier": IMPLEMENTED,
            "attention_multiplier": IMPLEMENTED}, no_windows,
           qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
           attention_scale="attention_multiplier", embedding_scale="embedding_multiplier",
           residual_multiplier_key="residual_multiplier", logits_scaling_key="logits_scaling"),
    Family("smollm3", "SmolLM3", "SmolLM3-3B (no rope on every fourth layer)",
           {"hidden_act": IMPLEMENTED, "attention_bias": IMPLEMENTED,
            "mlp_bias": IMPLEMENTED, "use_sliding_window": IMPLEMENTED,
            "sliding_window": IMPLEMENTED, "no_rope_layers": IMPLEMENTED,
            "no_rope_layer_interval": IMPLEMENTED, "layer_types": IMPLEMENTED},
           smollm3_windows, qkv_bias="attention_bias", o_bias="attention_bias",
           mlp_bias="mlp_bias", nope_layers=smollm3_rope_layers),
)}

MIXTURES_OF_EXPERTS = frozenset({
    "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe",
    "granitemoe", "granitemoeshared", "phimoe", "dbrx", "jamba", "jetmoe", "minimax",
    "llama4", "llama4_text", "gpt_oss", "hunyuan_v1_moe", "ernie4_5_moe", "glm4_moe",
    "dots1", "bailing_moe", "qwen3_next", "flex_olmo", "lfm2_moe",
})
"""Families served nowhere here: the engine has no expert routing."""


def family_of(raw: Mapping[str, Any]) -> Family:
    """The description of a config.json's family, or a refusal naming it."""
    model_type = raw.get("model_type", "llama")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is not None:
        return family
    if model_type in MIXTURES_OF_EXPERTS:
        raise UnsupportedModel(f"model_type {model_type!r} is a mixture of experts, which "
                               "this engine does not serve")
    raise UnsupportedModel(f"model_type {model_type!r} is not served (served: "
                           f"{', '.join(sorted(FAMILIES))})")
