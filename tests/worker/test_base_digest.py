"""`loraplane base-digest DIR`: the digest an operator registers so workers become ready."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from services.cli import app
from services.worker.engine import Engine
from tests.worker.conftest import ServedModel


def test_base_digest_command_gives_the_worker_s_digest(served_model: ServedModel,
                                                       tmp_path: Path) -> None:
    runner = CliRunner()
    plain = runner.invoke(app, ["base-digest", str(served_model.path)])
    assert plain.exit_code == 0, plain.output
    assert plain.output.strip() == Engine.from_pretrained(served_model.path).base_digest
    body = json.loads(runner.invoke(app, ["base-digest", str(served_model.path), "--json",
                                          "--name", "tiny"]).output)
    assert body["name"] == "tiny" and body["digest"] == plain.output.strip()
    assert body["config"] == json.loads((served_model.path / "config.json").read_text())
    missing = runner.invoke(app, ["base-digest", str(tmp_path)])
    assert missing.exit_code == 2 and "config.json" in missing.output
