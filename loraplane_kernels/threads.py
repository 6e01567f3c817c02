"""torch's intra-op thread counts: small CPU work in the calling thread only, and
long-lived compute threads that keep the count they were created with.

torch's intra-op threads are woken for every op; for an op of a few microseconds' work
(a LoRA shrink over the two decode rows of one adapter, a copy of a few hundred KB) the
wake-up costs more than the second thread saves.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch's CPU copies in the calling thread only.

    Copies of a few hundred KB each, hundreds of them: waking torch's intra-op threads costs
    more than they save at that size (measured 2-6x slower on 2 cores). OpenMP keeps the
    limit per thread, so a thread already running torch ops keeps its own count. torch also
    stores the count process-wide, and a thread's first torch op copies that value: a
    thread that starts computing while this is active elsewhere would keep one thread for
    good. Long-lived compute threads therefore set their own count first
    (`compute_thread`).
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


def compute_thread(target: Callable[[], None], *, name: str) -> threading.Thread:
    """A (daemon) thread running `target` with the intra-op thread count of the thread that
    creates it, set before its first torch op: whatever the process-wide count is when it
    starts (see `one_thread`), a long-lived compute thread keeps the count it was meant to
    have."""
    threads = torch.get_num_threads()

    def run() -> None:
        torch.set_num_threads(threads)
        target()

    return threading.Thread(target=run, name=name, daemon=True)
