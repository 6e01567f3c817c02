"""Tiny random checkpoints of every model family, PEFT adapters on them, and the parity
check against transformers + PEFT that each family's tests run (nothing is downloaded).

Every 1-D parameter (biases, norm weights) gets noise on top of its initial value:
transformers initialises biases to zero and norms to one (or zero for Gemma's +1 norms),
and a dropped bias or a missing +1 would otherwise go unnoticed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.worker.engine import (
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
    SchedulerLimits,
)

from .tiny_llama import EOS, VOCAB, write_tokenizer

DIMS: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    eos_token_id=EOS,
    bos_token_id=1,
    pad_token_id=0,
    tie_word_embeddings=False,
)

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

PROMPTS = [
    [5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71],
    [23, 29, 31, 37, 41, 43, 47],
    [71, 73, 79, 83, 4, 8, 15, 16, 23, 42, 10, 20, 30],
]
"""Lengths 19, 7 and 13: with the windows of 8 the tests use, two start past the window
and the third passes it while it generates."""


@dataclass(frozen=True)
class Variant:
    """One family configuration under test."""

    id: str
    model_type: str
    overrides: dict[str, Any] = field(default_factory=dict)
    targets: tuple[str, ...] = LLAMA_TARGETS
    """PEFT target modules of the two adapters (the family's own projection names)."""


def build_family(path: Path, variant: Variant, seed: int = 0):
    """Save a random fp32 model of the variant (safetensors) plus tokenizer; return it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(variant.model_type, **{**DIMS, **variant.overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, cfg.vocab_size)
    return model


def build_lora(base, path: Path, targets: tuple[str, ...], r: int, alpha: float,
               rslora: bool, seed: int = 0, **extra: Any) -> Path:
    """A PEFT LoRA adapter with random non-zero A and B, saved with save_pretrained."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                     init_lora_weights=False, lora_dropout=0.0, **extra)
    peft_model = get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.mul_(3.0)
    peft_model.save_pretrained(path)
    return path


@dataclass
class Family:
    """A built variant: the transformers model and its two adapters (r8, r16 rsLoRA)."""

    path: Path
    hf: Any
    adapters: dict[str, Path]


def build_with_adapters(root: Path, variant: Variant, seed: int = 0) -> Family:
    hf = build_family(root / "base", variant, seed)
    adapters = {
        "r8": build_lora(hf, root / "r8", variant.targets, 8, 16.0, False, seed + 1),
        "r16_rs": build_lora(hf, root / "r16_rs", variant.targets, 16, 32.0, True, seed + 2),
    }
    return Family(root / "base", hf, adapters)


def reference(fam: Family, adapter: str | None):
    """transformers alone, or transformers + PEFT with one adapter."""
    from peft import PeftModel

    model = copy.deepcopy(fam.hf)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, fam.adapters[adapter]).eval()
    return model


def greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, attention_mask=torch.ones(1, len(prompt),
                                                                        dtype=torch.long))
    return out[0, len(prompt):].tolist()


def make_engine(path: Path, *, step_tokens: int = 16, blocks: int = 96, **kw: Any) -> Engine:
    cfg: dict[str, Any] = dict(dtype="float32", num_kv_blocks=blocks, block_size=4,
                               adapter_slots=4, max_lora_rank=16,
                               limits=SchedulerLimits(max_running=16,
                                                      max_tokens_per_step=step_tokens))
    cfg.update(kw)
    return Engine.from_pretrained(path, EngineConfig(**cfg))


NEW_TOKENS = 12


def check_parity(fam: Family, *, prompts: list[list[int]] = PROMPTS,
                 new_tokens: int = NEW_TOKENS, atol: float = 1e-3) -> None:
    """The engine against transformers + PEFT for the base model and both adapters:
    logits over a prompt that runs past any window (one prefill) within `atol`, and greedy
    tokens exactly, each request alone and all of them in one mixed batch whose small
    step budget chunks the prefills between other sequences' decodes."""
    eng = make_engine(fam.path)
    digests = {name: eng.load_adapter(p).digest for name, p in fam.adapters.items()}
    names: list[str | None] = [None, *fam.adapters]
    expected: dict[tuple[str | None, int], list[int]] = {}
    long_prompt = prompts[0] + prompts[2]
    for name in names:
        model = reference(fam, name)
        with torch.no_grad():
            ref = model(torch.tensor([long_prompt])).logits[0].float()
        got = eng.score(long_prompt, None if name is None else digests[name])
        err = (got - ref).abs().max().item()
        assert err < atol, f"{name or 'base'}: logits differ by {err:.2e}"
        for i, prompt in enumerate(prompts):
            expected[(name, i)] = greedy(model, prompt, new_tokens)
    assert len({tuple(v) for v in expected.values()}) > 1  # the adapters change the output

    def request(name: str | None, i: int) -> GenerationRequest:
        return GenerationRequest(
            prompt_token_ids=prompts[i], adapter_digest=None if name is None else digests[name],
            sampling=SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens))

    alone = make_engine(fam.path, step_tokens=256)
    for p in fam.adapters.values():
        alone.load_adapter(p)
    for key in expected:
        got_alone = alone.generate([request(*key)])[0].token_ids
        assert got_alone == expected[key], f"alone {key}"
    mixed = eng.generate([request(*key) for key in expected])
    for key, res in zip(expected, mixed, strict=True):
        assert res.token_ids == expected[key], f"mixed {key}"
