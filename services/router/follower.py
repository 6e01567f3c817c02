"""The router's reading of the log, in one small class so a shared follower can replace it.

Every partition of `settings.topics` by `assign()`, from the beginning; `open` folds
everything committed before it started (every partition at its end; the router is ready
after that),
`poll` hands on what comes later. Each event goes to the caller's fold with `seen_at`, the
monotonic time the router takes it to have been emitted: for replayed events the event's
age (`occurred_at` against the wall clock, so a worker silent for a minute is not taken
for live at start), for live ones the moment they were read (so clock skew between
machines does not move workers in or out of the ring).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

from services.config import Settings
from services.contracts.events import Envelope
from services.eventlog import EventConsumer, Record

Fold = Callable[[Envelope, float, tuple[str, int]], None]
"""(event, seen_at, (topic, partition) it was read from)."""


class LogFollower:
    def __init__(self, settings: Settings, reader_id: str, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.reader_id = reader_id
        self.clock = clock
        self._consumer: EventConsumer | None = None

    def open(self, fold: Fold, timeout_s: float = 60.0) -> int:
        """Blocking: assign, fold to the end of every partition; returns the events folded."""
        consumer = EventConsumer(self.settings, self.settings.topics, reader_id=self.reader_id)

        def replayed(record: Record) -> None:
            age = (datetime.now(UTC) - record.envelope.occurred_at).total_seconds()
            fold(record.envelope, self.clock() - max(0.0, age), (record.topic, record.partition))

        try:
            count = consumer.catch_up(replayed, timeout_s=timeout_s)
        except BaseException:
            consumer.close()
            raise
        self._consumer = consumer
        return count

    def poll(self, timeout_s: float = 0.1) -> list[Record]:
        """Blocking: the next events (waits for the first up to `timeout_s`, then drains)."""
        assert self._consumer is not None, "open() first"
        records = self._consumer.poll(timeout=timeout_s, max_records=1)
        if records:
            records += self._consumer.poll(timeout=0, max_records=500)
        return records

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
