"""Continuous batching, limits, QoS priority, preemption, sampling, stop strings, streaming."""

from __future__ import annotations

import pytest

from services.worker.engine import (
    Engine,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    QosTier,
    RequestError,
    SamplingParams,
    SchedulerLimits,
)

PROMPTS = [list(range(10, 20)), list(range(30, 41)), list(range(50, 59))]


def make_engine(tiny, blocks=128, **limits) -> Engine:
    return Engine.from_pretrained(tiny.path, EngineConfig(
        num_kv_blocks=blocks, block_size=4, adapter_slots=4, max_lora_rank=16,
        limits=SchedulerLimits(**{"max_running": 8, "max_tokens_per_step": 64, **limits})))


def greedy(n):
    return SamplingParams(max_tokens=n, min_tokens=n)


def test_preemption_by_recompute_keeps_outputs(tiny):
    alone = [make_engine(tiny).generate([GenerationRequest(prompt_token_ids=p,
                                                           sampling=greedy(12))])[0].token_ids
             for p in PROMPTS]
    eng = make_engine(tiny, blocks=12)  # 48 token slots; the three need 66
    results = eng.generate([GenerationRequest(prompt_token_ids=p, sampling=greedy(12))
                            for p in PROMPTS])
    assert [r.token_ids for r in results] == alone
    assert eng.stats().preemptions > 0 and sum(r.preemptions for r in results) > 0
    assert len(eng.blocks.free) + len(eng.blocks.idle) == 12


def test_preemption_spares_higher_qos_tier(tiny):
    eng = make_engine(tiny, blocks=12)
    tiers = [QosTier.BRONZE, QosTier.PLATINUM, QosTier.SILVER]
    results = eng.generate([GenerationRequest(prompt_token_ids=p, sampling=greedy(12),
                                              qos_tier=t) for p, t in zip(PROMPTS, tiers,
                                                                          strict=True)])
    by_tier = dict(zip(tiers, results, strict=True))
    assert by_tier[QosTier.PLATINUM].preemptions == 0
    assert by_tier[QosTier.BRONZE].preemptions > 0


def test_qos_tier_admitted_first(tiny):
    eng = make_engine(tiny, max_running=1)
    order: list[str] = []

    def record(ev):
        if ev.finished:
            order.append(ev.request_id)

    for rid, tier in [("batch", QosTier.BRONZE), ("std", QosTier.SILVER),
                      ("premium", QosTier.PLATINUM)]:
        eng.submit(GenerationRequest(prompt_token_ids=PROMPTS[0], sampling=greedy(2),
                                     qos_tier=tier, request_id=rid, on_token=record))
    eng.run_until_idle()
    assert order == ["premium", "std", "batch"]


def test_new_requests_join_between_decode_steps(tiny):
    eng = make_engine(tiny)
    eng.submit(GenerationRequest(prompt_token_ids=PROMPTS[0], sampling=greedy(10),
                                 request_id="first"))
    for _ in range(3):
        eng.step()
    eng.submit(GenerationRequest(prompt_token_ids=PROMPTS[1], sampling=greedy(3),
                                 request_id="late"))
    events = eng.step()
    assert {e.request_id for e in events} == {"first", "late"}
    eng.run_until_idle()
    assert len(eng.result("first").token_ids) == 10


def test_token_and_adapter_limits_per_step(tiny):
    eng = make_engine(tiny, max_tokens_per_step=8, max_adapters_per_step=1, max_running=8)
    digests = [eng.load_adapter(tiny.adapters[n]).digest for n in ("attn_r4", "mlp_r8")]
    for i, p in enumerate(PROMPTS * 2):
        eng.submit(GenerationRequest(prompt_token_ids=p, sampling=greedy(3),
                                     adapter_digest=digests[i % 2]))
    while eng.has_work:
        plan_before = eng.steps
        eng.step()
        running = eng.scheduler.running
        assert len({s.scope.adapter_digest for s in running}) <= 1
        assert eng.steps == plan_before + 1
    assert eng.stats().waiting == 0


