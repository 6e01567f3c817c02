"""One- and two-row bf16 steps compute the base projections and the LM head from plain
weights kept beside oneDNN's packed ones (`DecoderModel.keep_row_weights`), within a byte
budget."""

from __future__ import annotations

import pytest
import torch

from loraplane_kernels import cpu_decode
from services.worker.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from services.worker.engine.model import ONEDNN, plain_weight

pytestmark = pytest.mark.skipif(not cpu_decode.AVAILABLE, reason="numba is not installed")


def engine(tiny, budget: int, dtype: str = "bfloat16", weights: str = "dense") -> Engine:
    return Engine.from_pretrained(tiny.path, EngineConfig(dtype=dtype, weights=weights,
                                                          adapter_slots=4,
                                                          row_weights_bytes=budget))


def greedy(eng: Engine, adapter: str | None = None) -> list[list[int]]:
    """One request at a time: single streams, every decode step one row."""
    digest = None if adapter is None else eng.load_adapter(adapter).digest
    return [eng.generate([GenerationRequest(prompt_token_ids=[5 + 3 * i for i in range(n)],
                                            adapter_digest=digest,
                                            sampling=SamplingParams(max_tokens=12))])[0]
            .token_ids for n in (1, 7, 30)]  # 1: a one-row prefill step


def pair(eng: Engine) -> list[list[int]]:
    """Two streams at once: their decodes are two-row steps until the shorter ends."""
    outs = eng.generate([GenerationRequest(prompt_token_ids=[4 + i for i in range(n)],
                                           sampling=SamplingParams(max_tokens=m))
                         for n, m in ((9, 8), (20, 14))])
    return [o.token_ids for o in outs]


