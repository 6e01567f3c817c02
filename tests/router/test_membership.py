"""Membership fold, pure: joins, three missed heartbeats, holdings per tier, `loading`."""

from __future__ import annotations

import random

from services.contracts.events import (
    AdapterLoaded,
    AdapterUnloaded,
    Envelope,
    LoadedAdapter,
    MergedMode,
    Payload,
    WorkerHeartbeat,
)
from services.router.membership import Membership

A, B = "a" * 64, "b" * 64


def ev(payload: Payload) -> Envelope:
    return Envelope.new(payload, stream="worker/x", seq=1, actor="test")


def beat(worker: str, *, base: str = "f" * 64, loaded: dict[str, str] | None = None,
         merged: MergedMode | None = None, draining: bool = False) -> Envelope:
    return ev(WorkerHeartbeat(
        worker_id=worker, address=f"{worker}:1", base_model="m", base_model_digest=base,
        loaded=[LoadedAdapter(adapter_id="x", version=1, sha256=sha, tier=tier)  # type: ignore[arg-type]
                for sha, tier in (loaded or {}).items()], merged_mode=merged,
        draining=draining))


def test_a_heartbeat_joins_and_three_missed_ones_leave() -> None:
    m = Membership(interval_s=1.0, misses=3)
    assert m.observe(beat("w1"), seen_at=10.0) is True
    assert m.observe(beat("w1"), seen_at=11.0) is False  # already in
    assert m.expire(13.9) == [] and m.live == {"w1"}
    assert m.expire(14.01) == ["w1"] and m.live == set()
    assert m.observe(beat("w1"), seen_at=15.0) is True  # back on its next heartbeat


def test_a_draining_heartbeat_leaves_at_once_and_a_new_process_comes_back() -> None:
    m = Membership(interval_s=1.0, misses=3)
    m.observe(beat("w1"), seen_at=10.0)
    m.observe(beat("w2"), seen_at=10.0)
    assert m.observe(beat("w1", draining=True), seen_at=10.5) is False
    assert m.expire(10.6) == ["w1"] and m.live == {"w2"}  # no missed beats needed
    assert m.eligible(None) == frozenset({"w2"})
    m.observe(beat("w1", draining=True), seen_at=11.5)  # still draining: stays out
    assert m.expire(11.6) == [] and m.live == {"w2"}
    m.observe(beat("w2"), seen_at=19.5)
    assert m.observe(beat("w1"), seen_at=20.0) is True  # the restarted process
    assert m.expire(20.1) == [] and m.live == {"w1", "w2"}


def test_an_old_heartbeat_read_late_changes_nothing() -> None:
    m = Membership()
    m.observe(beat("w1", loaded={A: "device"}), seen_at=10.0)
    m.observe(beat("w1", loaded={}), seen_at=9.0)
    assert m.tier("w1", A, 10.0) == "device"


def test_holdings_follow_heartbeats_and_load_events() -> None:
    m = Membership()
    m.observe(beat("w1", loaded={A: "host"}), seen_at=0.0)
    assert m.tier("w1", A, 0.0) == "host" and m.tier("w1", B, 0.0) is None
    m.observe(ev(AdapterLoaded(worker_id="w1", adapter_id="x", version=2, sha256=B,
                               load_ms=3, tier="device")), 0.1)
    assert m.tier("w1", B, 0.1) == "device"
    m.observe(ev(AdapterUnloaded(worker_id="w1", adapter_id="x", version=1, sha256=A,
                                 reason="evicted")), 0.2)
    assert m.tier("w1", A, 0.2) is None
    assert list(m.holders(B)) == ["w1"]
    m.observe(beat("w1", loaded={A: "disk"}), seen_at=0.5)  # a heartbeat is the full report
    assert m.tier("w1", B, 0.5) is None and m.tier("w1", A, 0.5) == "disk"


def test_a_cold_placement_counts_as_loading_until_reported_or_timed_out() -> None:
    m = Membership(interval_s=1.0, misses=3)
    m.observe(beat("w1"), seen_at=0.0)
    m.note_sent("w1", A, now=1.0)
    assert m.tier("w1", A, 2.0) == "loading"
    assert m.tier("w1", A, 4.5) is None  # never confirmed: cold again
    m.note_sent("w1", A, now=5.0)
    m.observe(beat("w1", loaded={A: "device"}), seen_at=5.5)
    assert m.tier("w1", A, 5.6) == "device" and not m.workers["w1"].sent
    m.note_sent("w1", A, now=6.0)  # already held: nothing to remember
    assert not m.workers["w1"].sent


def test_eligibility_is_by_base_model_and_cached_until_a_change() -> None:
    m = Membership(interval_s=1.0, misses=3)
    m.observe(beat("w1", base="1" * 64), 0.0)
    m.observe(beat("w2", base="2" * 64), 0.0)
    assert m.eligible("1" * 64) == {"w1"} and m.eligible(None) == {"w1", "w2"}
    m.observe(beat("w2", base="1" * 64), 0.5)  # re-deployed on the other base
    assert m.eligible("1" * 64) == {"w1", "w2"}
    m.observe(beat("w2", base="1" * 64), 2.0)
    m.expire(3.5)
    assert m.eligible("1" * 64) == {"w2"}


