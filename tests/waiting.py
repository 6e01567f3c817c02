"""Waiting on a condition with a deadline: the one way tests synchronise with a running system.

A fixed sleep is either too short on a loaded machine (a flaky test) or too long everywhere
else (a slow one); a wait on the condition the test needs is neither.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout_s: float, *, interval_s: float = 0.05,
             message: str | Callable[[], str] = "the condition",
             ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """The first truthy value of `condition()`, polled every `interval_s` until `timeout_s`.

    Returns the value so a caller can wait for a thing and use it in one step. On timeout it
    raises AssertionError naming `message` and the last value seen, which is usually what
    explains the failure; a callable message is called only then, so it can say how things
    stood at the end (a log's tail, the statuses seen). Exceptions of the types in `ignoring`
    (a server not yet listening, a row not yet there) count as "not yet", and the last one is
    reported as the last value.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value: object = condition()
        except ignoring as error:
            value = error
        else:
            if value:
                return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            what = message() if callable(message) else message
            raise AssertionError(
                f"timed out after {timeout_s:g} s waiting for {what}; last value: {value!r}")
        time.sleep(interval_s)
