"""Run the Triton kernel tests on the CPU, in a child pytest under ``TRITON_INTERPRET=1``.

See ``conftest.py`` for why this is a subprocess. The child's report is shown on failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


@pytest.mark.timeout(1500)
def test_triton_kernels_match_float64_reference_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("LORAPLANE_KERNELS_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(HERE / "interpreted"), "-q", "-p",
         "no:cacheprovider", "--timeout", "300"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500, check=False,
    )
    report = proc.stdout[-20000:] + proc.stderr[-5000:]
    assert proc.returncode == 0, f"interpreted kernel tests failed:\n{report}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, report
