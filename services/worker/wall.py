"""The version wall: a worker that has not heard from the registry lately stops serving.

The registry writes a `RegistryLease` every `lease_interval_s`. A worker whose newest
lease (by the lease's own timestamp, so replaying an old log does not look fresh) is
older than `stale_lease_threshold_s` cannot know whether a version was switched,
disabled or rolled back since, so it refuses new requests (UNAVAILABLE, with this
reason) instead of serving what may be a stale version: compliance over availability.
It serves again as soon as a fresh lease is folded.
"""

from __future__ import annotations

from datetime import datetime


def wall_reason(lease_at: datetime | None, now: datetime, threshold_s: float) -> str | None:
    """Why requests must be refused now, or None when the lease is fresh enough."""
    if lease_at is None:
        return ("version wall: no registry lease in the log yet, so this worker cannot "
                "know the current adapter versions")
    age = (now - lease_at).total_seconds()
    if age > threshold_s:
        return (f"version wall: the last registry lease is {age:.1f} s old (threshold "
                f"{threshold_s:g} s); this worker may hold stale adapter versions and "
                "refuses requests until a fresh lease arrives")
    return None
