"""Admission, pure: token buckets per tenant and adapter by tier, the cold-load cap."""

from __future__ import annotations

import math

import pytest

from services.router.limits import Limits, TokenBucket

TIERS = {"platinum": 8.0, "gold": 4.0, "silver": 2.0, "bronze": 1.0}


def limits(**kw: object) -> Limits:
    args: dict[str, object] = {"tenant_rate": TIERS, "adapter_rate": TIERS,
                               "cold_load_rate": {"silver": 0.5, "gold": 1.0}, "burst_s": 1.0}
    args.update(kw)
    return Limits(**args)  # type: ignore[arg-type]


def test_bucket_refills_continuously_and_says_how_long_to_wait() -> None:
    b = TokenBucket(rate=2.0, capacity=2.0, tokens=2.0, updated=0.0)
    assert b.wait(0.0) == 0
    b.take(0.0)
    b.take(0.0)
    assert b.wait(0.0) == pytest.approx(0.5)
    assert b.wait(0.25) == pytest.approx(0.25)
    assert b.wait(10.0) == 0 and b.tokens == 2.0  # capped at capacity
    assert TokenBucket(0.0, 1.0, 0.0, 0.0).wait(5.0) == math.inf


def test_tenant_rate_by_tier_and_retry_after() -> None:
    lim = limits()
    for _ in range(4):  # gold: 4/s, burst 1 s
        assert lim.admit(0.0, tenant="t", tenant_tier="gold") is None
    refusal = lim.admit(0.0, tenant="t", tenant_tier="gold")
    assert refusal is not None and refusal.reason == "tenant_rate"
    assert refusal.retry_after_s == pytest.approx(0.25) and refusal.retry_after_header == "1"
    assert lim.admit(0.25, tenant="t", tenant_tier="gold") is None
    assert lim.admit(0.0, tenant="other", tenant_tier="gold") is None  # per tenant


def test_unknown_tier_uses_silver_and_overrides_win() -> None:
    lim = limits(overrides={"tenant:vip": 100.0, "adapter:hot": 1.0})
    assert [lim.admit(0.0, tenant="t", tenant_tier=None) for _ in range(3)][-1] is not None
    assert all(lim.admit(0.0, tenant="vip", tenant_tier="bronze") is None for _ in range(50))
    assert lim.admit(0.0, tenant="a", tenant_tier="gold", adapter="hot") is None
    refusal = lim.admit(0.0, tenant="b", tenant_tier="gold", adapter="hot")
    assert refusal is not None and refusal.reason == "adapter_rate"


def test_a_refusal_spends_no_token() -> None:
    lim = limits()
    lim.admit(0.0, tenant="t", tenant_tier="platinum", adapter="a", adapter_tier="bronze")
    for _ in range(5):  # the adapter's bronze bucket is empty; the tenant's must stay full
        r = lim.admit(0.0, tenant="t", tenant_tier="platinum", adapter="a",
                      adapter_tier="bronze")
        assert r is not None and r.reason == "adapter_rate"
    assert all(lim.admit(0.0, tenant="t", tenant_tier="platinum", adapter=f"x{i}",
                         adapter_tier="gold") is None for i in range(7))


def test_cold_loads_have_their_own_cap() -> None:
    lim = limits()
    assert lim.admit(0.0, tenant="t", tenant_tier="gold", adapter="a1", cold=True) is None
    r = lim.admit(0.0, tenant="t", tenant_tier="gold", adapter="a2", cold=True)
    assert r is not None and r.reason == "cold_load_cap" and r.retry_after_s == 1.0
    assert lim.admit(0.0, tenant="t", tenant_tier="gold", adapter="a1") is None  # warm: fine
    assert lim.admit(1.0, tenant="t", tenant_tier="gold", adapter="a2", cold=True) is None


def test_full_buckets_are_forgotten_to_bound_memory() -> None:
    lim = limits(max_buckets=10)
    for i in range(50):
        lim.admit(float(i), tenant=f"t{i}", tenant_tier="gold")
    assert len(lim._buckets) <= 11


def test_a_kept_admission_follows_forgotten_and_re_rated_buckets() -> None:
    """What the request path keeps per caller takes from the buckets `admit` would."""
    lim = limits(max_buckets=2)
    kept = lim.admission(0.0, tenant="t", tenant_tier="gold")
    assert lim.admit(0.0, tenant="v", tenant_tier="gold") is None
    assert lim.admit(10.0, tenant="u", tenant_tier="gold") is None  # t and v full: forgotten
    assert ("tenant", "t") not in lim._buckets
    assert all(lim.admit_with(10.0, kept, False) is None for _ in range(4))  # gold: 4/s
    refusal = lim.admit(10.0, tenant="t", tenant_tier="gold")
    assert refusal is not None and refusal.reason == "tenant_rate"
    assert lim.admit(10.0, tenant="t", tenant_tier="silver") is not None  # re-rated ...
    assert lim._buckets[("tenant", "t")].rate == 2.0
    refusal = lim.admit_with(10.0, kept, False)  # ... and back by the kept admission
    assert refusal is not None and lim._buckets[("tenant", "t")].rate == 4.0
