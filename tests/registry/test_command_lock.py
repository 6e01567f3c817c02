"""The registry's command lock: first come, first served, leases first (pure, no broker)."""

from __future__ import annotations

import threading
import time

from services.registry.node import CommandLock
from tests.waiting import wait_for


def test_a_lease_goes_ahead_of_queued_writes_and_writes_keep_their_order() -> None:
    lock = CommandLock()
    assert lock.acquire(1.0)
    order: list[str] = []

    def take(name: str, urgent: bool) -> None:
        assert lock.acquire(10.0, urgent=urgent)
        order.append(name)
        time.sleep(0.01)
        lock.release()

    def queued(count: int) -> None:
        wait_for(lambda: len(lock._queue) == count, 5, interval_s=0.001,
                 message=f"{count} waiting for the lock")

    threads = []
    for name in ("write-1", "write-2", "write-3"):
        threads.append(threading.Thread(target=take, args=(name, False)))
        threads[-1].start()
        queued(len(threads))  # queued in this order
    threads.append(threading.Thread(target=take, args=("lease", True)))
    threads[-1].start()
    queued(len(threads))
    lock.release()
    for thread in threads:
        thread.join(10)
    assert order == ["lease", "write-1", "write-2", "write-3"]


def test_a_waiter_that_times_out_leaves_the_queue() -> None:
    lock = CommandLock()
    assert lock.acquire(1.0)
    assert not lock.acquire(0.05)  # gave up: must not block the ones behind it
    taken = threading.Event()
    waiter = threading.Thread(target=lambda: lock.acquire(5.0) and taken.set())
    waiter.start()
    lock.release()
    waiter.join(5)
    assert taken.is_set()
