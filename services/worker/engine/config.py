"""Base-model configuration: a Hugging Face `config.json` read through its family's
description (`services.families`), with the families' errors as the engine's own.

Anything that would change the maths but is not implemented is refused there, naming the
family or the field, before weights are loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services import families
from services.families import RopeConfig

from .errors import CheckpointError, UnsupportedModelError

__all__ = ["ModelConfig", "RopeConfig"]


class ModelConfig(families.ModelConfig):
    """`services.families.ModelConfig`, raising `UnsupportedModelError` for a family or
    field the engine does not compute and `CheckpointError` for a broken config."""

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        try:
            return super().from_dict(raw)  # type: ignore[return-value]
        except families.UnsupportedModel as exc:
            raise UnsupportedModelError(str(exc)) from exc
        except families.ConfigError as exc:
            raise CheckpointError(str(exc)) from exc

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        try:
            return super().from_dir(path)  # type: ignore[return-value]
        except families.UnsupportedModel as exc:
            raise UnsupportedModelError(str(exc)) from exc
        except families.ConfigError as exc:
            raise CheckpointError(str(exc)) from exc
