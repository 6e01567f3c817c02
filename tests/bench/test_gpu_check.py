"""bench/gpu_check.sh, shrunk to run on the CPU, so it cannot rot before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


def smoke_env(out) -> dict[str, str]:
    """This interpreter, results under `out`, and none of the caller's kernel overrides."""
    env = {**os.environ, "GPU_CHECK_OUT": str(out), "PYTHON": sys.executable}
    for var in ("LORAPLANE_KERNELS_BACKEND", "LORAPLANE_KERNELS_TUNING", "TRITON_INTERPRET"):
        env.pop(var, None)
    return env


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_stage_end_to_end(tmp_path) -> None:
    env = smoke_env(tmp_path)
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--smoke"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert report.count(" ok in ") == 3, report
    kernels = json.loads((tmp_path / "kernels_gpu_smoke.json").read_text())
    assert kernels["all_correct"]
    table = json.loads((tmp_path / "tuning.json").read_text())
    assert "fused_base_max_tokens" in table["entries"]["sgmv"]["64"]["16"]
    engine = json.loads((tmp_path / "multi_lora_smoke.json").read_text())["random_llama"]
    assert engine["mixed"]["vs_peft"]["tokens_identical"] == 1.0
    assert set(engine["mixed"]["runs_seconds"]) == {"engine_32", "engine_1", "engine_no_adapter"}
    assert engine["mixed"]["roofline_no_adapter"]["all"]["fraction_of_dense"] > 0
    repeats = engine["mixed"]["roofline_repeats"]  # one dense replay per repeat
    assert len(repeats) == engine["mixed"]["repeats"] and all(r["adapters_32"] > 0
                                                             for r in repeats)
    assert engine["tenant_prefix"]["prefix_cache"]["cross_tenant_hits"] == 0


def test_gpu_check_runs_only_the_stages_asked_for(tmp_path) -> None:
    env = smoke_env(tmp_path)
    script = str(REPO / "bench" / "gpu_check.sh")
    proc = subprocess.run(["bash", script, "--smoke", "--stages", "tuning"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== tuning ok in" in proc.stdout
    assert "== kernels" not in proc.stdout and "== engine" not in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuning.json"]
    bad = subprocess.run(["bash", script, "--smoke", "--stages", "kernels,bogus"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "unknown stage bogus" in bad.stderr
