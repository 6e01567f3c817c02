"""The command line refuses a model the engine cannot serve exactly before anything runs:
`loraplane register-base` before it asks the registry, a worker before it connects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

transformers = pytest.importorskip("transformers")

SHAPE = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def model_dir(root: Path, model_type: str, **extra: object) -> Path:
    """A model directory whose config.json is what transformers writes for the family."""
    root.mkdir(parents=True)
    config = transformers.CONFIG_MAPPING[model_type](**SHAPE, **extra).to_dict()
    (root / "config.json").write_text(json.dumps(config))
    return root


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "300",
                               "LORAPLANE_REGISTRY_URL": "http://127.0.0.1:9", **env})


@pytest.mark.parametrize(("model_type", "extra", "named"), [
    ("mixtral", {}, "model_type 'mixtral' is a mixture of experts"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
], ids=["moe", "field"])
def test_register_base_and_a_worker_refuse_naming_the_family_or_field(
        tmp_path: Path, model_type: str, extra: dict, named: str) -> None:
    path = model_dir(tmp_path / model_type, model_type, **extra)
    registered = cli("register-base", str(path))
    assert registered.returncode == 1 and named in registered.stderr + registered.stdout
    worker = cli("serve", "worker", LORAPLANE_BASE_MODEL=str(path),
                 LORAPLANE_KAFKA_BOOTSTRAP="127.0.0.1:9")
    assert worker.returncode == 2 and named in worker.stdout + worker.stderr
