"""Tenant purges as the engine loop carries them out.

A hard purge ends the tenant's work at once: its waiting requests are refused ABORTED and
`Residency.purge` aborts its sequences and drops its adapters and cached KV. A soft one
first lets the tenant's running sequences end (admitting none of its requests meanwhile),
and purges once none runs or 80% of the purge's deadline has passed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import UTC, datetime

from services.catalog.state import CatalogState, Purge
from services.worker.follower import CatalogFollower
from services.worker.residency import Residency
from services.worker.tickets import Parked, Ticket

SOFT_SHARE = 0.8
"""A soft purge waits for the tenant's sequences at most this share of its deadline."""


class TenantPurges:
    """The purges in progress on this worker (run in the loop's thread)."""

    def __init__(self, follower: CatalogFollower, residency: Residency, parked: Parked,
                 refuse: Callable[[Ticket, str, str], None], sweep: Callable[[], None]) -> None:
        self.follower = follower
        self.residency = residency
        self.parked = parked
        self.refuse = refuse
        self.sweep = sweep
        """Finishes the requests the purge aborted (the loop's)."""
        self._draining: dict[str, Purge] = {}
        """Tenant key → its soft purge, waiting for the tenant's sequences to end."""

    def draining(self, tenant_key: str) -> bool:
        """A soft purge of the tenant waits: its new requests are not admitted."""
        return tenant_key in self._draining

    def start(self, catalog: CatalogState, purge: Purge) -> None:
        if purge.tenant is None:
            return
        if purge.hard:
            self._purge_now(catalog, purge)
        else:  # let its sequences end, admit none of its requests meanwhile
            self._draining[purge.tenant.key] = purge

    def service(self, running: Iterable[Ticket]) -> None:
        """Purge the soft purges whose tenant has nothing running any more, or that waited
        long enough."""
        if not self._draining:
            return
        busy = {t.work.tenant.key for t in running}
        for key, purge in list(self._draining.items()):
            late = (datetime.now(UTC) - purge.requested_at).total_seconds() > (
                purge.deadline_s * SOFT_SHARE)
            if key not in busy or late:
                with self.follower.lock:
                    self._purge_now(self.follower.state, purge)

    def _purge_now(self, catalog: CatalogState, purge: Purge) -> None:
        assert purge.tenant is not None
        self._draining.pop(purge.tenant.key, None)
        for ticket in self.parked.take_tenant(purge.tenant):
            self.refuse(ticket, "ABORTED", f"tenant {purge.tenant.key} was purged")
        self.residency.purge(catalog, purge)
        self.sweep()
