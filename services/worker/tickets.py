"""A request in the engine loop (`Ticket`), what it ends with, and where requests wait.

The front makes a `Ticket` per request and reads its outputs from `Ticket.sink`: tokens,
then `Finished` (or `Refused`, before any token). `Parked` holds the tickets waiting for
their adapter (a page-in, or in merged mode its merge into the base weights), by the
adapter's digest; the loop, its purges and its housekeeping take them out from there.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from services.catalog.serving import ServingChoice
from services.contracts.events import TenantRef
from services.worker.engine import AdapterDigest, ChoiceResult, TokenEvent
from services.worker.intake import WorkItem
from services.worker.pool.tiers import Tier


@dataclass(frozen=True)
class Refused:
    """The request ends with a gRPC error (code name, message, retry hint)."""

    code: str
    message: str
    retry_after_s: float | None = None


@dataclass(frozen=True)
class Finished:
    """The request ends normally (or aborted mid-stream): what goes into FinalUsage."""

    reason: str
    """length | stop | abort | error"""
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    choice: ServingChoice | None
    ttft_ms: float
    total_ms: float
    choices: tuple[ChoiceResult, ...] = ()
    """Every generated sequence's end (n, best_of)."""
    durable: concurrent.futures.Future[None] | None = None
    """Set once the request's trace is in the log: the front sends FinalUsage after it
    (`worker_trace_durable`; None when off)."""


Output = TokenEvent | Refused | Finished


@dataclass(eq=False)
class Ticket:
    """One request in flight, from the front's view and the loop's."""

    work: WorkItem
    sink: Any = None
    """Where `deliver` puts this request's outputs (the front's queue)."""
    time_limit_s: float | None = None
    """The client's deadline, as seconds left when the request arrived."""
    arrival: float = field(default_factory=time.monotonic)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    choice: ServingChoice | None = None
    digest: AdapterDigest | None = None
    page_in_deadline: float = 0.0
    page_in_tier: Tier | None = None
    """The tier the adapter was paging in from when the request parked (its budget's tier)."""
    first_token_at: float | None = None
    last_token_at: float | None = None
    completion_tokens: int = 0
    status: str = "new"
    """new → parked (waiting for its adapter) → running → done."""
    cancelled: bool = False


Deliver = Callable[[list[tuple[Ticket, list[Output]]]], None]

def deliver_to_queues(batch: list[tuple[Ticket, list[Output]]]) -> None:
    """Default `deliver`: each ticket's sink is a thread-safe queue (tests, benches)."""
    for ticket, outputs in batch:
        for output in outputs:
            ticket.sink.put(output)



class Parked:
    """Tickets waiting for their adapter, by its digest (in arrival order)."""

    def __init__(self) -> None:
        self._waiting: dict[AdapterDigest, list[Ticket]] = {}

    def add(self, digest: AdapterDigest, ticket: Ticket) -> None:
        self._waiting.setdefault(digest, []).append(ticket)

    def take(self, digest: AdapterDigest) -> list[Ticket]:
        """Every ticket waiting for `digest` (cancelled ones too), no longer waiting."""
        return self._waiting.pop(digest, [])

    def take_all(self) -> list[Ticket]:
        tickets = [t for ts in self._waiting.values() for t in ts]
        self._waiting.clear()
        return tickets

    def take_tenant(self, tenant: TenantRef) -> list[Ticket]:
        """The tenant's waiting tickets, no longer waiting."""
        taken = []
        for digest, tickets in list(self._waiting.items()):
            mine = [t for t in tickets if t.work.tenant == tenant]
            for ticket in mine:
                tickets.remove(ticket)
            taken += mine
            if not tickets:
                del self._waiting[digest]
        return taken

    def take_late(self, now: float) -> list[tuple[AdapterDigest, Ticket]]:
        """Tickets whose page-in budget ran out by `now`, and cancelled ones."""
        late = []
        for digest, tickets in list(self._waiting.items()):
            for ticket in [t for t in tickets if now > t.page_in_deadline or t.cancelled]:
                tickets.remove(ticket)
                late.append((digest, ticket))
            if not tickets:
                del self._waiting[digest]
        return late

    def remove(self, ticket: Ticket) -> None:
        if ticket.digest is not None:
            waiting = self._waiting.get(ticket.digest, [])
            if ticket in waiting:
                waiting.remove(ticket)

    def has_waiters(self, digest: AdapterDigest) -> bool:
        return any(not t.cancelled for t in self._waiting.get(digest, ()))

    def count(self) -> int:
        """How many wait (any thread: an estimate while the loop changes them)."""
        return sum(len(t) for t in list(self._waiting.values()))

    def adapter_ids(self) -> list[str]:
        """The adapter of each waiting ticket that is not cancelled (the load gauges)."""
        return [t.choice.adapter_id for ts in self._waiting.values() for t in ts
                if t.choice is not None and not t.cancelled]
