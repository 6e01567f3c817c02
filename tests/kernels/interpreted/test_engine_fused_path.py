"""The engine's two-level batching on the Triton path: small adapter buckets take the fused
base + LoRA kernel, large ones the separate path, and tokens still equal PEFT's."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from loraplane_kernels import dispatch, tuning_table
from loraplane_kernels.tuning_table import TuningFallbackWarning
from services.worker.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from tests.worker.engine.tiny_llama import ADAPTERS, build_adapter, build_model

TABLE = {"device": "cpu", "source": "test", "entries": {
    "bgmv": {"64": {"16": {"fused_max_tokens": 0}}},
    "sgmv": {"64": {"16": {"fused_max_tokens": 0, "fused_base_max_tokens": 4}}},
}}


@pytest.fixture
def tiny(tmp_path):
    hf = build_model(tmp_path / "base")
    paths = {}
    for i, spec in enumerate(ADAPTERS[:3]):
        build_adapter(hf, spec, tmp_path / spec.name, seed=100 + i)
        paths[spec.name] = tmp_path / spec.name
    return hf, tmp_path / "base", paths


@pytest.fixture
def triton_backend(monkeypatch, tmp_path):
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    table = tmp_path / "table.json"
    table.write_text(json.dumps(TABLE))
    monkeypatch.setenv(tuning_table.OVERRIDE_ENV, str(table))
    tuning_table._load_table.cache_clear()
    yield
    tuning_table._load_table.cache_clear()


def peft_tokens(hf, adapter, prompt, n):
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(hf), adapter).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, attention_mask=torch.ones(1, len(prompt),
                                                                        dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_small_buckets_fused_large_separate_same_tokens_as_peft(tiny, triton_backend):
    hf, base, paths = tiny
    eng = Engine.from_pretrained(base, EngineConfig(num_kv_blocks=64, block_size=4,
                                                    adapter_slots=4, max_lora_rank=16))
    assert eng.fusion_threshold == 4
    assert dispatch.UNTUNED.labels(device="cpu")._value.get() == 0
    prompts = {"attn_r4": list(range(5, 19)), "mlp_r8": [7, 9, 11], "all_r16_rs": [4, 8, 15]}
    digests = {n: eng.load_adapter(p).digest for n, p in paths.items()}
    fused_steps = []
    forward = eng.model.forward
    eng.model.forward = lambda b, *a: (fused_steps.append(b.fused_from), forward(b, *a))[1]
    results = eng.generate([GenerationRequest(prompt_token_ids=p, adapter_digest=digests[n],
                                              sampling=SamplingParams(max_tokens=4,
                                                                      min_tokens=4))
                            for n, p in prompts.items()])
    assert fused_steps[0] == 14  # the 14-token prefill bucket separate, the 3-token ones fused
    assert all(f == 0 for f in fused_steps[1:])  # decode buckets (1 token each): all fused
    want = [peft_tokens(hf, paths[n], p, 4) for n, p in prompts.items()]
    assert [r.token_ids for r in results] == want


def test_untuned_device_takes_the_separate_path_and_says_so(tiny, monkeypatch):
    _, base, _ = tiny
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    monkeypatch.delenv(tuning_table.OVERRIDE_ENV, raising=False)
    tuning_table._load_table.cache_clear()
    dispatch._WARNED.clear()
    with pytest.warns(TuningFallbackWarning, match="separate path"):
        eng = Engine.from_pretrained(base, EngineConfig(num_kv_blocks=16, block_size=4))
    assert eng.fusion_threshold is None
    assert dispatch.UNTUNED.labels(device="cpu")._value.get() == 1


def test_int8_base_on_the_triton_path_gives_the_cpu_int8_tokens(tiny, triton_backend):
    """An int8 engine whose projections and LM head take the GPU's int8 kernel (a prefill
    of three prompts, then three-row decodes: never the CPU's few-row path) decodes the
    tokens the same engine does on the CPU's int8 paths."""
    _, base, paths = tiny
    prompts = [list(range(5, 19)), [7, 9, 11], [4, 8, 15, 16]]

    def tokens() -> list[list[int]]:
        eng = Engine.from_pretrained(base, EngineConfig(
            num_kv_blocks=64, block_size=4, adapter_slots=4, max_lora_rank=16,
            weights="int8"))
        digest = eng.load_adapter(paths["attn_r4"]).digest
        return [r.token_ids for r in eng.generate([
            GenerationRequest(prompt_token_ids=p, adapter_digest=digest if i == 0 else None,
                              sampling=SamplingParams(max_tokens=5, min_tokens=5))
            for i, p in enumerate(prompts)])]

    on_triton = tokens()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(dispatch.BACKEND_ENV, "torch")
        assert tokens() == on_triton
