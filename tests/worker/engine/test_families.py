"""Every served family and variant against transformers + PEFT in fp32: logits within
1e-3 and greedy tokens exactly, alone and in one mixed batch (`families.check_parity`)."""

from __future__ import annotations

import pytest

from .families import (
    PROMPTS,
    Variant,
    build_family,
    build_with_adapters,
    check_parity,
    make_engine,
)

WINDOW = 8

PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

VARIANTS = [
    Variant("llama", "llama"),
    Variant("llama-bias", "llama", {"attention_bias": True, "mlp_bias": True}),
    Variant("llama-yarn", "llama", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "rope_theta": 10000.0}}),
    Variant("llama-longrope", "llama", {"rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 24,
        "short_factor": [1.0 + i / 8 for i in range(8)],
        "long_factor": [2.0 + i / 2 for i in range(8)]}}),
    Variant("mistral", "mistral", {"sliding_window": None}),
    Variant("mistral-sliding", "mistral", {"sliding_window": WINDOW}),
    Variant("qwen2", "qwen2"),
    Variant("qwen2-tied", "qwen2", {"tie_word_embeddings": True}),
    Variant("qwen2-sliding", "qwen2", {"use_sliding_window": True, "sliding_window": WINDOW,
                                       "max_window_layers": 0}),
    Variant("qwen2-sliding-upper", "qwen2", {"use_sliding_window": True,
                                             "sliding_window": WINDOW,
                                             "max_window_layers": 1}),
    Variant("qwen3", "qwen3", {"head_dim": 16}),
    Variant("qwen3-bias-tied", "qwen3", {"head_dim": 24, "attention_bias": True,
                                         "tie_word_embeddings": True}),
    Variant("gemma", "gemma", {"head_dim": 16, "tie_word_embeddings": True}),
    Variant("gemma2", "gemma2", {"head_dim": 16, "query_pre_attn_scalar": 24,
                                 "sliding_window": WINDOW, "num_hidden_layers": 4,
                                 "attn_logit_softcapping": 2.0,
                                 "final_logit_softcapping": 5.0,
                                 "tie_word_embeddings": True}),
    Variant("gemma3", "gemma3_text", {"head_dim": 16, "query_pre_attn_scalar": 24,
                                      "sliding_window": WINDOW, "num_hidden_layers": 4,
                                      "layer_types": ["sliding_attention", "sliding_attention",
                                                      "sliding_attention", "full_attention"],
                                      "tie_word_embeddings": True}),
    Variant("gemma3-final-softcap-linear", "gemma3_text", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW,
        "num_hidden_layers": 3, "final_logit_softcapping": 4.0, "tie_word_embeddings": True,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}),
    Variant("phi3", "phi3", {"pad_token_id": 0}, PHI3_TARGETS),
    Variant("phi3-sliding", "phi3", {"pad_token_id": 0, "sliding_window": WINDOW},
            PHI3_TARGETS),
    Variant("phi3-longrope-partial", "phi3", {
        "pad_token_id": 0, "original_max_position_embeddings": 24,
        "rope_parameters": {"rope_type": "longrope", "partial_rotary_factor": 0.5,
                            "rope_theta": 10000.0,
                            "short_factor": [1.0, 1.5, 2.0, 2.5],
                            "long_factor": [3.0, 4.0, 5.0, 6.0]}}, PHI3_TARGETS),
    Variant("olmo2", "olmo2", {"attention_bias": True}),
    Variant("granite", "granite", {"embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                                   "attention_multiplier": 0.2, "logits_scaling": 2.0,
                                   "attention_bias": True, "mlp_bias": True}),
    Variant("smollm3", "smollm3", {"no_rope_layer_interval": 2,
                                   "tie_word_embeddings": True}),
    Variant("smollm3-sliding", "smollm3", {"no_rope_layer_interval": 2,
                                           "use_sliding_window": True,
                                           "sliding_window": WINDOW}),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.id for v in VARIANTS])
def test_family_matches_transformers_and_peft(tmp_path, variant: Variant) -> None:
    check_parity(build_with_adapters(tmp_path, variant))


COMPILED_LAYER_OPS = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                      "phi3", "olmo2", "granite", "smollm3"}
"""The families whose small steps (all of the parity test's) run their elementwise ops
through the compiled kernels (`DecoderModel.compiled_layers`): every family served."""


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.id for v in VARIANTS])
def test_the_parity_test_covers_the_compiled_layer_ops(tmp_path, variant: Variant) -> None:
    pytest.importorskip("numba")
    build_family(tmp_path, variant)
    compiled = make_engine(tmp_path).model.compiled_layers
    assert compiled == (variant.model_type in COMPILED_LAYER_OPS)


def test_sliding_window_on_the_torch_decode_path(tmp_path, monkeypatch) -> None:
    """The padded decode groups (GPU, fp16, no numba) mask the same window as the kernel."""
    from services.worker.engine import attention

    monkeypatch.setattr(attention, "HOST_DECODE", False)
    check_parity(build_with_adapters(tmp_path, VARIANTS[5]))


def test_sliding_window_frees_blocks_and_the_prefix_cache_needs_only_the_window(
        tmp_path) -> None:
    """With every layer sliding, a sequence holds only the blocks its window still sees;
    the released blocks stay in the prefix cache, and once the oldest of them are evicted
    a repeated prompt still resumes from the blocks inside its window, with the same
    tokens as transformers."""
    from services.worker.engine import CacheScope, GenerationRequest, SamplingParams
    from services.worker.engine.kv_cache import ROOT_HASH, block_hash

    from .families import greedy, make_engine, reference

    fam = build_with_adapters(tmp_path, Variant("mistral-sliding", "mistral",
                                                {"sliding_window": WINDOW}))
    prompt = PROMPTS[0]  # 19 tokens: 4 full blocks of 4 are cacheable
    want = greedy(reference(fam, None), prompt, 12)
    eng = make_engine(fam.path, blocks=12, step_tokens=64)
    held: list[int] = []
    req = GenerationRequest(prompt_token_ids=prompt,
                            sampling=SamplingParams(max_tokens=12, min_tokens=12))
    rid = eng.submit(req)
    while eng.has_work:
        eng.step()
        seq = eng._seqs.get(rid)
        if seq is not None:
            held.append(sum(b >= 0 for b in seq.block_table))
    assert eng.pop_result(rid).token_ids == want
    assert max(held[1:]) <= WINDOW // 4 + 1  # after the prefill step: the window's blocks
    # another prompt takes the free blocks and evicts the oldest cached ones (blocks 0, 1)
    eng.generate([GenerationRequest(prompt_token_ids=PROMPTS[2],
                                    sampling=SamplingParams(max_tokens=10))])
    scope = CacheScope(eng.base_digest, None, "default").partition_key(eng.config.sharing_policy)
    first = block_hash(ROOT_HASH, prompt[:4], scope)
    assert first not in eng.blocks.index  # evicted
    again = eng.generate([req])[0]
    assert again.cached_prompt_tokens == 16  # blocks 2 and 3 cover the window of 16
    assert again.token_ids == want
