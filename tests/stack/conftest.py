"""The stack tests that start worker processes reuse the worker tests' session model."""

from tests.worker.conftest import served_model

__all__ = ["served_model"]
