"""The operator's CLI on real services (the release flow's registry, gate worker, traffic and
canary controller): `loraplane deploy` walks a good version 5 → 25 → 50 → 100 and exits
0, exits 1 with the controller's figures when it rolls a bad one back; the read verbs
answer as tables that stay readable piped at 80 columns, and as JSON; errors go to
stderr."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli import app
from services.config import Settings
from services.worker.engine import Engine
from tests.registry.conftest import TOKENS
from tests.release.model import NumberModel
from tests.release.test_release_flow import ALIAS, Stack

pytestmark = pytest.mark.slow


@pytest.fixture
def stack(settings: Settings, tmp_path: Path, engine: Engine,
          numbers: NumberModel) -> Iterator[Stack]:
    quick = settings.model_copy(update={"canary_min_requests": 10, "canary_max_p95_ms": 2000})
    built = Stack(quick, tmp_path, engine, numbers)
    try:
        yield built
    finally:
        built.close()


def run(stack: Stack, *args: str, role: str = "publisher") -> tuple[int, str, str]:
    """`loraplane ARGS` as an operator runs it against this registry, piped (80 columns)."""
    env = {"LORAPLANE_REGISTRY_URL": stack.registry.url,
           "LORAPLANE_API_TOKEN": TOKENS[role][0],
           "LORAPLANE_STATE_DIR": str(stack.settings.state_dir / "no-stack"),
           "COLUMNS": "80"}
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def adapter_dir(stack: Stack, tmp_path: Path, name: str, folder_name: str = "") -> Path:
    folder = tmp_path / (folder_name or name)
    folder.mkdir()
    files = stack.numbers.adapters[name]
    (folder / "adapter_config.json").write_bytes(files.config_json)
    (folder / "adapter_model.safetensors").write_bytes(files.weights)
    return folder


def test_deploy_walks_a_good_version_to_100_and_rolls_a_bad_one_back(
        stack: Stack, tmp_path: Path) -> None:
    stack.gate_worker()
    regression = tmp_path / "set.jsonl"
    regression.write_bytes(stack.label_set)
    deploy = ("deploy", "--tenant", "acme/search/prod", "--adapter", "bot", "--alias", ALIAS,
              "--regression-set", str(regression), "--stages", "5,25,50,100",
              "--min-stage-s", "1.5")
    # the first version has no baseline: made active once its gate passed
    code, out, err = run(stack, *deploy, str(adapter_dir(stack, tmp_path, "v1")))
    assert code == 0, out + err
    assert "published bot v1" in out and "quality gate: passed on w1" in out
    assert "first version of bot" in out
    stack.traffic(errors={3: 0.5})
    stack.controller()

    code, out, err = run(stack, *deploy, str(adapter_dir(stack, tmp_path, "good")))
    assert code == 0, out + err
    assert "canary on alias bot-prod: v2 against v1, stages 5 → 25 → 50 → 100 %" in out
    actions = [line.split()[1] for line in out.splitlines() if " by " in line]
    assert actions == ["started", "advanced", "advanced", "advanced", "completed"], out
    assert "deployed bot v2: the rollout completed; v2 100 %" in out
    assert stack.publisher.get("/v1/adapters/bot").json()["active_version"] == 2

    # v3 passes its gate (same outputs as v2) but half its requests fail in production
    folder = adapter_dir(stack, tmp_path, "good", "bad-in-prod")
    code, out, err = run(stack, *deploy, "--label", "v3", str(folder))
    assert code == 1, out + err
    assert err.startswith("deploy of bot v3 rolled back: error rate"), err
    assert "controller's figures: verdict rollback; canary v3 " in err
    assert "baseline v2 " in err and "errors" in err
    assert stack.publisher.get("/v1/adapters/bot").json()["active_version"] == 2


def test_read_verbs_print_tables_records_and_json_and_errors_on_stderr(
        stack: Stack, tmp_path: Path) -> None:
    assert stack.publish("v1", "first").status_code == 201
    assert stack.publish("good", "second").status_code == 201

    code, out, err = run(stack, "--version")
    assert code == 0 and out.startswith("loraplane ") and not err

    code, out, err = run(stack, "versions", "bot")
    assert code == 0, err
    assert all(len(line) <= 80 for line in out.splitlines()), out
    assert "-- record 2 --" in out  # 12 columns do not fit 80: one record per version
    assert any(line.split() == ["label", "second"] for line in out.splitlines()), out
    assert any(line.startswith("sha256 ") for line in out.splitlines())
    sha = stack.numbers.adapters["good"]

    code, out, err = run(stack, "versions", "bot", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["version"], r["label"]) for r in rows] == [(1, "first"), (2, "second")]
    assert rows[1]["size_bytes"] == len(sha.weights)

    code, out, err = run(stack, "adapters", "list")
    assert code == 0, err
    assert "bot" in out and "acme/search/prod" in out and "-- record" not in out
    code, out, err = run(stack, "adapters", "list", "--json")
    assert code == 0 and json.loads(out.splitlines()[0])["adapter_id"] == "bot"
    code, out, err = run(stack, "adapters", "show", "bot", "--json")
    assert code == 0 and len(json.loads(out)["version_list"]) == 2
    code, out, err = run(stack, "base-models", "--json")
    assert code == 0 and json.loads(out)["name"] == "numbers"
    code, out, err = run(stack, "aliases", "--json")
    assert code == 0 and out == ""

    code, out, err = run(stack, "adapters", "show", "nope")
    assert code == 1 and out == "", out
    assert err.startswith("error: GET /v1/adapters/nope: 404") and len(err.splitlines()) == 1


def test_switch_and_rollback_name_the_version_they_made_active(stack: Stack) -> None:
    """The rollback's answer carries the version in `to_version`; the CLI used to print
    the empty `version` field ("rolled back to vNone")."""
    assert stack.publish("v1", "first").status_code == 201
    assert stack.publish("good", "second").status_code == 201
    for version in ("1", "2"):
        code, out, err = run(stack, "override", "bot", version, "--reason", "no set",
                             role="admin")
        assert code == 0, err
        code, out, err = run(stack, "switch", "bot", version)
        assert code == 0 and out.strip() == f"bot: active version is now v{version}", err
    code, out, err = run(stack, "rollback", "bot", "--reason", "second is worse")
    assert code == 0, err
    assert out.strip() == "bot: rolled back to v1"
    assert stack.publisher.get("/v1/adapters/bot").json()["active_version"] == 1
