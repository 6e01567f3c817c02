"""Argument checks shared by every backend.

A wrong shape handed to a Triton kernel does not fail: it reads or writes the wrong memory.
So every public op checks shapes and dtypes up front and raises ``ValueError`` naming the
argument. Checks of tensor *values* (slot indices in range, ranks within the slab) need a
device-to-host copy, so they run on CPU tensors always and on CUDA tensors only when
``LORAPLANE_KERNELS_CHECK_VALUES=1`` (a debugging aid; it would stall every layer otherwise).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import Tensor

from loraplane_kernels.rank_pool import PooledLora
from loraplane_kernels.segments import Segments

#: Activation and weight dtypes the Triton kernels accept. float64 is accepted by the torch
#: path only, because the tests use it as the oracle.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REFERENCE_DTYPES = (*KERNEL_DTYPES, torch.float64)

MAX_SUPPORTED_RANK = 128


def _require(condition: bool, name: str, message: str | Callable[[], str]) -> None:
    """`message` may be a callable, formatted only on failure: for checks on the per-step
    hot path, where formatting every message up front cost about 30 us a call."""
    if not condition:
        raise ValueError(f"{name}: {message() if callable(message) else message}")


def _values_checked(t: Tensor) -> bool:
    return t.device.type == "cpu" or os.environ.get("LORAPLANE_KERNELS_CHECK_VALUES") == "1"


def check_slot_tables(ranks: Tensor, num_slots: int, max_rank: int, device: torch.device,
                      scales: Tensor | None = None) -> None:
    """Check ``ranks`` (and ``scales``) against the slab they describe."""
    _require(ranks.device == device, "ranks", f"on {ranks.device}, weights on {device}")
    if scales is not None:
        _require(scales.device == device, "scales", f"on {scales.device}, weights on {device}")
    _require(ranks.dim() == 1 and ranks.shape[0] == num_slots, "ranks",
             f"expected shape [{num_slots}] (one per slot), got {list(ranks.shape)}")
    _require(ranks.dtype == torch.int32, "ranks", f"expected int32, got {ranks.dtype}")
    _require(max_rank <= MAX_SUPPORTED_RANK, "a_slab/b_slab",
             f"max_rank {max_rank} exceeds the supported {MAX_SUPPORTED_RANK}")
    if scales is not None:
        _require(scales.dim() == 1 and scales.shape[0] == num_slots, "scales",
                 f"expected shape [{num_slots}], got {list(scales.shape)}")
        _require(scales.dtype == torch.float32, "scales", f"expected float32, got {scales.dtype}")
    if _values_checked(ranks) and ranks.numel():
        lo, hi = int(ranks.min()), int(ranks.max())
        _require(lo >= 0 and hi <= max_rank, "ranks",
                 f"values must lie in [0, {max_rank}] (the slab's max_rank), got [{lo}, {hi}]")


def check_routing(indices: Tensor, segments: Segments | None, num_tokens: int,
                  num_slots: int, device: torch.device) -> None:
    """Check per-token ``indices`` or SGMV ``segments`` for a batch of ``num_tokens``."""
    # With segments the per-token indices are not read; callers may pass them or an empty
    # tensor, whichever they already hold.
    allowed = (num_tokens,) if segments is None else (num_tokens, 0)
    _require(indices.dim() == 1 and indices.shape[0] in allowed, "indices",
             f"expected shape [{num_tokens}] (one per token), got {list(indices.shape)}")
    _require(indices.dtype == torch.int32, "indices", f"expected int32, got {indices.dtype}")
    _require(indices.device == device, "indices", f"on {indices.device}, activations on {device}")
    if segments is None and _values_checked(indices) and indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        _require(lo >= -1 and hi < num_slots, "indices",
                 f"values must lie in [-1, {num_slots - 1}], got [{lo}, {hi}]")
    if segments is None:
        return
    starts, slots = segments.starts, segments.slots
    _require(slots.dim() == 1, "segments.slots", f"expected 1-D, got {list(slots.shape)}")
    _require(starts.dim() == 1 and starts.shape[0] == slots.shape[0] + 1, "segments.starts",
             f"expected shape [{slots.shape[0] + 1}] (G+1), got {list(starts.shape)}")
    for name, t in (("segments.starts", starts), ("segments.slots", slots)):
        _require(t.dtype == torch.int32, name, f"expected int32, got {t.dtype}")
        _require(t.device == device, name, f"on {t.device}, activations on {device}")
    if _values_checked(starts):
        first, last = int(starts[0]), int(starts[-1])
        _require(first == 0 and last == num_tokens, "segments.starts",
                 f"must run from 0 to {num_tokens}, got {first}..{last}")
        _require(bool((starts[1:] >= starts[:-1]).all()), "segments.starts",
                 "must be non-decreasing")
        if slots.numel():
            lo, hi = int(slots.min()), int(slots.max())
            _require(lo >= -1 and hi < num_slots, "segments.slots",
                     f"values must lie in [-1, {num_slots - 1}], got [{lo}, {hi}]")


def check_shrink(x: Tensor, a_slab: Tensor, ranks: Tensor, indices: Tensor,
                 segments: Segments | None, dtypes: tuple[torch.dtype, ...]) -> None:
    """Validate the arguments of ``lora_shrink``."""
    _require(x.dim() == 2, "x", f"expected [T, in_features], got {list(x.shape)}")
    _require(x.dtype in dtypes, "x", f"dtype {x.dtype} not in {dtypes}")
    _require(a_slab.dim() == 3, "a_slab",
             f"expected [num_slots, max_rank, in_features], got {list(a_slab.shape)}")
    _require(a_slab.shape[2] == x.shape[1], "a_slab",
             f"in_features {a_slab.shape[2]} does not match x's {x.shape[1]}")
    _require(a_slab.dtype == x.dtype, "a_slab", f"dtype {a_slab.dtype} differs from x's {x.dtype}")
    _require(a_slab.device == x.device, "a_slab", f"on {a_slab.device}, x on {x.device}")
    check_slot_tables(ranks, a_slab.shape[0], a_slab.shape[1], x.device)
    check_routing(indices, segments, x.shape[0], a_slab.shape[0], x.device)


def check_expand(y: Tensor, h: Tensor | None, b_slab: Tensor, ranks: Tensor, scales: Tensor,
                 indices: Tensor, out_offset: int, segments: Segments | None,
                 dtypes: tuple[torch.dtype, ...]) -> None:
    """Validate the arguments of ``lora_expand``."""
    _require(y.dim() == 2, "y", f"expected [T, out_total], got {list(y.shape)}")
    _require(y.dtype in dtypes, "y", f"dtype {y.dtype} not in {dtypes}")
    _require(b_slab.dim() == 3, "b_slab",
             f"expected [num_slots, out_features, max_rank], got {list(b_slab.shape)}")
    _require(b_slab.dtype == y.dtype, "b_slab", f"dtype {b_slab.dtype} differs from y's {y.dtype}")
    _require(b_slab.device == y.device, "b_slab", f"on {b_slab.device}, y on {y.device}")
    num_slots, out_features, max_rank = b_slab.shape
    if h is not None:  # None: fused apply, where h never leaves registers
        _require(h.dim() == 2 and h.shape[0] == y.shape[0] and h.shape[1] == max_rank, "h",
                 f"expected [{y.shape[0]}, {max_rank}], got {list(h.shape)}")
        _require(h.dtype in (torch.float32, torch.float64), "h",
                 f"expected float32 (as lora_shrink returns), got {h.dtype}")
        _require(h.device == y.device, "h", f"on {h.device}, y on {y.device}")
    _require(out_offset >= 0 and out_offset + out_features <= y.shape[1], "out_offset",
             f"slice [{out_offset}, {out_offset + out_features}) does not fit y's "
             f"{y.shape[1]} columns")
    check_slot_tables(ranks, num_slots, max_rank, y.device, scales)
    check_routing(indices, segments, y.shape[0], num_slots, y.device)


def check_slab_pair(a_slab: Tensor, b_slab: Tensor) -> None:
    """A and B slabs of one module must describe the same slots and the same max rank."""
    _require(a_slab.dim() == 3 and b_slab.dim() == 3
             and a_slab.shape[0] == b_slab.shape[0] and a_slab.shape[1] == b_slab.shape[2],
             "b_slab", f"shape {list(b_slab.shape)} does not pair with a_slab's "
             f"{list(a_slab.shape)} (expected [num_slots, out_features, max_rank])")


def check_pooled(y: Tensor, x: Tensor, w: PooledLora, out_offset: int) -> None:
    """Validate activations against a rank pool (its tables are checked when written).

    It runs for every projection of every step, so its messages are formatted on failure
    only."""
    _require(x.dim() == 2 and x.shape[1] == w.in_features, "x",
             lambda: f"expected [T, {w.in_features}], got {list(x.shape)}")
    _require(x.dtype == w.pool.dtype, "x", lambda: f"dtype {x.dtype} differs from the pool's "
             f"{w.pool.dtype}")
    _require(x.device == w.pool.device, "x", lambda: f"on {x.device}, pool on {w.pool.device}")
    _require(y.dim() == 2 and y.shape[0] == x.shape[0], "y",
             lambda: f"expected [{x.shape[0]}, out_total], got {list(y.shape)}")
    _require(y.dtype == x.dtype, "y", lambda: f"dtype {y.dtype} differs from x's {x.dtype}")
    _require(out_offset >= 0 and out_offset + w.out_features <= y.shape[1], "out_offset",
             lambda: f"slice [{out_offset}, {out_offset + w.out_features}) does not fit y's "
             f"{y.shape[1]} columns")
