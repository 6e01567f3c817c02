"""The extent layout: parsed adapters are packed exactly as the pool stores them, and a
slot filled from a packed adapter (the host tier) holds the same numbers as one filled
from loose tensors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load

from services.worker.engine import AdapterFiles, AdapterPool, ModelConfig, parse_adapter
from services.worker.engine.adapter import LoraWeights, pack_weights
from services.worker.engine.extent import ALIGN, extent_layout
from services.worker.pool.host import slot_ready, zero_adapter
from tests.registry.artifacts import LLAMA_CONFIG, build_adapter, tensor_name

CFG = ModelConfig.from_dict(LLAMA_CONFIG)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def files_of(dtype: torch.dtype, seed: int = 1):
    built = build_adapter(rank=5, targets=ALL, dtype=dtype, seed=seed)
    return AdapterFiles(built.config, built.weights), load(built.weights)


def loose(adapter):
    """The same adapter as unpacked, contiguous fp32 tensors (what parsing used to give)."""
    weights = {k: LoraWeights(w.a.float().clone(), w.b.float().clone(), w.scale)
               for k, w in adapter.weights.items()}
    return replace(adapter, weights=weights, packed=None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_parse_packs_in_the_published_dtype_as_views(dtype):
    files, tensors = files_of(dtype)
    adapter = parse_adapter(files, CFG)
    assert adapter.packed is not None and adapter.packed.dtype == dtype
    assert adapter.packed.numel() == adapter.layout.length
    base = adapter.packed.untyped_storage().data_ptr()
    for (layer, module), w in adapter.weights.items():
        assert w.a.untyped_storage().data_ptr() == base == w.b.untyped_storage().data_ptr()
        assert torch.equal(w.a, tensors[tensor_name(layer, module, "A")])
        assert torch.equal(w.b, tensors[tensor_name(layer, module, "B")])


def test_mixed_dtypes_pack_as_float32():
    def half_a(t: dict[str, torch.Tensor]) -> None:
        name = tensor_name(0, "q_proj", "A")
        t[name] = t[name].half()

    built = build_adapter(rank=5, targets=ALL, dtype=torch.float32, edit=half_a)
    adapter = parse_adapter(AdapterFiles(built.config, built.weights), CFG)
    assert adapter.packed is not None and adapter.packed.dtype == torch.float32


def test_pack_pads_to_the_alignment_with_zeros():
    a1, b1 = torch.randn(3, 5).half(), torch.randn(7, 3).half()
    a2, b2 = torch.randn(3, 9).half(), torch.randn(2, 3).half()
    entries = [((0, "q_proj"), a1, b1, 1.0), ((1, "k_proj"), a2, b2, 0.5)]
    packed, weights = pack_weights(entries, torch.float32)
    layout = extent_layout([((0, "q_proj"), 3, 5, 7), ((1, "k_proj"), 3, 9, 2)])
    assert layout.offsets == {(0, "q_proj"): (0, ALIGN), (1, "k_proj"): (3 * ALIGN, 5 * ALIGN)}
    assert packed.numel() == layout.length == 6 * ALIGN
    assert torch.equal(weights[(0, "q_proj")].a, a1.float())
    assert torch.equal(weights[(0, "q_proj")].b, b1.float())
    assert torch.equal(weights[(1, "k_proj")].b, b2.float())
    assert torch.equal(weights[(1, "k_proj")].a, a2.float())
    for start, end in ((15, ALIGN), (ALIGN + 21, 3 * ALIGN), (3 * ALIGN + 27, 5 * ALIGN),
                       (5 * ALIGN + 6, 6 * ALIGN)):  # after each A [3, in] and B.T [3, out]
        assert not packed[start:end].any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_slot_from_the_host_tier_holds_what_loose_tensors_give(dtype):
    """One copy of the packed extent (converting on the fly) against the per-projection
    copies of A and B.T from fp32 tensors: the same numbers, offsets and scales."""
    files, _ = files_of(dtype, seed=3)
    parsed = parse_adapter(files, CFG)
    held = slot_ready(parsed)
    from_host = AdapterPool(CFG, max_rank=8, num_slots=2, dtype=torch.float32)
    from_loose = AdapterPool(CFG, max_rank=8, num_slots=2, dtype=torch.float32)
    from_host.place(held)
    from_loose.place(loose(parsed))
    assert torch.equal(from_host.pool, from_loose.pool)
    mine, theirs = from_host.weights_of(parsed.digest), from_loose.weights_of(parsed.digest)
    assert mine.keys() == theirs.keys() == parsed.weights.keys()
    for key, (a, bt, scale) in mine.items():
        w = parsed.weights[key]
        assert torch.equal(a, w.a.float()) and torch.equal(bt, w.b.T.float())
        assert scale == theirs[key][2] == w.scale
    for pool in (from_host, from_loose):
        rows = CFG.num_hidden_layers * len(pool.modules)  # then embed_tokens and lm_head
        layer_tables = pool.tables.ranks[:rows, pool.info(parsed.digest).slot]
        assert layer_tables.tolist() == [5] * len(layer_tables)
    from_host.unload(parsed.digest)
    assert not from_host.pool.any() and not from_host.tables.ranks.any()


def test_a_pool_refuses_an_adapter_of_another_model_shape():
    files, _ = files_of(torch.float16)
    adapter = parse_adapter(files, CFG)
    other = ModelConfig.from_dict({**LLAMA_CONFIG, "intermediate_size": 96})
    pool = AdapterPool(other, max_rank=8, num_slots=1)
    with pytest.raises(Exception, match="is not this model's"):
        pool.place(adapter)


def test_scrubbing_a_packed_adapter_zeroes_its_buffer():
    files, _ = files_of(torch.float16)
    adapter = parse_adapter(files, CFG)
    zero_adapter(adapter)
    assert adapter.packed is not None and not adapter.packed.any()
    assert all(not w.a.any() and not w.b.any() for w in adapter.weights.values())
