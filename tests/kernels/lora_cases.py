"""Random multi-LoRA problems shared by the reference tests and the interpreted kernel tests.

Each case is small (the Triton interpreter runs every program in numpy) but covers the
shapes that break kernels: rank 1, odd ranks, a rank-0 slot, slot -1 for every token, a
single token, an empty segment, mixed ranks in one batch and the largest supported rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from loraplane_kernels import PooledLora, Segments

#: Allowed ``max|got - oracle| / max|oracle|`` per dtype. fp16/bf16 round x, A, B on input
#: (the oracle sees the same rounded values), round h to the weight dtype before the
#: tensor-core expand, and round y on output; bf16 keeps 8 bits of mantissa.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPES = tuple(TOLERANCE)


@dataclass(frozen=True)
class CaseSpec:
    name: str
    ranks: list[int]
    lengths: list[int]          # tokens per segment (BGMV uses them shuffled per token)
    slots: list[int]            # slot per segment, -1 = no LoRA
    in_features: int = 40
    out_features: int = 48
    max_rank: int | None = None  # slab padding; defaults to max(ranks) + 3
    extra: dict[str, int] = field(default_factory=dict)


CASES = [
    CaseSpec("rank1", ranks=[1, 1], lengths=[3, 4], slots=[0, 1]),
    CaseSpec("odd_ranks", ranks=[3, 7, 13, 31], lengths=[2, 5, 1, 6], slots=[3, 0, 2, 1],
             in_features=37, out_features=53),
    CaseSpec("mixed_ranks", ranks=[2, 16, 5, 33, 8], lengths=[4, 9, 3, 2, 6],
             slots=[1, 3, 0, 4, 2], max_rank=40),
    CaseSpec("minus_one_everywhere", ranks=[4, 9], lengths=[5, 3], slots=[-1, -1]),
    CaseSpec("single_token", ranks=[6], lengths=[1], slots=[0]),
    CaseSpec("empty_segment_and_empty_slot", ranks=[5, 0, 12], lengths=[3, 0, 4, 2, 0, 3],
             slots=[0, 2, 1, -1, 0, 2]),
    CaseSpec("rank128", ranks=[128, 1], lengths=[3, 2], slots=[0, 1], in_features=24,
             out_features=20, max_rank=128),
]
CASE_IDS = [c.name for c in CASES]


@dataclass(frozen=True)
class Problem:
    x: Tensor
    y: Tensor
    a_slab: Tensor
    b_slab: Tensor
    ranks: Tensor
    scales: Tensor
    indices: Tensor
    segments: Segments
    out_offset: int

    def to(self, dtype: torch.dtype) -> Problem:
        """Same problem with activations and weights in ``dtype`` (routing unchanged)."""
        return Problem(self.x.to(dtype), self.y.to(dtype), self.a_slab.to(dtype),
                       self.b_slab.to(dtype), self.ranks, self.scales, self.indices,
                       self.segments, self.out_offset)


def build(spec: CaseSpec, seed: int = 0, *, shuffle_tokens: bool = False) -> Problem:
    """Random float64 problem for ``spec``; padded slab rows hold garbage (NaN-free but huge)
    so that any read past a slot's rank shows up as a large error."""
    g = torch.Generator().manual_seed(seed)
    num_slots = len(spec.ranks)
    max_rank = spec.max_rank or max(spec.ranks) + 3
    k, n = spec.in_features, spec.out_features
    a_slab = torch.full((num_slots, max_rank, k), 1e4, dtype=torch.float64)
    b_slab = torch.full((num_slots, n, max_rank), 1e4, dtype=torch.float64)
    for s, r in enumerate(spec.ranks):
        a_slab[s, :r] = torch.randn(r, k, generator=g, dtype=torch.float64) / k**0.5
        b_slab[s, :, :r] = torch.randn(n, r, generator=g, dtype=torch.float64)
    num_tokens = sum(spec.lengths)
    segments = Segments.from_lengths(spec.lengths, spec.slots)
    indices = segments.token_indices()
    if shuffle_tokens:
        indices = indices[torch.randperm(num_tokens, generator=g)]
    out_offset = 5
    y = torch.randn(num_tokens, n + 2 * out_offset + 1, generator=g, dtype=torch.float64)
    return Problem(
        x=torch.randn(num_tokens, k, generator=g, dtype=torch.float64),
        y=y,
        a_slab=a_slab,
        b_slab=b_slab,
        ranks=torch.tensor(spec.ranks, dtype=torch.int32),
        scales=(torch.rand(num_slots, generator=g) + 0.5).to(torch.float32),
        indices=indices.contiguous(),
        segments=segments,
        out_offset=out_offset,
    )


def relative_error(got: Tensor, want: Tensor) -> float:
    """``max|got - want| / max|want|`` (0 when both are all zeros)."""
    denom = want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    return err if denom == 0 else err / denom


def naive_apply(p: Problem) -> Tensor:
    """Per-token loop straight from the definition, independent of the reference's grouping."""
    y = p.y.clone()
    off = p.out_offset
    for t in range(p.x.shape[0]):
        s = int(p.indices[t])
        if s < 0:
            continue
        r = int(p.ranks[s])
        h = p.a_slab[s, :r] @ p.x[t]
        y[t, off:off + p.b_slab.shape[1]] += float(p.scales[s]) * (p.b_slab[s, :, :r] @ h)
    return y


def pooled(p: Problem) -> PooledLora:
    """The same weights packed rank-granular into one pool, in reverse slot order and with
    garbage between extents, so reads at a wrong offset or past a rank show up."""
    k, n = p.a_slab.shape[2], p.b_slab.shape[1]
    ranks = p.ranks.tolist()
    gap = 7
    pool = torch.full((sum(r * (k + n) + 2 * gap for r in ranks) + gap,), 1e4,
                      dtype=p.a_slab.dtype)
    w = PooledLora(pool, k, n, len(ranks))
    cursor = gap
    for s in reversed(range(len(ranks))):
        r = ranks[s]
        if r == 0:
            continue
        a_off, b_off = cursor, cursor + r * k + gap
        pool[a_off:a_off + r * k] = p.a_slab[s, :r].reshape(-1)
        pool[b_off:b_off + r * n] = p.b_slab[s, :, :r].T.reshape(-1)
        w.place(s, a_off, b_off, r, float(p.scales[s]))
        cursor = b_off + r * n + gap
    return w
