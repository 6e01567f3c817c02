"""Rotary position embeddings with the scaling variants the served families use.

Frequencies follow transformers' definitions exactly (the oracle tests depend on it):
`linear` divides positions by the factor, `dynamic` (NTK) grows the base once a sequence
passes `max_position_embeddings`, `llama3` rescales low frequencies by wavelength band,
`yarn` blends interpolated and extrapolated frequencies by a ramp and scales cos/sin,
`longrope` switches from its short to its long factors once a sequence passes the
pretraining length. A partial rotary factor rotates only the first dimensions of a head.
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    return int(head_dim * rope.partial_rotary_factor)


def base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """Unscaled inverse frequencies, float32 [dim // 2]."""
    exps = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exps)


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    orig = rope.original_max_position_embeddings
    assert orig is not None

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attention


def _longrope_attention(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor
    orig = rope.original_max_position_embeddings
    assert orig is not None
    if rope.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(orig))


def _longrope(rope: RopeConfig, dim: int, factors: tuple[float, ...]) -> torch.Tensor:
    ext = torch.tensor(factors, dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * rope.theta**shape)


def static_inv_freq(rope: RopeConfig, dim: int, max_positions: int
                    ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies that do not depend on sequence length, and the factor cos and
    sin are multiplied by (1 but for yarn and longrope)."""
    inv = base_inv_freq(dim, rope.theta)
    if rope.rope_type == "linear":
        return inv / rope.factor, 1.0
    if rope.rope_type == "llama3":
        old_ctx = rope.original_max_position_embeddings or max_positions
        low_wl = old_ctx / rope.low_freq_factor
        high_wl = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim)
    if rope.rope_type == "longrope":
        return _longrope(rope, dim, rope.short_factor), _longrope_attention(rope)
    return inv, 1.0


class RotaryEmbedding:
    """Computes per-token cos/sin once per step, shared by all layers of one rope."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        self.rope = rope
        self.dim = rotary_dim(rope, head_dim)
        self.max_positions = max_positions
        self.inv_freq, self.attention = static_inv_freq(rope, self.dim, max_positions)
        self.dynamic = rope.rope_type == "dynamic"
        self.long_inv_freq = _longrope(rope, self.dim, rope.long_factor) \
            if rope.rope_type == "longrope" else None

    def _dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        seq_len = max(seq_len, self.max_positions)
        factor, dim = self.rope.factor, self.dim
        theta = self.rope.theta * (
            (factor * seq_len / self.max_positions) - (factor - 1)
        ) ** (dim / (dim - 2))
        return base_inv_freq(dim, theta)

    def cos_sin(
        self, positions: torch.Tensor, seq_lens: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, rotary dim] for flat token positions.

        `seq_lens` ([T], the length of each token's sequence after this step) is used by
        dynamic scaling, whose base depends on how long the sequence has grown, and by
        longrope, whose factors switch once it passes the pretraining length.
        """
        pos = positions.to(torch.float32)
        if self.dynamic and seq_lens is not None and int(seq_lens.max()) > self.max_positions:
            uniq, inverse = torch.unique(seq_lens, return_inverse=True)
            table = torch.stack([self._dynamic_inv_freq(int(n)) for n in uniq.tolist()])
            freqs = pos[:, None] * table[inverse]
        elif self.long_inv_freq is not None and seq_lens is not None:
            orig = self.rope.original_max_position_embeddings
            long = (seq_lens > orig)[:, None]
            freqs = pos[:, None] * torch.where(long, self.long_inv_freq[None, :],
                                               self.inv_freq[None, :])
        else:
            freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention != 1.0:
            cos, sin = cos * self.attention, sin * self.attention
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 out: torch.Tensor | None = None,
                 scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by per-token cos/sin [T, rotary dim] (rotate-half
    layout); dimensions past the rotary dim pass through unchanged.

    With `out` and `scratch` (both shaped like `x`) nothing is allocated; the products and
    the one sum are the same as without them (negating a product is exact), so the bits
    are too.
    """
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        res = torch.empty_like(x) if out is None else out
        res[..., rot:] = x[..., rot:]
        apply_rotary(x[..., :rot], cos, sin, out=res[..., :rot],
                     scratch=None if scratch is None else scratch[..., :rot])
        return res
    half = rot // 2
    if out is None or scratch is None:
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        result = x * cos[:, None, :] + rotated * sin[:, None, :]
        if out is not None:
            out.copy_(result)
            return out
        return result
    torch.mul(x, cos[:, None, :], out=out)
    torch.mul(x[..., half:], sin[:, None, :half], out=scratch[..., :half]).neg_()
    torch.mul(x[..., :half], sin[:, None, half:], out=scratch[..., half:])
    return out.add_(scratch)
