"""What a family description says: the vocabulary `served.py` describes each family in.

A description is data the engine, the checkpoint loader, the registry's adapter
validation and the config parser all read: which tensors a layer has and how they pack
into the engine's fused projections, which norms sit where and how they round, the
activation, the attention variant, how rope and embeddings are scaled, how PEFT's module
names map onto the projections, and what every key of the family's transformers config
does. The anchors are transformers' modular model files and vLLM's model executors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

IMPLEMENTED = "implemented"
"""The parser reads the key and the engine computes what it says."""
HARMLESS = "harmless"
"""The key cannot change what inference computes: training knobs (dropout, init),
bookkeeping (names, versions, label maps), generation defaults and token ids other than
eos (the engine's requests carry their own)."""


@dataclass(frozen=True)
class Refused:
    """A key served only at these values (an absent key counts as the first); any other
    value is refused by name, because the engine does not compute it."""

    allowed: tuple[Any, ...]
    why: str


KeyRule = str | Refused

COMMON_KEYS: Mapping[str, KeyRule] = {
    # shapes and numerics every family reads
    "model_type": IMPLEMENTED,
    "vocab_size": IMPLEMENTED,
    "hidden_size": IMPLEMENTED,
    "intermediate_size": IMPLEMENTED,
    "num_hidden_layers": IMPLEMENTED,
    "num_attention_heads": IMPLEMENTED,
    "num_key_value_heads": IMPLEMENTED,
    "head_dim": IMPLEMENTED,
    "max_position_embeddings": IMPLEMENTED,
    "rms_norm_eps": IMPLEMENTED,
    "tie_word_embeddings": IMPLEMENTED,
    "eos_token_id": IMPLEMENTED,
    "rope_parameters": IMPLEMENTED,
    "rope_theta": IMPLEMENTED,  # transformers 4's spelling, still in most checkpoints
    "rope_scaling": IMPLEMENTED,  # ditto
    "partial_rotary_factor": IMPLEMENTED,
    # cannot change inference
    "transformers_version": HARMLESS,
    "architectures": HARMLESS,
    "auto_map": HARMLESS,  # custom code transformers' built-in model replaces
    "output_hidden_states": HARMLESS,
    "output_attentions": HARMLESS,
    "return_dict": HARMLESS,
    "dtype": HARMLESS,  # the serving dtype is the engine's choice
    "torch_dtype": HARMLESS,
    "chunk_size_feed_forward": HARMLESS,
    "is_encoder_decoder": HARMLESS,
    "id2label": HARMLESS,
    "label2id": HARMLESS,
    "problem_type": HARMLESS,
    "_name_or_path": HARMLESS,
    "use_cache": HARMLESS,
    "initializer_range": HARMLESS,
    "pad_token_id": HARMLESS,
    "bos_token_id": HARMLESS,
    "attention_dropout": HARMLESS,
    "_attn_implementation": HARMLESS,
    "attn_implementation": HARMLESS,
    "cache_implementation": HARMLESS,
    "transformers.js_config": HARMLESS,
    "tie_encoder_decoder": HARMLESS,
    "pruned_heads": HARMLESS,
    "tokenizer_class": HARMLESS,
    # refused anywhere they are set
    "quantization_config": Refused((None,), "quantized checkpoints are not served"),
    "is_causal": Refused((True,), "only causal decoders are served"),
}
"""Keys every family shares. A key neither here nor in the family's own table is one the
family's transformers config class does not have: transformers' model ignores it too."""


@dataclass(frozen=True)
class LoraTarget:
    """Where a PEFT target module's delta lands: a part of one of the engine's packed
    projections. `packed` is "qkv", "o", "gate_up" or "down"; `part` is "q", "k", "v",
    "gate", "up" or "all" (the whole packed output, for a family whose checkpoint fuses
    the projection, so its adapters do too)."""

    path: str
    """The module's path inside a layer (`self_attn.q_proj`), as PEFT names its tensors."""
    packed: str
    part: str = "all"


LLAMA_LORA: Mapping[str, LoraTarget] = {
    "q_proj": LoraTarget("self_attn.q_proj", "qkv", "q"),
    "k_proj": LoraTarget("self_attn.k_proj", "qkv", "k"),
    "v_proj": LoraTarget("self_attn.v_proj", "qkv", "v"),
    "o_proj": LoraTarget("self_attn.o_proj", "o"),
    "gate_proj": LoraTarget("mlp.gate_proj", "gate_up", "gate"),
    "up_proj": LoraTarget("mlp.up_proj", "gate_up", "up"),
    "down_proj": LoraTarget("mlp.down_proj", "down"),
}

LLAMA_NORMS: Mapping[str, str | None] = {
    "attn_in": "input_layernorm",
    "attn_out": None,
    "mlp_in": "post_attention_layernorm",
    "mlp_out": None,
}
"""Which norm (tensor name inside the layer) sits where: before attention, on the
attention output before the residual add, before the MLP, on the MLP output."""

SANDWICH_NORMS: Mapping[str, str | None] = {
    "attn_in": "input_layernorm",
    "attn_out": "post_attention_layernorm",
    "mlp_in": "pre_feedforward_layernorm",
    "mlp_out": "post_feedforward_layernorm",
}

POST_NORMS: Mapping[str, str | None] = {
    "attn_in": None,
    "attn_out": "post_attention_layernorm",
    "mlp_in": None,
    "mlp_out": "post_feedforward_layernorm",
}

WindowRule = Callable[[Mapping[str, Any], int], tuple[int | None, ...]]
"""(config, layers) -> each layer's sliding window or None; refuses by raising."""


@dataclass(frozen=True)
class Family:
    """One model family, as the engine serves it."""

    model_type: str
    title: str
    """How people call it (the model table of docs/families.md)."""
    variants: str
    """The released models it covers, for docs/families.md's table."""
    keys: Mapping[str, KeyRule]
    """The family's own config keys (beside `COMMON_KEYS`), each classified."""
    windows: WindowRule
    lora: Mapping[str, LoraTarget] = field(default_factory=lambda: LLAMA_LORA)
    """PEFT target module name -> where its delta lands."""
    fused_qkv: str | None = None
    """The checkpoint's fused q|k|v tensor (`self_attn.qkv_proj`), or None for three."""
    fused_gate_up: str | None = None
    """The checkpoint's fused gate|up tensor (`mlp.gate_up_proj`), or None for two."""
    norms: Mapping[str, str | None] = field(default_factory=lambda: LLAMA_NORMS)
    norm_style: str = "llama"
    """How RMSNorm rounds and weighs: "llama" (normalise in fp32, cast, times w), "gemma"
    (times 1 + w in fp32, then cast: weights are stored minus one), "olmo" (times w in
    fp32, then cast)."""
    qk_norm: str | None = None
    """RMSNorm on queries and keys before rope: "head" (over each head, Qwen3, Gemma 3) or
    "full" (over all heads at once, OLMo 2)."""
    activation_key: str = "hidden_act"
    activation_default: str = "silu"
    activation_aliases: Mapping[str, str] = field(default_factory=dict)
    """Legacy values transformers rewrites (Gemma's "gelu" means the tanh approximation)."""
    qkv_bias: bool | str = False
    """q, k and v carry biases: always (True), never (False), or as this key says."""
    o_bias: bool | str = False
    mlp_bias: bool | str = False
    rope_by_layer_type: bool = False
    """`rope_parameters` nested by layer type (Gemma 3: local and global bases)."""
    rope_types: frozenset[str] = frozenset(
        {"default", "linear", "dynamic", "llama3", "yarn", "longrope"})
    default_theta: float | Mapping[str, float] = 10000.0
    nope_layers: Callable[[Mapping[str, Any], int], tuple[bool, ...]] | None = None
    """(config, layers) -> which layers use rope (SmolLM3 skips it on every fourth)."""
    attention_scale: str = "head_dim"
    """head_dim ** -0.5, or "query_pre_attn_scalar" ** -0.5 (Gemma 2/3), or the value of
    "attention_multiplier" (Granite)."""
    attn_softcap_key: str | None = None
    final_softcap_key: str | None = None
    embedding_scale: str | None = None
    """"sqrt_hidden" (Gemma: times sqrt(hidden_size), rounded to the weights' dtype) or
    the key of a multiplier (Granite's "embedding_multiplier")."""
    residual_multiplier_key: str | None = None
    logits_scaling_key: str | None = None
    """The logits are divided by this key's value (Granite)."""
    longrope_recompute: bool = False
    """Generation drops the cache once a sequence passes the pretraining length, so the
    whole sequence is recomputed with the long factors (transformers' Phi-3
    `prepare_inputs_for_generation`); elsewhere longrope keeps the short-factor cache."""
    legacy_rope: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    """Family-specific rewrites of transformers 4 rope spellings (Phi-3's "su")."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """What the family's transformers config class fills in for an absent key, where that
    differs from the general defaults (no window, hidden / heads, silu, untied)."""

    @property
    def all_keys(self) -> dict[str, KeyRule]:
        return {**COMMON_KEYS, **self.keys}
