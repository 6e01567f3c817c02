"""An engine compiles its CPU kernels when it is built, not in a request's step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from loraplane_kernels import cpu_decode
from tests.conftest import REPO

pytestmark = pytest.mark.skipif(not cpu_decode.AVAILABLE, reason="numba is not installed")

SCRIPT = """
import json, sys
import numba
from loraplane_kernels import _cpu_decode_numba as k
from services.worker.engine import Engine, EngineConfig, GenerationRequest, SamplingParams

def signatures():
    return {name: len(f.signatures) for name, f in vars(k).items()
            if isinstance(f, numba.core.registry.CPUDispatcher)
            and f.targetoptions.get("inline") != "always"}

model_dir, adapters = sys.argv[1], sys.argv[2:]
out = {}
for dtype in ("bfloat16", "float32"):
    eng = Engine.from_pretrained(model_dir, EngineConfig(dtype=dtype, adapter_slots=4))
    before = signatures()
    digests = [None, *(eng.load_adapter(a).digest for a in adapters)]
    prompts = [[1 + (i * 7 + j) % 90 for j in range(n)] for i, n in enumerate((3, 9, 40, 150))]
    eng.generate([GenerationRequest(prompt_token_ids=prompts[i % 4], adapter_digest=d,
                                    sampling=SamplingParams(max_tokens=3 + i % 3))
                  for i, d in enumerate(digests * 3)])
    # one stream decoding while a later prompt fills: a step that is not decodes only,
    # with a single decode (the attention kernel whole, called from Python)
    eng.submit(GenerationRequest(prompt_token_ids=prompts[0],
                                 sampling=SamplingParams(max_tokens=6)))
    eng.step()
    eng.step()
    eng.submit(GenerationRequest(prompt_token_ids=prompts[2],
                                 sampling=SamplingParams(max_tokens=2)))
    while eng.has_work:
        eng.step()
    out[dtype] = {"before": before, "after": signatures()}
print(json.dumps(out))
"""


def test_a_mixed_workload_compiles_nothing_after_the_engine_is_built(tiny) -> None:
    """Every signature the steps of a mixed workload (base and adapters, prompts of 3 to
    150 tokens, one to twelve decodes a step) call is there once the engine is built,
    in bf16 and fp32: nothing compiles, or loads from numba's cache, inside a step."""
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny.path), *map(str, tiny.adapters.values())],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.splitlines()[-1])
    for dtype, run in runs.items():
        assert run["after"] == run["before"], dtype
        # a layer's elementwise ops go through their shares kernels at every step size
        # (`cpu_layer.step_kernels`: one compiled body, the same bits)
        kernels = {"runs", "decode_attention", "residual_norm_shares", "rope_cache_shares",
                   "gated_shares"}
        if torch.get_num_threads() > 1:  # one thread never cuts a step's work in shares
            kernels |= {"decode_attention_shares", "runs_shares"}
        # one-row bf16 steps' projections (`keep_row_weights`); compiled by the bf16 engine,
        # built first, so the fp32 one finds it there (and adds no fp32 signature)
        kernels |= {"linear_rows_shares"}
        # and their layers in one call (`cpu_layer.layer_stack_rows`); a single decode
        # beside a prefill calls the attention kernel whole from Python, in both dtypes
        kernels |= {"layer_stack_rows"}
        # the serial bodies of the shares kernels are compiled with them, and numba lists
        # them as compiled where a caller compiled here rather than loading from its cache
        bodies = {"residual_norm", "rope_cache", "gated", "decode_attention"}
        compiled = {name for name, n in run["before"].items() if n}
        assert kernels <= compiled <= kernels | bodies, dtype
