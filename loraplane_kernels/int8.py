"""Int8 weight-only base projections: per-output-channel symmetric int8 weights with one
scale per row, multiplied against activations in the serving dtype.

The format is the one vLLM's and llama.cpp's 8-bit weight-only paths use in spirit
(Q8_0 scales blocks of 32, this scales whole rows, which is what torch's int8 matmul
takes): ``w ≈ q * scale[:, None]``, ``q = round(w / scale)`` in [-127, 127],
``scale = max|w_row| / 127``. Halving the bytes of every base weight is what a decode
step, bound by memory bandwidth, gains from; the LoRA deltas stay in the serving dtype.

On CPU the product runs in torch's weight-only int8 kernel (``_weight_int8pack_mm``,
which dequantises a tile at a time in registers) for batches of a few rows, where bytes
dominate; for bigger batches the whole weight is dequantised once into a reused buffer
and multiplied there by the dense kernel (AMX/AVX512-BF16 matmuls are several times
faster than the int8 kernel's arithmetic once a step has many rows). On GPU every
batch takes a Triton kernel that widens each int8 tile in registers
(:mod:`loraplane_kernels.triton.int8_mm`), so no dequantised copy is ever written there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from loraplane_kernels import cpu_decode
from loraplane_kernels.dispatch import BACKEND_ENV, select_backend

QMAX = 127
INT8PACK_MAX_ROWS = 16
"""CPU batches of at most this many rows take the int8 kernel; more rows dequantise the
weight into a buffer and take the dense matmul (see the module doc and bench/int8.py)."""


@dataclass
class Int8Weight:
    """A [out, in] projection weight as int8 rows and one scale per row."""

    q: Tensor  # [out, in] int8, contiguous
    scale: Tensor  # [out], the activations' dtype (the int8 kernel multiplies in it)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.scale.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def dequantize(self, out: Tensor | None = None) -> Tensor:
        """``q * scale`` in the serving dtype (into `out` when given)."""
        if out is None:
            out = torch.empty(self.q.shape, dtype=self.dtype, device=self.device)
        if cpu_decode.dequantize_int8(self.q, self.scale, out):
            return out
        out.copy_(self.q)
        return out.mul_(self.scale[:, None])

    def __getitem__(self, rows: slice) -> Int8Weight:
        """Rows lo:hi of a packed weight (q|k|v, gate|up), sharing storage."""
        return Int8Weight(self.q[rows], self.scale[rows])


def quantize_int8(w: Tensor) -> Int8Weight:
    """Per-row symmetric int8 of a [out, in] weight; the scale is rounded to `w`'s dtype
    first and the rows are divided by that rounded scale, so ``q * scale`` is the
    reconstruction the kernels compute (an all-zero row gets scale 0 and q 0)."""
    wf = w.detach().float()
    scale = (wf.abs().amax(dim=1) / QMAX).to(w.dtype)
    sf = scale.float()
    q = torch.where(sf[:, None] > 0, wf / sf.clamp_min(torch.finfo(torch.float32).tiny)[:, None],
                    torch.zeros((), device=w.device))
    q = q.round_().clamp_(-QMAX, QMAX).to(torch.int8).contiguous()
    return Int8Weight(q, scale.contiguous())


def int8_linear(x: Tensor, w: Int8Weight, *, bias: Tensor | None = None,
                scratch: Tensor | None = None) -> Tensor:
    """``x @ dequant(w).T (+ bias)`` in `x`'s dtype, as a new [rows, out] tensor.

    `scratch`, shaped `dequant_buffer_shape(w)` in the serving dtype, holds the
    dequantised weight on the paths that build one (reused between steps instead of
    allocated per call); a weight of more rows is dequantised and multiplied that many
    rows at a time.
    """
    if _on_triton(x):
        from loraplane_kernels.triton.int8_mm import int8_mm

        y = int8_mm(x, w.q, w.scale)
    elif _int8pack(x):
        y = torch._weight_int8pack_mm(x.contiguous(), w.q, w.scale)
    else:
        y = _dequantised_mm(x, w, scratch)
    if bias is not None:
        y += bias
    return y


DEQUANT_ROWS = 8192
"""At most this many rows of a weight are dequantised at once (`dequant_buffer_shape`).
SmolLM2's int8 LM head (49,152 x 576) at 32 rows, bf16, on the 2-core Xeon: 5.9-6.0 ms
in 8,192-row pieces against 7.7 ms whole (7.4-7.6 against 8.8 at 64 rows, 13.8-15.9
against 16.4 at 256), the same bits there, and a 9.4 MB buffer instead of 57 MB. 2,048-
and 4,096-row pieces were slower; the projections (at most 3,072 rows) stay whole."""


def dequant_buffer_shape(w: Int8Weight) -> tuple[int, int]:
    """The `scratch` an `int8_linear` of `w` takes where `needs_dequant_buffer`."""
    return min(w.shape[0], DEQUANT_ROWS), w.shape[1]


def _dequantised_mm(x: Tensor, w: Int8Weight, scratch: Tensor | None) -> Tensor:
    """``x @ dequant(w).T`` through the dense kernel, `scratch`'s rows at a time. Each
    output column is one weight row's dot product either way; the kernel may block that
    sum by the piece's width, so the last bits can differ from the whole product's."""
    rows = w.shape[0]
    if scratch is None or scratch.shape[0] >= rows:
        return x @ w.dequantize(None if scratch is None else scratch[:rows]).t()
    y = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    step = scratch.shape[0]
    for a in range(0, rows, step):
        b = min(rows, a + step)
        part = Int8Weight(w.q[a:b], w.scale[a:b]).dequantize(scratch[:b - a])
        torch.mm(x, part.t(), out=y[:, a:b])
    return y


def needs_dequant_buffer(x: Tensor) -> bool:
    """Whether `int8_linear(x, ...)` dequantises the weight (and so wants a `scratch`)."""
    return not (_on_triton(x) or _int8pack(x))


def _int8pack(x: Tensor) -> bool:
    """Whether a batch not on Triton takes torch's int8 kernel (`INT8PACK_MAX_ROWS`)."""
    return x.device.type == "cpu" and x.shape[0] <= INT8PACK_MAX_ROWS


def _on_triton(x: Tensor) -> bool:
    """The LoRA kernels' backend choice (`dispatch.select_backend`): CUDA tensors, or CPU
    ones under ``LORAPLANE_KERNELS_BACKEND=triton`` with the interpreter (tests). A CPU
    tensor with the variable unset answers before the full choice (1.5 us a call, asked
    twice per projection of an int8 step: `needs_dequant_buffer`, then `int8_linear`)."""
    if not x.is_cuda and BACKEND_ENV not in os.environ:
        return False
    return select_backend(x.device) == "triton"
