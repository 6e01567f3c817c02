"""Benches that nothing else runs, run small: the registry's and the release
controller's, so that a change to what the registry accepts does not leave `make bench`
stopping at them (the registry bench stopped at a 422 for a while: its base model config
lacked what registration had come to require); and the per-step profile, which wraps the
engine's kernels by name (it stopped at a renamed one); and the families' bench, whose
random models follow transformers' configs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("script", "args"), [
    ("registry.py", ["--quick", "--versions", "8", "--rollbacks", "8"]),
    ("release.py", ["--quick"]),
    ("profile_step.py", ["--steps", "2", "--label", "suite"]),
    ("families.py", ["--quick", "--rounds", "1", "--layers", "2", "--families",
                     "gemma2,olmo2"]),
])
def test_bench_runs_and_records_its_figures(tmp_path: Path, script: str,
                                            args: list[str]) -> None:
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args,
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())["figures"]
    assert figures and all(f["value"] is not None for f in figures), figures
