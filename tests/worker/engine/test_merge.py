"""Merged mode: one adapter folded into the base weights, exactly reversible."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine import (
    Engine,
    EngineConfig,
    GenerationRequest,
    RequestError,
    SamplingParams,
)

PROMPT = [5, 7, 9, 11, 13, 17, 19, 23, 29]


def make_engine(tiny) -> Engine:
    return Engine.from_pretrained(tiny.path, EngineConfig(num_kv_blocks=64, block_size=4,
                                                          adapter_slots=4, max_lora_rank=16))


def weights(eng: Engine) -> list[torch.Tensor]:
    return [t.clone() for t in eng.model.plain_projections()]


def run(eng: Engine, digest, n=6):
    req = GenerationRequest(prompt_token_ids=PROMPT, adapter_digest=digest,
                            sampling=SamplingParams(max_tokens=n, min_tokens=n))
    return eng.generate([req])[0].token_ids


def test_merged_adapter_serves_the_same_tokens_and_unmerges_exactly(tiny):
    eng = make_engine(tiny)
    pristine = weights(eng)
    x = eng.load_adapter(tiny.adapters["all_r16_rs"]).digest
    unmerged = run(eng, x)
    logits = eng.score(PROMPT, x)
    eng.merge_adapter(x)
    assert eng.merged_adapter == x
    assert run(eng, x) == unmerged
    torch.testing.assert_close(eng.score(PROMPT, x), logits, atol=1e-4, rtol=1e-4)
    assert eng.unmerge() == x and eng.merged_adapter is None
    assert all(torch.equal(a, b) for a, b in zip(weights(eng), pristine, strict=True))


def test_switching_the_merged_adapter_starts_from_the_pristine_base(tiny):
    eng = make_engine(tiny)
    x = eng.load_adapter(tiny.adapters["all_r16_rs"]).digest
    y = eng.load_adapter(tiny.adapters["mlp_r8"]).digest
    eng.merge_adapter(y)
    only_y = weights(eng)
    eng.unmerge()
    eng.merge_adapter(x)
    eng.merge_adapter(y)  # a switch back (rollback): no residue of x
    assert all(torch.equal(a, b) for a, b in zip(weights(eng), only_y, strict=True))


def test_merged_mode_refuses_other_adapters_and_unload_unmerges(tiny):
    eng = make_engine(tiny)
    pristine = weights(eng)
    x = eng.load_adapter(tiny.adapters["attn_r4"]).digest
    y = eng.load_adapter(tiny.adapters["mlp_r8"]).digest
    eng.submit(GenerationRequest(prompt_token_ids=PROMPT, adapter_digest=y))
    with pytest.raises(RequestError, match="in flight"):
        eng.merge_adapter(x)
    eng.run_until_idle()
    eng.merge_adapter(x)
    with pytest.raises(RequestError, match="merged"):
        eng.submit(GenerationRequest(prompt_token_ids=PROMPT, adapter_digest=y))
    with pytest.raises(RequestError, match="merged"):
        eng.submit(GenerationRequest(prompt_token_ids=PROMPT))
    assert eng.adapters.info(y).active_sequences == 0
    eng.unload_adapter(x)
    assert eng.merged_adapter is None
    assert all(torch.equal(a, b) for a, b in zip(weights(eng), pristine, strict=True))
