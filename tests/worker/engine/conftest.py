"""Session fixtures: one tiny random Llama with four PEFT adapters."""

from __future__ import annotations

import pytest

from .tiny_llama import ADAPTERS, TinyModel, build_adapter, build_model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyModel:
    root = tmp_path_factory.mktemp("tiny")
    hf = build_model(root / "base")
    adapters = {}
    for i, spec in enumerate(ADAPTERS):
        p = root / spec.name
        build_adapter(hf, spec, p, seed=100 + i)
        adapters[spec.name] = p
    return TinyModel(root / "base", hf, adapters)

