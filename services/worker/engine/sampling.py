"""Next-token selection and stop-string handling.

Each request owns a `torch.Generator` seeded from its seed, advanced once per sampled
token, so a seeded request's output does not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from .request import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    mask_eos: list[bool],
    eos_ids: tuple[int, ...],
) -> list[int]:
    """Pick one token per row of float32 logits [S, V].

    Greedy rows are one batched argmax; sampled rows apply temperature, top-p (nucleus)
    and draw with the row's own generator.
    """
    if eos_ids and any(mask_eos):
        rows = torch.tensor([i for i, m in enumerate(mask_eos) if m], dtype=torch.long)
        logits = logits.clone()
        logits[rows[:, None], torch.tensor(eos_ids, dtype=torch.long)[None, :]] = float("-inf")
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            keep = cum - sorted_p < p.top_p  # always keeps the most likely token
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            choice = torch.multinomial(sorted_p, 1, generator=generators[i])
            out[i] = int(order[choice])
        else:
            out[i] = int(torch.multinomial(probs, 1, generator=generators[i]))
    return out


def find_stop(text: str, stops: tuple[str, ...], search_from: int) -> int | None:
    """Index where the earliest stop string starts in `text[search_from:]`, if any."""
    best: int | None = None
    for s in stops:
        pos = text.find(s, max(0, search_from))
        if pos != -1 and (best is None or pos < best):
            best = pos
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
