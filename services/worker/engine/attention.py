"""Ragged causal attention over the paged KV cache for one mixed step.

A step holds decode tokens (one query per sequence) and prefill chunks (many queries per
sequence). On the CPU in fp32 or bf16, a step's decodes attend in one compiled call per
layer that reads the paged cache in place (`loraplane_kernels.cpu_decode.decode_attention`).
Elsewhere they are batched, in a few groups of similar context length, into grouped
matmuls over their gathered block tables. Each prefill chunk is one SDPA call (flash path
when it has no cached prefix). There is no per-token Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from loraplane_kernels import cpu_decode

from .workspace import Workspace

HOST_DECODE = cpu_decode.AVAILABLE
"""CPU decodes in fp32 or bf16 take the compiled kernel; tests and the bench switch it off
to pin it to (or time it against) the torch path."""


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk inside the flat token batch."""

    row_start: int
    q_len: int
    prefix_len: int
    """Tokens of this sequence already in the cache before the chunk."""
    ctx_slots: torch.Tensor | None = None
    """Flat cache slots of the context the chunk attends to, positions `ctx_start` to
    prefix_len + q_len; None when prefix_len == 0 (the chunk's own K/V are the context)."""
    ctx_start: int = 0
    """Position of `ctx_slots[0]`: past 0 when blocks before a sliding window are freed."""
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict, repr=False)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """Which context positions each query sees (bool [q_len, context]), made once per
        step and window; None where plain causal attention over the chunk is the answer."""
        if window is not None and self.prefix_len + self.q_len <= window:
            window = None  # nothing of this chunk's context is outside the window
        if window not in self._masks:
            if self.ctx_slots is None and window is None:
                self._masks[window] = None
            else:
                q_pos = torch.arange(self.q_len, device=device)[:, None] + self.prefix_len
                k_pos = torch.arange(self.ctx_start, self.prefix_len + self.q_len,
                                     device=device)[None, :]
                seen = k_pos <= q_pos
                if window is not None:
                    seen &= k_pos > q_pos - window
                self._masks[window] = seen
        return self._masks[window]


@dataclass
class DecodeGroup:
    """Decodes of similar context length, attended as one padded batch."""

    rows: torch.Tensor  # [B] rows of decode tokens
    slots: torch.Tensor  # [B, L] flat slots, padded to the group's longest context
    mask: torch.Tensor  # [1, B, 1, L] additive float mask
    lens: torch.Tensor  # [B] context lengths
    _bias: dict[tuple[int | None, torch.dtype], torch.Tensor] = field(default_factory=dict,
                                                                      repr=False)

    def scores_bias(self, kv_heads: int, group: int, dtype: torch.dtype,
                    window: int | None = None) -> torch.Tensor:
        """The mask laid out as the scores' [KVH * B, G, L] batches, made once per step and
        window (every layer of the same window adds the same one)."""
        key = (window, dtype)
        bias = self._bias.get(key)
        if bias is None or bias.shape[0] != kv_heads * self.rows.shape[0] or \
                bias.shape[1] != group:
            b, length = self.mask.shape[1], self.mask.shape[-1]
            mask = self.mask.view(b, length)
            if window is not None:
                pos = torch.arange(length, device=mask.device)[None, :]
                mask = mask.masked_fill(pos < self.lens[:, None] - window, float("-inf"))
            bias = mask.to(dtype).view(1, b, 1, length).expand(
                kv_heads, b, group, length).reshape(kv_heads * b, group, length)
            self._bias[key] = bias
        return bias


DECODE_GROUP_MIN = 8
"""Fewest decodes in a length group: below that one more gather and matmul per layer cost
more than the padding they would skip."""


