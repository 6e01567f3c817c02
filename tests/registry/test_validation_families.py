"""Upload validation by the base model's family description, without a server: per-module
ranks, embedding/lm_head LoRA and saved modules, another family's module names."""

from __future__ import annotations

import io

import pytest
import torch

from services.contracts.capacity import AdapterLimits
from services.registry.validation import UploadRejected, validate_adapter
from tests.registry.artifacts import LLAMA_CONFIG, AdapterFiles, build_adapter, tensor_name

ALLOWED = ["float16", "bfloat16", "float32"]
VOCAB = LLAMA_CONFIG["vocab_size"]


def check(files: AdapterFiles, **base: object):
    return validate_adapter(files.config, io.BytesIO(files.weights), len(files.weights),
                            {**LLAMA_CONFIG, **base}, limits=AdapterLimits(64, tuple(ALLOWED)))


def test_rank_pattern_shapes_are_checked_per_module() -> None:
    def rank8_v(t: dict[str, torch.Tensor]) -> None:
        for layer in (0, 1):
            t[tensor_name(layer, "v_proj", "A")] = torch.zeros(8, 64).half()
            t[tensor_name(layer, "v_proj", "B")] = torch.zeros(32, 8).half()

    patterned = build_adapter(edit=rank8_v, config_edit=lambda c: c.update(
        rank_pattern={"v_proj": 8}))
    facts = check(patterned)
    assert facts.rank == 8 and facts.target_modules == ("q_proj", "v_proj")
    with pytest.raises(UploadRejected) as err:
        check(build_adapter(config_edit=lambda c: c.update(rank_pattern={"v_proj": 8})))
    assert err.value.tensor == tensor_name(0, "v_proj", "A") and "r=8" in err.value.message


def test_saved_lm_head_and_embedding_lora_are_accepted_and_reported() -> None:
    def vocab_parts(t: dict[str, torch.Tensor]) -> None:
        t["base_model.model.lm_head.weight"] = torch.zeros(VOCAB, 64).half()
        t["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, VOCAB).half()
        t["base_model.model.model.embed_tokens.lora_embedding_B"] = torch.zeros(64, 4).half()

    files = build_adapter(edit=vocab_parts, config_edit=lambda c: c.update(
        modules_to_save=["lm_head"], target_modules=["q_proj", "v_proj", "embed_tokens"]))
    assert check(files).target_modules == ("q_proj", "v_proj", "embed_tokens", "lm_head")
    with pytest.raises(UploadRejected, match="modules_to_save names lm_head") as err:
        check(build_adapter(config_edit=lambda c: c.update(modules_to_save=["lm_head"])))
    assert err.value.field == "modules_to_save"


def test_modules_of_another_family_are_refused_naming_this_one() -> None:
    with pytest.raises(UploadRejected, match=r"not projections of Phi-3 models \(\['qkv_proj'"):
        check(build_adapter(), model_type="phi3")
