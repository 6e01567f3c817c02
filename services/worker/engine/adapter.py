"""PEFT LoRA adapters: parse, validate against the base model, compute the content digest.

Everything that would make the engine's output differ from PEFT's is refused here with a
message naming the field or tensor (DoRA, trained biases, modules the model lacks,
per-module rank/alpha patterns, embedding LoRA), before any slot is touched. Given the
pool's limits, so is an adapter past them (rank, dtype, target modules): the same checks
the registry makes at publish (`services.contracts.capacity`), so both agree.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors_bytes

from services.contracts.capacity import AdapterLimits, OverCapacity
from services.contracts.peft import (
    CONFIG_FILE,
    PARENT,
    TARGET_MODULES,
    TENSOR_NAME,
    WEIGHTS_FILE,
    projection_shape,
)

from .config import ModelConfig
from .errors import AdapterDigestMismatch, AdapterError
from .extent import ExtentLayout, Key, extent_layout, host_buffer, one_thread

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class AdapterDigest:
    """The identity of an adapter version: the digests the registry publishes for it.

    `sha256` is the hex SHA-256 of `adapter_model.safetensors` and `config_sha256` that of
    `adapter_config.json` (`AdapterVersionPublished.sha256` / `.config_sha256`). Both are
    part of the key because the config carries the scale (alpha, rsLoRA): the same
    weights under another config are another adapter, with other KV. Never a name.
    """

    sha256: str
    config_sha256: str

    def __post_init__(self) -> None:
        for name in ("sha256", "config_sha256"):
            if not _HEX64.match(getattr(self, name)):
                raise AdapterError(f"adapter {name} must be 64 lowercase hex characters, "
                                   f"got {getattr(self, name)!r}")

    def __str__(self) -> str:
        return self.sha256

    @property
    def key(self) -> str:
        """Stable text form for hashes and logs."""
        return f"{self.sha256}.{self.config_sha256}"


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a target projection."""
    return projection_shape(module, hidden_size=cfg.hidden_size,
                            intermediate_size=cfg.intermediate_size, q_size=cfg.q_size,
                            kv_size=cfg.kv_size)


@dataclass(frozen=True)
class AdapterFiles:
    """The two files of a PEFT adapter as bytes: what the blob store hands the worker."""

    config_json: bytes
    weights: bytes

    @classmethod
    def from_dir(cls, path: str | Path) -> AdapterFiles:
        root = Path(path)
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (root / name).is_file():
                raise AdapterError(f"adapter directory lacks {name}")
        return cls((root / CONFIG_FILE).read_bytes(), (root / WEIGHTS_FILE).read_bytes())

    def digest(self) -> AdapterDigest:
        """The digests of the two files, as the registry computes them at publish."""
        return AdapterDigest(hashlib.sha256(self.weights).hexdigest(),
                             hashlib.sha256(self.config_json).hexdigest())

    def verify(self, expected: AdapterDigest) -> None:
        """Refuse files whose bytes are not the ones the registry published."""
        actual = self.digest()
        if actual.sha256 != expected.sha256:
            raise AdapterDigestMismatch(f"{WEIGHTS_FILE} has sha256 {actual.sha256}, "
                                        f"expected {expected.sha256}")
        if actual.config_sha256 != expected.config_sha256:
            raise AdapterDigestMismatch(f"{CONFIG_FILE} has sha256 {actual.config_sha256}, "
                                        f"expected {expected.config_sha256}")


