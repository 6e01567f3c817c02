"""The drills reuse the worker tests' session model (tiny base with a chat template)."""

from tests.worker.conftest import served_model

__all__ = ["served_model"]
