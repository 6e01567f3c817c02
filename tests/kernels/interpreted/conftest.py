"""Collected only under ``TRITON_INTERPRET=1`` (see ``tests/kernels/conftest.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # for lora_cases

from loraplane_kernels.dispatch import triton_interpreted

if not triton_interpreted():  # compiled kernels cannot take CPU tensors: fail, don't skip
    raise RuntimeError("loraplane_kernels.triton was imported before TRITON_INTERPRET=1 "
                       "took effect")
