"""Running small CPU work in the calling thread only.

torch's intra-op threads are woken for every op; for an op of a few microseconds' work
(a LoRA shrink over the two decode rows of one adapter, a copy of a few hundred KB) the
wake-up costs more than the second thread saves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch's CPU copies in the calling thread only.

    Copies of a few hundred KB each, hundreds of them: waking torch's intra-op threads costs
    more than they save at that size (measured 2-6x slower on 2 cores). OpenMP keeps the
    limit per thread, so another running thread's matmuls keep their own team.
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
