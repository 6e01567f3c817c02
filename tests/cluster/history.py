"""The history of a fault run: every client operation with its invoke and complete times
and its result, as Jepsen records one.

An operation ends `ok` (acknowledged), `fail` (known not to have happened: refused, or
the registry said `not_written`, or nothing was sent) or `unknown` (it may or may not
have happened: a timeout, a lost connection, a 503 whose outcome is unknown). Times are
the machine's wall clock (`time.time()`), the clock the services stamp events with.
Plain data only, so the checker needs nothing of the services' code to read it.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Outcome = Literal["ok", "fail", "unknown"]


@dataclass
class Op:
    id: int
    client: str
    f: str
    """publish, switch, read, generate, purge, ready (a /readyz probe)."""
    args: dict[str, Any]
    invoke: float
    complete: float | None = None
    outcome: Outcome | None = None
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def latency_s(self) -> float | None:
        return None if self.complete is None else self.complete - self.invoke


@dataclass
class Phase:
    """A named stretch of the run (before, fault, healed): the checker and the summary
    compare latencies across them."""

    name: str
    start: float
    end: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class History:
    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.phases: list[Phase] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def invoke(self, client: str, f: str, **args: Any) -> Op:
        op = Op(next(self._ids), client, f, args, time.time())
        with self._lock:
            self.ops.append(op)
        return op

    @staticmethod
    def complete(op: Op, outcome: Outcome, **result: Any) -> Op:
        op.complete = time.time()
        op.outcome = outcome
        op.result = result
        return op

    def phase(self, name: str, **detail: Any) -> Phase:
        now = time.time()
        with self._lock:
            if self.phases and self.phases[-1].end is None:
                self.phases[-1].end = now
            phase = Phase(name, now, detail=detail)
            self.phases.append(phase)
        return phase

    def close(self) -> None:
        with self._lock:
            if self.phases and self.phases[-1].end is None:
                self.phases[-1].end = time.time()

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {"ops": [asdict(op) for op in self.ops],
                    "phases": [asdict(p) for p in self.phases]}

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json()))
