"""The batched sampler: next-token selection for every sampling row of a step at once.

Each rule is one tensor operation over the rows of the step, with its settings as per-row
tensors (temperature, top-k, top-p, min-p, penalties), and is skipped outright when no
row of the step uses it, so a batch pays only for what its requests ask. The order is
transformers' (`GenerationMixin._get_logits_processor`): logit bias, repetition penalty,
OpenAI's presence and frequency penalties, bad words, the min-tokens mask, the grammar's
token mask; then greedy rows take the argmax, and sampled rows go through temperature,
top-k, top-p and min-p and draw.

Each request (each choice of one) owns a `torch.Generator` seeded from its seed and
advanced once per sampled token: the draw is one uniform number per row from the row's
own generator, turned into a token by inverse-CDF over the batch, so a seeded request's
output does not depend on what else is in the batch.

Logprobs are the log-softmax of the model's own logits, before any rule (vLLM's
`raw_logprobs`, and what transformers' `compute_transition_scores` of a greedy run gives).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .request import SamplingParams


class TokenMask(Protocol):
    """A grammar's view of one row (`grammar.GuideState`): which tokens may come next."""

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None: ...


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed % 2**64)
    return g


@dataclass
class SamplerRow:
    """One row of the step's logits to sample from, and what the sampler needs of it."""

    params: SamplingParams
    generator: torch.Generator
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    mask_eos: bool = False
    """min_tokens not reached yet: end-of-sequence and stop tokens may not be sampled."""
    guide: TokenMask | None = None
    want_logprob: bool = False
    """The chosen token's logprob is wanted (logprobs, or a cumulative one for best_of)."""


@dataclass
class Sampled:
    """The step's choices, one per row, with logprobs where a row asked for them."""

    tokens: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]]] = field(default_factory=list)


