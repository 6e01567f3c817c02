"""The shared retry pause: doubling to a ceiling, reset by a success, cut short by a stop."""

from __future__ import annotations

import threading
import time

from services.eventlog import Backoff


def test_pauses_double_to_the_ceiling_and_reset_after_a_success() -> None:
    backoff, never = Backoff(first=0.001, most=0.004), threading.Event()
    pauses = []
    for _ in range(4):
        pauses.append(backoff.pause)
        assert backoff.wait(never) is False
    assert pauses == [0.001, 0.002, 0.004, 0.004]
    backoff.succeeded()
    assert backoff.pause == 0.001


def test_a_stop_ends_the_pause_at_once() -> None:
    backoff, stop = Backoff(first=60.0), threading.Event()
    stop.set()
    started = time.monotonic()
    assert backoff.wait(stop) is True
    assert time.monotonic() - started < 1.0
