"""A tiny random Llama whose words are numbers, and PEFT adapters for it (nothing downloaded).

The tokenizer's words are "0" … "95", so a one-token output is a JSON integer: a
regression case can hold a version to a JSON Schema ("the label is one of …") that one
adapter's greedy output satisfies and another's breaks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.worker.engine import AdapterFiles, Engine, GenerationRequest
from services.worker.engine import SamplingParams as Sampling
from tests.registry.artifacts import build_adapter
from tests.worker.engine.tiny_llama import VOCAB, build_model

PROMPT = "7 3 11 42"


def write_number_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={str(i): i for i in range(VOCAB)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


@dataclass
class NumberModel:
    path: Path
    config: dict[str, object]
    adapters: dict[str, AdapterFiles]

    def engine(self) -> Engine:
        return Engine.from_pretrained(self.path)


def build_number_model(root: Path) -> NumberModel:
    build_model(root / "base", seed=3)
    write_number_tokenizer(root / "base")
    config = json.loads((root / "base" / "config.json").read_text())
    adapters = {}
    for name, seed in (("v1", 11), ("good", 12), ("bad", 13), ("other", 14)):
        built = build_adapter(seed=seed, targets=("q_proj", "v_proj", "o_proj"))
        adapters[name] = AdapterFiles(built.config, built.weights)
    return NumberModel(root / "base", config, adapters)


def first_tokens(engine: Engine, files: AdapterFiles | None, prompt: str = PROMPT,
                 max_tokens: int = 1) -> list[int]:
    """Greedy output ids of one adapter (None: the base model) on `prompt`."""
    digest = None
    if files is not None:
        digest = files.digest()
        engine.load_adapter(files, digest)
    try:
        [result] = engine.generate([GenerationRequest(
            prompt=prompt, sampling=Sampling(max_tokens=max_tokens), adapter_digest=digest)])
    finally:
        if digest is not None:
            engine.unload_adapter(digest)
    return result.token_ids
