"""Settings that no longer exist stop a process by name instead of being ignored."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.config import REMOVED, Settings


@pytest.mark.parametrize("name", sorted(REMOVED))
def test_a_removed_setting_is_refused_by_name(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    env = f"LORAPLANE_{name.upper()}"
    monkeypatch.setenv(env, "1")
    with pytest.raises(ValidationError, match=f"{env} was removed"):
        Settings()
    monkeypatch.delenv(env)
    with pytest.raises(ValidationError, match=f"{env} was removed"):
        Settings(**{name: 1})  # type: ignore[arg-type]
    assert name not in Settings.model_fields


def test_the_weights_format_is_one_the_engine_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().worker_weights == "dense"
    monkeypatch.setenv("LORAPLANE_WORKER_WEIGHTS", "int8")
    assert Settings().worker_weights == "int8"
    monkeypatch.setenv("LORAPLANE_WORKER_WEIGHTS", "int4")
    with pytest.raises(ValidationError, match="worker_weights") as refused:
        Settings()
    assert "'dense' or 'int8'" in str(refused.value)


def test_merged_mode_over_int8_weights_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="LORAPLANE_WORKER_MERGE needs dense base "
                                              "weights, not LORAPLANE_WORKER_WEIGHTS=int8"):
        Settings(worker_merge="bot", worker_weights="int8")
    assert Settings(worker_merge="bot").worker_weights == "dense"
