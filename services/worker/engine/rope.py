"""Rotary position embeddings with the scaling variants Llama-family checkpoints use.

Frequencies follow transformers' definitions exactly (the oracle tests depend on it):
`linear` divides positions by the factor, `dynamic` (NTK) grows the base once a sequence
passes `max_position_embeddings`, `llama3` rescales low frequencies by wavelength band.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def base_inv_freq(cfg: ModelConfig, theta: float | None = None) -> torch.Tensor:
    """Unscaled inverse frequencies, float32 [head_dim // 2]."""
    dim = cfg.head_dim
    base = cfg.rope.theta if theta is None else theta
    exps = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (base**exps)


def static_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies that do not depend on sequence length."""
    rope = cfg.rope
    inv = base_inv_freq(cfg)
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        old_ctx = rope.original_max_position_embeddings or cfg.max_position_embeddings
        low_wl = old_ctx / rope.low_freq_factor
        high_wl = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding:
    """Computes per-token cos/sin once per step, shared by all layers."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.inv_freq = static_inv_freq(cfg)
        self.dynamic = cfg.rope.rope_type == "dynamic"

    def _dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        cfg = self.cfg
        seq_len = max(seq_len, cfg.max_position_embeddings)
        dim = cfg.head_dim
        factor = cfg.rope.factor
        theta = cfg.rope.theta * (
            (factor * seq_len / cfg.max_position_embeddings) - (factor - 1)
        ) ** (dim / (dim - 2))
        return base_inv_freq(cfg, theta)

    def cos_sin(
        self, positions: torch.Tensor, seq_lens: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, head_dim] for flat token positions.

        `seq_lens` ([T], the length of each token's sequence after this step) is only used
        by dynamic scaling, whose base depends on how long the sequence has grown.
        """
        pos = positions.to(torch.float32)
        if self.dynamic and seq_lens is not None and int(seq_lens.max()) > (
            self.cfg.max_position_embeddings
        ):
            uniq, inverse = torch.unique(seq_lens, return_inverse=True)
            table = torch.stack([self._dynamic_inv_freq(int(n)) for n in uniq.tolist()])
            freqs = pos[:, None] * table[inverse]
        else:
            freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 out: torch.Tensor | None = None,
                 scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by per-token cos/sin [T, head_dim] (rotate-half layout).

    With `out` and `scratch` (both shaped like `x`) nothing is allocated; the products and
    the one sum are the same as without them (negating a product is exact), so the bits
    are too.
    """
    half = x.shape[-1] // 2
    if out is None or scratch is None:
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]
    torch.mul(x, cos[:, None, :], out=out)
    torch.mul(x[..., half:], sin[:, None, :half], out=scratch[..., :half]).neg_()
    torch.mul(x[..., :half], sin[:, None, half:], out=scratch[..., half:])
    return out.add_(scratch)
