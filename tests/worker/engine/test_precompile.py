"""`loraplane compile-kernels` leaves every kernel a worker's steps run in numba's cache."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loraplane_kernels import cpu_decode
from services.worker.engine.precompile import FORMATS, MODELS
from tests.conftest import REPO

from .families import build_family
from .test_families import VARIANTS

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
model_dir, families, adapters = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
prompts = [[1 + (i * 7 + j) % 90 for j in range(n)] for i, n in enumerate((3, 9, 40, 150))]
for dtype, weights in (("float32", "dense"), ("bfloat16", "dense"), ("float32", "int8"),
                       ("bfloat16", "int8")):
    eng = Engine.from_pretrained(model_dir, EngineConfig(dtype=dtype, weights=weights,
                                                         adapter_slots=4))
    digests = [None, *(eng.load_adapter(a).digest for a in adapters)]
    eng.generate([GenerationRequest(prompt_token_ids=prompts[i % 4], adapter_digest=d,
                                    sampling=SamplingParams(max_tokens=3 + i % 3))
                  for i, d in enumerate(digests * 3)])
for path in families:  # other families' checkpoints, on the base
    for dtype, weights in (("float32", "dense"), ("bfloat16", "dense"), ("bfloat16", "int8")):
        eng = Engine.from_pretrained(path, EngineConfig(dtype=dtype, weights=weights))
        eng.generate([GenerationRequest(prompt_token_ids=p,
                                        sampling=SamplingParams(max_tokens=3 + i % 3))
                      for i, p in enumerate(prompts * 2)])
after = signatures()
print(json.dumps({name: sigs for name, sigs in after.items() if sigs != before[name]}))
"""


FAMILIES = [v for v in VARIANTS if v.id in {"qwen3", "gemma", "gemma2", "gemma3", "smollm3"}]
"""Families whose steps pass the kernels other types (Gemma's fp32 norm weights, query-key
norms, two ropes, rope-less layers), beside Llama's in the fixture."""


def test_compile_kernels_compiles_every_signature_a_workload_calls(tiny, tmp_path) -> None:
    """After the command, engines on other checkpoints (the tiny Llama fixture with its
    adapters in all four formats; Qwen3, Gemma 1-3 and SmolLM3 in fp32, bf16 and bf16 over
    int8 weights), stepped through requests of 3 to 150 tokens (one to twelve decodes a
    step), call no kernel signature it did not compile. Compared in one process, so the
    check does not depend on what the cache held."""
    families = []
    for variant in FAMILIES:
        build_family(tmp_path / variant.id, variant)
        families.append(str(tmp_path / variant.id))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny.path), ",".join(families),
         *map(str, tiny.adapters.values())],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {}


def test_the_command_says_what_it_compiled() -> None:
    cli = subprocess.run([sys.executable, "-m", "services.cli", "compile-kernels"], cwd=REPO,
                         capture_output=True, text=True, timeout=600, check=False)
    assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-3000:]
    lines = [line for line in cli.stdout.splitlines() if line.endswith(" s")]
    assert len(lines) == len(MODELS) * len(FORMATS), cli.stdout
    assert "NumbaIRAssumptionWarning" not in cli.stderr
