"""Checks on an uploaded PEFT LoRA adapter, before anything is stored or emitted.

The safetensors file is never loaded as tensors: its header (8-byte little-endian length,
then JSON) gives every tensor's name, dtype, shape and byte range, which is enough to check
PEFT naming against the declared target modules and the A/B shapes against `r` and the
registered base model's config.json. The data is then streamed once, in chunks: hashed
(sha256), scanned for NaN/Inf by exponent bits (no float conversion, so bf16 needs no
special support), and copied to the caller's sink (the blob store's temporary file).

The rules mirror what a worker's engine accepts (`services/worker/engine/adapter.py`),
so the registry never publishes an adapter a worker would refuse; the limits both check
(rank, dtype, target modules) are one rule they both call, `services.contracts.capacity`.
This module keeps no torch dependency.
"""

from __future__ import annotations

import hashlib
import json
import re
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from services.contracts.capacity import AdapterLimits, OverCapacity
from services.contracts.peft import (
    CONFIG_FILE,
    PARENT,
    TARGET_MODULES,
    TENSOR_NAME,
    WEIGHTS_FILE,
    projection_shape,
)
from services.registry.domain import ArtifactFacts

MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_CONFIG_BYTES = 1024 * 1024
CHUNK_BYTES = 1 << 20


# safetensors dtype → (numpy-style name, item size, unsigned view, exponent mask)
_DTYPES: dict[str, tuple[str, int, Any, int]] = {
    "F16": ("float16", 2, np.uint16, 0x7C00),
    "BF16": ("bfloat16", 2, np.uint16, 0x7F80),
    "F32": ("float32", 4, np.uint32, 0x7F800000),
    "F64": ("float64", 8, np.uint64, 0x7FF0000000000000),
}


class UploadRejected(Exception):
    """An upload that may not be stored; `status` is 413 or 422, `tensor` or `field` names
    the culprit, `extensions` go into the problem as they are."""

    def __init__(self, message: str, *, status: int = 422, tensor: str | None = None,
                 field: str | None = None, **extensions: Any) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.tensor = tensor
        self.field = field
        self.extensions = extensions


# --- the base model ------------------------------------------------------------------------


@dataclass(frozen=True)
class BaseModelShape:
    """The dimensions of a Llama-family base model that LoRA shapes depend on."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> BaseModelShape:
        """Read config.json; raises ValueError naming the missing or bad field."""
        def positive(key: str, default: Any = None) -> int:
            raw = config.get(key, default)
            if isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0:
                raise ValueError(f"config.json: {key} must be a positive integer, got {raw!r}")
            return raw

        hidden = positive("hidden_size")
        heads = positive("num_attention_heads")
        kv_heads = positive("num_key_value_heads", config.get("num_key_value_heads") or heads)
        head_dim = positive("head_dim", config.get("head_dim") or hidden // heads or None)
        if heads % kv_heads:
            raise ValueError("config.json: num_attention_heads must be a multiple of "
                             "num_key_value_heads")
        return cls(hidden, positive("intermediate_size"), heads, kv_heads, head_dim,
                   positive("num_hidden_layers"))

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of one projection."""
        return projection_shape(
            module, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            q_size=self.num_attention_heads * self.head_dim,
            kv_size=self.num_key_value_heads * self.head_dim)


# --- adapter_config.json -------------------------------------------------------------------


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...] | str
    """A list of module names, or PEFT's regex string (full match on the module path)."""
    layers: frozenset[int] | None
    declared_base: str | None = None
    """`base_model_name_or_path`: the model the adapter says it was trained on."""


def over_capacity(exc: OverCapacity, *, tensor: str | None = None,
                  field: str | None = None) -> UploadRejected:
    """A limit of the fleet (`services.contracts.capacity`): 422 naming it (`limit`)."""
    where = f"{CONFIG_FILE}: " if field == "adapter_config" else \
        f"tensor {tensor}: " if tensor else f"{WEIGHTS_FILE}: "
    return UploadRejected(where + exc.message, tensor=tensor, field=field, limit=exc.limit)


