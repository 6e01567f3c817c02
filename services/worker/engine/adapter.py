"""PEFT LoRA adapters: parse, validate against the base model, compute the content digest.

The rules are the ones the registry validates uploads by (`services.families.adapters`),
read against the base model's family description; everything that would make the
engine's output differ from PEFT's is refused with a message naming the field or tensor
(DoRA, trained biases, modules the model lacks), before any slot is touched. Given the
pool's limits, so is an adapter past them (rank, dtype): the same checks the registry
makes at publish (`services.contracts.capacity`), so both agree.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors_bytes

from services.contracts.capacity import AdapterLimits, OverCapacity
from services.families.adapters import (
    CONFIG_FILE,
    EMBED,
    LM_HEAD,
    WEIGHTS_FILE,
    AdapterRefused,
    check_targets,
    classify_tensor,
    expected_pairs,
    module_path,
    read_lora_config,
    tensor_name,
    tensor_shape,
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


REPLACED = -2
"""The layer of a `LoraAdapter.weights` entry that holds a whole replacement weight of
embed_tokens or lm_head (`modules_to_save`) as its A [vocab, hidden], with an empty B: it
travels in the adapter's extent like its LoRA weights, so the pool's byte budget counts
it. LoRA on embed_tokens and lm_head sits at layer -1."""


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a target module: a projection of the family, or
    embed_tokens (LoRA A [r, vocab], B [hidden, r]) or lm_head."""
    v, h = cfg.vocab_size, cfg.hidden_size
    return {EMBED: (v, h), LM_HEAD: (h, v)}.get(module) or cfg.lora_shape(module)


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
    """(layer, module) -> A, B and scale; layer -1 is embed_tokens / lm_head LoRA and
    `REPLACED` a whole replacement weight (see there)."""
    packed: torch.Tensor | None = None
    """Every weight in one flat tensor laid out as the pool's extent (`extent.py`), with
    `weights` as views into it: a slot is filled from it with one copy. `parse_adapter`
    always packs (in the file's dtype); None only for an adapter built from loose tensors,
    which `pack` lays out on demand."""
    replaced_modules: tuple[str, ...] = ()
    """embed_tokens / lm_head weights the adapter replaces whole (`modules_to_save`)."""

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


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` → "bfloat16": the names `services.contracts.capacity` uses."""
    return str(dtype).removeprefix("torch.")


def parse_adapter(files: AdapterFiles, cfg: ModelConfig,
                  digest: AdapterDigest | None = None,
                  limits: AdapterLimits | None = None,
                  base: Mapping[str, torch.Tensor] | None = None) -> LoraAdapter:
    """Validate a PEFT LoRA adapter against `cfg` (and, given them, the pool's `limits`)
    and return its per-module weights.

    `base` (embed_tokens and lm_head of the served model): a replacement weight equal to
    the base weight in the serving dtype is dropped, since serving it changes nothing.
    PEFT saves a copy of the base embedding beside embedding LoRA; kept, each would cost
    a vocabulary-sized weight per adapter."""
    try:
        return _parse(files, cfg, digest, limits, base or {})
    except AdapterRefused as exc:
        raise AdapterError(exc.message) from exc
    except OverCapacity as exc:
        raise AdapterError(exc.message) from None


def _parse(files: AdapterFiles, cfg: ModelConfig, digest: AdapterDigest | None,
           limits: AdapterLimits | None, base: Mapping[str, torch.Tensor]) -> LoraAdapter:
    spec = read_lora_config(files.config_json)
    check_targets(spec, cfg)
    if limits is not None:
        limits.check_rank(spec.max_rank)
    try:
        tensors = load_safetensors_bytes(files.weights)
    except Exception as exc:  # safetensors raises its own error type
        raise AdapterError(f"{WEIGHTS_FILE} is not a valid safetensors file: {exc}") from exc
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    replaced: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        t = classify_tensor(name, spec, cfg)
        want = tensor_shape(t, spec, cfg)
        if tuple(tensor.shape) != want:
            raise AdapterError(f"tensor {name} has shape {list(tensor.shape)}, expected "
                               f"{list(want)}")
        if t.which in ("W", "base"):
            targets = (t.module,)
            if t.which == "base" and cfg.tie_word_embeddings:  # one shared parameter
                targets = (EMBED, LM_HEAD)
            for module in targets:
                if module in replaced and not torch.equal(replaced[module], tensor):
                    raise AdapterError(f"tensor {name}: {module} is replaced twice, with "
                                       "different weights")
                replaced[module] = tensor
            continue
        if t.which in pairs.setdefault(t.key, {}):
            raise AdapterError(f"tensor {name} duplicates another lora_{t.which}")
        pairs[t.key][t.which] = tensor
    if not pairs and not replaced:
        raise AdapterError(f"{WEIGHTS_FILE} contains no LoRA weights")
    if limits is not None:
        limits.check_dtypes({dtype_name(t.dtype) for t in tensors.values()})
    for module in spec.modules_to_save:
        if module not in replaced:
            raise AdapterError(f"{CONFIG_FILE}: modules_to_save names {module}, but "
                               f"{WEIGHTS_FILE} holds no {module} weight")
    for module, weight in list(replaced.items()):
        served = base.get(module)
        if served is not None and torch.equal(
                weight.to(device=served.device, dtype=served.dtype), served):
            del replaced[module]
    for key in expected_pairs(spec, cfg, pairs):
        for which in ("A", "B"):
            if which not in pairs.get(key, {}):
                raise AdapterError(f"tensor {tensor_name(*key, which, cfg)} is missing "
                                   f"(layer {key[0]} {key[1]}: lora_{which})")
    entries: list[tuple[Key, torch.Tensor, torch.Tensor, float]] = []
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module}: lora_{'A' if 'A' not in ab else 'B'} "
                               "is missing")
        entries.append(((layer, module), ab["A"], ab["B"],
                        spec.scale_of(module_path(layer, module, cfg))))
    for module, weight in sorted(replaced.items()):
        entries.append(((REPLACED, module), weight,
                        weight.new_zeros(0, weight.shape[0]), 1.0))
    packed, weights = pack_weights(entries, host_dtype({t.dtype for t in tensors.values()}))
    order = [*cfg.family.lora, EMBED, LM_HEAD]
    modules = tuple(m for m in order if any(k[1] == m and k[0] != REPLACED for k in weights))
    return LoraAdapter(
        digest=digest or files.digest(),
        rank=max([w.rank for k, w in weights.items() if k[0] != REPLACED], default=0),
        alpha=spec.alpha,
        use_rslora=spec.use_rslora,
        target_modules=modules,
        weights=weights,
        packed=packed,
        replaced_modules=tuple(sorted(replaced)),
    )
