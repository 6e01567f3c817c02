"""An adapter's extent: the one layout its weights have in the pool and in the host tier.

The pool stores an adapter as one contiguous run of elements holding, for every
(layer, projection) it adapts in order, ``A`` [rank, in] then ``B.T`` [rank, out], each
starting on an `ALIGN` boundary. The host tier keeps parsed adapters in exactly this
layout (`LoraAdapter.packed`), so moving one into a slot is a single copy of the whole
extent (converting dtype on the fly) instead of hundreds of small strided ones. Both sides
compute offsets here, so they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from loraplane_kernels.threads import one_thread

__all__ = ["one_thread"]  # re-exported: the pool and the parser copy in one thread

ALIGN = 16
"""Each A / B.T starts on a 16-element boundary (64 bytes in fp32): aligned vector loads."""

Key = tuple[int, str]
"""(layer, projection)"""


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ExtentLayout:
    """Where each projection's A and B.T start, relative to the extent's start."""

    offsets: dict[Key, tuple[int, int]]
    length: int
    """Elements the whole extent takes, padding included."""


def extent_layout(shapes: Iterable[tuple[Key, int, int, int]]) -> ExtentLayout:
    """Offsets for (key, rank, in_features, out_features) entries, in the order given."""
    offsets: dict[Key, tuple[int, int]] = {}
    cursor = 0
    for key, rank, fin, fout in shapes:
        a_off, cursor = cursor, cursor + aligned(rank * fin)
        b_off, cursor = cursor, cursor + aligned(rank * fout)
        offsets[key] = (a_off, b_off)
    return ExtentLayout(offsets, cursor)


def host_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory numpy allocated.

    numpy asks the kernel for transparent huge pages for buffers of 4 MiB and more
    (madvise); torch's CPU allocator does not. Touching a fresh 60 MB buffer of 4 KiB pages
    measured 60-90 ms on the 2-core bench machine, against about 10 ms with huge pages:
    more than the whole conversion it holds.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.empty(numel * itemsize, dtype=np.uint8)).view(dtype)
