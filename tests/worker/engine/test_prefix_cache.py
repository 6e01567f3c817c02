"""Prefix cache scoping and invalidation by adapter digest and tenant."""

from __future__ import annotations

from services.worker.engine import (
    Engine,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    SharingPolicy,
)

FIXED8 = SamplingParams(max_tokens=8, min_tokens=8)
PROMPT = list(range(10, 27))  # 17 tokens: 4 full blocks of 4 are cacheable


def make_engine(tiny, policy=SharingPolicy.STRICT) -> Engine:
    eng = Engine.from_pretrained(tiny.path, EngineConfig(num_kv_blocks=64, block_size=4,
                                                         adapter_slots=4, max_lora_rank=16,
                                                         sharing_policy=policy))
    return eng


def run(eng, tenant="acme", adapter=None, sharing=None, prompt=PROMPT, n=3):
    req = GenerationRequest(prompt_token_ids=prompt, adapter_digest=adapter, tenant_key=tenant,
                            sharing_scope=sharing, sampling=SamplingParams(max_tokens=n))
    return eng.generate([req])[0]


def test_same_tenant_same_adapter_reuses(tiny):
    eng = make_engine(tiny)
    x = eng.load_adapter(tiny.adapters["attn_r4"]).digest
    first = run(eng, adapter=x)
    second = run(eng, adapter=x)
    assert first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens == 16
    assert second.token_ids == first.token_ids
    # a longer prompt sharing the prefix reuses the shared full blocks only
    assert run(eng, adapter=x, prompt=[*PROMPT[:9], 90, 91, 92]).cached_prompt_tokens == 8


def test_strict_never_reuses_across_tenant_or_adapter(tiny):
    eng = make_engine(tiny)
    x = eng.load_adapter(tiny.adapters["attn_r4"]).digest
    y = eng.load_adapter(tiny.adapters["mlp_r8"]).digest
    for tenant, adapter, sharing in [("acme", x, "s"), ("acme", None, "s")]:
        run(eng, tenant=tenant, adapter=adapter, sharing=sharing)
    for tenant, adapter, sharing in [
        ("globex", x, "s"),  # other tenant, same adapter
        ("acme", y, "s"),  # same tenant, other adapter
        ("globex", None, "s"),  # other tenant, base model, same sharing scope
    ]:
        res = run(eng, tenant=tenant, adapter=adapter, sharing=sharing)
        assert res.cached_prompt_tokens == 0, (tenant, adapter)
    # ... while each of those scopes reuses its own blocks
    assert run(eng, tenant="globex", adapter=x).cached_prompt_tokens == 16


def test_shared_base_prefix_policy(tiny):
    eng = make_engine(tiny, SharingPolicy.SHARED_BASE_PREFIX)
    x = eng.load_adapter(tiny.adapters["attn_r4"]).digest
    run(eng, tenant="acme", sharing="public")
    assert run(eng, tenant="globex", sharing="public").cached_prompt_tokens == 16
    assert run(eng, tenant="initech", sharing="other").cached_prompt_tokens == 0
    assert run(eng, tenant="umbrella", sharing=None).cached_prompt_tokens == 0
    run(eng, tenant="acme", adapter=x, sharing="public")
    assert run(eng, tenant="globex", adapter=x, sharing="public").cached_prompt_tokens == 0


def test_invalidate_adapter_counts_and_blocks_reuse(tiny):
    eng = make_engine(tiny)
    x = eng.load_adapter(tiny.adapters["attn_r4"]).digest
    run(eng, adapter=x, n=3)  # 17 + 3 tokens, 19 computed: 4 full blocks published
    run(eng, tenant="globex")  # unrelated blocks stay cached
    cached = len(eng.blocks.index)
    result = eng.invalidate_adapter(x)
    assert result.blocks_freed == 4 and result.sequences_aborted == 0
    assert len(eng.blocks.index) == cached - 4
    assert run(eng, adapter=x).cached_prompt_tokens == 0
    assert run(eng, tenant="globex").cached_prompt_tokens == 16


def test_soft_invalidation_defers_held_blocks_until_finish(tiny):
    eng = make_engine(tiny)
    x = eng.load_adapter(tiny.adapters["attn_r4"]).digest
    run(eng, adapter=x)
    eng.submit(GenerationRequest(prompt_token_ids=PROMPT, adapter_digest=x, tenant_key="acme",
                                 sampling=SamplingParams(max_tokens=6, min_tokens=6),
                                 request_id="r1"))
    eng.step()  # r1 runs on the 4 cached blocks + its own
    assert eng.scheduler.running[0].cached_prompt_tokens == 16
    result = eng.invalidate_adapter(x)
    assert result.sequences_aborted == 0
    assert result.blocks_deferred == len(eng.scheduler.running[0].block_table) == 5
    eng.run_until_idle()
    assert eng.result("r1").finish_reason is FinishReason.LENGTH
    assert len(eng.blocks.free) == eng.blocks.num_blocks  # nothing re-cached, all freed
    assert run(eng, adapter=x).cached_prompt_tokens == 0


