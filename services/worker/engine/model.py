"""The decoder of every served family, running one flat, ragged batch per step over the
paged cache.

All tokens of a step (prefill chunks and decodes of many sequences, many adapters) go
through each projection as one [T, hidden] matmul; q|k|v and gate|up are fused so the
base model costs two matmuls fewer per layer, and LoRA deltas are added into the fused
outputs at column offsets by the multi-LoRA kernels. What differs between families
(biases, norms and where they sit, q/k norms, activation, attention scale, windows and
soft-capping, rope per layer, embedding, residual and logit scaling) is read from the
family's description (`services.families`) once, at load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, get_args

import numpy as np
import torch
import torch.nn.functional as F

from loraplane_kernels import cpu_decode, cpu_layer
from loraplane_kernels.int8 import (
    Int8Weight,
    dequant_buffer_shape,
    int8_linear,
    needs_dequant_buffer,
    quantize_int8,
)
from loraplane_kernels.threads import one_thread
from services.contracts.events import BaseWeights

from .adapter_pool import AdapterPool
from .attention import AttentionMetadata, paged_attention
from .checkpoint import load_checkpoint, load_tokenizer
from .config import ModelConfig
from .kv_cache import KVStorage
from .lora_ops import Runs, Segments, SmallRuns
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
Every op works row by row, so the bits do not depend on the thread count. 0 turns it off.
A family with the compiled ops (`DecoderModel.compiled_layers`) takes them instead at any
step size."""

