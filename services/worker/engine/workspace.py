"""Scratch tensors a step's forward writes into, reused from step to step.

A step's activations are large ([4,096 tokens, 5,632] for a fused gate|up is 92 MB in
float32). A fresh tensor that size comes from the OS as untouched pages, and on a CPU the
page faults and zeroing cost as much as the elementwise op that fills it (silu times up
took 110 ms allocating its output, 31 ms writing into a reused one). Keeping one buffer
per role, grown to the largest step seen and never shrunk, pays that once per process.
Layers reuse the same buffers one after another, so a view handed out is only valid until
the next request for the same role: the forward never keeps one across layers.

The views themselves are kept too, per role, shape and dtype: a decode step asks for about
360 of them (12 per layer), and slicing and viewing a buffer anew cost 3.5 us each against
0.06 us for the lookup, over 1 ms of a SmolLM2 decode step in the calling thread.
"""

from __future__ import annotations

import torch

MAX_VIEWS = 1024
"""Views kept at most (each step size asks for its own shapes)."""


class Workspace:
    """Named flat buffers on one device and dtype; `take` views the front of one."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._views: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def take(self, role: str, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape` backed by the role's buffer."""
        dtype = dtype or self.dtype
        key = (role, shape, dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        need = 1
        for n in shape:
            need *= n
        buf = self._buffers.get(role)
        if buf is None or buf.numel() < need or buf.dtype != dtype:
            buf = torch.empty(need, dtype=dtype, device=self.device)
            self._buffers[role] = buf
            # views of the old buffer would keep it alive and hand it out again
            self._views = {k: v for k, v in self._views.items() if k[0] != role}
        if len(self._views) >= MAX_VIEWS:  # step sizes vary: keep the recent ones only
            self._views.clear()
        view = self._views[key] = buf[:need].view(shape)
        return view

    @property
    def nbytes(self) -> int:
        """Bytes held between steps: `EngineStats.workspace_bytes` and the worker's
        `loraplane_worker_step_workspace_bytes` gauge report it beside the KV budget."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