def test_hard_tenant_purge_aborts_and_frees_everything(tiny):
    eng = make_engine(tiny, SharingPolicy.SHARED_BASE_PREFIX)
    events = []
    run(eng, tenant="acme", sharing="public")
    eng.submit(GenerationRequest(prompt_token_ids=PROMPT, tenant_key="acme", request_id="a",
                                 sampling=SamplingParams(max_tokens=8), on_token=events.append))
    # globex reuses acme's shared blocks: purging acme must not leave them behind
    eng.submit(GenerationRequest(prompt_token_ids=PROMPT, tenant_key="globex", request_id="g",
                                 sharing_scope="public", sampling=FIXED8))
    eng.submit(GenerationRequest(prompt_token_ids=[50, 51, 52], tenant_key="initech",
                                 request_id="i", sampling=FIXED8))
    eng.step()
    eng.submit(GenerationRequest(prompt_token_ids=PROMPT, tenant_key="acme", request_id="w",
                                 sampling=SamplingParams(max_tokens=2)))
    result = eng.invalidate_tenant("acme")
    assert sorted(result.aborted_request_ids) == ["a", "g", "w"]
    assert result.sequences_aborted == 3 and result.blocks_freed > 0
    assert events[-1].finished and events[-1].finish_reason is FinishReason.ABORT
    assert [s.request_id for s in eng.scheduler.running] == ["i"]
    eng.run_until_idle()
    assert eng.result("i").finish_reason is FinishReason.LENGTH
    # nothing of acme's left: no cached block with its scope, refcounts all zero
    assert all(b.scope is None or b.scope.tenant_key != "acme" for b in eng.blocks.blocks)
    assert all(b.ref_count == 0 for b in eng.blocks.blocks)


def test_unload_adapter_aborts_its_sequences(tiny):
    eng = make_engine(tiny)
    x = eng.load_adapter(tiny.adapters["attn_r4"]).digest
    eng.submit(GenerationRequest(prompt_token_ids=PROMPT, adapter_digest=x, request_id="x1"))
    eng.submit(GenerationRequest(prompt_token_ids=PROMPT, request_id="b1"))
    eng.step()
    result = eng.unload_adapter(x)
    assert result.aborted_request_ids == ["x1"]
    assert not eng.adapters.is_loaded(x)
    eng.run_until_idle()
    assert eng.result("b1").finish_reason is FinishReason.LENGTH


def test_requests_arriving_together_share_the_prefix_being_computed(tiny):
    """The second request waits one step for the first to publish the shared system
    prompt instead of computing it twice; another tenant's identical prompt does not."""
    eng = make_engine(tiny)
    system = list(range(30, 54))  # 6 full blocks
    reqs = [GenerationRequest(prompt_token_ids=system + turn, tenant_key=tenant,
                              sampling=SamplingParams(max_tokens=3, min_tokens=3))
            for tenant, turn in (("acme", [60, 61]), ("acme", [62, 63, 64]),
                                 ("globex", [60, 61]))]
    results = eng.generate(reqs)
    assert [r.cached_prompt_tokens for r in results] == [0, 24, 0]
    stats = eng.stats()
    assert stats.deferred_admissions >= 1
    assert stats.prefix_cache_cross_tenant_hits == 0
    assert stats.prefix_cache_hits_by_tenant == {"acme": 6}


def test_prefix_cache_off_computes_everything(tiny):
    eng = Engine.from_pretrained(tiny.path, EngineConfig(num_kv_blocks=64, block_size=4,
                                                         prefix_cache=False))
    first, second = run(eng), run(eng)
    assert first.token_ids == second.token_ids and second.cached_prompt_tokens == 0
    assert eng.stats().prefix_cache_hits == 0 and eng.stats().deferred_admissions == 0


def test_cross_tenant_hits_are_counted_under_shared_base_prefix(tiny):
    eng = make_engine(tiny, SharingPolicy.SHARED_BASE_PREFIX)
    run(eng, tenant="acme", sharing="public")
    run(eng, tenant="globex", sharing="public")
    stats = eng.stats()
    assert stats.prefix_cache_cross_tenant_hits == 4
    assert stats.prefix_cache_hits_by_tenant == {"globex": 4}
