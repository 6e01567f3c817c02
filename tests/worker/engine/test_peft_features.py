"""Adapters as users bring them, against PEFT in fp32 (`families.check_parity`): per-module
ranks and alphas, LoRA on embed_tokens and lm_head (in families that scale embeddings
inside and outside the embedding module), and modules_to_save of those two."""

from __future__ import annotations

import copy

import pytest
import torch

from services.worker.engine import AdapterError, AdapterFiles, RequestError

from .families import (
    Family,
    Variant,
    build_family,
    build_lora,
    check_parity,
    make_engine,
)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def family_with(tmp_path, variant: Variant, **adapters: dict) -> Family:
    hf = build_family(tmp_path / "base", variant)
    paths = {name: build_lora(hf, tmp_path / name, seed=10 + i, **spec)
             for i, (name, spec) in enumerate(adapters.items())}
    return Family(tmp_path / "base", hf, paths)


def test_rank_and_alpha_patterns_match_peft(tmp_path) -> None:
    fam = family_with(
        tmp_path, Variant("llama", "llama"),
        patterns=dict(targets=ALL, r=8, alpha=16.0, rslora=False,
                      rank_pattern={"q_proj": 4, "layers.1.mlp.down_proj": 12},
                      alpha_pattern={"v_proj": 3.0, "gate_proj": 40.0}),
        patterns_rs=dict(targets=ALL, r=6, alpha=12.0, rslora=True,
                         rank_pattern={"o_proj": 16}, alpha_pattern={"k_proj": 2.0}))
    check_parity(fam)
    info = make_engine(fam.path).load_adapter(fam.adapters["patterns"])
    assert info.rank == 12  # the largest of the module ranks


VOCAB_VARIANTS = [
    Variant("llama", "llama"),
    Variant("gemma", "gemma", {"head_dim": 16, "tie_word_embeddings": True}),  # scaled inside
    Variant("granite", "granite", {"embedding_multiplier": 3.0, "logits_scaling": 2.0,
                                   "residual_multiplier": 0.5, "attention_multiplier": 0.2}),
]


@pytest.mark.parametrize("variant", VOCAB_VARIANTS, ids=[v.id for v in VOCAB_VARIANTS])
def test_lora_on_embed_tokens_and_lm_head_matches_peft(tmp_path, variant: Variant) -> None:
    targets = ("q_proj", "v_proj", "embed_tokens", "lm_head")
    fam = family_with(tmp_path, variant,
                      vocab=dict(targets=targets, r=8, alpha=16.0, rslora=False),
                      embed_only=dict(targets=("embed_tokens", "down_proj"), r=4, alpha=8.0,
                                      rslora=True))
    check_parity(fam)
    # PEFT saved a copy of the base embedding (and lm_head) beside the LoRA: equal to the
    # served weights, it is dropped instead of costing a vocabulary-sized weight a slot
    eng = make_engine(fam.path)
    info = eng.load_adapter(fam.adapters["vocab"])
    assert info.bytes < eng.config.max_lora_rank * 96 * 4 * 8
    assert not eng.adapters.replaced


def saved_modules_adapter(base, path, modules: tuple[str, ...]) -> None:
    """LoRA on q/v plus whole trained copies of `modules` (perturbed, so they differ)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=list(modules),
        init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.5)
    peft_model.save_pretrained(path)


def test_modules_to_save_of_embed_tokens_and_lm_head_match_peft(tmp_path) -> None:
    hf = build_family(tmp_path / "base", Variant("llama", "llama"))
    for name, modules in (("both", ("embed_tokens", "lm_head")), ("head", ("lm_head",))):
        saved_modules_adapter(hf, tmp_path / name, modules)
    fam = Family(tmp_path / "base", hf, {"both": tmp_path / "both", "head": tmp_path / "head"})
    check_parity(fam)
    eng = make_engine(fam.path)
    slot = eng.load_adapter(fam.adapters["both"]).slot
    assert sorted(eng.adapters.replaced[slot]) == ["embed_tokens", "lm_head"]
    with pytest.raises(RequestError, match="embed_tokens or lm_head"):
        eng.merge_adapter(eng.list_adapters()[0].digest)


def test_modules_to_save_naming_other_modules_is_refused(tmp_path) -> None:
    hf = build_family(tmp_path / "base", Variant("llama", "llama"))
    build_lora(hf, tmp_path / "a", ("q_proj",), 4, 8.0, False, 1)
    import json

    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    eng = make_engine(tmp_path / "base")
    for saved, message in ((["score"], r"modules_to_save \['score'\]"),
                           (["lm_head"], "holds no lm_head weight")):
        files = AdapterFiles.from_dir(tmp_path / "a")
        bad = AdapterFiles(json.dumps({**cfg, "modules_to_save": saved}).encode(),
                           files.weights)
        with pytest.raises(AdapterError, match=message):
            eng.load_adapter(bad)
