"""Pre-warm planning, pure: only keys whose home changes, sent to the new home."""

from __future__ import annotations

from services.router.prewarm import RecentAdapter, RecentUse, plan
from services.router.ring import Ring


def adapter(i: int, base: str = "b") -> RecentAdapter:
    return RecentAdapter(f"a{i}", 1, f"{i:064x}", base)


def test_recent_use_keeps_the_newest_per_key_and_bounds_keys() -> None:
    recent = RecentUse(per_key=2, max_keys=3)
    for i in range(3):
        recent.touch("k", adapter(i))
    recent.touch("k", adapter(1))
    assert [a.adapter_id for a in recent.of("k")] == ["a1", "a2"]
    for key in ("k2", "k3", "k4"):
        recent.touch(key, adapter(0))
    assert recent.tenant_keys() == ["k2", "k3", "k4"]
    assert RecentUse(per_key=0).of("x") == []


def test_a_join_prefetches_the_gained_keys_recent_adapters_on_the_new_worker_only() -> None:
    old = Ring([f"w{i}" for i in range(8)])
    new = old.copy()
    new.add("w8")
    recent = RecentUse(per_key=2)
    for i in range(400):
        recent.touch(f"t{i}", adapter(i))
        recent.touch(f"t{i}", adapter(i, base="other"))
    wanted = plan(old, new, recent, lambda worker, base: base == "b")
    assert set(wanted) == {"w8"}
    gained = {f"t{i}" for i in range(400) if new.home(f"t{i}") == "w8"}
    assert 10 < len(gained) < 100
    assert {a.adapter_id for a in wanted["w8"]} == {f"a{t[1:]}" for t in gained}
    assert all(a.base_digest == "b" for a in wanted["w8"])


def test_a_leave_prefetches_on_the_workers_that_inherit() -> None:
    old = Ring([f"w{i}" for i in range(4)])
    new = old.copy()
    new.remove("w2")
    recent = RecentUse()
    for i in range(200):
        recent.touch(f"t{i}", adapter(i))
    wanted = plan(old, new, recent, lambda worker, base: True)
    moved = {f"t{i}" for i in range(200) if old.home(f"t{i}") == "w2"}
    assert "w2" not in wanted
    assert sum(len(v) for v in wanted.values()) == len(moved)
    for worker, adapters in wanted.items():
        assert all(new.home(f"t{a.adapter_id[1:]}") == worker for a in adapters)
