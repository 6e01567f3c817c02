"""The batched sampler's rules against transformers' own logits processors, row by row on
the same logits, and OpenAI's penalty formula; one batch mixes every setting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from services.worker.engine import SamplingParams
from services.worker.engine.sampling import SamplerRow, make_generator, process, sample, warp

V, EOS = 40, (2,)
ROWS = [
    (SamplingParams(temperature=0.7, top_k=5), [3, 4], [5, 5, 6]),
    (SamplingParams(temperature=1.3, top_p=0.6, repetition_penalty=1.3), [7, 8, 9], [9, 10]),
    (SamplingParams(temperature=1.0, min_p=0.2, logit_bias=((11, 5.0), (12, -3.0))), [1],
     [11]),
    (SamplingParams(temperature=0.5, top_k=8, top_p=0.8, min_p=0.05,
                    bad_words_ids=((13,), (14, 15))), [2, 3], [16, 14]),
    (SamplingParams(max_tokens=9, min_tokens=5, stop_token_ids=(17,)), [1, 2], [20, 21]),
    (SamplingParams(temperature=0.9, presence_penalty=0.7, frequency_penalty=0.4),
     [1], [22, 22, 23]),
    (SamplingParams(), [1], []),
]


def _rows() -> list[SamplerRow]:
    return [SamplerRow(params=p, generator=make_generator(i), prompt_ids=prompt,
                       output_ids=out, mask_eos=len(out) < p.min_tokens)
            for i, (p, prompt, out) in enumerate(ROWS)]


def _transformers(scores: torch.Tensor, p: SamplingParams, prompt: list[int],
                  out: list[int]) -> torch.Tensor:
    """One row through transformers' processors, in `_get_logits_processor`'s order."""
    ids = torch.tensor([prompt + out])
    s = scores.clone().unsqueeze(0)
    if p.logit_bias:
        s = SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias})(ids, s)
    if p.repetition_penalty != 1.0:
        s = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, s)
    if p.presence_penalty or p.frequency_penalty:  # OpenAI's formula (no HF processor)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=V).float()
        s = s - counts * p.frequency_penalty - (counts > 0).float() * p.presence_penalty
    if p.bad_words_ids:
        s = NoBadWordsLogitsProcessor([list(w) for w in p.bad_words_ids], eos_token_id=99)(
            ids, s)
    if len(out) < p.min_tokens:
        s = MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens,
                                              [*EOS, *p.stop_token_ids])(ids, s)
    if p.greedy:
        return s[0]
    s = TemperatureLogitsWarper(p.temperature)(ids, s)
    if p.top_k > 0:
        s = TopKLogitsWarper(p.top_k)(ids, s)
    if p.top_p < 1.0:
        s = TopPLogitsWarper(p.top_p)(ids, s)
    if p.min_p > 0:
        s = MinPLogitsWarper(p.min_p)(ids, s)
    return s[0]


@pytest.mark.parametrize("seed", range(5))
def test_every_rule_matches_transformers_row_by_row_in_one_batch(seed: int) -> None:
    torch.manual_seed(seed)
    logits = torch.randn(len(ROWS), V) * 3
    rows = _rows()
    mine = process(logits.clone(), rows, EOS)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    mine[sampled] = warp(mine[sampled].clone(), [rows[i].params for i in sampled])
    for i, (p, prompt, out) in enumerate(ROWS):
        expected = _transformers(logits[i], p, prompt, out)
        assert torch.equal(torch.isinf(mine[i]), torch.isinf(expected)), i
        finite = torch.isfinite(expected)
        torch.testing.assert_close(mine[i][finite], expected[finite], rtol=1e-5, atol=1e-5)


def test_sampled_tokens_are_allowed_and_seeded_rows_repeat() -> None:
    torch.manual_seed(0)
    logits = torch.randn(len(ROWS), V) * 3
    first = sample(logits.clone(), _rows(), EOS).tokens
    again = sample(logits.clone(), _rows(), EOS).tokens
    assert first == again  # each row's own generator, seeded the same
    processed = process(logits.clone(), _rows(), EOS)
    for i, token in enumerate(first):
        assert torch.isfinite(processed[i, token]), (i, token)
    assert first[4] == int(processed[4].argmax())  # greedy row
    assert first[4] not in (*EOS, 17)  # min_tokens masks EOS and stop tokens


def test_a_row_draws_the_same_token_whatever_shares_its_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    p = SamplingParams(temperature=1.0, top_p=0.9)
    alone = sample(logits[:1].clone(), [SamplerRow(p, make_generator(5), [1], [])], EOS)
    mixed = sample(logits.clone(), [SamplerRow(p, make_generator(5), [1], []),
                                    SamplerRow(SamplingParams(temperature=2.0),
                                               make_generator(6), [1], []),
                                    SamplerRow(SamplingParams(), make_generator(7), [1], [])],
                   EOS)
    assert alone.tokens[0] == mixed.tokens[0]


def test_logprobs_are_the_raw_log_softmax_with_top_alternatives() -> None:
    torch.manual_seed(2)
    logits = torch.randn(2, V)
    rows = [SamplerRow(SamplingParams(logprobs=True, top_logprobs=3, repetition_penalty=2.0),
                       make_generator(0), [1, 2], [3], want_logprob=True),
            SamplerRow(SamplingParams(), make_generator(1), [1], [])]
    out = sample(logits.clone(), rows, EOS, top_logprobs=3)
    raw = logits.log_softmax(-1)
    assert abs(out.logprobs[0] - float(raw[0, out.tokens[0]])) < 1e-6
    values, ids = raw[0].topk(3)
    assert out.top[0] == list(zip(ids.tolist(), values.tolist(), strict=True))
    assert out.logprobs[1] is None and out.top[1] == []


@given(rows=st.lists(st.lists(st.sampled_from(
    [0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")]), min_size=1,
    max_size=12), min_size=1, max_size=6).filter(lambda r: len({len(x) for x in r}) == 1))
@settings(max_examples=200, deadline=None)
def test_greedy_rows_take_argmaxs_token_ties_and_nan_included(rows: list[list[float]]) -> None:
    """Greedy rows take the first index of the row's maximum, torch.argmax's token, in
    rows of ties, infinities and NaNs (the sampler takes it through `max`, faster on CPU)."""
    logits = torch.tensor(rows, dtype=torch.float32)
    want = logits.argmax(dim=-1).tolist()
    params = SamplingParams()
    got = sample(logits.clone(), [SamplerRow(params=params, generator=make_generator(0),
                                             prompt_ids=[1], output_ids=[], mask_eos=False)
                                  for _ in rows], eos_ids=())
    assert got.tokens == want
