"""Checks on an uploaded PEFT LoRA adapter, before anything is stored or emitted.

The safetensors file is never loaded as tensors: its header (8-byte little-endian length,
then JSON) gives every tensor's name, dtype, shape and byte range, which is enough to check
PEFT naming against the declared target modules and the A/B shapes against `r` and the
registered base model's config.json. The data is then streamed once, in chunks: hashed
(sha256), scanned for NaN/Inf by exponent bits (no float conversion, so bf16 needs no
special support), and copied to the caller's sink (the blob store's temporary file).

The rules are the ones a worker's engine loads adapters by (`services.families.adapters`,
read against the base model's family description), so the registry never publishes an
adapter a worker would refuse; the limits both check (rank, dtype) are one rule they both
call, `services.contracts.capacity`. This module keeps no torch dependency.
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
from services.families import ModelConfig
from services.families.adapters import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterRefused,
    LoraSpec,
    check_targets,
    classify_tensor,
    expected_pairs,
    read_lora_config,
    tensor_name,
    tensor_shape,
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
    """A registered base model's config.json read through its family's description (the
    LoRA shapes and module names an adapter must have)."""

    config: ModelConfig

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> BaseModelShape:
        """Read config.json; raises ValueError naming the family or field it refuses."""
        return cls(ModelConfig.from_dict(config))

    @property
    def num_hidden_layers(self) -> int:
        return self.config.num_hidden_layers

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of one of the family's target modules."""
        return self.config.lora_shape(module)


# --- adapter_config.json -------------------------------------------------------------------


LoraConfig = LoraSpec


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
        return read_lora_config(raw)
    except AdapterRefused as exc:
        raise UploadRejected(exc.message, field=exc.field) from exc


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
    """PEFT naming, coverage and shapes by the family's description, and the fleet's
    limits; returns (modules, dtype)."""
    try:
        limits.check_rank(lora.max_rank)
    except OverCapacity as exc:
        raise over_capacity(exc, field="adapter_config") from None
    if not layout.tensors:
        raise UploadRejected(f"{WEIGHTS_FILE} contains no tensors")
    cfg = base.config
    try:
        check_targets(lora, cfg)
    except AdapterRefused as exc:  # the family's modules: a limit of what workers serve
        raise UploadRejected(exc.message, field=exc.field, limit="target_modules") from exc
    dtypes = set()
    pairs: dict[tuple[int, str], dict[str, TensorEntry]] = {}
    for entry in layout.tensors:
        try:
            role = classify_tensor(entry.name, lora, cfg)
        except AdapterRefused as exc:
            raise UploadRejected(exc.message, tensor=entry.name) from exc
        name = _DTYPES[entry.dtype][0] if entry.dtype in _DTYPES else entry.dtype
        try:
            limits.check_dtypes({name})
        except OverCapacity as exc:
            raise over_capacity(exc, tensor=entry.name) from None
        dtypes.add(name)
        if role.which in pairs.setdefault(role.key, {}):
            raise UploadRejected(f"tensor {entry.name} duplicates another "
                                 f"{role.module} {role.which}", tensor=entry.name)
        pairs[role.key][role.which] = entry
        want = tensor_shape(role, lora, cfg)
        if entry.shape != want:
            raise UploadRejected(f"tensor {entry.name} has shape {list(entry.shape)}, expected "
                                 f"{list(want)} (r={lora.rank_of(role.path)}, {role.module})",
                                 tensor=entry.name)
    try:
        dtype = limits.check_dtypes(dtypes)
    except OverCapacity as exc:
        raise over_capacity(exc, field="adapter_model") from None
    lora_pairs = {k for k, v in pairs.items() if "A" in v or "B" in v}
    try:
        expected = expected_pairs(lora, cfg, lora_pairs)
    except AdapterRefused as exc:
        raise UploadRejected(exc.message, field=exc.field) from exc
    for key in [*expected, *sorted(lora_pairs - set(expected))]:
        for which in ("A", "B"):
            if which not in pairs.get(key, {}):
                name = tensor_name(*key, which, cfg)
                raise UploadRejected(f"tensor {name} is missing", tensor=name)
    for module in lora.modules_to_save:
        if "W" not in pairs.get((-1, module), {}):
            raise UploadRejected(f"{CONFIG_FILE}: modules_to_save names {module}, but "
                                 f"{WEIGHTS_FILE} holds no {module} weight",
                                 field="modules_to_save")
    order = [*cfg.family.lora, "embed_tokens", "lm_head"]
    modules = tuple(m for m in order if any(k[1] == m for k in pairs))  # saved ones too
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
        rank=lora.max_rank,
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
