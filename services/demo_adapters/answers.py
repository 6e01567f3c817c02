"""Greedy answers of the base model and each demo adapter, through the serving engine.

What the demo's claim rests on: the same question, the same base weights, a different
answer per tenant. The test and `python -m services.demo_adapters compare` both use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .build import DemoAdapter

BASE = "base"
"""The row label of the base model's answers."""


@dataclass(frozen=True)
class Answer:
    model: str
    """BASE, or the adapter id."""
    question: str
    text: str


def chat_text(tokenizer: Any, question: str) -> str:
    """The chat-templated prompt (the engine's tokenizer is a `tokenizers.Tokenizer`, so
    the template is applied with transformers' tokenizer of the same directory)."""
    from .training import chat_prompt

    return chat_prompt(tokenizer, question)


def greedy_answers(model_dir: str | Path, adapters: Sequence[DemoAdapter],
                   questions: Sequence[str], max_tokens: int = 48) -> list[Answer]:
    """Every question to the base model and to every adapter, in one batch, greedy."""
    from transformers import AutoTokenizer

    from services.worker.engine import Engine, EngineConfig, GenerationRequest, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = Engine.from_pretrained(model_dir, EngineConfig(
        num_kv_blocks=256, adapter_slots=max(1, len(adapters)), max_lora_rank=16))
    digests = {a.adapter_id: engine.load_adapter(a.directory).digest for a in adapters}
    rows: list[tuple[str, str]] = [(BASE, q) for q in questions]
    rows += [(a.adapter_id, q) for a in adapters for q in questions]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    results = engine.generate([
        GenerationRequest(prompt=chat_text(tokenizer, q), sampling=sampling,
                          adapter_digest=digests.get(model), tenant_key=model)
        for model, q in rows])
    return [Answer(model, q, r.text) for (model, q), r in zip(rows, results, strict=True)]
