"""Ragged causal attention over the paged KV cache for one mixed step.

A step holds decode tokens (one query per sequence) and prefill chunks (many queries per
sequence). Decodes are batched into one grouped matmul over their gathered block tables;
each prefill chunk is one SDPA call (flash path when it has no cached prefix). There is no
per-token Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .workspace import Workspace


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk inside the flat token batch."""

    row_start: int
    q_len: int
    prefix_len: int
    """Tokens of this sequence already in the cache before the chunk."""
    ctx_slots: torch.Tensor | None = None
    """Flat cache slots of prefix + chunk [prefix_len + q_len]; None when prefix_len == 0."""
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Per-step layout, built once and shared by every layer."""

    decode_rows: torch.Tensor | None = None  # [B] rows of decode tokens
    decode_slots: torch.Tensor | None = None  # [B, Lmax] flat slots, padded
    decode_mask: torch.Tensor | None = None  # [1, B, 1, Lmax] additive float mask
    prefills: list[PrefillSpan] = field(default_factory=list)

    def finalize(
        self,
        decode_rows: list[int],
        decode_tables: list[list[int]],
        decode_lens: list[int],
        block_size: int,
        dtype: torch.dtype,
    ) -> None:
        """Build masks for prefill spans and the padded slot table for decodes."""
        for span in self.prefills:
            if span.prefix_len:
                total = span.prefix_len + span.q_len
                q_pos = torch.arange(span.q_len)[:, None] + span.prefix_len
                span.mask = torch.arange(total)[None, :] <= q_pos
        if not decode_rows:
            return
        width = max(len(t) for t in decode_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables],
                              dtype=torch.long)
        lmax = max(decode_lens)
        slots = (tables[:, :, None] * block_size + torch.arange(block_size)).flatten(1)
        lens = torch.tensor(decode_lens, dtype=torch.long)
        mask = torch.zeros(len(decode_rows), lmax, dtype=dtype)
        mask.masked_fill_(torch.arange(lmax)[None, :] >= lens[:, None], float("-inf"))
        self.decode_rows = torch.tensor(decode_rows, dtype=torch.long)
        self.decode_slots = slots[:, :lmax].contiguous()
        self.decode_mask = mask[None, :, None, :]

    def to(self, device: torch.device) -> AttentionMetadata:
        """Move the index and mask tensors next to the KV cache (no-op on CPU)."""
        if device.type == "cpu":
            return self
        for span in self.prefills:
            if span.ctx_slots is not None:
                span.ctx_slots = span.ctx_slots.to(device, non_blocking=True)
            if span.mask is not None:
                span.mask = span.mask.to(device, non_blocking=True)
        for name in ("decode_rows", "decode_slots", "decode_mask"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device, non_blocking=True))
        return self


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Attention for all T tokens of a step: q [T, H, D]; caches [KVH, slots, D].

    The step's new K/V must already be written to the cache (decodes read them from it).
    Returns [T, H, D]; with a `workspace` the output and the decodes' gathered K/V are
    written into its buffers (valid until the next layer's call).
    """
    t, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    out = torch.empty_like(q) if workspace is None else workspace.take("attn", t, heads, dim)
    for span in meta.prefills:
        rows = slice(span.row_start, span.row_start + span.q_len)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
        if span.ctx_slots is None:
            ks = k_new[rows].transpose(0, 1).unsqueeze(0)
            vs = v_new[rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            ks = k_cache[:, span.ctx_slots].unsqueeze(0)  # [1, KVH, L, D]
            vs = v_cache[:, span.ctx_slots].unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, scale=scale,
                                               enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    if meta.decode_rows is not None:
        assert meta.decode_slots is not None and meta.decode_mask is not None
        b = meta.decode_rows.shape[0]
        # kv-head-major throughout: gathers land contiguous, K^T is a free transpose
        qd = q[meta.decode_rows].view(b, kv_heads, group, dim).transpose(0, 1)  # [KVH,B,G,D]
        kd = gather_slots(k_cache, meta.decode_slots, workspace, "decode_k")  # [KVH, B, L, D]
        vd = gather_slots(v_cache, meta.decode_slots, workspace, "decode_v")
        scores = torch.matmul(qd, kd.transpose(-1, -2)) * scale + meta.decode_mask.to(qd.dtype)
        probs = torch.softmax(scores.float(), dim=-1).to(qd.dtype)
        ctx = torch.matmul(probs, vd)  # [KVH, B, G, D]
        out[meta.decode_rows] = ctx.transpose(0, 1).reshape(b, heads, dim)
    return out


def gather_slots(cache: torch.Tensor, slots: torch.Tensor, workspace: Workspace | None,
                 role: str) -> torch.Tensor:
    """cache [KVH, slots, D] at slots [B, L] -> [KVH, B, L, D].

    One `index_select` over the flattened table (row copies of D elements) into a reused
    buffer: about half the time of advanced indexing with a 2-D index into a fresh tensor.
    """
    b, length = slots.shape
    kv_heads, _, dim = cache.shape
    flat = slots.view(-1)
    if workspace is None:
        return cache.index_select(1, flat).view(kv_heads, b, length, dim)
    out = workspace.take(role, kv_heads, b * length, dim, dtype=cache.dtype)
    return torch.index_select(cache, 1, flat, out=out).view(kv_heads, b, length, dim)
