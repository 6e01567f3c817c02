"""Session fixtures for the worker service: one tiny base model (tokenizer and chat
template included) with PEFT adapters saved by PEFT itself, built once."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Engine

from services.audit.projector import AuditProjector
from tests.worker.engine.tiny_llama import ADAPTERS, build_adapter, build_model
from tests.worker.harness import Stack, add_chat_template, audit_projection


@dataclass
class ServedModel:
    path: Path
    hf: object
    adapters: dict[str, Path]


@pytest.fixture(scope="session")
def served_model(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    root = tmp_path_factory.mktemp("served")
    hf = build_model(root / "base", max_position_embeddings=1024)
    add_chat_template(root / "base")
    adapters = {}
    for i, spec in enumerate(ADAPTERS):
        build_adapter(hf, spec, root / spec.name, seed=200 + i)
        adapters[spec.name] = root / spec.name
    return ServedModel(root / "base", hf, adapters)


@pytest.fixture(scope="module")
def audit_db(stack: Stack) -> Iterator[tuple[AuditProjector, Engine]]:
    """The audit projection of the module's own `stack` (each module defines that)."""
    with audit_projection(stack) as audit:
        yield audit