def _padded(rows: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out


def _occurrences(rows: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """[S, V] counts of each token id per row (padding lands in a dropped extra column)."""
    ids = _padded(rows, vocab)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def take_rows(t: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """`t[rows]` as a new tensor: the rows themselves when that is all of them, else one
    copy per row (torch's CPU `index_select` of long rows is tens of times slower)."""
    if len(rows) == t.shape[0] and all(i == r for i, r in enumerate(rows)):
        return t
    return torch.stack([t[i] for i in rows])


def _column(values: Sequence[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> None:
    r, t, v = [], [], []
    for i, row in enumerate(rows):
        for token, bias in row.params.logit_bias:
            r.append(i)
            t.append(token)
            v.append(bias)
    if r:
        logits.index_put_((torch.tensor(r), torch.tensor(t)), torch.tensor(v), accumulate=True)


def apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> None:
    """transformers' rule over prompt and output: a seen token's logit is divided by the
    penalty when positive, multiplied when negative."""
    seen = _occurrences([list(r.prompt_ids) + list(r.output_ids) for r in rows],
                        logits.shape[1]) > 0
    penalty = _column([r.params.repetition_penalty for r in rows])
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    logits.copy_(torch.where(seen, penalised, logits))


def apply_presence_frequency(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> None:
    """OpenAI's rule over the output so far: `logit -= count * frequency + (count > 0) *
    presence`."""
    counts = _occurrences([r.output_ids for r in rows], logits.shape[1])
    frequency = _column([r.params.frequency_penalty for r in rows])
    presence = _column([r.params.presence_penalty for r in rows])
    logits -= counts * frequency + (counts > 0).float() * presence


def apply_bad_words(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> None:
    """transformers' `NoBadWordsLogitsProcessor`: a one-token word is never sampled; the
    last token of a longer one is not, right after the rest of it."""
    r, t = [], []
    for i, row in enumerate(rows):
        out = row.output_ids
        for word in row.params.bad_words_ids:
            head = word[:-1]
            if not head or (len(out) >= len(head) and tuple(out[-len(head):]) == head):
                r.append(i)
                t.append(word[-1])
    if r:
        logits[torch.tensor(r), torch.tensor(t)] = float("-inf")


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplerRow],
                     eos_ids: tuple[int, ...]) -> None:
    r, t = [], []
    for i, row in enumerate(rows):
        if row.mask_eos:
            for token in (*eos_ids, *row.params.stop_token_ids):
                r.append(i)
                t.append(token)
    if r:
        logits[torch.tensor(r), torch.tensor(t)] = float("-inf")


def apply_guides(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> None:
    """The grammar's token mask on the constrained rows only."""
    constrained = [i for i, row in enumerate(rows) if row.guide is not None]
    if not constrained:
        return
    from .grammar import apply_bitmask, new_bitmask

    bitmask = new_bitmask(len(rows), logits.shape[1])
    for i in constrained:
        rows[i].guide.fill_mask(bitmask, i)  # type: ignore[union-attr]
    apply_bitmask(logits, bitmask, constrained if len(constrained) < len(rows) else None)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> None:
    """transformers' `TopKLogitsWarper` with a per-row k (k >= vocab: off)."""
    vocab = logits.shape[1]
    k = top_k.clamp(1, vocab)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
    logits.masked_fill_(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """transformers' `TopPLogitsWarper` with a per-row p (1: off)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p).unsqueeze(1)
    remove[:, -1] = False
    logits.masked_fill_(remove.scatter(1, order, remove), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """transformers' `MinPLogitsWarper` with a per-row min_p (0: off)."""
    probs = logits.softmax(dim=-1)
    remove = probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
    logits.masked_fill_(remove, float("-inf"))


def process(logits: torch.Tensor, rows: Sequence[SamplerRow],
            eos_ids: tuple[int, ...]) -> torch.Tensor:
    """Every rule before the greedy / sampled split, in place on float32 logits [S, V]."""
    params = [r.params for r in rows]
    if any(p.logit_bias for p in params):
        apply_logit_bias(logits, rows)
    if any(p.repetition_penalty != 1.0 for p in params):
        apply_repetition_penalty(logits, rows)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        apply_presence_frequency(logits, rows)
    if any(p.bad_words_ids for p in params):
        apply_bad_words(logits, rows)
    if any(r.mask_eos for r in rows):
        apply_min_tokens(logits, rows, eos_ids)
    apply_guides(logits, rows)
    return logits


def warp(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p for sampled rows (in place on [S, V])."""
    logits /= _column([p.temperature for p in params])
    vocab = logits.shape[1]
    if any(0 < p.top_k < vocab for p in params):
        apply_top_k(logits, torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]))
    if any(p.top_p < 1.0 for p in params):
        apply_top_p(logits, torch.tensor([p.top_p for p in params], dtype=torch.float32))
    if any(p.min_p > 0 for p in params):
        apply_min_p(logits, torch.tensor([p.min_p for p in params], dtype=torch.float32))
    return logits


def draw(logits: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row by inverse CDF, with one uniform number from each row's own
    generator (the only per-row call: a generator cannot be shared by a batch)."""
    u = torch.cat([torch.rand(1, generator=g) for g in generators])
    probs = logits.softmax(dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    picked = picked.clamp(max=logits.shape[1] - 1)
    # never a token of probability 0 (a float edge at the top of the CDF)
    zero = probs.gather(1, picked.unsqueeze(1)).squeeze(1) == 0
    if bool(zero.any()):
        picked = torch.where(zero, probs.argmax(dim=-1), picked)
    return picked


def sample(logits: torch.Tensor, rows: Sequence[SamplerRow],
           eos_ids: tuple[int, ...], top_logprobs: int = 0) -> Sampled:
    """Pick one token per row of float32 logits [S, V] (rows' own copy: changed in place)."""
    want = [i for i, r in enumerate(rows) if r.want_logprob]
    raw = take_rows(logits, want).log_softmax(dim=-1) if want else None
    process(logits, rows, eos_ids)
    # the first index of the row's maximum, as argmax (NaN counts as the maximum in both):
    # over 32 x 49,152 fp32 logits on 2 cores, 0.42 ms against argmax's 1.06
    tokens = logits.max(dim=-1).indices
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        warped = warp(take_rows(logits, sampled).clone() if len(sampled) < len(rows)
                      else logits, [rows[i].params for i in sampled])
        tokens[torch.tensor(sampled)] = draw(warped, [rows[i].generator for i in sampled])
    out = tokens.tolist()
    logprobs: list[float | None] = [None] * len(rows)
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    if raw is not None:
        chosen = raw.gather(1, tokens[torch.tensor(want)].unsqueeze(1))
        for k, i in enumerate(want):
            logprobs[i] = float(chosen[k, 0])
        if top_logprobs:
            values, ids = raw.topk(min(top_logprobs, raw.shape[1]), dim=-1)
            for k, i in enumerate(want):
                n = rows[i].params.top_logprobs
                top[i] = list(zip(ids[k, :n].tolist(), values[k, :n].tolist(), strict=True))
    return Sampled(out, logprobs, top)


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], top: int
                    ) -> list[tuple[float, list[tuple[int, float]]]]:
    """Logprob of each target token under the logits row before it, with `top`
    alternatives: [(logprob, [(token, logprob), …]), …]."""
    raw = logits.float().log_softmax(dim=-1)
    chosen = raw.gather(1, torch.tensor(targets, dtype=torch.long).unsqueeze(1))[:, 0].tolist()
    if not top:
        return [(c, []) for c in chosen]
    values, ids = raw.topk(min(top, raw.shape[1]), dim=-1)
    return [(c, list(zip(i, v, strict=True)))
            for c, i, v in zip(chosen, ids.tolist(), values.tolist(), strict=True)]


def find_stop(text: str, stops: tuple[str, ...], search_from: int) -> tuple[int, str] | None:
    """Where the earliest stop string starts in `text[search_from:]`, and which it is."""
    best: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s, max(0, search_from))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string.

    That many characters must not be streamed yet: the next token may complete a stop
    string, and stop strings are never part of the output.
    """
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold
