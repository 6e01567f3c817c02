"""Engine error types; each names the offending artefact so operators can act on it."""

from __future__ import annotations


class EngineError(Exception):
    """Base class for engine errors."""


class CheckpointError(EngineError):
    """A base-model directory is missing files, tensors, or has mis-shaped tensors."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint is readable but uses a feature this engine does not implement."""


class AdapterError(EngineError):
    """A LoRA adapter is malformed, unsupported, or incompatible with the base model."""


class AdapterDigestMismatch(AdapterError):
    """An adapter file's bytes do not hash to the digest the registry published for it."""


class AdapterPoolFullError(EngineError):
    """No free or evictable slot (or byte budget) is left in the adapter pool."""


class AdapterNotLoadedError(EngineError):
    """A request names an adapter digest that is not resident in the pool."""


class RequestError(EngineError):
    """A generation request is invalid (bad sampling parameters, empty prompt, ...)."""
