"""A decode step of one or two rows runs every layer in one compiled call
(`cpu_layer.layer_stack_rows`), its adapters' deltas too, with the bits of the per-kernel
loop it replaces, in every family shape that loop takes: biases, q/k norms per head and
over the projection, norms after attention and the MLP, a residual multiplier, sliding
windows, soft-capping, two ropes, layers without rope, int8 weights; one adapter, two,
an adapter beside the base."""

from __future__ import annotations

import pytest
import torch

from loraplane_kernels import cpu_decode, cpu_layer
from services.worker.engine import GenerationRequest, SamplingParams

from .families import Variant, build_with_adapters, make_engine
from .test_families import WINDOW

pytestmark = pytest.mark.skipif(not cpu_decode.AVAILABLE, reason="numba is not installed")

SHAPES = [
    (Variant("llama-bias", "llama", {"attention_bias": True, "mlp_bias": True}), "dense"),
    (Variant("llama-bias", "llama", {"attention_bias": True, "mlp_bias": True}), "int8"),
    (Variant("qwen3", "qwen3", {"head_dim": 16}), "dense"),
    (Variant("olmo2", "olmo2", {"attention_bias": True}), "dense"),
    (Variant("granite", "granite", {"embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                                    "attention_multiplier": 0.2, "logits_scaling": 2.0}),
     "dense"),
    (Variant("gemma2", "gemma2", {"head_dim": 16, "query_pre_attn_scalar": 24,
                                  "sliding_window": WINDOW, "num_hidden_layers": 4,
                                  "attn_logit_softcapping": 2.0,
                                  "tie_word_embeddings": True}), "dense"),
    (Variant("gemma3", "gemma3_text", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW,
        "num_hidden_layers": 3, "tie_word_embeddings": True,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}), "dense"),
    (Variant("smollm3", "smollm3", {"no_rope_layer_interval": 2, "num_hidden_layers": 4,
                                    "tie_word_embeddings": True}), "dense"),
]


@pytest.mark.parametrize(("variant", "weights"), SHAPES,
                         ids=[f"{v.id}-{w}" for v, w in SHAPES])
def test_few_row_steps_take_one_call_with_the_loops_bits(tmp_path, monkeypatch,
                                                          variant: Variant,
                                                          weights: str) -> None:
    """Single streams (one-row steps) and pairs (two-row steps, their decodes in shares)
    past the window, on the base and on adapters: every step's logits are bit for bit
    those of the per-kernel loop, and the one call served the decode steps, adapters'
    included."""
    from services.worker.engine.model import DecoderModel

    fam = build_with_adapters(tmp_path, variant)
    eng = make_engine(fam.path, dtype="bfloat16", weights=weights)
    first, second = (eng.load_adapter(path).digest for path in fam.adapters.values())
    if cpu_layer.layer_stack_rows() is None:
        pytest.skip("numba has no thread-safe threading layer here")
    assert eng.model.row_weights is not None
    logits: list[torch.Tensor] = []
    real_logits = DecoderModel._logits
    monkeypatch.setattr(DecoderModel, "_logits",
                        lambda self, *a: logits.append(real_logits(self, *a).clone())
                        or logits[-1])
    whole = cpu_layer.layer_stack_rows
    calls: list[tuple[int, int]] = []  # (rows, adapted rows' slots)
    monkeypatch.setattr(cpu_layer, "layer_stack_rows", lambda: (
        lambda *a: calls.append((a[0].shape[0], len(a[-2][4]))) or whole()(*a)))

    def run() -> list[list[int]]:
        cases = [[(1, 14, None)], [(11, 10, None)], [(9, 12, None), (20, 14, None)],
                 [(10, 12, first)], [(9, 12, first), (20, 14, second)],
                 [(6, 12, None), (13, 14, second)]]
        return [o.token_ids for case in cases for o in eng.generate([
            GenerationRequest(prompt_token_ids=[3 + 2 * i for i in range(n)],
                              adapter_digest=digest,
                              sampling=SamplingParams(max_tokens=m, ignore_eos=True))
            for n, m, digest in case])]

    run()  # the adapters paged in: both runs below step alike
    calls.clear()
    logits.clear()
    tokens = run()
    assert {rows for rows, _ in calls} == {1, 2}
    assert {(1, 1), (2, 2)} <= set(calls)  # one adapter alone, two adapters, a pair
    fused = logits[:]
    logits.clear()
    monkeypatch.setattr(cpu_layer, "layer_stack_rows", lambda: None)
    assert run() == tokens
    assert len(logits) == len(fused)
    assert all(torch.equal(a, b) for a, b in zip(fused, logits, strict=True))
