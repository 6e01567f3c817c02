"""The generated reference pages (`docs/reference/`) are what the code renders now: a
setting, command, metric, route or event added without `make docs` fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer.main

from services import docs
from services.cli import app
from services.config import Settings
from tests.conftest import REPO


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    return {name: render() for name, render in docs.PAGES.items()}


@pytest.mark.parametrize("page", sorted(docs.PAGES))
def test_committed_reference_page_is_current(page: str, rendered: dict[str, str]) -> None:
    committed = REPO / "docs" / "reference" / page
    assert committed.is_file(), f"docs/reference/{page} is missing: run `make docs`"
    assert committed.read_text() == rendered[page], \
        f"docs/reference/{page} is stale: run `make docs`"


def test_every_setting_says_what_it_is_for() -> None:
    """The configuration reference is only as good as each field's description."""
    bare = [name for name, field in Settings.model_fields.items() if not field.description]
    assert not bare, f"settings without a description: {bare}"


def test_every_setting_command_event_metric_and_route_is_listed(
        rendered: dict[str, str]) -> None:
    """What the freshness check relies on: each page names every item of its source."""
    configuration = rendered["configuration.md"]
    assert all(f"`LORAPLANE_{name.upper()}`" in configuration for name in Settings.model_fields)
    root = typer.main.get_command(app)
    assert all(f"## loraplane {name}\n" in rendered["cli.md"]
               for name in root.list_commands(None))  # type: ignore[attr-defined]
    assert all(f"### {path.stem}\n" in rendered["events.md"]
               for path in docs.SCHEMAS.glob("*.json") if path.stem != "envelope")
    metrics = rendered["metrics.md"]
    assert "`loraplane_worker_adapter_load_seconds`" in metrics
    assert "`vllm:num_requests_running`" in metrics
    assert "`loraplane_audit_lag_records`" in metrics  # a custom collector
    api = rendered["api.md"]
    assert "| POST | `/v1/adapters/{adapter_id}/versions` | publish |" in api
    assert "| POST | `/v1/chat/completions` | infer |" in api
    assert "| GET | `/v1/models/{model}` | infer |" in api  # a path parameter of `:path` type


def test_check_mode_names_a_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str],
                                       rendered: dict[str, str]) -> None:
    monkeypatch.setattr(docs, "REFERENCE", tmp_path)
    monkeypatch.setattr(docs, "PAGES", {name: (lambda text=text: text)
                                        for name, text in rendered.items()})
    assert docs.main([]) == 0
    assert docs.main(["--check"]) == 0
    (tmp_path / "cli.md").write_text("old\n")
    assert docs.main(["--check"]) == 1
    assert "docs/reference/cli.md is stale: run `make docs`" in capsys.readouterr().err
