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
    limit per thread, so a thread already running torch ops keeps its own count. torch also
    stores the count process-wide, and a thread's first torch op copies that value: a
    thread that starts computing while this is active elsewhere would keep one thread for
    good. Long-lived compute threads therefore set their own count first (`own_threads`).
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


def own_threads(threads: int) -> None:
    """Give the calling thread `threads` intra-op threads, whatever the process-wide count
    is at this moment (see `one_thread`): the first thing a long-lived compute thread does,
    with a count read where it was created."""
    torch.set_num_threads(threads)
