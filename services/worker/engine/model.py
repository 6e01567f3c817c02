"""Llama-family decoder that runs one flat, ragged batch per step over the paged cache.

All tokens of a step (prefill chunks and decodes of many sequences, many adapters) go
through each projection as one [T, hidden] matmul; q|k|v and gate|up are fused so the
base model costs two matmuls fewer per layer, and LoRA deltas are added into the fused
outputs at column offsets by the multi-LoRA kernels.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplane_kernels.threads import one_thread

from .adapter_pool import AdapterPool
from .attention import AttentionMetadata, paged_attention
from .checkpoint import load_checkpoint, load_tokenizer
from .config import ModelConfig
from .kv_cache import KVStorage
from .lora_ops import Runs, Segments
from .rope import RotaryEmbedding, apply_rotary
from .workspace import Workspace

SERIAL_TOKENS = 128
"""Steps of at most this many tokens run the per-layer elementwise ops (RMSNorm, rope,
the cache write, SwiGLU, residual adds) in the calling thread only; the matmuls, LoRA and
attention keep every intra-op thread. Those ops at SmolLM2's shapes on 2 cores, one thread
against two, per layer: at 64 tokens 0.36 ms against 1.2 CPU-ms (1.4 ms wall) with
`OMP_WAIT_POLICY=PASSIVE` (waking the sleeping thread costs more than the op), 0.26 ms
against 0.45 ms wall with spinning threads; at 128 tokens, spinning, the same wall time
(0.63 and 0.60 ms) at half the CPU time; at 256 tokens two spinning threads are faster.
Every op works row by row, so the bits do not depend on the thread count. 0 turns it off."""


@dataclass
class ForwardBatch:
    """Everything one step's forward needs, built by the engine from the schedule."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [T] length of each token's sequence after the step (dynamic rope)
    slot_mapping: torch.Tensor  # [T] flat KV slot per token
    attention: AttentionMetadata
    logits_rows: torch.Tensor  # [S] rows whose next-token logits are needed
    lora_indices: torch.Tensor | None = None  # [T] int32 slot, -1 = base
    lora_segments: Segments | None = None  # set when the step has prefill (SGMV)
    lora_slots: tuple[int, ...] = ()  # distinct slots >= 0 in the step
    lora_runs: Runs | None = None  # host (slot, start, end) runs: the torch path's groups
    fused_from: int | None = None
    """Rows from here on are small adapter buckets served by the fused base + LoRA kernel
    (`fused_segments`, relative to this row); rows before it take the separate path."""
    fused_segments: Segments | None = None

    def to(self, device: torch.device) -> ForwardBatch:
        """Move device-side tensors; positions stay on the host for the rope tables."""
        if device.type == "cpu":
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        seg, fseg = self.lora_segments, self.fused_segments
        return ForwardBatch(
            input_ids=move(self.input_ids),  # type: ignore[arg-type]
            positions=self.positions,
            seq_lens=self.seq_lens,
            slot_mapping=move(self.slot_mapping),  # type: ignore[arg-type]
            attention=self.attention.to(device),
            logits_rows=move(self.logits_rows),  # type: ignore[arg-type]
            lora_indices=move(self.lora_indices),
            lora_segments=None if seg is None else Segments(
                move(seg.starts), move(seg.slots)),  # type: ignore[arg-type]
            lora_slots=self.lora_slots,
            lora_runs=self.lora_runs,
            fused_from=self.fused_from,
            fused_segments=None if fseg is None else Segments(
                move(fseg.starts), move(fseg.slots)),  # type: ignore[arg-type]
        )


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor  # [q + 2kv, hidden]
    o: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor
    qkv_bias: torch.Tensor | None = None  # [q + 2kv]
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None, scratch: torch.Tensor | None = None
             ) -> torch.Tensor:
    """RMSNorm computed in float32, as transformers does, then cast back.

    With `out` the result is written there and with `scratch` (float32, shaped like `x`)
    the squares too: the same ops, so the same bits as without.
    """
    xf = x.float()
    sq = xf.pow(2) if scratch is None else torch.pow(xf, 2, out=scratch)
    inv = torch.rsqrt(sq.mean(-1, keepdim=True) + eps)
    if out is None:
        return weight * (xf * inv).to(x.dtype)
    if x.dtype == xf.dtype:
        torch.mul(xf, inv, out=out)
    else:
        out.copy_(xf * inv)
    return out.mul_(weight)


