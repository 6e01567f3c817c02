"""Each family's description against its transformers config class: every key classified,
every default the class fills in, every refused key refused by name, the spellings
transformers 4 checkpoints still carry read as transformers 5 reads them; and the same
walk over PEFT's `LoraConfig`."""

from __future__ import annotations

import pytest

from services.families import (
    COMMON_KEYS,
    FAMILIES,
    ModelConfig,
    Refused,
    UnsupportedModel,
)
from services.families.adapters import LORA_KEYS, AdapterRefused, read_lora_config

transformers = pytest.importorskip("transformers")

SHAPE = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2}


def config_class_dict(model_type: str, **kwargs: object) -> dict:
    """What transformers makes of these keys: its config class's full `to_dict()`."""
    return transformers.CONFIG_MAPPING[model_type](**kwargs).to_dict()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_config_key_is_classified(model_type: str) -> None:
    """A key transformers' config class has is implemented, harmless or refused by name:
    a key a new transformers release adds fails here until it is classified."""
    keys = FAMILIES[model_type].all_keys
    unclassified = sorted(set(config_class_dict(model_type)) - set(keys))
    assert not unclassified, f"{model_type}: classify {unclassified} in services/families"


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_defaults_are_the_config_class_defaults(model_type: str) -> None:
    """A config.json that leaves keys out means what the config class fills in."""
    sparse = ModelConfig.from_dict({"model_type": model_type, **SHAPE})
    full = ModelConfig.from_dict(config_class_dict(model_type, **SHAPE))
    assert sparse == full


REFUSED = [(t, k, r) for t in sorted(FAMILIES) for k, r in FAMILIES[t].all_keys.items()
           if isinstance(r, Refused)]


@pytest.mark.parametrize(("model_type", "key", "rule"), REFUSED,
                         ids=[f"{t}-{k}" for t, k, _ in REFUSED])
def test_refused_keys_are_refused_by_name(model_type: str, key: str, rule: Refused) -> None:
    raw = {"model_type": model_type, **SHAPE}
    assert ModelConfig.from_dict({**raw, key: rule.allowed[0]})
    bad = {"quantization_config": {"quant_method": "awq"}, "is_causal": False}.get(key, 1)
    with pytest.raises(UnsupportedModel, match=key):
        ModelConfig.from_dict({**raw, key: bad})


LEGACY = [
    ("llama", {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                         "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32}}),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    ("qwen2", {"rope_theta": 1000000.0, "use_sliding_window": False, "sliding_window": 131072,
               "max_window_layers": 21}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
    ("qwen3", {"rope_theta": 1000000.0, "head_dim": 16, "attention_bias": True}),
    ("mistral", {"sliding_window": None, "rope_theta": 1000000.0}),
    ("mistral", {"sliding_window": 16}),
    ("gemma", {"hidden_act": "gelu", "head_dim": 16}),
    ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8}),
    ("gemma3_text", {"head_dim": 16, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                     "sliding_window_pattern": 3, "sliding_window": 8,
                     "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    ("phi3", {"partial_rotary_factor": 0.5, "original_max_position_embeddings": 64,
              "max_position_embeddings": 256, "rope_scaling": {
                  "type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}}),
    ("phi3", {"sliding_window": 16}),
    ("smollm3", {"no_rope_layer_interval": 3, "use_sliding_window": True,
                 "sliding_window": 8}),
    ("granite", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                 "attention_multiplier": 0.0078125, "logits_scaling": 8.0,
                 "attention_bias": True, "mlp_bias": True}),
]


@pytest.mark.parametrize(("model_type", "extra"), LEGACY,
                         ids=[f"{t}-{i}" for i, (t, _) in enumerate(LEGACY)])
def test_transformers_4_spellings_read_as_transformers_5_reads_them(
        model_type: str, extra: dict) -> None:
    """Checkpoints on the Hub still say `rope_theta`, `rope_scaling` (with "type"),
    `rope_local_base_freq`, `sliding_window_pattern`: the raw config.json means what the
    config class makes of it."""
    raw = {"model_type": model_type, **SHAPE, **extra}
    assert ModelConfig.from_dict(raw) == ModelConfig.from_dict(
        config_class_dict(model_type, **SHAPE, **extra))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_mixtures_of_experts_are_refused_by_name(model_type: str) -> None:
    with pytest.raises(UnsupportedModel, match=f"{model_type}.*mixture of experts"):
        ModelConfig.from_dict(config_class_dict(model_type))


@pytest.mark.parametrize("model_type", ["gpt2", "falcon", "cohere", "starcoder2", "phi"])
def test_families_not_described_are_refused_by_name(model_type: str) -> None:
    with pytest.raises(UnsupportedModel, match=f"model_type '{model_type}' is not served"):
        ModelConfig.from_dict(config_class_dict(model_type))


@pytest.mark.parametrize(("model_type", "extra", "named"), [
    ("llama", {"hidden_act": "relu"}, "hidden_act"),
    ("gemma2", {"hidden_activation": "gelu_new"}, "hidden_activation"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mrope_section": [1]}},
     "mrope_section"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8,
               "layer_types": ["chunked_attention"] * 6}, "chunked_attention"),
], ids=["activation", "gemma2-activation", "rope-key", "layer-type"])
def test_values_the_engine_does_not_compute_are_refused_by_name(
        model_type: str, extra: dict, named: str) -> None:
    with pytest.raises(UnsupportedModel, match=named):
        ModelConfig.from_dict({"model_type": model_type, **SHAPE, **extra})


def test_every_peft_lora_config_key_is_classified() -> None:
    peft = pytest.importorskip("peft")
    keys = set(peft.LoraConfig(target_modules=["q_proj"]).to_dict())
    assert not sorted(keys - set(LORA_KEYS)), "classify them in services/families/adapters.py"


LORA_REFUSED = [(k, r) for k, r in LORA_KEYS.items() if isinstance(r, Refused)]


@pytest.mark.parametrize(("key", "rule"), LORA_REFUSED, ids=[k for k, _ in LORA_REFUSED])
def test_refused_lora_keys_are_refused_by_name(key: str, rule: Refused) -> None:
    conf = {"r": 4, "target_modules": ["q_proj"]}
    read_lora_config({**conf, key: rule.allowed[0]})
    with pytest.raises(AdapterRefused, match=key) as err:
        read_lora_config({**conf, key: "IA3" if key == "peft_type" else True})
    assert err.value.field == key


def test_dora_is_refused_naming_it() -> None:
    with pytest.raises(AdapterRefused, match="DoRA"):
        read_lora_config({"r": 4, "target_modules": ["q_proj"], "use_dora": True})


def test_common_keys_hold_no_family_specific_computation() -> None:
    """A key that changes the maths in some family is classified in that family, not in
    the shared table, where it would silently be "implemented" for every family."""
    for family in FAMILIES.values():
        assert not set(family.keys) & {k for k, r in COMMON_KEYS.items()
                                       if isinstance(r, Refused)}
