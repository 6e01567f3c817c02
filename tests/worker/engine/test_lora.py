"""Multi-LoRA: mixed batches against PEFT, adapter validation, the adapter pool."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil

import pytest
import torch

from services.worker.engine import (
    AdapterDigest,
    AdapterDigestMismatch,
    AdapterError,
    AdapterFiles,
    AdapterNotLoadedError,
    AdapterPoolFullError,
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
    SchedulerLimits,
)

from .tiny_llama import ADAPTERS

PROMPTS = [
    [5, 7, 9, 11, 13, 17, 19],
    [23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67],
    [71, 73, 79, 83],
    [4, 8, 15, 16, 23, 42, 10, 20, 30, 40, 50, 60, 70, 80, 90, 11, 12],
]


def peft_greedy(tiny, name: str | None, prompt: list[int], n: int) -> list[int]:
    from peft import PeftModel

    model = copy.deepcopy(tiny.hf)
    if name is not None:
        model = PeftModel.from_pretrained(model, tiny.adapters[name]).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, attention_mask=torch.ones(1, len(prompt),
                                                                        dtype=torch.long))
    return out[0, len(prompt):].tolist()


def make_engine(tiny, **kw) -> Engine:
    cfg = dict(num_kv_blocks=256, block_size=4, adapter_slots=8, max_lora_rank=16)
    cfg.update(kw)
    return Engine.from_pretrained(tiny.path, EngineConfig(**cfg))


def test_mixed_batch_matches_peft_per_adapter(tiny):
    """Four adapters (ranks 2-16, attention and MLP, rsLoRA, layers_to_transform) plus the
    base model in one continuous batch; each request equals PEFT for its adapter alone."""
    eng = make_engine(tiny, limits=SchedulerLimits(max_running=16, max_tokens_per_step=40))
    digests = {s.name: eng.load_adapter(tiny.adapters[s.name]).digest for s in ADAPTERS}
    n = 8
    reqs, expected = [], []
    names: list[str | None] = [s.name for s in ADAPTERS] + [None]
    for i, name in enumerate(names * 2):
        prompt = PROMPTS[i % len(PROMPTS)]
        reqs.append(GenerationRequest(
            prompt_token_ids=prompt,
            adapter_digest=None if name is None else digests[name],
            sampling=SamplingParams(max_tokens=n, min_tokens=n)))
        expected.append(peft_greedy(tiny, name, prompt, n))
    results = eng.generate(reqs)
    assert [r.token_ids for r in results] == expected
    # the adapters really change the output
    assert len({tuple(e) for e in expected[: len(names)]}) > 1
    assert eng.stats().steps < len(reqs) * n  # batched, not one request at a time


def test_adapter_logits_match_peft(tiny):
    from peft import PeftModel

    eng = make_engine(tiny)
    for spec in ADAPTERS:
        digest = eng.load_adapter(tiny.adapters[spec.name]).digest
        peft = PeftModel.from_pretrained(copy.deepcopy(tiny.hf), tiny.adapters[spec.name])
        with torch.no_grad():
            ref = peft(torch.tensor([PROMPTS[3]])).logits[0]
        torch.testing.assert_close(eng.score(PROMPTS[3], digest), ref, atol=1e-4, rtol=1e-4)


def _adapter_copy(tiny, tmp_path, name="attn_r4", **config_changes):
    dst = tmp_path / name
    shutil.copytree(tiny.adapters[name], dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(config_changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"target_modules": ["q_proj", "c_attn"]}, r"\['c_attn'\]"),
        ({"target_modules": ["q_proj"]}, "not covered by target_modules"),
        ({"layers_to_transform": [1]}, "outside layers_to_transform"),
        ({"peft_type": "IA3"}, "IA3"),
        # whichever tensor is checked first: its rank side is 4, where 3 is expected
        ({"r": 3},
         r"lora_[AB]\.weight has shape \[(4, \d+|\d+, 4)\], expected \[(3, \d+|\d+, 3)\]"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save names lm_head"),
        ({"modules_to_save": ["score"]}, r"modules_to_save \['score'\]"),
    ],
)
def test_bad_adapters_refused(tiny, tmp_path, changes, message):
    eng = make_engine(tiny)
    with pytest.raises(AdapterError, match=message):
        eng.load_adapter(_adapter_copy(tiny, tmp_path, **changes))
    assert eng.list_adapters() == []


def test_unknown_module_tensor_refused(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    dst = _adapter_copy(tiny, tmp_path)
    w = load_file(dst / "adapter_model.safetensors")
    w["base_model.model.model.layers.0.self_attn.rotary.lora_A.weight"] = torch.zeros(4, 64)
    save_file(w, dst / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="rotary"):
        make_engine(tiny).load_adapter(dst)


def test_rank_above_pool_max_refused(tiny):
    eng = make_engine(tiny, max_lora_rank=8)
    with pytest.raises(AdapterError, match="maximum rank 8"):
        eng.load_adapter(tiny.adapters["all_r16_rs"])


def test_pool_load_unload_pin_evict(tiny):
    eng = make_engine(tiny, adapter_slots=2)
    pool = eng.adapters
    a = eng.load_adapter(tiny.adapters["attn_r4"], pin=True)
    again = eng.load_adapter(tiny.adapters["attn_r4"])
    assert again.slot == a.slot and a.pinned and len(a.digest.sha256) == 64
    b = eng.load_adapter(tiny.adapters["mlp_r8"])
    assert pool.free_slots == 0
    # ranks 4 and 8 are stored at their own ranks: only alignment, no padding to 16
    assert pool.padding_fraction() < 0.05
    assert b.bytes == 4 * sum(8 * (64 + 128) for _ in range(3)) * 2  # 3 MLP modules, 2 layers
    # full: the unpinned idle adapter (b) is evicted, the pinned one never
    c = eng.load_adapter(tiny.adapters["ko_r2_l1"])
    assert c.slot == b.slot and not pool.is_loaded(b.digest) and pool.is_loaded(a.digest)
    # an adapter in use is not evictable either
    eng.submit(GenerationRequest(prompt_token_ids=[5, 6], adapter_digest=c.digest))
    with pytest.raises(AdapterPoolFullError):
        eng.load_adapter(tiny.adapters["mlp_r8"])
    eng.run_until_idle()
    # unload zeroes the adapter's weights and its slot's ranks
    eng.unload_adapter(c.digest)
    assert all(int(w.ranks[c.slot]) == 0 and w.a_views[c.slot] is None
               for layer in pool.weights for w in layer.values())
    assert not pool.pool[pool.used_bytes // 4:].any()
    with pytest.raises(AdapterNotLoadedError):
        eng.submit(GenerationRequest(prompt_token_ids=[5], adapter_digest=c.digest))


def test_load_from_bytes_with_registry_digest(tiny):
    eng = make_engine(tiny)
    files = AdapterFiles.from_dir(tiny.adapters["mlp_r8"])
    published = AdapterDigest(hashlib.sha256(files.weights).hexdigest(),
                              hashlib.sha256(files.config_json).hexdigest())
    info = eng.load_adapter(files, digest=published)
    assert info.digest == published and str(info.digest) == published.sha256
    assert [i.digest for i in eng.list_adapters()] == [info.digest]


def test_files_that_do_not_match_the_published_digest_are_refused(tiny):
    eng = make_engine(tiny)
    files = AdapterFiles.from_dir(tiny.adapters["mlp_r8"])
    good = files.digest()
    for wrong, which in ((AdapterDigest("0" * 64, good.config_sha256), "adapter_model"),
                         (AdapterDigest(good.sha256, "0" * 64), "adapter_config")):
        with pytest.raises(AdapterDigestMismatch, match=which):
            eng.load_adapter(files, digest=wrong)
    assert eng.list_adapters() == []
    with pytest.raises(AdapterError, match="64 lowercase hex"):
        AdapterDigest("sha256:" + "ab" * 32, good.config_sha256)


def test_byte_budget_sizes_pool(tiny):
    probe = make_engine(tiny, adapter_slots=1)
    per_slot = probe.adapters.bytes_per_slot
    eng = make_engine(tiny, adapter_slots=None, adapter_byte_budget=3 * per_slot + 5)
    assert eng.adapters.byte_budget == 3 * per_slot + 4  # whole fp32 elements


def test_mixed_ranks_fill_the_budget_by_their_real_size(tiny):
    """A budget of one max-rank slot (16) holds rank 4 and rank 8 adapters side by side,
    where a slab pool would have held exactly one of them."""
    per_slot = make_engine(tiny, adapter_slots=1).adapters.bytes_per_slot
    eng = make_engine(tiny, adapter_slots=None, adapter_byte_budget=per_slot)
    infos = [eng.load_adapter(tiny.adapters[n]) for n in ("attn_r4", "mlp_r8", "ko_r2_l1")]
    assert all(eng.adapters.is_loaded(i.digest) for i in infos)
    assert sum(i.bytes for i in infos) == eng.adapters.used_bytes <= per_slot


def test_fragmented_pool_compacts_and_outputs_stay_identical(tiny):
    """Unloading the middle adapter leaves a hole too small for the next; the pool moves
    extents down (re-pointing the kernels' offsets) and serves the moved adapters as before."""
    spec = [s for s in ADAPTERS if s.name != "all_r16_rs"]
    eng = make_engine(tiny)
    first = {s.name: eng.load_adapter(tiny.adapters[s.name]) for s in spec}
    prompt = PROMPTS[1]

    def outputs():
        reqs = [GenerationRequest(prompt_token_ids=prompt, adapter_digest=i.digest,
                                  sampling=SamplingParams(max_tokens=5, min_tokens=5))
                for _, i in sorted(first.items())]
        return [r.token_ids for r in eng.generate(reqs)]

    before = outputs()
    pool = eng.adapters
    budget_left = pool.capacity - pool.used_elements
    eng.unload_adapter(first["attn_r4"].digest)
    big = tiny.adapters["all_r16_rs"]
    need = make_engine(tiny).load_adapter(big).bytes // 4
    assert need <= pool.capacity - pool.used_elements
    if need > budget_left:  # does not fit at the end: forces a compaction
        eng.load_adapter(big)
        assert pool.compactions == 1
    del first["attn_r4"]
    first["attn_r4"] = eng.load_adapter(tiny.adapters["attn_r4"])
    assert outputs() == before


def test_place_a_parsed_adapter_and_ask_whether_it_fits(tiny):
    from services.worker.engine.adapter import parse_adapter

    eng = make_engine(tiny, adapter_slots=1)
    pool = eng.adapters
    big = parse_adapter(AdapterFiles.from_dir(tiny.adapters["all_r16_rs"]), pool.cfg)
    small = parse_adapter(AdapterFiles.from_dir(tiny.adapters["attn_r4"]), pool.cfg)
    assert pool.fits(big)
    info = pool.place(big)
    assert pool.is_loaded(info.digest) and not pool.fits(small)  # the one slot is taken
    assert pool.place(small).digest == small.digest and pool.evictions == 1
