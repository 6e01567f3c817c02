"""Restarts for the processes `loraplane up` runs: when, and how often.

A dead service is restarted after a delay that doubles with each exit in a row (0.5 s,
1 s, 2 s … at most `max_delay_s`), so a service that cannot start (a port taken, a bad
setting) does not spin, while one that crashes once comes back at once. A run that lasted
`stable_after_s` counts as healthy and resets the count. The policy is pure (times are
passed in) so it is tested without processes; the stack applies it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RestartPolicy:
    """Backoff state of one supervised process."""

    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    stable_after_s: float = 30.0
    failures: int = 0
    started_at: float = 0.0
    due_at: float | None = None
    """When the next restart is due; None while the process runs."""

    def started(self, now: float) -> None:
        self.started_at = now
        self.due_at = None

    def exited(self, now: float) -> float:
        """The process was found dead at `now`: schedule a restart, return its delay."""
        if now - self.started_at >= self.stable_after_s:
            self.failures = 0
        self.failures += 1
        delay = min(self.max_delay_s, self.first_delay_s * 2 ** (self.failures - 1))
        self.due_at = now + delay
        return delay

    def due(self, now: float) -> bool:
        return self.due_at is not None and now >= self.due_at
