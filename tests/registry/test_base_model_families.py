"""Families over HTTP against a real registry and broker: a base model the engine cannot
serve exactly is refused at registration, naming the family or field; adapters are
validated by the family's description (PEFT's per-module ranks and embedding/lm_head LoRA
accepted, DoRA refused by name)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from tests.registry.artifacts import LLAMA_CONFIG, build_adapter
from tests.registry.conftest import RunningRegistry, domain_events, publish, register_base

pytestmark = pytest.mark.slow

SHAPE = {k: v for k, v in LLAMA_CONFIG.items() if k not in ("architectures", "model_type")}


def digest_of(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize(("config", "named"), [
    ({**SHAPE, "model_type": "mixtral", "num_local_experts": 4}, "mixture of experts"),
    ({**SHAPE, "model_type": "gpt2"}, "model_type 'gpt2' is not served"),
    ({**SHAPE, "model_type": "llama", "hidden_act": "relu"}, "hidden_act"),
    ({**SHAPE, "model_type": "gemma3_text", "attn_logit_softcapping": 50.0},
     "attn_logit_softcapping"),
    ({**SHAPE, "model_type": "qwen2", "quantization_config": {"quant_method": "awq"}},
     "quantization_config"),
    ({**SHAPE, "model_type": "llama", "rope_scaling": {"rope_type": "mrope", "factor": 2.0}},
     "mrope"),
], ids=["moe", "unknown-family", "activation", "gemma3-softcap", "quantized", "rope-type"])
def test_registration_refuses_what_the_engine_cannot_serve(registry: RunningRegistry,
                                                           config: dict, named: str) -> None:
    with registry.client() as admin:
        response = admin.post("/v1/base-models", json={
            "name": "refused", "digest": digest_of(config), "config": config})
        assert response.status_code == 422, response.text
        assert named in response.json()["detail"]
        assert response.json()["field"] == "config"
        served = {**SHAPE, "model_type": "qwen2", "use_sliding_window": True,
                  "sliding_window": 8}
        assert admin.post("/v1/base-models", json={
            "name": "qwen", "digest": digest_of(served), "config": served}).status_code == 201
    assert [e.type for e in domain_events(registry.settings)] == ["BaseModelRegistered"]


def test_adapters_are_validated_by_the_family_description(registry: RunningRegistry) -> None:
    """rank_pattern and lm_head LoRA are accepted (the engine serves them); DoRA is a 422
    that names it; a module the family lacks is refused naming the family's own."""
    vocab = 256

    def with_head(t: dict[str, torch.Tensor]) -> None:
        t["base_model.model.lm_head.lora_A.weight"] = torch.randn(4, 64).half()
        t["base_model.model.lm_head.lora_B.weight"] = torch.randn(vocab, 4).half()

    patterned = build_adapter(
        rank=4, targets=("q_proj", "v_proj"), edit=with_head, config_edit=lambda c: c.update(
            target_modules=["q_proj", "v_proj", "lm_head"], rank_pattern={"layers.1.*": 4},
            alpha_pattern={"v_proj": 3}))
    dora = build_adapter(config_edit=lambda c: c.update(use_dora=True))
    fused = build_adapter(config_edit=lambda c: c.update(target_modules=["qkv_proj"]))
    with registry.client() as admin:
        register_base(admin)
        accepted = publish(admin, "patterned", patterned, "v1")
        assert accepted.status_code == 201, accepted.text
        assert accepted.json()["target_modules"] == ["q_proj", "v_proj", "lm_head"]
        refused = publish(admin, "dora", dora, "v1")
        assert refused.status_code == 422 and "DoRA" in refused.json()["detail"]
        assert refused.json()["field"] == "use_dora"
        other = publish(admin, "fused", fused, "v1")
        assert other.status_code == 422 and "qkv_proj" in other.json()["detail"]
        assert "Llama models" in other.json()["detail"]