@dataclass(frozen=True)
class LoraWeights:
    """One adapted projection of one layer: A [r, in], B [out, r] and its scale."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoraAdapter:
    """A validated adapter, keyed by (layer, module)."""

    digest: AdapterDigest
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], LoraWeights]
    packed: torch.Tensor | None = None
    """Every weight in one flat tensor laid out as the pool's extent (`extent.py`), with
    `weights` as views into it: a slot is filled from it with one copy. `parse_adapter`
    always packs (in the file's dtype); None only for an adapter built from loose tensors,
    which `pack` lays out on demand."""

    @property
    def num_parameters(self) -> int:
        return sum(w.a.numel() + w.b.numel() for w in self.weights.values())

    @cached_property
    def layout(self) -> ExtentLayout:
        """Its extent in the pool (and of `packed`); computed once per adapter."""
        return extent_layout((key, w.rank, int(w.a.shape[1]), int(w.b.shape[0]))
                             for key, w in self.weights.items())

    def pack(self) -> LoraAdapter:
        """This adapter with its weights in one extent-layout buffer (itself if they are)."""
        if self.packed is not None:
            return self
        dtype = host_dtype({t.dtype for w in self.weights.values() for t in (w.a, w.b)})
        packed, weights = pack_weights(
            [(k, w.a, w.b, w.scale) for k, w in self.weights.items()], dtype)
        return replace(self, weights=weights, packed=packed)

    def moved_to(self, packed: torch.Tensor) -> LoraAdapter:
        """The same adapter over a copy of its packed buffer (e.g. a page-locked one)."""
        assert self.packed is not None and packed.shape == self.packed.shape
        layout = self.layout
        weights = {k: _views(packed, layout.offsets[k], w.rank, int(w.a.shape[1]),
                             int(w.b.shape[0]), w.scale) for k, w in self.weights.items()}
        return replace(self, weights=weights, packed=packed)


HOST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def host_dtype(dtypes: set[torch.dtype]) -> torch.dtype:
    """The dtype a packed adapter keeps: the published one when all its tensors share one
    of `HOST_DTYPES` (fp16 weights stay fp16: half the host memory, and the slot copy
    converts on the fly), else float32."""
    return next(iter(dtypes)) if len(dtypes) == 1 and dtypes <= set(HOST_DTYPES) \
        else torch.float32


def _views(packed: torch.Tensor, offsets: tuple[int, int], rank: int, fin: int, fout: int,
           scale: float) -> LoraWeights:
    a_off, b_off = offsets
    a = packed[a_off:a_off + rank * fin].view(rank, fin)
    bt = packed[b_off:b_off + rank * fout].view(rank, fout)
    return LoraWeights(a, bt.T, scale)


_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`; a strided copy between equal dtypes goes through numpy, whose
    plain element moves transpose a [5632, 19] fp16 B about 6x faster than torch's copy
    kernel (measured 43 against 260 us), with the bits viewed as integers so bfloat16,
    which numpy lacks, moves the same way."""
    as_int = _SAME_SIZE_INT.get(dst.element_size())
    if (src.dtype != dst.dtype or as_int is None or src.is_contiguous()
            or src.device.type != "cpu" or dst.device.type != "cpu"):
        dst.copy_(src)
        return
    dst.view(as_int).numpy()[...] = src.detach().view(as_int).numpy()


def pack_weights(entries: list[tuple[Key, torch.Tensor, torch.Tensor, float]],
                 dtype: torch.dtype) -> tuple[torch.Tensor, dict[Key, LoraWeights]]:
    """(key, A [r, in], B [out, r], scale) entries into one extent-layout buffer of `dtype`.

    Each tensor is converted and transposed straight into its place (one copy from the
    source view), so nothing is materialised twice; the alignment padding is zeroed.
    """
    layout = extent_layout((k, int(a.shape[0]), int(a.shape[1]), int(b.shape[0]))
                           for k, a, b, _ in entries)
    packed = host_buffer(layout.length, dtype)
    weights: dict[Key, LoraWeights] = {}
    cursor = 0
    with one_thread(), torch.no_grad():
        for key, a, b, scale in entries:
            rank, fin, fout = int(a.shape[0]), int(a.shape[1]), int(b.shape[0])
            w = weights[key] = _views(packed, layout.offsets[key], rank, fin, fout, scale)
            for offset, end, dst, src in ((layout.offsets[key][0], rank * fin, w.a, a),
                                          (layout.offsets[key][1], rank * fout, w.b.T, b.T)):
                if offset > cursor:
                    packed[cursor:offset].zero_()
                _copy(dst, src)
                cursor = offset + end
        packed[cursor:].zero_()
    return packed, weights


def _matches_target(target: Any, module: str, full_name: str) -> bool:
    """PEFT's target_modules semantics: regex full-match if a string, else suffix match."""
    if isinstance(target, str):
        if target == "all-linear":
            return True
        return re.fullmatch(target, full_name) is not None
    return module in target or any(full_name.endswith("." + t) for t in target)


def _layers(raw: Any) -> set[int] | None:
    if raw is None:
        return None
    if isinstance(raw, int):
        return {raw}
    return {int(x) for x in raw}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` → "bfloat16": the names `services.contracts.capacity` uses."""
    return str(dtype).removeprefix("torch.")


def parse_adapter(files: AdapterFiles, cfg: ModelConfig, digest: AdapterDigest | None = None,
                  limits: AdapterLimits | None = None) -> LoraAdapter:
    """Validate a PEFT LoRA adapter against `cfg` (and, given them, the pool's `limits`)
    and return its per-module weights."""
    try:
        conf = json.loads(files.config_json)
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {exc}") from exc
    if conf.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {conf.get('peft_type')!r} is not supported (only LORA)")
    if conf.get("use_dora"):
        raise AdapterError("DoRA adapters (use_dora=true) are not supported")
    if conf.get("bias", "none") != "none":
        raise AdapterError(f"bias={conf.get('bias')!r} is not supported (only 'none')")
    for key in ("rank_pattern", "alpha_pattern"):
        if conf.get(key):
            raise AdapterError(f"{key} is not supported")
    if conf.get("modules_to_save"):
        raise AdapterError("modules_to_save is not supported (it replaces base weights)")
    if conf.get("layer_replication"):
        raise AdapterError("layer_replication is not supported")
    try:
        rank = int(conf["r"])
        alpha = float(conf.get("lora_alpha", rank))
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterError(f"{CONFIG_FILE} lacks a valid 'r'") from exc
    if rank <= 0:
        raise AdapterError(f"r must be positive, got {rank}")
    rslora = bool(conf.get("use_rslora", False))
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    targets = conf.get("target_modules")
    if targets is None:
        raise AdapterError("target_modules is missing")
    if not isinstance(targets, str):
        targets = list(targets)
        try:
            AdapterLimits.check_modules(targets)
        except OverCapacity as exc:
            raise AdapterError(exc.message) from None
    if limits is not None:
        try:
            limits.check_rank(rank)
        except OverCapacity as exc:
            raise AdapterError(exc.message) from None
    layers = _layers(conf.get("layers_to_transform"))
    # fan_in_fan_out only concerns Conv1D-style base weights; for nn.Linear projections PEFT
    # itself resets it to False, so it does not change the maths here.

    try:
        tensors = load_safetensors_bytes(files.weights)
    except Exception as exc:  # safetensors raises its own error type
        raise AdapterError(f"{WEIGHTS_FILE} is not a valid safetensors file: {exc}") from exc
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if "lora_magnitude_vector" in name:
            raise AdapterError(f"tensor {name}: DoRA magnitude vectors are not supported")
        m = TENSOR_NAME.match(name)
        if m is None:
            raise AdapterError(f"tensor {name} is not a LoRA weight of a decoder-layer projection")
        layer, parent, module, which = int(m[1]), m[2], m[3], m[4]
        if module not in TARGET_MODULES or PARENT[module] != parent:
            raise AdapterError(f"tensor {name} targets module {module!r}, which this model lacks")
        if not 0 <= layer < cfg.num_hidden_layers:
            raise AdapterError(f"tensor {name} targets layer {layer}, model has "
                               f"{cfg.num_hidden_layers}")
        full = f"model.layers.{layer}.{parent}.{module}"
        if not _matches_target(targets, module, full):
            raise AdapterError(f"tensor {name} is not covered by target_modules {targets}")
        if layers is not None and layer not in layers:
            raise AdapterError(f"tensor {name} is outside layers_to_transform {sorted(layers)}")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} contains no LoRA weights")
    if limits is not None:
        try:
            limits.check_dtypes({dtype_name(t.dtype) for t in tensors.values()})
        except OverCapacity as exc:
            raise AdapterError(exc.message) from None
    entries: list[tuple[Key, torch.Tensor, torch.Tensor, float]] = []
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_{'A' if 'A' not in ab else 'B'} is missing")
        a, b = ab["A"], ab["B"]
        fin, fout = module_shape(cfg, module)
        if tuple(a.shape) != (rank, fin):
            raise AdapterError(f"{where}: lora_A shape {list(a.shape)}, expected {[rank, fin]}")
        if tuple(b.shape) != (fout, rank):
            raise AdapterError(f"{where}: lora_B shape {list(b.shape)}, expected {[fout, rank]}")
        entries.append(((layer, module), a, b, scale))
    packed, weights = pack_weights(entries, host_dtype({t.dtype for t in tensors.values()}))
    modules = tuple(m for m in TARGET_MODULES if any(k[1] == m for k in weights))
    return LoraAdapter(
        digest=digest or files.digest(),
        rank=rank,
        alpha=alpha,
        use_rslora=rslora,
        target_modules=modules,
        weights=weights,
        packed=packed,
    )
