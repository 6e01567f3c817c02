"""The router reads the log with the shared follower: a restarted router starts from the
snapshot of its fold that its last stop wrote, plus what the log holds after it, and routes
by both (a real router on the test's topics, in front of stand-in workers)."""

from __future__ import annotations

from typing import Any

from services.config import Settings
from tests.router.conftest import CatalogWriter, RunningRouter, collect, request


def served_version(router: RunningRouter, alias: str) -> int:
    final = collect(router.stub(), request(alias))[-1].final
    return int(final.served_adapter.version)


def test_a_restarted_router_starts_from_its_snapshot_and_folds_the_tail(
        catalog: CatalogWriter, fleet: Any, make_router: Any, rsettings: Settings) -> None:
    catalog.publish("snap-bot", 1)
    fleet.add("w1")
    first = RunningRouter(rsettings).start()
    first.wait_ring({"w1"})
    assert served_version(first, "snap-bot") == 1
    assert first.app.follower.status()["started_from"] == "beginning"
    first.stop()  # a clean stop writes the snapshot
    catalog.publish("snap-bot", 2)  # after the snapshot: only in the log's tail

    second: RunningRouter = make_router()
    second.wait_ring({"w1"})
    status = second.app.follower.status()
    assert status["started_from"] == "snapshot" and status["snapshot_records"] > 0
    assert served_version(second, "snap-bot") == 2
