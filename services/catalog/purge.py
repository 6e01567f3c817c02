"""When is a tenant purge met: the one rule the registry and the audit store share.

The `purge_proofs` SQL view implements the same rule in SQL, and an agreement test
drives the real registry and projector over one log and checks both give the same
status for every purge. Change one, change the other.

The rule uses event timestamps (`occurred_at`) only, never the order in which a reader
happened to consume the two topics, so every reader of the same log agrees:

1. The *expected workers* are listed in the `TenantPurgeRequested` event itself: the
   registry writes there the workers whose last heartbeat was at most
   `stale_after_s` old (and not from the future) when it decided the command. Heartbeats
   folded later cannot change the set.
2. An acknowledgement *counts* when it is a `TenantPurged` for this purge, from an
   expected worker, with `refcounts_zero` true, and its `occurred_at` is at or before the
   deadline (`requested_at + deadline_s`). Any counting ack of a worker counts, not only
   its first: a worker may ack once with references still held and again once they drop.
3. The tenant's blobs count as *erased* when the registry's `TenantBlobsDeleted` for this
   purge is dated at or before the deadline (the registry deletes every blob that only the
   purged versions reference before it writes that event, `services/registry/erasure.py`).
4. The status is `met` when every expected worker has a counting ack (with no expected
   worker, there was nothing to clear) AND the blobs are erased; else `missed` once `now`
   is past the deadline; else `pending`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

PurgeStatus = Literal["met", "missed", "pending"]

FUTURE_SKEW_S = 5.0
"""A heartbeat stamped this far past the decision time still counts as live (clock skew)."""


@dataclass(frozen=True)
class PurgeAck:
    """One `TenantPurged` acknowledgement, as folded."""

    worker_id: str
    acked_at: datetime
    kv_blocks_freed: int
    adapters_unloaded: int
    sequences_aborted: int
    refcounts_zero: bool


def deadline_of(requested_at: datetime, deadline_s: float) -> datetime:
    return requested_at + timedelta(seconds=deadline_s)


def live_workers(last_heartbeats: dict[str, datetime], now: datetime,
                 stale_after_s: float) -> tuple[str, ...]:
    """Workers whose last heartbeat lies in [now - stale_after_s, now + skew]."""
    low = now - timedelta(seconds=stale_after_s)
    high = now + timedelta(seconds=FUTURE_SKEW_S)
    return tuple(sorted(w for w, seen in last_heartbeats.items() if low <= seen <= high))


def ack_counts(ack: PurgeAck, expected: Iterable[str], deadline: datetime) -> bool:
    return ack.worker_id in set(expected) and ack.refcounts_zero and ack.acked_at <= deadline


def workers_done(expected: Iterable[str], acks: Iterable[PurgeAck],
                 deadline: datetime) -> set[str]:
    """Expected workers with at least one counting ack."""
    wanted = set(expected)
    return {a.worker_id for a in acks if ack_counts(a, wanted, deadline)}


def blobs_erased(erased_at: datetime | None, deadline: datetime) -> bool:
    """Rule 3: the erasure is recorded, no later than the deadline."""
    return erased_at is not None and erased_at <= deadline


def purge_status(expected: Iterable[str], acks: Iterable[PurgeAck], requested_at: datetime,
                 deadline_s: float, now: datetime, *,
                 erased_at: datetime | None) -> PurgeStatus:
    wanted = set(expected)
    deadline = deadline_of(requested_at, deadline_s)
    if wanted <= workers_done(wanted, acks, deadline) and blobs_erased(erased_at, deadline):
        return "met"
    return "missed" if now > deadline else "pending"
