"""The generated reference pages (`docs/reference/`) are what the code renders now: a
setting, command, metric, route or event added without `make docs` fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from services import docs
from services.config import Settings
from tests.conftest import REPO


@pytest.mark.parametrize("page", sorted(docs.PAGES))
def test_committed_reference_page_is_current(page: str) -> None:
    committed = REPO / "docs" / "reference" / page
    assert committed.is_file(), f"docs/reference/{page} is missing: run `make docs`"
    assert committed.read_text() == docs.PAGES[page](), \
        f"docs/reference/{page} is stale: run `make docs`"


def test_every_setting_says_what_it_is_for() -> None:
    """The configuration reference is only as good as each field's description."""
    bare = [name for name, field in Settings.model_fields.items() if not field.description]
    assert not bare, f"settings without a description: {bare}"


def test_every_setting_command_and_event_is_listed() -> None:
    """What the freshness check relies on: each page names every item of its source."""
    import typer.main

    from services.cli import app

    configuration = docs.configuration()
    assert all(f"`LORAPLANE_{name.upper()}`" in configuration for name in Settings.model_fields)
    cli = docs.cli()
    root = typer.main.get_command(app)
    assert all(f"## loraplane {name}\n" in cli for name in root.list_commands(None))
    events = docs.events()
    assert all(f"### {path.stem}\n" in events
               for path in docs.SCHEMAS.glob("*.json") if path.stem != "envelope")
    metrics = docs.metrics()
    assert "`loraplane_worker_adapter_load_seconds`" in metrics
    assert "`vllm:num_requests_running`" in metrics
    assert "`loraplane_audit_lag_records`" in metrics  # a custom collector
    api = docs.api()
    assert "| POST | `/v1/adapters/{adapter_id}/versions` | publish |" in api
    assert "| POST | `/v1/chat/completions` | infer |" in api


def test_check_mode_names_a_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(docs, "REFERENCE", tmp_path)
    assert docs.main([]) == 0
    assert docs.main(["--check"]) == 0
    (tmp_path / "cli.md").write_text("old\n")
    assert docs.main(["--check"]) == 1
    assert "docs/reference/cli.md is stale: run `make docs`" in capsys.readouterr().err