@dataclass
class AttentionMetadata:
    """Per-step layout, built once and shared by every layer."""

    decode_rows: torch.Tensor | None = None  # [B] rows of all decode tokens
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    host_decodes: cpu_decode.DecodePlan | None = None
    """All decodes for the compiled CPU kernel (then `decodes` stays empty)."""

    def finalize(
        self,
        decode_rows: list[int],
        decode_tables: list[list[int]],
        decode_lens: list[int],
        block_size: int,
        dtype: torch.dtype,
        groups: int = 4,
        device: torch.device | None = None,
    ) -> None:
        """Build the decodes' plan for the compiled kernel on the CPU (`device` None is the
        CPU) or their padded slot tables elsewhere (prefill masks are made on first use).
        A block freed outside a sliding window is -1 in its table.

        Decodes are sorted by context length and cut into up to `groups` groups of at
        least `DECODE_GROUP_MIN`, each padded only to its own longest context: with
        contexts of 16 to 640 tokens one table padded to the longest gathered and
        multiplied about twice the K/V there is.
        """
        if not decode_rows:
            return
        self.decode_rows = torch.tensor(decode_rows, dtype=torch.long)
        if HOST_DECODE and dtype in cpu_decode.DTYPES and (device is None or device.type == "cpu"):
            self.host_decodes = cpu_decode.DecodePlan(decode_rows, decode_tables, decode_lens,
                                                block_size)
            return
        order = sorted(range(len(decode_rows)), key=lambda i: decode_lens[i])
        size = max(DECODE_GROUP_MIN, -(-len(order) // groups))
        for lo in range(0, len(order), size):
            part = order[lo:lo + size]
            if len(order) - (lo + size) < DECODE_GROUP_MIN // 2:  # no tiny tail group
                part = order[lo:]
            self.decodes.append(_decode_group([decode_rows[i] for i in part],
                                              [decode_tables[i] for i in part],
                                              [decode_lens[i] for i in part], block_size,
                                              dtype))
            if len(part) > size:
                break

    def to(self, device: torch.device) -> AttentionMetadata:
        """Move the index and mask tensors next to the KV cache (no-op on CPU)."""
        if device.type == "cpu":
            return self
        for span in self.prefills:
            if span.ctx_slots is not None:
                span.ctx_slots = span.ctx_slots.to(device, non_blocking=True)
        if self.decode_rows is not None:
            self.decode_rows = self.decode_rows.to(device, non_blocking=True)
        self.decodes = [DecodeGroup(*(t.to(device, non_blocking=True)
                                      for t in (g.rows, g.slots, g.mask, g.lens)))
                        for g in self.decodes]
        return self


def _decode_group(rows: list[int], tables: list[list[int]], lens: list[int],
                  block_size: int, dtype: torch.dtype) -> DecodeGroup:
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    table.clamp_(min=0)  # a block freed outside a window: read as block 0, then masked
    lmax = max(lens)
    slots = (table[:, :, None] * block_size + torch.arange(block_size)).flatten(1)
    length = torch.tensor(lens, dtype=torch.long)
    mask = torch.zeros(len(rows), lmax, dtype=dtype)
    mask.masked_fill_(torch.arange(lmax)[None, :] >= length[:, None], float("-inf"))
    return DecodeGroup(torch.tensor(rows, dtype=torch.long), slots[:, :lmax].contiguous(),
                       mask[None, :, None, :], length)


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    workspace: Workspace | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention for all T tokens of a step: q [T, H, D]; caches [KVH, slots, D].

    The step's new K/V must already be written to the cache (decodes read them from it).
    `window` is a sliding-window layer's (a query at position p sees keys after p - window,
    transformers' rule); `softcap` soft-caps the scaled scores (``cap * tanh(s / cap)``).
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
        else:
            ks = k_cache[:, span.ctx_slots].unsqueeze(0)  # [1, KVH, L, D]
            vs = v_cache[:, span.ctx_slots].unsqueeze(0)
        mask = span.mask(window, q.device)
        if softcap is not None:
            o = _capped_attention(qs, ks, vs, mask, scale, softcap)
        elif mask is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    if meta.host_decodes is not None:
        cpu_decode.decode_attention(q, k_cache, v_cache, out, meta.host_decodes, scale, window,
                              softcap)
    for g in meta.decodes:
        b = g.rows.shape[0]
        # kv-head-major throughout: gathers land contiguous, K^T is a free transpose
        # index_select / index_copy_ rather than q[rows] / out[rows] = ...: advanced
        # indexing cost 200-300 us a call on a 48-decode step, these a tenth of that
        qd = q.index_select(0, g.rows).view(b, kv_heads, group, dim).transpose(0, 1)
        kd = gather_slots(k_cache, g.slots, workspace, "decode_k")  # [KVH, B, L, D]
        vd = gather_slots(v_cache, g.slots, workspace, "decode_v")
        length = kd.shape[2]
        bias = g.scores_bias(kv_heads, group, qd.dtype, window)
        k_t = kd.view(kv_heads * b, length, dim).transpose(1, 2)
        if softcap is None:
            # mask + scale * q @ K^T in one BLAS call ([KVH*B] batches of [G, D] @ [D, L])
            scores = torch.baddbmm(bias, qd.reshape(kv_heads * b, group, dim), k_t,
                                   alpha=scale)
        else:
            scores = torch.bmm(qd.reshape(kv_heads * b, group, dim), k_t).mul_(scale)
            scores = torch.tanh(scores / softcap).mul_(softcap).add_(bias)
        probs = torch.softmax(scores.float(), dim=-1).to(qd.dtype)
        ctx = torch.bmm(probs, vd.view(kv_heads * b, length, dim))  # [KVH*B, G, D]
        out.index_copy_(0, g.rows, ctx.view(kv_heads, b, group * dim)
                        .transpose(0, 1).reshape(b, heads, dim))
    return out


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, scale: float, softcap: float) -> torch.Tensor:
    """Attention with soft-capped scores, in transformers' eager order (SDPA has no
    soft-capping): scale, ``cap * tanh(s / cap)``, mask, fp32 softmax, weighted sum.
    q [1, H, Lq, D]; k, v [1, KVH, L, D]; mask bool [Lq, L] or None (causal)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


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