class LlamaModel:
    """Weights plus a forward over `ForwardBatch`; stateless between steps (the workspace
    holds scratch only, overwritten by every step)."""

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: dict[str, torch.Tensor],
        digest: str,
        tokenizer: object | None = None,
    ) -> None:
        self.cfg = cfg
        self.digest = digest
        self.tokenizer = tokenizer
        self.dtype = tensors["model.embed_tokens.weight"].dtype
        self.device = tensors["model.embed_tokens.weight"].device
        self.embed = tensors["model.embed_tokens.weight"]
        self.norm = tensors["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else tensors["lm_head.weight"]
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                LayerWeights(
                    input_norm=tensors[p + "input_layernorm.weight"],
                    post_norm=tensors[p + "post_attention_layernorm.weight"],
                    qkv=torch.cat([tensors[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                    o=tensors[p + "self_attn.o_proj.weight"],
                    gate_up=torch.cat(
                        [tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]]
                    ),
                    down=tensors[p + "mlp.down_proj.weight"],
                    qkv_bias=torch.cat([tensors[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
                    if cfg.qkv_bias else None,
                    o_bias=tensors[p + "self_attn.o_proj.bias"] if cfg.o_bias else None,
                    gate_up_bias=torch.cat([tensors[p + "mlp.gate_proj.bias"],
                                            tensors[p + "mlp.up_proj.bias"]])
                    if cfg.mlp_bias else None,
                    down_bias=tensors[p + "mlp.down_proj.bias"] if cfg.mlp_bias else None,
                )
            )
        self.rope = RotaryEmbedding(cfg)
        self.scale = cfg.head_dim**-0.5
        self.workspace = Workspace(self.dtype, self.device)
        """Step activations are written into reused buffers (see `Workspace`)."""

    def projection_weight(self, layer: int, module: str) -> torch.Tensor:
        """The [out, in] weight of one projection: a view into the fused q|k|v or gate|up
        matrix where the module is packed there, so writing it changes what forward uses."""
        w = self.layers[layer]
        qs, ks, inter = self.cfg.q_size, self.cfg.kv_size, self.cfg.intermediate_size
        rows = {"q_proj": (w.qkv, 0, qs), "k_proj": (w.qkv, qs, qs + ks),
                "v_proj": (w.qkv, qs + ks, qs + 2 * ks), "o_proj": (w.o, 0, w.o.shape[0]),
                "gate_proj": (w.gate_up, 0, inter), "up_proj": (w.gate_up, inter, 2 * inter),
                "down_proj": (w.down, 0, w.down.shape[0])}
        t, lo, hi = rows[module]
        return t[lo:hi]

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu") -> LlamaModel:
        """Load config, weights (validated, digested) and tokenizer from an HF directory."""
        ckpt = load_checkpoint(model_dir, dtype, device)
        return cls(ckpt.config, ckpt.tensors, ckpt.digest, load_tokenizer(model_dir))

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVStorage, adapters: AdapterPool | None = None
    ) -> torch.Tensor:
        """Run one step; writes new K/V into `kv` and returns float32 logits [S, vocab]."""
        cfg = self.cfg
        t = batch.input_ids.shape[0]
        qs, ks = cfg.q_size, cfg.kv_size
        inter = cfg.intermediate_size
        batch = batch.to(self.device)
        cos, sin = self.rope.cos_sin(batch.positions, batch.seq_lens, self.dtype)
        cos, sin = cos.to(self.device), sin.to(self.device)
        use_lora = adapters is not None and bool(batch.lora_slots) and (
            batch.lora_indices is not None
        )
        idx, seg, slots = batch.lora_indices, batch.lora_segments, list(batch.lora_slots)
        runs, split = batch.lora_runs, batch.fused_from

        ws = self.workspace

        def project(layer: int, x: torch.Tensor, weight: torch.Tensor,
                    modules: tuple[tuple[str, int], ...], role: str,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
            """Base projection (+ bias, as `nn.Linear` adds it) plus LoRA deltas (at column
            offsets of packed outputs, after the bias: PEFT's order)."""
            y = ws.take(role, t, weight.shape[0])
            if split is None:
                if bias is None:
                    torch.mm(x, weight.t(), out=y)
                else:
                    torch.addmm(bias, x, weight.t(), out=y)
                if use_lora:
                    for module, off in modules:
                        if adapters.layer_has_lora(layer, module, slots):  # type: ignore[union-attr]
                            adapters.apply(layer, module, y, x, idx, seg, off, runs)  # type: ignore[union-attr,arg-type]
                return y
            # two-level batching: large buckets separate, small ones fused (rows >= split)
            if split:
                torch.mm(x[:split], weight.t(), out=y[:split])  # bias added below
                for module, off in modules:
                    if adapters.layer_has_lora(layer, module, slots):  # type: ignore[union-attr]
                        adapters.apply(layer, module, y[:split], x[:split], idx[:split], seg,  # type: ignore[union-attr,index]
                                       off)
            for module, off in modules:
                adapters.apply_fused_base(  # type: ignore[union-attr]
                    layer, module, y[split:], x[split:], self.projection_weight(layer, module),
                    batch.fused_segments, off)  # type: ignore[arg-type]
            if bias is not None:  # after the deltas here: rounding order only differs
                y += bias
            return y

        heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv_mods = (("q_proj", 0), ("k_proj", qs), ("v_proj", qs + ks))
        gate_up_mods = (("gate_proj", 0), ("up_proj", inter))
        serial = one_thread if t <= SERIAL_TOKENS and self.device.type == "cpu" else (
            contextlib.nullcontext)
        norm_sq = ws.take("norm_sq", t, cfg.hidden_size, dtype=torch.float32)
        with serial():
            h = torch.index_select(self.embed, 0, batch.input_ids,
                                   out=ws.take("hidden", t, cfg.hidden_size))
        for li, w in enumerate(self.layers):
            with serial():
                x = rms_norm(h, w.input_norm, cfg.rms_norm_eps, out=ws.take("norm", *h.shape),
                             scratch=norm_sq)
            qkv = project(li, x, w.qkv, qkv_mods, "qkv", w.qkv_bias)
            with serial():
                q = apply_rotary(qkv[:, :qs].view(t, heads, dim), cos, sin,
                                 out=ws.take("q", t, heads, dim),
                                 scratch=ws.take("rope", t, heads, dim))
                k = apply_rotary(qkv[:, qs : qs + ks].view(t, kv_heads, dim), cos, sin,
                                 out=ws.take("k", t, kv_heads, dim),
                                 scratch=ws.take("rope", t, kv_heads, dim))
                v = qkv[:, qs + ks :].view(t, kv_heads, dim)
                kv.write(li, batch.slot_mapping, k, v)
            attn = paged_attention(q, k, v, kv.k[li], kv.v[li], batch.attention, self.scale,
                                   workspace=ws, window=cfg.window(li))
            delta = project(li, attn.view(t, qs), w.o, (("o_proj", 0),), "delta", w.o_bias)
            with serial():
                h.add_(delta)
                x = rms_norm(h, w.post_norm, cfg.rms_norm_eps, out=ws.take("norm", *h.shape),
                             scratch=norm_sq)
            gu = project(li, x, w.gate_up, gate_up_mods, "gate_up", w.gate_up_bias)
            with serial():
                act = torch.mul(F.silu(gu[:, :inter], inplace=True), gu[:, inter:],
                                out=ws.take("act", t, inter))
            delta = project(li, act, w.down, (("down_proj", 0),), "delta", w.down_bias)
            with serial():
                h.add_(delta)
        last = rms_norm(h[batch.logits_rows], self.norm, cfg.rms_norm_eps)
        return F.linear(last, self.lm_head).float()
