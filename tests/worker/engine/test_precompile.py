"""`loraplane compile-kernels` leaves every kernel a worker's steps run in numba's cache."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loraplane_kernels import cpu_decode
from services.worker.engine.precompile import FORMATS
from tests.conftest import REPO

pytestmark = pytest.mark.skipif(not cpu_decode.AVAILABLE, reason="numba is not installed")

SCRIPT = """
import json, sys
import numba
from loraplane_kernels import _cpu_decode_numba as k
from services.worker.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from services.worker.engine.precompile import compile_kernels

def signatures():
    return {name: sorted(map(str, f.signatures)) for name, f in vars(k).items()
            if isinstance(f, numba.core.registry.CPUDispatcher)}

compile_kernels()
before = signatures()
model_dir, adapters = sys.argv[1], sys.argv[2:]
for dtype, weights in (("float32", "dense"), ("bfloat16", "dense"), ("float32", "int8"),
                       ("bfloat16", "int8")):
    eng = Engine.from_pretrained(model_dir, EngineConfig(dtype=dtype, weights=weights,
                                                         adapter_slots=4))
    digests = [None, *(eng.load_adapter(a).digest for a in adapters)]
    prompts = [[1 + (i * 7 + j) % 90 for j in range(n)] for i, n in enumerate((3, 9, 40, 150))]
    eng.generate([GenerationRequest(prompt_token_ids=prompts[i % 4], adapter_digest=d,
                                    sampling=SamplingParams(max_tokens=3 + i % 3))
                  for i, d in enumerate(digests * 3)])
after = signatures()
print(json.dumps({name: sigs for name, sigs in after.items() if sigs != before[name]}))
"""


def test_compile_kernels_compiles_every_signature_a_workload_calls(tiny) -> None:
    """The command's tiny model stands for any model: after it, engines on another
    checkpoint in all four formats, stepped through base and adapter requests of 3 to 150
    tokens (one to twelve decodes a step), call no kernel signature it did not compile.
    Compared in one process, so the check does not depend on what the cache held."""
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny.path), *map(str, tiny.adapters.values())],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {}


def test_the_command_says_what_it_compiled() -> None:
    cli = subprocess.run([sys.executable, "-m", "services.cli", "compile-kernels"], cwd=REPO,
                         capture_output=True, text=True, timeout=600, check=False)
    assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-3000:]
    lines = [line for line in cli.stdout.splitlines() if line.endswith(" s")]
    assert len(lines) == len(FORMATS), cli.stdout
    assert "NumbaIRAssumptionWarning" not in cli.stderr
