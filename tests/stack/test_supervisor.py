"""Restart backoff of `loraplane up`: pure, times passed in."""

from __future__ import annotations

from services.stack.supervisor import RestartPolicy


def test_delays_double_up_to_the_cap_and_a_stable_run_resets_them() -> None:
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=4.0, stable_after_s=30.0)
    policy.started(0.0)
    delays = []
    now = 1.0
    for _ in range(6):  # crashes right after each start
        delays.append(policy.exited(now))
        assert not policy.due(now) and policy.due(now + delays[-1])
        now += delays[-1]
        policy.started(now)
        now += 1.0
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert policy.due_at is None  # running again
    assert policy.exited(now + 60.0) == 0.5  # it ran a minute: the count starts over
