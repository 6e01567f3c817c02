"""The retry pause every loop that writes to or reads from the log uses while the broker
(or the database behind it) is away."""

from __future__ import annotations

import threading


class Backoff:
    """Doubling pauses from `first` up to `most`, back to `first` after a success.

    Waits on the loop's stop event, so a stop is never held up by a pause."""

    def __init__(self, first: float = 0.2, most: float = 5.0) -> None:
        self.first = first
        self.most = most
        self.pause = first

    def succeeded(self) -> None:
        self.pause = self.first

    def wait(self, stop: threading.Event) -> bool:
        """Pause (or less, if `stop` is set meanwhile); True when stopping."""
        stopped = stop.wait(self.pause)
        self.pause = min(self.pause * 2, self.most)
        return stopped
