"""Engine outputs beyond one token: logprobs and prompt logprobs against transformers'
log-softmax (fp32, 1e-4), n choices forked on shared prompt blocks with their own seed
streams, stop reasons, and structured output masked by the grammar in a mixed batch."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from services.worker.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from services.worker.engine.request import GuideSpec
from tests.worker.engine.tiny_bpe import build_chat_model


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("bpe") / "base"
    return path, build_chat_model(path)


def _engine(path: Path, **kw: object) -> Engine:
    return Engine.from_pretrained(path, EngineConfig(block_size=4, num_kv_blocks=256, **kw))


def _hf_logprobs(hf: object, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]  # type: ignore[operator]
    return logits.float().log_softmax(-1)


def test_logprobs_and_prompt_logprobs_equal_transformers(chat_model) -> None:
    path, hf = chat_model
    engine = _engine(path)
    prompt = engine.tokenizer.encode('{"answer": "yes"').ids
    result, = engine.generate([GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3, prompt_logprobs=2))])
    events = []
    engine2 = _engine(path)
    events = list(engine2.stream(GenerationRequest(
        prompt_token_ids=prompt, sampling=SamplingParams(
            max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3, prompt_logprobs=2))))
    ref = _hf_logprobs(hf, prompt + result.token_ids)
    tokens = [e for e in events if e.token_id is not None]
    assert [e.token_id for e in tokens] == result.token_ids
    for k, event in enumerate(tokens):
        row = ref[len(prompt) - 1 + k]
        assert abs(event.logprob - float(row[event.token_id])) < 1e-4
        values, ids = row.topk(3)
        assert [t for t, _ in event.top_logprobs] == ids.tolist()
        assert max(abs(a - b) for (_, a), b in zip(event.top_logprobs, values.tolist(),
                                                    strict=True)) < 1e-4
    prompt_lp = tokens[0].prompt_logprobs
    assert prompt_lp is not None and len(prompt_lp) == len(prompt) - 1
    for i, (lp, alts) in enumerate(prompt_lp):
        assert abs(lp - float(ref[i, prompt[i + 1]])) < 1e-4
        assert [t for t, _ in alts] == ref[i].topk(2).indices.tolist()
    assert all(e.prompt_logprobs is None for e in tokens[1:])


def test_prompt_logprobs_across_chunked_prefill(chat_model) -> None:
    from services.worker.engine.scheduler import SchedulerLimits

    path, hf = chat_model
    engine = _engine(path, limits=SchedulerLimits(max_running=4, max_tokens_per_step=5))
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog").ids
    assert len(prompt) > 5
    first = next(e for e in engine.stream(GenerationRequest(
        prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=1, prompt_logprobs=0))))
    ref = _hf_logprobs(hf, prompt)
    got = [lp for lp, _ in first.prompt_logprobs]
    want = [float(ref[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


def test_n_choices_share_the_prompt_blocks_and_draw_their_own_streams(chat_model) -> None:
    path, _ = chat_model
    prompt = list(range(5, 5 + 14))  # 3 full blocks of 4 and a partial one
    params = dict(max_tokens=5, ignore_eos=True, temperature=1.0, seed=42)
    engine = _engine(path)
    free = engine.blocks.num_available
    rid = engine.submit(GenerationRequest(prompt_token_ids=prompt,
                                          sampling=SamplingParams(n=4, **params)))
    engine.step()  # prefill + fork + first tokens
    used = free - engine.blocks.num_available
    # one copy of the 3 full prompt blocks, 4 private tail blocks (the partial one copied)
    assert used == 3 + 4
    engine.run_until_idle()
    together = engine.pop_result(rid)
    assert together is not None and len(together.choices) == 4
    for i, choice in enumerate(together.choices):
        alone, = _engine(path).generate([GenerationRequest(
            prompt_token_ids=prompt, sampling=SamplingParams(**{**params, "seed": 42 + i}))])
        assert choice.token_ids == alone.token_ids, i
    assert len({tuple(c.token_ids) for c in together.choices}) > 1
    assert engine.blocks.num_available == free


def test_abort_ends_every_choice_and_frees_the_blocks(chat_model) -> None:
    path, _ = chat_model
    engine = _engine(path)
    free = engine.blocks.num_available
    rid = engine.submit(GenerationRequest(prompt_token_ids=list(range(5, 15)),
                                          sampling=SamplingParams(n=3, max_tokens=20,
                                                                  ignore_eos=True)))
    engine.step()
    engine.step()
    assert engine.abort(rid)
    result = engine.pop_result(rid)
    assert result is not None and [c.finish_reason.value for c in result.choices] == ["abort"] * 3
    assert engine.blocks.num_available == free and not engine.has_work


def test_stop_reasons_name_the_string_or_token(chat_model) -> None:
    path, _ = chat_model
    engine = _engine(path)
    prompt = list(range(5, 12))
    free_run, = engine.generate([GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=8, ignore_eos=True))])
    token = free_run.token_ids[3]
    by_token, = engine.generate([GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=8, ignore_eos=True, stop_token_ids=(token,)))])
    assert by_token.choices[0].stop_reason == token
    assert by_token.token_ids == free_run.token_ids[:free_run.token_ids.index(token) + 1]
    text = free_run.text
    stop = text[len(text) // 2:len(text) // 2 + 2] or text[:1]
    by_text, = engine.generate([GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=8, ignore_eos=True, stop=(stop,)))])
    assert by_text.choices[0].stop_reason == stop and stop not in by_text.text


SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "kind", "n"], "additionalProperties": False}


def test_constrained_rows_follow_their_grammar_beside_free_rows(chat_model) -> None:
    path, _ = chat_model
    engine = _engine(path)
    prompt = engine.tokenizer.encode("answer:").ids
    guide = GuideSpec("json_schema", json.dumps(SCHEMA))
    requests = []
    for i in range(6):
        constrained = i % 2 == 0
        requests.append(GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(
            max_tokens=48, temperature=1.0, seed=i, guide=guide if constrained else None)))
    requests.append(GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=24, temperature=1.0, seed=9, n=2,
        guide=GuideSpec("choice", json.dumps(["red", "green", "blue"])))))
    requests.append(GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=24, guide=GuideSpec("regex", "[0-9]{3}-[a-z]{2}"))))
    results = engine.generate(requests)
    for r in results[0:6:2]:
        assert r.finish_reason.value == "stop", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)
    assert any(not _is_json(r.text) for r in results[1:6:2])  # free rows are not masked
    assert all(c.text in ("red", "green", "blue") for c in results[6].choices)
    import re

    assert re.fullmatch("[0-9]{3}-[a-z]{2}", results[7].text)
    assert engine.grammars.stats.compiled == 3 and engine.grammars.stats.hits == 2


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_a_grammar_that_does_not_compile_is_a_request_error(chat_model) -> None:
    from services.worker.engine import RequestError

    engine = _engine(path := chat_model[0])
    del path
    with pytest.raises(RequestError, match="regex"):
        engine.submit(GenerationRequest(prompt_token_ids=[5], sampling=SamplingParams(
            guide=GuideSpec("regex", "(unclosed"))))