def too_large_config(size: int) -> UploadRejected:
    """One status for one problem: an oversized adapter_config.json is 413 however sent."""
    return UploadRejected(f"{CONFIG_FILE} is {size} bytes, over the {MAX_CONFIG_BYTES}-byte "
                          "limit", status=413, field="adapter_config")


def parse_lora_config(raw: bytes) -> LoraConfig:
    if len(raw) > MAX_CONFIG_BYTES:
        raise too_large_config(len(raw))
    try:
        conf = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UploadRejected(f"{CONFIG_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(conf, dict):
        raise UploadRejected(f"{CONFIG_FILE} must be a JSON object")
    if conf.get("peft_type", "LORA") != "LORA":
        raise UploadRejected(f"peft_type {conf.get('peft_type')!r} is not supported (only LORA)")
    for key, why in (("use_dora", "DoRA is not supported"),
                     ("rank_pattern", "per-module ranks are not supported"),
                     ("alpha_pattern", "per-module alphas are not supported"),
                     ("modules_to_save", "it replaces base weights"),
                     ("layer_replication", "it is not supported")):
        if conf.get(key):
            raise UploadRejected(f"{CONFIG_FILE}: {key} is set ({why})")
    if conf.get("bias", "none") != "none":
        raise UploadRejected(f"{CONFIG_FILE}: bias={conf.get('bias')!r} (only 'none')")
    rank = conf.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise UploadRejected(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    alpha = conf.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise UploadRejected(f"{CONFIG_FILE}: lora_alpha must be a number")
    targets = conf.get("target_modules")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as exc:
            raise UploadRejected(f"{CONFIG_FILE}: target_modules regex is invalid: {exc}") from exc
        declared: tuple[str, ...] | str = targets
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        try:
            AdapterLimits.check_modules(targets)
        except OverCapacity as exc:
            raise over_capacity(exc, field="adapter_config") from None
        declared = tuple(targets)
    else:
        raise UploadRejected(f"{CONFIG_FILE}: target_modules must be a non-empty list or a "
                             "regex string")
    layers_raw = conf.get("layers_to_transform")
    layers: frozenset[int] | None = None
    if isinstance(layers_raw, int) and not isinstance(layers_raw, bool):
        layers = frozenset({layers_raw})
    elif isinstance(layers_raw, list) and all(isinstance(x, int) for x in layers_raw):
        layers = frozenset(layers_raw)
    elif layers_raw is not None:
        raise UploadRejected(f"{CONFIG_FILE}: layers_to_transform must be integers")
    base = conf.get("base_model_name_or_path")
    if base is not None and (not isinstance(base, str) or len(base) > 512):
        raise UploadRejected(f"{CONFIG_FILE}: base_model_name_or_path must be a name or path "
                             "of at most 512 characters")
    return LoraConfig(rank, float(alpha), declared, layers, base or None)


def declared_base_matches(declared: str, registered: str,
                          registered_config: Mapping[str, Any]) -> bool:
    """Whether `base_model_name_or_path` names the registered base model: its name, or the
    `_name_or_path` of its config.json, compared by last path segment, case-insensitively
    (`/models/Tiny-Llama/` names `tiny-llama`)."""
    def tail(name: str) -> str:
        return name.strip().rstrip("/").rsplit("/", 1)[-1].lower()

    names = {tail(registered)}
    if isinstance(registered_config.get("_name_or_path"), str):
        names.add(tail(registered_config["_name_or_path"]))
    return tail(declared) in names


def _covers(targets: tuple[str, ...] | str, module: str, path: str) -> bool:
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, path) is not None
    return module in targets


# --- the safetensors header ----------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsLayout:
    header: bytes
    """The 8 length bytes and the JSON header, exactly as read (they are hashed too)."""
    tensors: tuple[TensorEntry, ...]
    """Sorted by byte offset; together they cover the data region exactly."""
    data_bytes: int


def read_header(source: IO[bytes], total_size: int) -> SafetensorsLayout:
    """Parse the header from the start of `source`; leaves the stream at the data region."""
    prefix = source.read(8)
    if len(prefix) < 8:
        raise UploadRejected(f"{WEIGHTS_FILE} is truncated: {total_size} bytes, less than the "
                             "8 bytes that start every safetensors file", field="adapter_model")
    length = int.from_bytes(prefix, "little")
    if length > MAX_HEADER_BYTES:
        raise UploadRejected(f"{WEIGHTS_FILE}: its header would be {length} bytes, over the "
                             f"{MAX_HEADER_BYTES}-byte limit: is it a safetensors file?",
                             field="adapter_model")
    if length > total_size - 8:
        raise UploadRejected(f"{WEIGHTS_FILE} is truncated: its header declares {length} "
                             f"bytes, only {total_size - 8} follow", field="adapter_model")
    raw = source.read(length)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UploadRejected(f"{WEIGHTS_FILE}: header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise UploadRejected(f"{WEIGHTS_FILE}: header must be a JSON object")
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(info["dtype"])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UploadRejected(f"tensor {name}: malformed header entry", tensor=name) from exc
        if any(d < 0 for d in shape) or begin < 0 or end < begin:
            raise UploadRejected(f"tensor {name}: negative shape or offsets", tensor=name)
        entries.append(TensorEntry(name, dtype, shape, begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    data_bytes = total_size - 8 - length
    cursor = 0
    for entry in entries:
        if entry.begin != cursor:
            raise UploadRejected(f"tensor {entry.name}: data offsets overlap or leave a gap",
                                 tensor=entry.name)
        size = _DTYPES[entry.dtype][1] if entry.dtype in _DTYPES else None
        if size is not None and entry.end - entry.begin != size * int(np.prod(entry.shape)):
            raise UploadRejected(f"tensor {entry.name}: byte range does not match shape "
                                 f"{list(entry.shape)} of {entry.dtype}", tensor=entry.name)
        cursor = entry.end
    if cursor > data_bytes:
        raise UploadRejected(f"{WEIGHTS_FILE} is truncated: its tensors need {cursor} bytes "
                             f"of data, the file holds {data_bytes}", field="adapter_model")
    if cursor < data_bytes:
        raise UploadRejected(f"{WEIGHTS_FILE} has {data_bytes - cursor} bytes after its last "
                             "tensor", field="adapter_model")
    return SafetensorsLayout(prefix + raw, tuple(entries), data_bytes)


# --- naming and shapes ---------------------------------------------------------------------


def check_tensors(layout: SafetensorsLayout, lora: LoraConfig, base: BaseModelShape, *,
                  limits: AdapterLimits) -> tuple[tuple[str, ...], str]:
    """PEFT naming, coverage, shapes, and the fleet's limits; returns (modules, dtype)."""
    try:
        limits.check_rank(lora.rank)
    except OverCapacity as exc:
        raise over_capacity(exc, field="adapter_config") from None
    if not layout.tensors:
        raise UploadRejected(f"{WEIGHTS_FILE} contains no tensors")
    dtypes = set()
    pairs: dict[tuple[int, str], dict[str, TensorEntry]] = {}
    for entry in layout.tensors:
        m = TENSOR_NAME.match(entry.name)
        if m is None:
            raise UploadRejected(f"tensor {entry.name} is not a PEFT LoRA weight of a decoder "
                                 "layer projection", tensor=entry.name)
        layer, parent, module, which = int(m[1]), m[2], m[3], m[4]
        if module not in TARGET_MODULES or PARENT[module] != parent:
            raise UploadRejected(f"tensor {entry.name} targets {parent}.{module}, which the "
                                 "base model lacks", tensor=entry.name)
        if layer >= base.num_hidden_layers:
            raise UploadRejected(f"tensor {entry.name} targets layer {layer}; the base model has "
                                 f"{base.num_hidden_layers}", tensor=entry.name)
        path = f"model.layers.{layer}.{parent}.{module}"
        if not _covers(lora.targets, module, path):
            raise UploadRejected(f"tensor {entry.name} is not covered by target_modules "
                                 f"{lora.targets!r}", tensor=entry.name)
        if lora.layers is not None and layer not in lora.layers:
            raise UploadRejected(f"tensor {entry.name} is outside layers_to_transform",
                                 tensor=entry.name)
        name = _DTYPES[entry.dtype][0] if entry.dtype in _DTYPES else entry.dtype
        try:
            limits.check_dtypes({name})
        except OverCapacity as exc:
            raise over_capacity(exc, tensor=entry.name) from None
        dtypes.add(name)
        if which in pairs.setdefault((layer, module), {}):
            raise UploadRejected(f"tensor {entry.name} duplicates another lora_{which}",
                                 tensor=entry.name)
        pairs[(layer, module)][which] = entry
        fin, fout = base.module_shape(module)
        want = (lora.rank, fin) if which == "A" else (fout, lora.rank)
        if entry.shape != want:
            raise UploadRejected(f"tensor {entry.name} has shape {list(entry.shape)}, expected "
                                 f"{list(want)} (r={lora.rank}, {module} {fin}->{fout})",
                                 tensor=entry.name)
    try:
        dtype = limits.check_dtypes(dtypes)
    except OverCapacity as exc:
        raise over_capacity(exc, field="adapter_model") from None
    layers = sorted(lora.layers) if lora.layers is not None else range(base.num_hidden_layers)
    present = {module for _, module in pairs}
    declared = lora.targets if isinstance(lora.targets, tuple) else tuple(sorted(present))
    for module in declared:
        for layer in layers:
            ab = pairs.get((layer, module), {})
            for which in ("A", "B"):
                if which not in ab:
                    name = (f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}"
                            f".lora_{which}.weight")
                    raise UploadRejected(f"tensor {name} is missing", tensor=name)
    modules = tuple(m for m in TARGET_MODULES if m in present)
    return modules, dtype


# --- the data ------------------------------------------------------------------------------


def scan_data(source: IO[bytes], layout: SafetensorsLayout, hasher: Any,
              sink: IO[bytes] | None) -> None:
    """Stream every tensor's bytes once: hash, copy to `sink`, refuse NaN/Inf by name."""
    for entry in layout.tensors:
        _, item, view, mask = _DTYPES[entry.dtype]
        remaining = entry.end - entry.begin
        step = CHUNK_BYTES - CHUNK_BYTES % item
        while remaining:
            chunk = source.read(min(step, remaining))
            if not chunk:
                raise UploadRejected(f"{WEIGHTS_FILE} is truncated: it ends inside tensor "
                                     f"{entry.name}", tensor=entry.name)
            if len(chunk) % item:
                rest = source.read(item - len(chunk) % item)
                chunk += rest
            remaining -= len(chunk)
            hasher.update(chunk)
            if sink is not None:
                sink.write(chunk)
            bits = np.frombuffer(chunk, dtype=np.dtype(view).newbyteorder("<"))
            if np.any((bits & view(mask)) == view(mask)):
                raise UploadRejected(f"tensor {entry.name} contains NaN or Inf",
                                     tensor=entry.name)


def validate_adapter(config_bytes: bytes, weights: IO[bytes], weights_size: int,
                     base_config: Mapping[str, Any], *, limits: AdapterLimits,
                     sink: IO[bytes] | None = None,
                     base_name: str | None = None) -> ArtifactFacts:
    """Every check, in order of cost; the weights are read once and copied to `sink`.

    `base_name` is the registered base model's name: when the adapter declares another
    base (`base_model_name_or_path`) and its shapes do not fit, the refusal says so."""
    lora = parse_lora_config(config_bytes)
    try:
        base = BaseModelShape.from_config(base_config)
    except ValueError as exc:
        raise UploadRejected(f"registered base model: {exc}") from exc
    layout = read_header(weights, weights_size)
    try:
        modules, dtype = check_tensors(layout, lora, base, limits=limits)
    except UploadRejected as exc:
        declared = lora.declared_base
        if declared and base_name and not declared_base_matches(declared, base_name,
                                                                base_config):
            exc.message += (f". The adapter declares base_model_name_or_path {declared!r}; it "
                            f"was checked against the registered base model {base_name!r}: "
                            "publish it against the model it was trained on")
            exc.extensions["declared_base_model"] = declared
        raise
    hasher = hashlib.sha256(layout.header)
    if sink is not None:
        sink.write(layout.header)
    scan_data(weights, layout, hasher, sink)
    if weights.read(1):
        raise UploadRejected(f"{WEIGHTS_FILE} has bytes after its last tensor",
                             field="adapter_model")
    return ArtifactFacts(
        sha256=hasher.hexdigest(),
        config_sha256=hashlib.sha256(config_bytes).hexdigest(),
        size_bytes=weights_size,
        rank=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=modules,
        dtype=dtype,
        declared_base_model=lora.declared_base,
    )


# --- tarballs ------------------------------------------------------------------------------


@dataclass
class UnpackedAdapter:
    config: bytes
    weights: IO[bytes]
    weights_size: int


def unpack_archive(archive: IO[bytes], max_bytes: int) -> UnpackedAdapter:
    """Read the two adapter files out of a .tar.gz without writing anything to a path.

    Any absolute or `..` member name, link, device or FIFO refuses the whole archive:
    a tarball that tries it is hostile, whatever else it holds. Members may sit at the top
    or under one directory. Decompressed sizes are capped (a gzip bomb is a 413).
    """
    config: bytes | None = None
    weights: IO[bytes] | None = None
    size = 0
    try:
        with tarfile.open(fileobj=archive, mode="r:gz") as tar:
            for member in tar:
                name = member.name
                parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
                if name.startswith(("/", "\\")) or ".." in parts or re.match(r"^[A-Za-z]:", name):
                    raise UploadRejected(f"archive member {name!r} escapes the adapter directory")
                if member.issym() or member.islnk():
                    raise UploadRejected(f"archive member {name!r} is a link")
                if member.isdir():
                    continue
                if not member.isfile():
                    raise UploadRejected(f"archive member {name!r} is not a regular file")
                if len(parts) > 2:
                    raise UploadRejected(f"archive member {name!r} is nested too deep")
                base = parts[-1]
                if base not in (CONFIG_FILE, WEIGHTS_FILE):
                    continue
                if base == CONFIG_FILE and member.size > MAX_CONFIG_BYTES:
                    raise too_large_config(member.size)
                if member.size > max_bytes:
                    raise UploadRejected(f"archive member {name!r} is {member.size} bytes, over "
                                         f"the {max_bytes}-byte limit", status=413,
                                         field="archive")
                handle = tar.extractfile(member)
                assert handle is not None
                if base == CONFIG_FILE:
                    config = handle.read(MAX_CONFIG_BYTES + 1)
                else:
                    spool = tempfile.SpooledTemporaryFile(max_size=8 * CHUNK_BYTES)  # noqa: SIM115 (returned)
                    while chunk := handle.read(CHUNK_BYTES):
                        spool.write(chunk)
                    size = spool.tell()
                    spool.seek(0)
                    weights = spool
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        raise UploadRejected(f"archive is not a valid .tar.gz: {exc}") from exc
    if config is None or weights is None:
        raise UploadRejected(f"archive must contain {CONFIG_FILE} and {WEIGHTS_FILE}")
    return UnpackedAdapter(config, weights, size)
