"""A tiny random Llama with a byte-level BPE tokenizer and a chat template that renders
tools (Hermes / Qwen `<tool_call>` format): JSON, regexes and tool calls can be spelled
in its vocabulary, so structured output and tool calling run on it. Nothing is
downloaded: the tokenizer is trained here on a few lines."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"answer": "yes", "confidence": 0.9, "items": [1, 2, 3], "ok": true, "none": null}',
    "The quick brown fox jumps over the lazy dog. 0123456789 +-*/=<>()[]{}",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ !?.,;:'\"_#@$%^&|~`\\\n\t",
]
SPECIAL = ["<|im_start|>", "<|im_end|>"]
MARKERS = ["<tool_call>", "</tool_call>"]
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call a function as <tool_call>\n{\"name\": <name>, \"arguments\": <json>}\n"
    "</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n"
    "{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for tc in m.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_bpe_tokenizer(path: Path, vocab_size: int = 400) -> int:
    """Train and save tokenizer.json + tokenizer_config.json; returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "bos_token": "<|im_start|>",
         "eos_token": "<|im_end|>"}))
    return int(tok.get_vocab_size())


def build_chat_model(path: Path, seed: int = 0, **overrides: object) -> object:
    """A random LlamaForCausalLM over that tokenizer (EOS = <|im_end|>); the HF model."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    from tests.worker.engine.tiny_llama import llama_config

    vocab = write_bpe_tokenizer(path)
    eos = Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id("<|im_end|>")
    torch.manual_seed(seed)
    cfg = llama_config(vocab_size=vocab, eos_token_id=eos, bos_token_id=0, pad_token_id=eos,
                       **overrides)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model