def test_one_and_two_streams_tokens_match_the_packed_matmuls(tiny, monkeypatch) -> None:
    """Within the budget the kernel serves every one- and two-row step (base and adapter);
    its greedy tokens are the packed matmuls' on the same engine settings, and nothing is
    kept in fp32 or with a budget of 0."""
    calls: list[int] = []
    real = cpu_decode.linear_rows_arrays
    monkeypatch.setattr(cpu_decode, "linear_rows_arrays",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    kept = engine(tiny, 1 << 30)
    assert kept.model.row_weights is not None
    calls.clear()
    few_rows = [greedy(kept), greedy(kept, next(iter(tiny.adapters.values()))), pair(kept)]
    assert set(calls) == {1, 2}  # a prefill of 7 to 30 rows never takes it
    if ONEDNN:
        packed = engine(tiny, 0)
        assert packed.model.row_weights is None
        calls.clear()
        assert few_rows == [greedy(packed), greedy(packed, next(iter(tiny.adapters.values()))),
                            pair(packed)]
        assert not calls
    assert engine(tiny, 1 << 30, dtype="float32").model.row_weights is None


def test_a_merged_weight_reaches_the_kept_copy_and_the_packed_one(tiny) -> None:
    model = engine(tiny, 1 << 30).model
    assert model.row_weights is not None
    value = torch.full_like(model.projection_weight(0, "v_proj"), 0.5)
    model.set_projection_weight(0, "v_proj", value)
    kept = model.row_weights[0]["qkv"][0]
    _, lo, hi = model.cfg.lora_rows("v_proj")
    assert torch.equal(kept[lo:hi], value)
    assert torch.equal(plain_weight(model.layers[0].qkv), kept)
    flat = model.row_weights[0]["qkv"][1]
    assert flat.reshape(kept.shape)[lo, 0] == cpu_decode.as_array(value)[0, 0]


def test_int8_weights_are_read_as_stored_whatever_the_budget(tiny, monkeypatch) -> None:
    """int8 projections and LM head need no second copy: a budget of 0 still serves
    one- and two-row steps from them, with `int8_linear`'s tokens."""
    kernel = engine(tiny, 0, weights="int8")
    assert kernel.model.row_weights is not None
    assert all(kept is None for layer in kernel.model.row_weights for kept, *_ in
               layer.values())
    adapter = next(iter(tiny.adapters.values()))
    tokens = [greedy(kernel), greedy(kernel, adapter), pair(kernel)]
    monkeypatch.setattr(cpu_decode, "LINEAR_ROWS", 0)  # every step through `int8_linear`
    torch_path = engine(tiny, 0, weights="int8")
    assert tokens == [greedy(torch_path), greedy(torch_path, adapter), pair(torch_path)]


def test_few_row_adapter_steps_add_their_deltas_in_the_layer_loop_with_the_same_bits(
        tiny, monkeypatch) -> None:
    """One- and two-row steps on adapters (one adapter, two adapters, an adapter beside the
    base) take `AdapterPool.apply_direct` inside the compiled layer loop; every step's
    logits are bit for bit those of the path through `project` and `AdapterPool.apply`."""
    from loraplane_kernels import cpu_layer
    from services.worker.engine.adapter_pool import AdapterPool
    from services.worker.engine.model import DecoderModel

    # the loop from Python (its one-call form has the same bits: test_layer_stack.py)
    monkeypatch.setattr(cpu_layer, "layer_stack_rows", lambda: None)
    eng = engine(tiny, 1 << 30)
    names = list(tiny.adapters)
    digests = [eng.load_adapter(tiny.adapters[n]).digest for n in names[:2]]
    cases = [[(9, digests[0])], [(9, digests[0]), (14, digests[1])],
             [(6, None), (11, digests[1])]]
    logits: list[torch.Tensor] = []
    real_logits = DecoderModel._logits
    monkeypatch.setattr(DecoderModel, "_logits",
                        lambda self, *a: logits.append(real_logits(self, *a).clone())
                        or logits[-1])
    direct_calls: list[str] = []
    real_direct = AdapterPool.apply_direct
    monkeypatch.setattr(AdapterPool, "apply_direct",
                        lambda self, layer, module, *a: direct_calls.append(module)
                        or real_direct(self, layer, module, *a))

    def run() -> list[list[int]]:
        return [o.token_ids for case in cases for o in eng.generate([
            GenerationRequest(prompt_token_ids=[3 + 2 * i for i in range(n)],
                              adapter_digest=d, sampling=SamplingParams(max_tokens=6))
            for n, d in case])]

    tokens = run()
    direct_logits = logits[:]
    assert direct_calls, "no adapter step took the direct pass"
    logits.clear()
    monkeypatch.setattr(AdapterPool, "direct_runs", lambda self, *a: None)
    assert run() == tokens
    assert len(logits) == len(direct_logits)
    assert all(torch.equal(a, b) for a, b in zip(direct_logits, logits, strict=True))


@pytest.mark.parametrize("weights", ["dense", "int8"])
def test_row_weights_lie_end_to_end_in_step_order_as_the_models_own(tiny, weights) -> None:
    """A one-row step streams its weights from one buffer in the order it reads them (the
    prefetcher runs on from one into the next), and the model's tensors are views of that
    buffer, not a second copy: unpacked, the layers' weights themselves; packed, the
    plain copies the budget pays for; the LM head (the embedding, where tied) too."""
    model = engine(tiny, 1 << 30, weights=weights).model
    assert model.row_weights is not None
    names = ("qkv", "o", "gate_up", "down")
    head = model.lm_head if model.lm_head_int8 is None else model.lm_head_int8.q
    order = [layer[n][1] for layer in model.row_weights for n in names] + [
        model._row_head[0]]
    starts = [a.__array_interface__["data"][0] for a in order]
    assert starts == sorted(starts)
    for a, start, following in zip(order, starts, starts[1:], strict=False):
        assert 0 <= following - (start + a.nbytes) < 64  # end to end, each on a cache line
    assert head.data_ptr() == starts[-1]
    if weights == "dense":
        assert model.embed.data_ptr() == head.data_ptr() or not model.cfg.tie_word_embeddings
        for w, layer in zip(model.layers, model.row_weights, strict=True):
            for n in names:
                kept = layer[n][0]
                assert kept is not None and kept.data_ptr() == layer[n][1].ctypes.data
                if not w.qkv.is_mkldnn:
                    assert getattr(w, n) is kept
    else:
        assert [w.q.data_ptr() for layer in model.layers
                for w in (layer.qkv, layer.o, layer.gate_up, layer.down)] == starts[:-1]
