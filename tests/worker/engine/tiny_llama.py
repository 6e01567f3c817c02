"""Builders for tiny random Llama checkpoints and PEFT adapters (nothing is downloaded)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB = 96
EOS = 2


def write_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    """A WordLevel tokenizer over words w0..wN, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = dict(
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
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def build_model(path: Path, seed: int = 0, **overrides):
    """Save a random LlamaForCausalLM (safetensors) plus tokenizer; return the HF model."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = llama_config(**overrides)
    model = LlamaForCausalLM(cfg).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, cfg.vocab_size)
    return model


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    r: int
    targets: tuple[str, ...]
    alpha: float = 16.0
    rslora: bool = False
    layers: tuple[int, ...] | None = None


ADAPTERS = (
    AdapterSpec("attn_r4", 4, ("q_proj", "v_proj")),
    AdapterSpec("mlp_r8", 8, ("gate_proj", "up_proj", "down_proj"), alpha=8.0),
    AdapterSpec("all_r16_rs", 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                   "up_proj", "down_proj"), alpha=32.0, rslora=True),
    AdapterSpec("ko_r2_l1", 2, ("k_proj", "o_proj", "down_proj"), alpha=4.0, layers=(1,)),
)


def build_adapter(base, spec: AdapterSpec, path: Path, seed: int) -> None:
    """A PEFT LoRA adapter with random non-zero A and B, saved with save_pretrained."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.rslora,
        layers_to_transform=list(spec.layers) if spec.layers else None,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    import copy

    peft_model = get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.mul_(3.0)
    peft_model.save_pretrained(path)


@dataclass
class TinyModel:
    path: Path
    hf: object
    adapters: dict[str, Path]
