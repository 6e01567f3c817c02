"""One tiny numeric Llama and its adapters for the whole release suite (built once)."""

from __future__ import annotations

import pytest

from services.worker.engine import Engine
from tests.release.model import NumberModel, build_number_model


@pytest.fixture(scope="session")
def numbers(tmp_path_factory: pytest.TempPathFactory) -> NumberModel:
    return build_number_model(tmp_path_factory.mktemp("numbers"))


@pytest.fixture(scope="session")
def engine(numbers: NumberModel) -> Engine:
    return numbers.engine()
