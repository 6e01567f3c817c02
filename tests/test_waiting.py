"""The shared wait: returns the condition's value, fails with the message and the last value."""

from __future__ import annotations

import itertools
import time

import pytest

from tests.waiting import wait_for


def test_returns_the_first_truthy_value() -> None:
    counter = itertools.count()
    assert wait_for(lambda: (n := next(counter)) >= 3 and n, 5, interval_s=0.001) == 3


def test_times_out_with_the_message_and_the_last_value() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"the flag to rise; last value: \[\]"):
        wait_for(list, 0.1, interval_s=0.01, message="the flag to rise")
    assert 0.1 <= time.monotonic() - started < 2


def test_a_callable_message_says_how_things_stood_at_the_timeout() -> None:
    seen: list[int] = []
    with pytest.raises(AssertionError, match=r"statuses \[503, 503"):
        wait_for(lambda: seen.append(503), 0.05, interval_s=0.01,
                 message=lambda: f"an answer; statuses {seen}")


def test_ignored_errors_count_as_not_yet_and_others_propagate() -> None:
    attempts = iter([ConnectionError("refused"), ConnectionError("refused"), "up"])

    def probe() -> str:
        outcome = next(attempts)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert wait_for(probe, 5, interval_s=0.001, ignoring=(ConnectionError,)) == "up"
    with pytest.raises(AssertionError, match="last value: ConnectionError"):
        wait_for(probe_refused, 0.05, interval_s=0.01, ignoring=(ConnectionError,))
    with pytest.raises(ValueError):
        wait_for(lambda: int("x"), 5, ignoring=(ConnectionError,))


def probe_refused() -> None:
    raise ConnectionError("refused")