def test_stop_strings_and_streaming(tiny):
    eng = make_engine(tiny)
    base = eng.generate([GenerationRequest(prompt_token_ids=PROMPTS[0], sampling=greedy(8))])[0]
    words = base.text.split(" ")
    stop = " " + words[3]  # stop right before the 4th generated word
    events = list(eng.stream(GenerationRequest(
        prompt_token_ids=PROMPTS[0],
        sampling=SamplingParams(max_tokens=8, min_tokens=8, stop=(stop, "never-seen")))))
    assert events[-1].finished and events[-1].finish_reason is FinishReason.STOP
    text = "".join(e.text for e in events)
    assert text == " ".join(words[:3])
    assert [e.token_id for e in events] == base.token_ids[:4]
    assert all(not e.finished for e in events[:-1])


def test_text_prompt_and_eos(tiny):
    eng = make_engine(tiny)
    res = eng.generate([GenerationRequest(prompt="w10 w11 w12 w13",
                                          sampling=SamplingParams(max_tokens=40))])[0]
    ids = eng.generate([GenerationRequest(prompt_token_ids=[10, 11, 12, 13],
                                          sampling=SamplingParams(max_tokens=40))])[0]
    assert res.token_ids == ids.token_ids
    if res.finish_reason is FinishReason.STOP:  # EOS ends the request, not part of the text
        assert res.token_ids[-1] == 2 and "w2" not in res.text.split(" ")


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    def sampled(seed, companions=0):
        eng = make_engine(tiny)
        reqs = [GenerationRequest(prompt_token_ids=PROMPTS[0], request_id="target",
                                  sampling=SamplingParams(max_tokens=12, min_tokens=12,
                                                          temperature=1.0, top_p=0.9,
                                                          seed=seed))]
        reqs += [GenerationRequest(prompt_token_ids=PROMPTS[1 + i % 2],
                                   sampling=SamplingParams(max_tokens=5, temperature=0.7,
                                                           seed=i)) for i in range(companions)]
        return eng.generate(reqs)[0].token_ids

    a = sampled(7)
    assert a == sampled(7) == sampled(7, companions=3)
    assert a != sampled(8)


def test_top_p_small_is_greedy(tiny):
    eng = make_engine(tiny)
    g = eng.generate([GenerationRequest(prompt_token_ids=PROMPTS[2], sampling=greedy(6))])[0]
    s = eng.generate([GenerationRequest(prompt_token_ids=PROMPTS[2], sampling=SamplingParams(
        max_tokens=6, min_tokens=6, temperature=1.5, top_p=1e-6, seed=1))])[0]
    assert s.token_ids == g.token_ids


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1.0),
                                    dict(top_p=0.0), dict(stop=("",)),
                                    dict(max_tokens=2, min_tokens=3)])
def test_bad_sampling_params(kwargs):
    with pytest.raises(RequestError):
        SamplingParams(**kwargs)


def test_bad_requests(tiny):
    eng = make_engine(tiny, blocks=4)
    with pytest.raises(RequestError, match="empty"):
        eng.submit(GenerationRequest(prompt_token_ids=[]))
    with pytest.raises(RequestError, match="vocabulary"):
        eng.submit(GenerationRequest(prompt_token_ids=[10_000]))
    with pytest.raises(RequestError, match="KV capacity"):
        eng.submit(GenerationRequest(prompt_token_ids=[5] * 10, sampling=greedy(10)))
    eng.submit(GenerationRequest(prompt_token_ids=[5], request_id="dup", sampling=greedy(2)))
    with pytest.raises(RequestError, match="duplicate"):
        eng.submit(GenerationRequest(prompt_token_ids=[5], request_id="dup", sampling=greedy(2)))


def test_abort(tiny):
    eng = make_engine(tiny)
    eng.submit(GenerationRequest(prompt_token_ids=PROMPTS[0], request_id="x",
                                 sampling=greedy(20)))
    eng.step()
    assert eng.abort("x")
    assert eng.result("x").finish_reason is FinishReason.ABORT
    assert not eng.has_work and eng.blocks.num_available == eng.blocks.num_blocks


def test_step_scratch_memory_is_reported_once_a_step_ran(tiny):
    eng = make_engine(tiny)
    assert eng.stats().workspace_bytes == 0
    eng.generate([GenerationRequest(prompt_token_ids=PROMPTS[0], sampling=greedy(2))])
    held = eng.stats().workspace_bytes
    assert held == eng.model.workspace.nbytes > 0
