"""Base model: logits against transformers, checkpoint formats and checkpoint errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.engine import CheckpointError, Engine, EngineConfig, UnsupportedModelError
from services.worker.engine.checkpoint import load_checkpoint

from .families import Variant, build_family
from .tiny_llama import build_model

PROMPT = [5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73]


def engine_logits(path, ids, dtype="float32", block_size=4):
    eng = Engine.from_pretrained(path, EngineConfig(dtype=dtype, num_kv_blocks=64,
                                                    block_size=block_size))
    return eng.score(ids)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 500.0},
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 12},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8}},
        {"num_key_value_heads": 1, "head_dim": 32},
    ],
    ids=["plain", "tied", "linear", "dynamic", "llama3", "mqa-headdim"],
)
def test_base_logits_match_transformers(tmp_path, overrides):
    hf = build_model(tmp_path, seed=3, **overrides)
    ours = engine_logits(tmp_path, PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads_with_same_digest(tmp_path):
    hf = build_model(tmp_path / "single", seed=4)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    single = load_checkpoint(tmp_path / "single")
    sharded = load_checkpoint(tmp_path / "sharded")
    assert single.digest == sharded.digest and len(single.digest) == 64
    torch.testing.assert_close(engine_logits(tmp_path / "sharded", PROMPT),
                               engine_logits(tmp_path / "single", PROMPT))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_fp32(tmp_path, dtype):
    build_model(tmp_path, seed=5)
    ref = engine_logits(tmp_path, PROMPT)
    half = engine_logits(tmp_path, PROMPT, dtype=dtype)
    assert half.dtype == torch.float32
    assert (half - ref).abs().max() < 0.1 * ref.abs().max()


def test_missing_tensor_is_named(tmp_path):
    build_model(tmp_path, seed=6)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj"):
        load_checkpoint(tmp_path)


def test_misshaped_tensor_is_named(tmp_path):
    build_model(tmp_path, seed=6)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"self_attn\.k_proj\.weight has shape \[64, 64\]"):
        load_checkpoint(tmp_path)


def test_missing_shard_and_weights(tmp_path):
    hf = build_model(tmp_path / "a", seed=7)
    hf.save_pretrained(tmp_path / "b", max_shard_size="40KB")
    index = json.loads((tmp_path / "b" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "b" / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        load_checkpoint(tmp_path / "b")
    (tmp_path / "a" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_checkpoint(tmp_path / "a")


def test_unsupported_config_refused(tmp_path):
    build_model(tmp_path, seed=8)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "mrope", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="mrope"):
        load_checkpoint(tmp_path)


def test_chunked_prefill_matches_single_pass(tiny):
    """A prompt split over several steps (and blocks) gives the same tokens."""
    from services.worker.engine import GenerationRequest, SamplingParams, SchedulerLimits

    prompt = PROMPT * 2
    outs = []
    for budget in (256, 7):
        eng = Engine.from_pretrained(tiny.path, EngineConfig(
            num_kv_blocks=64, block_size=4,
            limits=SchedulerLimits(max_running=4, max_tokens_per_step=budget)))
        res = eng.generate([GenerationRequest(prompt_token_ids=prompt,
                                              sampling=SamplingParams(max_tokens=6))])
        outs.append(res[0].token_ids)
    assert outs[0] == outs[1]


def test_serial_elementwise_ops_give_the_same_bits(tmp_path, monkeypatch):
    """Small steps run RMSNorm, rope, SwiGLU and the adds in one thread (`SERIAL_TOKENS`):
    the logits are bit-identical to running them on every intra-op thread, and the thread
    count is back afterwards. 200 tokens x hidden 256 is above torch's grain size, so the
    parallel side really splits each op."""
    from services.worker.engine import model as model_mod

    build_model(tmp_path, seed=5, hidden_size=256, intermediate_size=512)
    monkeypatch.setattr(model_mod, "COMPILED_LAYERS", False)  # the torch ops' threads here
    prompt = [(7 * i + 3) % 90 + 3 for i in range(200)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = {}
        for serial in (0, 10_000):
            monkeypatch.setattr(model_mod, "SERIAL_TOKENS", serial)
            got[serial] = engine_logits(tmp_path, prompt, block_size=16)
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[0], got[10_000])


COMPILED_NORMS = {
    "llama": None,
    "qwen3": Variant("qwen3", "qwen3", {"head_dim": 16}),  # q/k norm per head
    "gemma3": Variant("gemma3", "gemma3_text", {"head_dim": 16, "query_pre_attn_scalar": 24,
                                                "sliding_window": 8}),  # norms before, after
    "olmo2": Variant("olmo2", "olmo2"),  # norms after only, q/k norm over the projection
}


@pytest.mark.parametrize("family", COMPILED_NORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_layer_ops_match_the_torch_ops(tmp_path, monkeypatch, dtype, family):
    """Steps run norms, rope, the cache write and the gated activation through
    `loraplane_kernels.cpu_layer`: prefill and decode of several
    sequences give the torch ops' tokens, and logits within rounding of theirs, for each
    placement of the norms."""
    from services.worker.engine import GenerationRequest, SamplingParams
    from services.worker.engine import model as model_mod

    pytest.importorskip("numba")
    variant = COMPILED_NORMS[family]
    if variant is None:
        build_model(tmp_path, seed=6, num_key_value_heads=2)
    else:
        build_family(tmp_path, variant, seed=6)
    prompts = [PROMPT, PROMPT[:7], PROMPT[3:16], [9] * 30]
    got = {}
    for compiled in (False, True):
        monkeypatch.setattr(model_mod, "COMPILED_LAYERS", compiled)
        eng = Engine.from_pretrained(tmp_path, EngineConfig(dtype=dtype, num_kv_blocks=64,
                                                            block_size=4))
        assert eng.model.compiled_layers is compiled
        res = eng.generate([GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
            max_tokens=12, min_tokens=12, ignore_eos=True, logprobs=True)) for p in prompts])
        got[compiled] = ([r.token_ids for r in res], eng.score(PROMPT))
    assert got[True][0] == got[False][0]
    tol = 1e-5 if dtype == "float32" else 5e-2
    torch.testing.assert_close(got[True][1], got[False][1], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_projections_give_the_plain_weights_logits(tmp_path, monkeypatch, dtype):
    """On the CPU the engine keeps the projections in oneDNN's packed layout
    (`DecoderModel.pack_weights`, in place of the plain ones): the logits are the plain
    weights' within rounding, the plain weights read back unchanged, and a written
    projection lands in what forward uses."""
    from services.worker.engine import model as model_mod

    if not model_mod.ONEDNN:
        pytest.skip("no oneDNN ops in this torch")
    build_model(tmp_path, seed=7)
    config = EngineConfig(dtype=dtype, num_kv_blocks=64, block_size=4)
    packed = Engine.from_pretrained(tmp_path, config)
    assert packed.model.packed and packed.model.layers[0].qkv.is_mkldnn
    monkeypatch.setattr(model_mod.DecoderModel, "pack_weights", lambda self: False)
    plain = Engine.from_pretrained(tmp_path, config)
    assert not plain.model.packed
    for a, b in zip(packed.model.plain_projections(), plain.model.plain_projections(),
                    strict=True):
        assert torch.equal(a, b)
    tol = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(packed.score(PROMPT), plain.score(PROMPT), atol=tol, rtol=tol)
    for eng in (packed, plain):
        w = eng.model.projection_weight(1, "k_proj").clone()
        eng.model.set_projection_weight(1, "k_proj", w * 2)
        assert torch.equal(eng.model.projection_weight(1, "k_proj"), w * 2)
    torch.testing.assert_close(packed.score(PROMPT), plain.score(PROMPT), atol=tol, rtol=tol)