def test_merged_mode_workers_leave_the_general_pool() -> None:
    m = Membership(interval_s=1.0, misses=3)
    m.observe(beat("w1"), 0.0)
    m.observe(beat("w2", merged=MergedMode(adapter_id="bot")), 0.0)
    m.observe(beat("w3", merged=MergedMode(adapter_id="bot", pinned_version=2, version=2)), 0.0)
    assert m.eligible(None) == {"w1"} and m.eligible("f" * 64) == {"w1"}
    assert not m.serves_base("w2", "f" * 64)  # no prefetch hints of other adapters either
    assert m.merged_for("bot") == ("w2", "w3") and m.merged_for("other") == ()
    assert m.workers["w3"].dedication == ("bot", 2)
    m.observe(beat("w2"), 0.5)  # restarted without --merge: back in the pool
    assert m.eligible(None) == {"w1", "w2"} and m.merged_for("bot") == ("w3",)
    m.observe(beat("w1", merged=MergedMode(adapter_id="bot")), 2.5)
    m.observe(beat("w2"), 2.5)
    m.expire(3.6)  # w3 went silent
    assert m.merged_for("bot") == ("w1",) and m.eligible(None) == {"w2"}


def test_in_flight_counts() -> None:
    m = Membership()
    m.acquire("w1")
    m.acquire("w1")
    m.release("w1")
    m.release("w1")
    m.release("w1")
    assert m.in_flight["w1"] == 0


def test_the_holder_index_agrees_with_every_worker_view_under_any_sequence() -> None:
    """Placement reads holdings from an index by adapter sha; it must answer what the
    workers' own views say after any mix of heartbeats, loads, unloads, sends and expiries."""
    rnd = random.Random(5)
    shas = [c * 64 for c in "abcdef"]
    workers = ["w1", "w2", "w3"]
    tiers = ["device", "host", "disk"]
    m = Membership(interval_s=1.0, misses=2)
    now = 0.0

    def reference(worker: str, sha: str) -> str | None:
        view = m.workers.get(worker)
        if view is None:
            return None
        held = view.held.get(sha)
        if held is not None and held != "disk":
            return held
        sent = view.sent.get(sha)
        return "loading" if sent is not None and now - sent <= m.timeout_s else held

    for _ in range(3000):
        now += rnd.random() * 0.3
        worker, sha, move = rnd.choice(workers), rnd.choice(shas), rnd.randrange(5)
        if move == 0:
            m.observe(beat(worker, loaded={s: rnd.choice(tiers) for s in
                                           rnd.sample(shas, rnd.randrange(4))}), now)
        elif move == 1:
            m.observe(ev(AdapterLoaded(worker_id=worker, adapter_id="x", version=1,
                                       sha256=sha, load_ms=1, tier=rnd.choice(tiers))), now)
        elif move == 2:
            m.observe(ev(AdapterUnloaded(worker_id=worker, adapter_id="x", version=1,
                                         sha256=sha, reason="evicted")), now)
        elif move == 3:
            m.note_sent(worker, sha, now)
        else:
            m.expire(now)
        for s in shas:
            for w in workers:
                assert m.tier(w, s, now) == reference(w, s), (w, s)
            assert sorted(m.holders(s)) == sorted(w for w in m.live if s in m.workers[w].held)


def test_heartbeats_stuck_behind_a_failing_over_partition_do_not_empty_the_ring() -> None:
    """Three workers beat on one liveness partition whose leader dies: nothing is read from
    it for several seconds. They stay in the ring (for `stall_grace_s`), and come back
    fresh once the partition is read again; a worker whose partition is read while its
    own heartbeats are missing is silent, and leaves after three intervals as before."""
    m = Membership(interval_s=1.0, misses=3, stall_grace_s=10.0)
    stalled, flowing = ("t.liveness", 0), ("t.liveness", 1)
    for worker in ("w1", "w2", "w3"):
        m.observe(beat(worker), seen_at=10.0, source=stalled)
    m.observe(beat("w4"), seen_at=10.0, source=flowing)
    for second in range(11, 20):  # partition 1 keeps flowing: w4 and the lease beat there
        m.observe(beat("w4"), seen_at=float(second), source=flowing)
    assert m.expire(19.0) == [] and m.live == {"w1", "w2", "w3", "w4"}
    for worker in ("w1", "w2"):  # the new leader serves: the heartbeats held up arrive
        m.observe(beat(worker), seen_at=19.5, source=stalled)
    assert m.expire(20.0) == [] and m.live == {"w1", "w2", "w3", "w4"}  # in any order
    # w3 is really gone: its partition is read again (w1, w2 beat) but not w3's heartbeat
    m.observe(beat("w1"), seen_at=20.5, source=stalled)
    assert m.expire(20.6) == ["w3"] and m.live == {"w1", "w2", "w4"}
    # a partition silent past the grace: its workers leave all the same
    m.observe(beat("w4"), seen_at=33.0, source=flowing)
    assert m.expire(20.5 + 3 + 10.1) == ["w1", "w2"] and m.live == {"w4"}


def test_a_silent_worker_leaves_once_its_partition_shows_newer_records() -> None:
    m = Membership(interval_s=1.0, misses=3, stall_grace_s=10.0)
    source = ("t.liveness", 0)
    m.observe(beat("w1"), seen_at=10.0, source=source)
    m.observe(beat("w2"), seen_at=10.0, source=source)
    for second in (11.0, 12.0, 13.0, 14.0):
        m.observe(beat("w2"), seen_at=second, source=source)
    assert m.expire(12.9) == []
    assert m.expire(13.1) == ["w1"] and m.live == {"w2"}  # three intervals, as before
