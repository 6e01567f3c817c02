"""Per-GPU-model launch decisions, read from ``loraplane_kernels/tuning/<GPU_MODEL>.json``.

Where fusing shrink+expand stops paying depends on the GPU's launch latency, SM count and
bandwidth, so the crossover is data measured per GPU model by ``bench/tune_kernels.py``,
not a constant in code. File layout::

    {"device": "NVIDIA H200", "source": "how the numbers were obtained",
     "entries": {"bgmv": {"4096": {"16": {"fused_max_tokens": 32, ...}}}}}

keyed by op (``bgmv`` or ``sgmv``), hidden size (the op's input width) and rank bucket (the
slab's ``max_rank`` rounded up to a listed bucket). The nearest hidden size on a log scale
is used. Optional per-entry launch parameters: ``shrink_split_k``, ``fused_n_split``, and
on sgmv entries ``fused_base_max_tokens``, the bucket size up to which the fused base +
LoRA kernel is used (two-level batching: one decision per adapter bucket).

When no file exists for the GPU model, ``default.json`` is used and a
:class:`TuningFallbackWarning` says so once per device, naming the file to create. It
carries launch parameters only and no fusion threshold: an untuned GPU runs every bucket
on the separate path (see ``loraplane_kernels.dispatch.base_fusion_threshold``, which also sets the
``loraplane_kernels_untuned`` metric). Setting ``LORAPLANE_KERNELS_TUNING`` to a JSON path
overrides the lookup entirely.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

TUNING_DIR = Path(__file__).parent / "tuning"
FALLBACK_FILE = "default.json"
OVERRIDE_ENV = "LORAPLANE_KERNELS_TUNING"
OPS = ("bgmv", "sgmv")


class TuningFallbackWarning(UserWarning):
    """No tuning table was measured for this GPU model; fallback thresholds are in use."""


def table_file_name(device_name: str) -> str:
    """``"NVIDIA H200"`` -> ``"NVIDIA_H200.json"``: the GPU model name as a file name."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"


@dataclass(frozen=True)
class TuningEntry:
    """Launch decisions for one (op, hidden size, rank bucket)."""

    fused_max_tokens: int
    shrink_split_k: int = 1
    fused_n_split: int = 1
    fused_base_max_tokens: int | None = None
    """Largest adapter bucket (tokens of one adapter in a step) for which the fused base +
    LoRA kernel beats the base GEMM followed by SGMV (sgmv entries). None: not measured,
    so the separate path is used; only a measured table sets it."""


@dataclass(frozen=True)
class TuningTable:
    device: str
    source: str
    path: Path
    is_fallback: bool
    entries: dict[str, dict[int, dict[int, TuningEntry]]]

    def lookup(self, op: str, hidden: int, max_rank: int) -> TuningEntry:
        """Entry for the nearest hidden size and the smallest rank bucket >= ``max_rank``."""
        if op not in self.entries:
            raise ValueError(f"op: {op!r} not in tuning table {self.path.name} "
                             f"(has {sorted(self.entries)})")
        by_hidden = self.entries[op]
        nearest = min(by_hidden, key=lambda h: (abs(math.log2(h / max(hidden, 1))), h))
        buckets = by_hidden[nearest]
        fitting = [r for r in buckets if r >= max_rank]
        return buckets[min(fitting) if fitting else max(buckets)]


def parse_table(data: dict[str, Any], path: Path, is_fallback: bool) -> TuningTable:
    """Build a table from its JSON form, rejecting malformed files loudly."""
    try:
        entries: dict[str, dict[int, dict[int, TuningEntry]]] = {
            op: {
                int(hidden): {int(rank): TuningEntry(**params) for rank, params in ranks.items()}
                for hidden, ranks in by_hidden.items()
            }
            for op, by_hidden in data["entries"].items()
        }
        table = TuningTable(device=str(data["device"]), source=str(data["source"]), path=path,
                            is_fallback=is_fallback, entries=entries)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"tuning table {path}: malformed ({exc!r})") from exc
    for op, by_hidden in entries.items():
        if not by_hidden or not all(by_hidden.values()):
            raise ValueError(f"tuning table {path}: op {op!r} has no entries")
    return table


def read_table(path: Path, is_fallback: bool = False) -> TuningTable:
    return parse_table(json.loads(path.read_text()), path, is_fallback)


def load_table(device_name: str) -> TuningTable:
    """The table for a GPU model (``torch.cuda.get_device_name()``), cached per process."""
    return _load_table(device_name, os.environ.get(OVERRIDE_ENV) or None)


@cache
def _load_table(device_name: str, override: str | None) -> TuningTable:
    if override:
        return read_table(Path(override))
    path = TUNING_DIR / table_file_name(device_name)
    if path.exists():
        return read_table(path)
    warnings.warn(
        f"no kernel tuning table for {device_name!r} "
        f"(expected loraplane_kernels/tuning/{path.name}); "
        f"using {FALLBACK_FILE}, whose thresholds are not measured. Run "
        f"bench/tune_kernels.py on this GPU to create one.",
        TuningFallbackWarning, stacklevel=3,
    )
    return read_table(TUNING_DIR / FALLBACK_FILE, is_fallback=True)