ONEDNN = torch.backends.mkldnn.is_available() and all(
    hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight"))
"""Whether CPU projections can call oneDNN directly (`mkldnn._linear_pointwise`), over
weights packed into its blocked layout (`mkldnn._reorder_linear_weight`, see
`DecoderModel.pack_weights`); without it, `torch.mm`."""

PACK_ROWS = 128
"""The batch size oneDNN packs the weights for. On the 2-core AMD EPYC (AVX-512 BF16) of
the peer bench, 30 SmolLM2-shaped bf16 weights packed for 128 rows against `torch.mm` over
the plain ones ([3072, 576]): 1 row 1.7 against 1.9 ms, 8 rows 2.6 against 5.7, 32 rows
5.0 against 9.4, 128 rows 14.8 against 19.7, 1024 rows 106 against 126 ms; never slower at
the other shapes (packed for 1 row, 128 rows ran 16% slower than plain). The bf16 results
are `torch.mm`'s bit for bit, but for one row through the widest matrix (gate|up), where
`torch.mm`'s own one-row kernel sums in another order. fp32 `torch.mm` goes to the BLAS
(MKL), which streamed fp32 weights at 20 GB/s against oneDNN's 40-55 on that CPU (1 row
5.1 against 11.9 ms, 32 rows 9.3 against 24.0, 1024 rows 262 against 465); oneDNN's fp32
sums come in another order than MKL's, so fp32 results differ from `torch.mm`'s in the
last bits."""

LINEAR = getattr(torch.ops.mkldnn._linear_pointwise.default, "_op",
                 torch.ops.mkldnn._linear_pointwise.default) if ONEDNN else None
"""oneDNN's linear over packed weights, called as the C++ op itself: through
`torch.ops`' Python dispatch it cost a few microseconds more a call, 120 calls a step."""

COMPILED_LAYERS = True
"""Whether the families `DecoderModel._compiled_layers_apply` accepts run small steps'
elementwise ops through the compiled kernels (off: the torch ops, for comparison)."""


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


WEIGHT_FORMATS: tuple[str, ...] = get_args(BaseWeights)
"""How the base projections are stored: dense in the serving dtype, or int8 per output
channel (`loraplane_kernels.int8`) with activations and LoRA in the serving dtype."""

INT8_LM_HEAD = True
"""Whether the int8 format quantises lm_head too (the embedding stays dense: a lookup reads
one row per token). lm_head is the largest single matmul of a small model's decode step
(SmolLM2: 28M of 135M parameters). Measured by bench/int8.py --quick on SmolLM2 against
bf16 (bf16's greedy answers to the demo questions, base and the 3 demo adapters, teacher-
forced): top-1 agreement 96.9% with int8 lm_head, 98.1% with a dense one (fp32's own
agreement with bf16: 98.1%); perplexity 1.460 and 1.453 against bf16's 1.448. Kept: the
loss is small and lm_head is the bytes a decode step most saves on. With tied embeddings
the int8 copy comes beside the dense embedding (half its bytes)."""

Weight = torch.Tensor | Int8Weight
RowWeight = tuple[torch.Tensor | None, np.ndarray, np.ndarray, np.ndarray]
"""A projection as one- and two-row steps read it (`DecoderModel.keep_row_weights`)."""

PROJECTIONS = ("qkv", "o", "gate_up", "down")
"""A layer's packed projections, in the order a step computes them: the row arena's order
and the index `cpu_layer.layer_stack_rows` takes each by."""


class RowStack(NamedTuple):
    """What `cpu_layer.layer_stack_rows` reads of the model (`DecoderModel._row_stack`)."""

    arrays: tuple[Any, ...]
    """Weights, int8 scales and biases flat with their spans, then the norms stacked."""
    rope_of: np.ndarray
    """Each layer's rope, an index into `DecoderModel.ropes` (-1: none)."""
    windows: np.ndarray
    """Each layer's sliding window (0: none)."""


@dataclass
class LayerWeights:
    qkv: Weight  # [q + 2kv, hidden]
    o: Weight
    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight
    attn_in_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_in_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None  # [q + 2kv]
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    @property
    def input_norm(self) -> torch.Tensor | None:
        return self.attn_in_norm

    @property
    def post_norm(self) -> torch.Tensor | None:
        return self.mlp_in_norm


def plain_weight(w: torch.Tensor) -> torch.Tensor:
    """A weight in the plain layout: itself, or a copy out of oneDNN's packed layout."""
    return w.to_dense() if w.is_mkldnn else w


ROW_ARENA_ALIGN = 64
"""Bytes each weight of `row_arena` starts on (a cache line)."""


def row_arena(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `weights` (contiguous CPU tensors) laid end to end in one buffer, in the
    order given: the order a one-row step reads them. A one-row step is bound by how fast
    memory streams its weights, and the hardware prefetcher runs on from one weight into
    the next only where the next one follows in memory. SmolLM2's single-stream bf16 step
    on a 2-core Xeon, alternating in one process: 27.5 ms over weights in their own
    allocations, 22.2 ms over one buffer in step order (24.2 with the layers in it and the
    LM head apart)."""
    sizes = [-(-w.nbytes // ROW_ARENA_ALIGN) * ROW_ARENA_ALIGN for w in weights]
    buffer = torch.empty(sum(sizes), dtype=torch.uint8)
    out, offset = [], 0
    for w, size in zip(weights, sizes, strict=True):
        view = buffer[offset:offset + w.nbytes].view(w.dtype).view(w.shape)
        view.copy_(w)
        out.append(view)
        offset += size
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
             weigh_in_fp32: bool = False) -> torch.Tensor:
    """RMSNorm computed in float32, as transformers does, then cast back.

    Llama casts the normalised values and then multiplies by the weight; Gemma and OLMo 2
    multiply in float32 and cast last (`weigh_in_fp32`, with a float32 weight for Gemma's
    1 + w). In fp32 both are the same products. With `out` the result is written there and
    with `scratch` (float32, shaped like `x`) the squares too: the same ops, so the same
    bits as without.
    """
    xf = x.float()
    sq = xf.pow(2) if scratch is None else torch.pow(xf, 2, out=scratch)
    inv = torch.rsqrt(sq.mean(-1, keepdim=True) + eps)
    if weigh_in_fp32 and x.dtype != torch.float32:
        res = (xf * inv * weight).to(x.dtype)
        return res if out is None else out.copy_(res)
    if out is None:
        return weight * (xf * inv).to(x.dtype)
    if x.dtype == xf.dtype:
        torch.mul(xf, inv, out=out)
    else:
        out.copy_(xf * inv)
    return out.mul_(weight)


ACTIVATIONS = {
    "silu": lambda x: F.silu(x, inplace=True),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
"""transformers' ACT2FN entries the families use (`services.families.ACTIVATIONS`)."""


class DecoderModel:
    """Weights plus a forward over `ForwardBatch`; stateless between steps (the workspace
    holds scratch only, overwritten by every step)."""

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: dict[str, torch.Tensor],
        digest: str,
        tokenizer: object | None = None,
        weights: str = "dense",
        int8_lm_head: bool | None = None,
    ) -> None:
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights {weights!r} is not one of {WEIGHT_FORMATS}")
        self.cfg = cfg
        self.weights = weights
        fam = cfg.family
        self.digest = digest
        self.tokenizer = tokenizer
        self.warmed = False
        """An engine ran its kernels once on this model (`Engine._warm_up`)."""
        self.dtype = tensors["model.embed_tokens.weight"].dtype
        self.device = tensors["model.embed_tokens.weight"].device
        self.embed = tensors["model.embed_tokens.weight"]
        self.weigh_in_fp32 = fam.norm_style != "llama"
        self.norm = self._norm_weight(tensors["model.norm.weight"])
        self.lm_head = self.embed if cfg.tie_word_embeddings else tensors["lm_head.weight"]
        self.layers: list[LayerWeights] = []

        def cat(*names: str) -> torch.Tensor:
            return torch.cat([tensors[n] for n in names])

        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            norms = {role: None if name is None else self._norm_weight(
                tensors[p + name + ".weight"]) for role, name in fam.norms.items()}
            self.layers.append(LayerWeights(
                qkv=tensors[p + fam.fused_qkv + ".weight"] if fam.fused_qkv else cat(
                    *(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                o=tensors[p + "self_attn.o_proj.weight"],
                gate_up=tensors[p + fam.fused_gate_up + ".weight"] if fam.fused_gate_up
                else cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=tensors[p + "mlp.down_proj.weight"],
                attn_in_norm=norms["attn_in"], attn_out_norm=norms["attn_out"],
                mlp_in_norm=norms["mlp_in"], mlp_out_norm=norms["mlp_out"],
                q_norm=self._norm_weight(tensors[p + "self_attn.q_norm.weight"])
                if fam.qk_norm else None,
                k_norm=self._norm_weight(tensors[p + "self_attn.k_norm.weight"])
                if fam.qk_norm else None,
                qkv_bias=cat(*(p + f"self_attn.{n}_proj.bias" for n in "qkv"))
                if cfg.qkv_bias else None,
                o_bias=tensors[p + "self_attn.o_proj.bias"] if cfg.o_bias else None,
                gate_up_bias=cat(p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias")
                if cfg.mlp_bias else None,
                down_bias=tensors[p + "mlp.down_proj.bias"] if cfg.mlp_bias else None,
            ))
        self.lm_head_int8: Int8Weight | None = None
        if weights == "int8":
            for w in self.layers:
                w.qkv, w.o = quantize_int8(w.qkv), quantize_int8(w.o)  # type: ignore[arg-type]
                w.gate_up, w.down = quantize_int8(w.gate_up), quantize_int8(w.down)  # type: ignore[arg-type]
            if INT8_LM_HEAD if int8_lm_head is None else int8_lm_head:
                self.lm_head_int8 = quantize_int8(self.lm_head)
        ropes: dict[int, RotaryEmbedding] = {}
        self.layer_ropes: list[RotaryEmbedding | None] = []
        for i in range(cfg.num_hidden_layers):
            rope = cfg.rope_of(i)
            if rope is not None and id(rope) not in ropes:
                ropes[id(rope)] = RotaryEmbedding(rope, cfg.head_dim,
                                                  cfg.max_position_embeddings)
            self.layer_ropes.append(None if rope is None else ropes[id(rope)])
        self.ropes = list(ropes.values())
        self.rope = self.ropes[0] if self.ropes else None
        self.scale = cfg.scale
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.embed_scale: float | torch.Tensor | None = cfg.embedding_scale
        self.scale_in_embedding = fam.embedding_scale == "sqrt_hidden"
        """Gemma scales inside its embedding module (so PEFT scales embedding LoRA too),
        by the scale rounded to the weights' dtype; Granite multiplies the module's output."""
        if self.scale_in_embedding:
            self.embed_scale = torch.tensor(cfg.embedding_scale).to(self.dtype)
        self.lora_mods: dict[str, tuple[tuple[str, int], ...]] = {
            packed: tuple((m, cfg.lora_rows(m)[1]) for m in fam.lora
                          if cfg.lora_rows(m)[0] == packed)
            for packed in PROJECTIONS}
        """Per packed projection, the PEFT modules that adapt it and their column offsets."""
        self.workspace = Workspace(self.dtype, self.device)
        """Step activations are written into reused buffers (see `Workspace`)."""
        self.packed = False
        """The layers' projections are in oneDNN's packed layout (`pack_weights`)."""
        self.lm_head_packed: torch.Tensor | None = None
        """A packed copy of the LM head beside the plain one (`pack_weights`)."""
        self.row_weights: list[dict[str, RowWeight]] | None = None
        """Per layer and projection, the kept plain dense weight (None for int8) and the
        flat arrays (weight, int8 scale, bias) that few-row steps' projections read
        (`keep_row_weights`); None: they take the matmul."""
        self._no_bias = np.empty(0, dtype=np.uint16)
        self._row_head = (self._no_bias, self._no_bias)
        """The LM head as `linear_rows` reads it (weight, int8 scale)."""
        self.compiled_layers = self._compiled_layers_apply()
        """Whether steps run each layer's elementwise ops through
        `loraplane_kernels.cpu_layer` (four calls a layer, in row shares on every thread
        from `cpu_layer.SHARE_ROWS` rows) instead of torch's: at 4,096 prefill tokens of
        SmolLM2 in bf16, the torch ops took about 720 ms a step and these 330."""
        self._kv_arrays: tuple[KVStorage, list[tuple[np.ndarray, np.ndarray]]] | None = None
        self._stack: RowStack | tuple[()] | None = None  # (): the one call does not apply
        self._lora_rows: tuple[AdapterPool | None, np.ndarray, tuple[Any, ...]] | None = None
        self._norm_arrays = [self._layer_norm_arrays(w) for w in self.layers] \
            if self.compiled_layers else []

    def _compiled_layers_apply(self) -> bool:
        """The compiled elementwise ops cover RMSNorms before and after attention and the
        MLP (any of the four), q/k norms per head or over the projection, and the gated
        activations they compute (`cpu_layer.GATED_ACTIVATIONS`), on the CPU in fp32 or
        bf16: every served family today. A family outside that takes the torch ops."""
        cfg, fam = self.cfg, self.cfg.family
        return (cpu_layer.AVAILABLE and COMPILED_LAYERS and self.device.type == "cpu"
                and self.dtype in cpu_layer.DTYPES and fam.qk_norm in cpu_layer.QK_NORMS
                and cfg.hidden_act in cpu_layer.GATED_ACTIVATIONS)

    def _layer_norm_arrays(self, w: LayerWeights) -> tuple[Any, ...]:
        """A layer's norm weights as the compiled ops take them: (before attention, its
        `residual_norm` mode, after attention, before the MLP, its mode, after the MLP, q,
        k), an empty array for a norm the layer lacks."""
        empty = cpu_layer.as_array(torch.empty(0, dtype=self.dtype))

        def weight(t: torch.Tensor | None) -> Any:
            return empty if t is None else cpu_layer.as_array(t)

        def mode(t: torch.Tensor | None) -> int:
            return cpu_layer.NORM_COPY if t is None else cpu_layer.NORM_RMS

        return (weight(w.attn_in_norm), mode(w.attn_in_norm), weight(w.attn_out_norm),
                weight(w.mlp_in_norm), mode(w.mlp_in_norm), weight(w.mlp_out_norm),
                weight(w.q_norm), weight(w.k_norm))

    def drop_scratch(self) -> None:
        """Let go of the step buffers and cache views a warm-up's steps left: the engine's
        first step sizes its own, and reports none held until then."""
        self.workspace = Workspace(self.dtype, self.device)
        self._kv_arrays = None

    def _cache_arrays(self, kv: KVStorage) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each layer's K and V cache as numpy views, made once per cache."""
        if self._kv_arrays is None or self._kv_arrays[0] is not kv:
            self._kv_arrays = (kv, [(cpu_layer.as_array(kv.k[i]), cpu_layer.as_array(kv.v[i]))
                                    for i in range(len(self.layers))])
        return self._kv_arrays[1]

    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        """Gemma stores norm weights minus one and multiplies by 1 + w in float32."""
        return 1.0 + w.float() if self.cfg.family.norm_style == "gemma" else w

    def keep_row_weights(self, budget_bytes: int) -> bool:
        """Let steps of `cpu_decode.LINEAR_ROWS` rows (one or two streams' decodes) compute
        the base projections and the LM head with `cpu_decode.linear_rows`: bf16 on the
        CPU, dense or int8 weights. Call it before `pack_weights`: packing replaces the
        plain dense projections, so keeping them costs their bytes again, taken only
        within `budget_bytes` (0: never; int8 weights are read as they are stored, at no
        cost). SmolLM2-135M's dense ones are 214 MB (docs/engine.md has the figures).

        The weights these steps read move into one buffer, in the order a step reads them
        (`row_arena`), and the model's own tensors become views of it: no second copy.
        Returns whether the kernel serves those steps."""
        if self.packed or self.row_weights is not None:  # decided by the first engine
            return self.row_weights is not None
        if not (cpu_decode.AVAILABLE and self.device.type == "cpu"
                and self.dtype == torch.bfloat16):
            return False
        names = PROJECTIONS
        none = self._no_bias
        int8 = self.weights == "int8"
        extra = 0 if int8 else sum(plain_weight(getattr(w, n)).nbytes
                                   for w in self.layers for n in names)
        if (ONEDNN or self.packed) and extra > budget_bytes:  # else they are the weights
            return False

        def stored(w: Weight) -> torch.Tensor:
            return w.q if isinstance(w, Int8Weight) else plain_weight(w)

        head = self.lm_head if self.lm_head_int8 is None else self.lm_head_int8
        moved = iter(row_arena([stored(getattr(w, n)) for w in self.layers for n in names]
                               + [stored(head)]))
        for w in self.layers:
            for n in names:
                if isinstance(weight := getattr(w, n), Int8Weight):
                    weight.q = next(moved)
                else:
                    setattr(w, n, next(moved))
        if isinstance(head, Int8Weight):
            head.q = next(moved)
        else:
            tied, self.lm_head = self.lm_head is self.embed, next(moved)
            if tied:
                self.embed = self.lm_head

        def flat(t: torch.Tensor | None) -> np.ndarray:
            return none if t is None else cpu_decode.as_array(t.contiguous()).reshape(-1)

        def arrays(w: Weight) -> tuple[np.ndarray, np.ndarray]:
            """(weight, scale) as the kernel reads them."""
            if isinstance(w, Int8Weight):
                return w.q.numpy().reshape(-1), flat(w.scale)
            return flat(w), none

        self.row_weights = [
            {n: (None if int8 else getattr(w, n), *arrays(getattr(w, n)),
                 flat(getattr(w, f"{n}_bias"))) for n in names} for w in self.layers]
        self._row_head = arrays(head if isinstance(head, Int8Weight) else self.lm_head)
        return True

    def pack_weights(self) -> bool:
        """Store the layers' projections in oneDNN's packed layout, in place of the plain
        ones (the same bytes, no second copy), where that serves: dense fp32 or bf16
        weights on the CPU with oneDNN's ops present. The engine asks for it when no fused
        base + LoRA kernel reads the plain weights (`PACK_ROWS` has the figures). Returns
        whether they are packed."""
        if self.packed or not (ONEDNN and self.weights == "dense" and self.device.type == "cpu"
                               and self.dtype in (torch.float32, torch.bfloat16)):
            return self.packed
        for w in self.layers:
            for name in PROJECTIONS:
                setattr(w, name, torch.ops.mkldnn._reorder_linear_weight(getattr(w, name),
                                                                         PACK_ROWS))
        if self.lm_head_int8 is None:
            # a copy: the plain LM head is the embedding where they are tied, and adapters
            # that replace lm_head rows read it. SmolLM2's 49,152 x 576 in bf16, 32 rows:
            # 2.3 against 4.5 ms plain (8 rows 1.0 against 2.7), for 57 MB more
            self.lm_head_packed = torch.ops.mkldnn._reorder_linear_weight(self.lm_head,
                                                                          PACK_ROWS)
        self.packed = True
        return True

    def int8_matmul(self, x: torch.Tensor, w: Int8Weight,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        """`int8_linear` of `w` with the workspace's dequantisation buffer where it takes
        one (reused between steps, not allocated per call)."""
        return int8_linear(x, w, bias=bias, scratch=self.workspace.take(
            "dequant", *dequant_buffer_shape(w)) if needs_dequant_buffer(x) else None)

    def projection_weight(self, layer: int, module: str) -> torch.Tensor:
        """The [out, in] weight a PEFT target module adapts, in the serving dtype: a view
        into the plain q|k|v or gate|up matrix where the module is fused there, or a copy
        out of the packed layout (`pack_weights`); write it with `set_projection_weight`.
        Dense weights only (merging and the fused kernel write or read them)."""
        if self.weights != "dense":
            raise ValueError(f"{self.weights} base weights have no dense projection weight")
        packed, lo, hi = self.cfg.lora_rows(module)
        return plain_weight(getattr(self.layers[layer], packed))[lo:hi]

    def set_projection_weight(self, layer: int, module: str, value: torch.Tensor) -> None:
        """Write a module's [out, in] weight (merged mode); a packed matrix is unpacked,
        written and packed again."""
        if not self.packed:
            self.projection_weight(layer, module).copy_(value)
            return
        packed, lo, hi = self.cfg.lora_rows(module)
        w = self.layers[layer]
        dense = (plain_weight(getattr(w, packed)) if self.row_weights is None
                 else self.row_weights[layer][packed][0])  # its arrays see the write
        dense[lo:hi] = value
        setattr(w, packed, torch.ops.mkldnn._reorder_linear_weight(dense, PACK_ROWS))

    def plain_projections(self) -> list[torch.Tensor]:
        """Every layer's q|k|v, o, gate|up and down weights in the plain layout (copies
        where packed): what comparisons and benchmarks read."""
        return [plain_weight(getattr(w, name)) for w in self.layers
                for name in PROJECTIONS]

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu", weights: str = "dense",
                        int8_lm_head: bool | None = None) -> DecoderModel:
        """Load config, weights (validated, digested) and tokenizer from an HF directory;
        the digest is the checkpoint's whatever `weights` format serves it."""
        ckpt = load_checkpoint(model_dir, dtype, device)
        return cls(ckpt.config, ckpt.tensors, ckpt.digest, load_tokenizer(model_dir),
                   weights=weights, int8_lm_head=int8_lm_head)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, role: str,
              scratch: torch.Tensor | None) -> torch.Tensor:
        return rms_norm(x, weight, self.cfg.rms_norm_eps,
                        out=self.workspace.take(role, *x.shape),
                        scratch=scratch if scratch is not None and scratch.shape == x.shape
                        else None, weigh_in_fp32=self.weigh_in_fp32)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVStorage, adapters: AdapterPool | None = None
    ) -> torch.Tensor:
        """Run one step; writes new K/V into `kv` and returns float32 logits [S, vocab]."""
        cfg = self.cfg
        fam = cfg.family
        t = batch.input_ids.shape[0]
        qs, ks = cfg.q_size, cfg.kv_size
        inter = cfg.intermediate_size
        batch = batch.to(self.device)
        tables = {id(r): tuple(x.to(self.device) for x in r.cos_sin(
            batch.positions, batch.seq_lens, self.dtype)) for r in self.ropes}
        use_lora = adapters is not None and bool(batch.lora_slots) and (
            batch.lora_indices is not None
        )
        idx, seg, slots = batch.lora_indices, batch.lora_segments, list(batch.lora_slots)
        runs, split = batch.lora_runs, batch.fused_from

        ws = self.workspace
        packed = self.packed

        rows = self.row_weights if t <= cpu_decode.LINEAR_ROWS and split is None else None

        def project(layer: int, x: torch.Tensor, name: str, role: str) -> torch.Tensor:
            """Base projection `name` of `layer` (+ bias, as `nn.Linear` adds it) plus LoRA
            deltas (at column offsets of packed outputs, after the bias: PEFT's order)."""
            lw = self.layers[layer]
            weight: Weight = getattr(lw, name)
            bias: torch.Tensor | None = getattr(lw, f"{name}_bias")
            modules = mods[name]
            if rows is not None and x.is_contiguous():
                _, flat, scale, flat_bias = rows[layer][name]
                y = cpu_decode.linear_rows(x, flat, scale, flat_bias,
                                           ws.take(role, t, weight.shape[0]))
            elif isinstance(weight, Int8Weight):  # never fused: the engine turns fusion off
                y = self.int8_matmul(x, weight, bias)
            elif split is None and packed:
                y = LINEAR(x, weight, bias, "none", [], "")  # type: ignore[misc]
            elif split is None:
                y = ws.take(role, t, weight.shape[0])
                if bias is None:
                    torch.mm(x, weight.t(), out=y)
                else:
                    torch.addmm(bias, x, weight.t(), out=y)
            else:
                # two-level batching: large buckets separate, small ones fused (rows >= split)
                y = ws.take(role, t, weight.shape[0])
                if split:
                    torch.mm(x[:split], weight.t(), out=y[:split])  # bias added below
                    for module, off in modules:
                        if adapters.layer_has_lora(layer, module, slots):  # type: ignore[union-attr]
                            adapters.apply(layer, module, y[:split], x[:split], idx[:split],  # type: ignore[union-attr,index]
                                           seg, off)
                for module, off in modules:
                    adapters.apply_fused_base(  # type: ignore[union-attr]
                        layer, module, y[split:], x[split:],
                        self.projection_weight(layer, module), batch.fused_segments, off)  # type: ignore[arg-type]
                if bias is not None:  # after the deltas here: rounding order only differs
                    y += bias
                return y
            if use_lora:
                for module, off in modules:
                    if adapters.layer_has_lora(layer, module, slots):  # type: ignore[union-attr]
                        adapters.apply(layer, module, y, x, idx, seg, off, runs)  # type: ignore[union-attr,arg-type]
            return y

        heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        mods = self.lora_mods
        serial = one_thread if t <= SERIAL_TOKENS and self.device.type == "cpu" else (
            contextlib.nullcontext)
        norm_sq = ws.take("norm_sq", t, cfg.hidden_size, dtype=torch.float32)
        vocab = use_lora and adapters.adapts_vocab(slots)  # type: ignore[union-attr]
        with serial():
            h = torch.index_select(self.embed, 0, batch.input_ids,
                                   out=ws.take("hidden", t, cfg.hidden_size))
            if vocab:
                adapters.replace_embeddings(h, batch.input_ids, runs)  # type: ignore[union-attr,arg-type]
            if self.embed_scale is not None and self.scale_in_embedding:
                h.mul_(self.embed_scale)
            if vocab:
                adapters.add_embedding_lora(  # type: ignore[union-attr]
                    h, batch.input_ids, runs,  # type: ignore[arg-type]
                    self.embed_scale if self.scale_in_embedding else None)  # type: ignore[arg-type]
            if self.embed_scale is not None and not self.scale_in_embedding:
                h.mul_(self.embed_scale)
        if self.compiled_layers and kv.k.dtype == self.dtype:
            lora = None
            if use_lora and rows is not None:
                small = adapters.direct_runs(runs, self.dtype, self.device)  # type: ignore[union-attr]
                lora = None if small is None else (adapters, small, slots)
            self._compiled_layer_loop(h, batch, kv, tables, project,
                                      rows if not use_lora or lora is not None else None,
                                      lora)
            return self._logits(h, batch, adapters, idx, vocab)
        for li, w in enumerate(self.layers):
            with serial():
                x = h if w.attn_in_norm is None else self._norm(h, w.attn_in_norm, "norm",
                                                                 norm_sq)
            qkv = project(li, x, "qkv", "qkv")
            rope = self.layer_ropes[li]
            with serial():
                q_src, k_src = qkv[:, :qs], qkv[:, qs : qs + ks]
                if fam.qk_norm == "full":
                    q_src = self._norm(q_src, w.q_norm, "q_normed", None)  # type: ignore[arg-type]
                    k_src = self._norm(k_src, w.k_norm, "k_normed", None)  # type: ignore[arg-type]
                q_src, k_src = q_src.view(t, heads, dim), k_src.view(t, kv_heads, dim)
                if fam.qk_norm == "head":
                    q_src = self._norm(q_src, w.q_norm, "q_normed", None)  # type: ignore[arg-type]
                    k_src = self._norm(k_src, w.k_norm, "k_normed", None)  # type: ignore[arg-type]
                if rope is None:
                    q = ws.take("q", t, heads, dim).copy_(q_src)
                    k = ws.take("k", t, kv_heads, dim).copy_(k_src)
                else:
                    cos, sin = tables[id(rope)]
                    q = apply_rotary(q_src, cos, sin, out=ws.take("q", t, heads, dim),
                                     scratch=ws.take("rope", t, heads, dim))
                    k = apply_rotary(k_src, cos, sin, out=ws.take("k", t, kv_heads, dim),
                                     scratch=ws.take("rope", t, kv_heads, dim))
                v = qkv[:, qs + ks :].view(t, kv_heads, dim)
                kv.write(li, batch.slot_mapping, k, v)
            attn = paged_attention(q, k, v, kv.k[li], kv.v[li], batch.attention, self.scale,
                                   workspace=ws, window=cfg.window(li),
                                   softcap=cfg.attn_softcap)
            delta = project(li, attn.view(t, qs), "o", "delta")
            with serial():
                if w.attn_out_norm is not None:
                    delta = self._norm(delta, w.attn_out_norm, "delta_normed", norm_sq)
                if cfg.residual_multiplier != 1.0:
                    delta.mul_(cfg.residual_multiplier)
                h.add_(delta)
                x = h if w.mlp_in_norm is None else self._norm(h, w.mlp_in_norm, "norm",
                                                                norm_sq)
            gu = project(li, x, "gate_up", "gate_up")
            with serial():
                act = torch.mul(self.act(gu[:, :inter]), gu[:, inter:],
                                out=ws.take("act", t, inter))
            delta = project(li, act, "down", "delta")
            with serial():
                if w.mlp_out_norm is not None:
                    delta = self._norm(delta, w.mlp_out_norm, "delta_normed", norm_sq)
                if cfg.residual_multiplier != 1.0:
                    delta.mul_(cfg.residual_multiplier)
                h.add_(delta)
        return self._logits(h, batch, adapters, idx, vocab)

    def _compiled_layer_loop(self, h: torch.Tensor, batch: ForwardBatch, kv: KVStorage,
                             tables: dict[int, tuple[torch.Tensor, ...]],
                             project: Callable[..., torch.Tensor],
                             direct: list[dict[str, RowWeight]] | None,
                             lora: tuple[AdapterPool, SmallRuns, list[int]] | None = None,
                             ) -> None:
        """Every layer with its elementwise ops as four calls of three compiled kernels
        (`loraplane_kernels.cpu_layer`): the residual add fused with the next norm, rope
        with the cache write, SwiGLU. The projections (with their LoRA) and attention are
        the torch path's own; with `direct` (a step of few rows, see `keep_row_weights`)
        the projections go straight to `cpu_decode.linear_rows_arrays` over the step's
        buffers: `project`'s Python around each of 120 calls a step cost about as much as
        the kernel's launch. With `lora` (the step's adapters take the compiled LoRA pass,
        `AdapterPool.direct_runs`) each projection's deltas are added the same way
        (`AdapterPool.apply_direct`), after the bias as `project` adds them."""
        cfg, ws = self.cfg, self.workspace
        as_array = cpu_layer.as_array
        t, hidden = h.shape
        heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qs, ks = cfg.q_size, cfg.kv_size
        held: dict[int, tuple[torch.Tensor, np.ndarray]] = {}

        def arr(x: torch.Tensor) -> np.ndarray:
            # keyed by identity, with the tensor held so that its id is not reused
            got = held.get(id(x))
            if got is None:
                got = held[id(x)] = (x, as_array(x))
            return got[1]

        x = ws.take("norm", t, hidden)
        q, k = ws.take("q", t, heads, dim), ws.take("k", t, kv_heads, dim)
        act = ws.take("act", t, cfg.intermediate_size)
        h_a, x_a, q_a, k_a, act_a = arr(h), arr(x), arr(q), arr(k), arr(act)
        slots = batch.slot_mapping.numpy()
        rope_arrays = {key: (as_array(c), as_array(s)) for key, (c, s) in tables.items()}
        no_rope = np.empty((t, 0), dtype=h_a.dtype)  # a layer without rope: k passes through
        rope_arrays[id(None)] = (no_rope, no_rope)
        kind = cpu_layer.GATED_ACTIVATIONS.index(cfg.hidden_act)
        mult = np.float32(cfg.residual_multiplier)
        caches = self._cache_arrays(kv)
        eps, fp32_weigh = np.float32(cfg.rms_norm_eps), self.weigh_in_fp32
        layers = self.layers
        meta = batch.attention
        decodes_only = meta.host_decodes is not None and not meta.prefills
        attn = ws.take("attn", t, heads, dim)  # paged_attention's output buffer too
        attn_a = arr(attn)
        residual_norm, rope_cache, gated = cpu_layer.step_kernels(t)
        attend = cpu_decode.decode_attention_arrays
        plan, scale, softcap = meta.host_decodes, self.scale, cfg.attn_softcap
        attn_flat = attn.view(t, qs)
        lin = cpu_decode.linear_rows_arrays
        mods = self.lora_mods
        pool, small_runs, lora_slots = lora if lora is not None else (None, None, None)
        outs = {} if direct is None else {  # the roles' buffers, as `project` takes them
            role: ws.take(role, t, width) for role, width in (
                ("qkv", qs + 2 * ks), ("gate_up", 2 * cfg.intermediate_size),
                ("delta", hidden))}

        def linear(li: int, name: str, role: str,
                   x_t: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
            """`project`, or with `direct` the kernel straight into the role's buffer."""
            if direct is None:  # a fresh tensor (packed) or the role's buffer: its own view
                y = project(li, x_t, name, role)  # (`arr` would hold every one to the end)
                return y, as_array(y)
            y = outs[role]
            x_a, y_a = arr(x_t), arr(y)
            lin(x_a, *direct[li][name][1:], y_a)
            if pool is not None:
                for module, off in mods[name]:
                    pool.apply_direct(li, module, y_a, x_a, off, small_runs, lora_slots)
            return y, y_a

        norms = self._norm_arrays
        qk_norm = cpu_layer.QK_NORMS[cfg.family.qk_norm]
        last = len(layers) - 1
        empty = norms[0][2][:0]
        stack = self._row_stack() if direct is not None and decodes_only else None
        if stack is not None and (whole := cpu_layer.layer_stack_rows()) is not None:
            lora_modules, no_lora = self._lora_plan(pool)
            threads = torch.get_num_threads()
            lora_args = no_lora if pool is None else (
                *pool.direct_arrays(), np.asarray(lora_slots, dtype=np.int64),
                small_runs.slots, small_runs.starts, small_runs.ends,  # type: ignore[union-attr]
                small_runs.rows_max,  # type: ignore[union-attr]
                min(threads, len(small_runs.slots)))  # type: ignore[union-attr]
            cos, sin = (np.stack([rope_arrays[id(r)][i] for r in self.ropes]) if self.ropes
                        else no_rope[None] for i in (0, 1))
            cuts = np.asarray(plan.cuts(threads) if len(plan.lens) > 1 else (0, 1),
                              dtype=np.int64)
            whole(h_a, x_a, q_a, k_a, attn_a, arr(attn_flat), act_a,
                  *(arr(outs[role]) for role in ("qkv", "delta", "gate_up")), *stack.arrays,
                  empty, cos, sin, stack.rope_of, no_rope, as_array(kv.k), as_array(kv.v),
                  slots, heads, kv_heads, qk_norm, eps, fp32_weigh, mult, kind, plan.rows,
                  plan.tables, plan.lens, plan.block_size, np.float32(scale), stack.windows,
                  np.float32(softcap or 0.0), cuts, threads, lora_args, lora_modules)
            return
        residual_norm(h_a, h_a, False, mult, empty, norms[0][0], norms[0][1], eps, fp32_weigh,
                      x_a)
        for li in range(len(layers)):
            _, _, attn_out, mlp_in, mlp_in_mode, mlp_out, q_norm, k_norm = norms[li]
            qkv, qkv_a = linear(li, "qkv", "qkv", x)
            cos, sin = rope_arrays[id(self.layer_ropes[li])]
            k_cache, v_cache = caches[li]
            rope_cache(qkv_a, cos, sin, heads, kv_heads, q_a, k_a, k_cache, v_cache, slots,
                       qk_norm, q_norm, k_norm, eps, fp32_weigh)
            window = cfg.window(li)
            if decodes_only:  # straight to the kernel, over the views made above
                attend(q_a, k_cache, v_cache, attn_a, plan, scale, window, softcap)
            else:
                v = qkv[:, qs + ks:].view(t, kv_heads, dim)
                attn_flat = paged_attention(q, k, v, kv.k[li], kv.v[li], meta, scale,
                                            workspace=ws, window=window,
                                            softcap=softcap).view(t, qs)
            delta_a = linear(li, "o", "delta", attn_flat)[1]
            residual_norm(h_a, delta_a, True, mult, attn_out, mlp_in, mlp_in_mode, eps,
                          fp32_weigh, x_a)
            gu_a = linear(li, "gate_up", "gate_up", x)[1]
            gated(gu_a, kind, act_a)
            delta_a = linear(li, "down", "delta", act)[1]
            nxt, nxt_mode = (norms[li + 1][0], norms[li + 1][1]) if li < last else (
                empty, cpu_layer.NORM_NONE)  # the final norm is the logits' own
            residual_norm(h_a, delta_a, True, mult, mlp_out, nxt, nxt_mode, eps, fp32_weigh,
                          x_a)

    def _row_stack(self) -> RowStack | None:
        """What `cpu_layer.layer_stack_rows` reads of the model, made on first use: the
        row weights as one flat array (the arena `keep_row_weights` laid them in) with
        each projection's spans of it, of the int8 scales and of the biases (copied end
        to end: a few KB), and each norm's weights stacked a row per layer. None where
        the ropes differ in width: those steps take the Python loop."""
        if self._stack is not None:
            return self._stack or None
        self._stack = ()
        if self.row_weights is None or len({r.dim for r in self.ropes}) > 1:
            return None
        names = PROJECTIONS
        dense, first = self.row_weights[0]["qkv"][:2]
        kept = dense if dense is not None else self.layers[0].qkv.q  # type: ignore[union-attr]
        arena = torch.empty(0, dtype=torch.uint8).set_(  # the buffer the weights are views of
            kept.untyped_storage())
        weights = arena.numpy().view(first.dtype)
        start = weights.ctypes.data
        scales: list[np.ndarray] = []
        biases: list[np.ndarray] = []
        spans = np.zeros((len(self.layers), len(names), 6), dtype=np.int64)
        at = [0, 0]
        for li, layer in enumerate(self.row_weights):
            for j, n in enumerate(names):
                _, w, scale, bias = layer[n]
                lo = (w.ctypes.data - start) // w.itemsize
                if lo < 0 or lo + w.size > weights.size:  # sliced, numba would clip it
                    raise RuntimeError("a row weight lies outside the row arena")
                spans[li, j, :2] = lo, lo + w.size
                for k, (part, into) in enumerate(((scale, scales), (bias, biases))):
                    into.append(part)
                    spans[li, j, 2 + 2 * k:4 + 2 * k] = at[k], at[k] + part.size
                    at[k] += part.size

        def joined(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts) if parts else self._no_bias

        norms = self._norm_arrays
        stacked = [np.stack([n[i] for n in norms]) for i in range(8)]
        self._stack = RowStack(
            (weights, joined(scales), joined(biases), spans, stacked[0], norms[0][1],
             stacked[2], stacked[3], norms[0][4], stacked[5], stacked[6], stacked[7]),
            np.asarray([-1 if r is None else self.ropes.index(r) for r in self.layer_ropes],
                       dtype=np.int64),
            np.asarray([self.cfg.window(i) or 0 for i in range(len(self.layers))],
                       dtype=np.int64))
        return self._stack

    def _lora_plan(self, pool: AdapterPool | None) -> tuple[np.ndarray, tuple[Any, ...]]:
        """`layer_stack_rows`' LoRA arguments that do not change from step to step: per
        projection, a (module index in the pool, column offset, in, out) row for each
        module it packs (-1 past the last), and the arguments of a step with no adapter
        (empty, of the types a step with adapters passes, so one compiled signature). Made
        for the engine's pool; a step on the base takes whichever was made."""
        if self._lora_rows is None or (pool is not None and self._lora_rows[0] is not pool):
            names = PROJECTIONS
            width = max(1, *(len(self.lora_mods[n]) for n in names))
            plan = np.full((len(names), width, 4), -1, dtype=np.int64)
            if pool is not None:
                for i, n in enumerate(names):
                    for j, (module, off) in enumerate(self.lora_mods[n]):
                        plan[i, j] = (pool.modules.index(module), off, *pool.shapes[module])
            none = np.empty(0, dtype=np.int64)
            bits = np.uint16 if self.dtype == torch.bfloat16 else np.float32
            no_lora = (np.empty(0, dtype=bits), np.zeros((0, 3, 1), dtype=np.int64),
                       np.zeros((0, 1), dtype=np.float32), 0, none, none, none, none, 0, 1)
            self._lora_rows = (pool, plan, no_lora)
        return self._lora_rows[1], self._lora_rows[2]

    def _logits(self, h: torch.Tensor, batch: ForwardBatch, adapters: AdapterPool | None,
                idx: torch.Tensor | None, vocab: bool) -> torch.Tensor:
        cfg = self.cfg
        last = rms_norm(h[batch.logits_rows], self.norm, cfg.rms_norm_eps,
                        weigh_in_fp32=self.weigh_in_fp32)
        if self.row_weights is not None and last.shape[0] <= cpu_decode.LINEAR_ROWS:
            logits = cpu_decode.linear_rows(
                last.contiguous(), *self._row_head, self._no_bias,
                torch.empty(last.shape[0], self.lm_head.shape[0], dtype=self.dtype))
        elif self.lm_head_int8 is not None:
            logits = self.int8_matmul(last, self.lm_head_int8)
        elif self.lm_head_packed is not None:
            logits = LINEAR(last, self.lm_head_packed, None, "none", [], "")  # type: ignore[misc]
        else:
            logits = F.linear(last, self.lm_head)
        if vocab:
            adapters.apply_lm_head(logits, last,  # type: ignore[union-attr]
                                   idx[batch.logits_rows].tolist())  # type: ignore[index]
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits.float()


LlamaModel = DecoderModel
"""The name the engine's callers used when it served Llama only."""
