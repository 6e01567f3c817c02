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
