"""Admission: token buckets per tenant and per adapter, and a cap on cold loads. Pure.

Rates come from the settings by QoS tier (the tenant's tier from its token, the adapter's
from its published version), unless `router_rate_overrides` names the tenant or adapter.
A bucket holds `rate * burst_s` tokens and refills continuously; a request takes one
token from its tenant's bucket and one from its adapter's, or neither: a refusal never
spends tokens. The cold-load cap is a third bucket per tenant, taken only when placement
has to make a worker load the adapter from disk, so one tenant cycling through many
adapters cannot thrash every worker's pool. A refusal says how long until a retry can
succeed (gRPC RESOURCE_EXHAUSTED with `retry-after`, HTTP 429 with `Retry-After`).

Token buckets are a dozen lines; the libraries that offer them answer yes/no without the
exact wait a Retry-After needs, hence this.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

RejectReason = Literal["tenant_rate", "adapter_rate", "cold_load_cap"]

DEFAULT_TIER = "silver"


class TokenBucket:
    __slots__ = ("capacity", "rate", "tokens", "updated")

    def __init__(self, rate: float, capacity: float, tokens: float, updated: float) -> None:
        self.rate = rate
        """Tokens per second."""
        self.capacity = capacity
        self.tokens = tokens
        self.updated = updated

    def level(self, now: float) -> float:
        """Tokens there at `now` (refilled up to it); takes nothing."""
        if now > self.updated:
            self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
            self.updated = now
        return self.tokens

    def wait(self, now: float, n: float = 1.0) -> float:
        """Seconds until `n` tokens are there (0 = now); takes nothing."""
        tokens = self.level(now)
        if tokens >= n:
            return 0.0
        if self.rate <= 0 or n > self.capacity:
            return math.inf
        return (n - tokens) / self.rate

    def take(self, now: float, n: float = 1.0) -> None:
        self.level(now)
        self.tokens -= n


class Admission:
    """Direct references to the buckets one caller's requests take from (tenant, adapter,
    cold-load cap) and their rates, kept by the request path per caller and adapter."""

    __slots__ = ("a_bucket", "a_rate", "adapter", "adapter_tier", "c_bucket", "c_rate",
                 "generation", "t_bucket", "t_rate", "tenant", "tenant_tier")

    def __init__(self, tenant: str, tenant_tier: str | None, adapter: str | None,
                 adapter_tier: str | None) -> None:
        self.tenant, self.tenant_tier = tenant, tenant_tier
        self.adapter, self.adapter_tier = adapter, adapter_tier
        self.t_bucket: TokenBucket
        self.t_rate = self.a_rate = self.c_rate = 0.0
        self.a_bucket: TokenBucket | None = None
        self.c_bucket: TokenBucket | None = None
        self.generation = -1


@dataclass(frozen=True)
class Rejection:
    reason: RejectReason
    retry_after_s: float
    message: str

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, at least 1 (RFC 9110 delay-seconds)."""
        return str(max(1, math.ceil(self.retry_after_s))) if math.isfinite(
            self.retry_after_s) else "3600"


class Limits:
    """The buckets of every tenant and adapter seen lately. The request path keeps one
    `Admission` per caller and adapter, so a request's admission looks nothing up: one
    refill per bucket it takes from."""

    def __init__(self, *, tenant_rate: Mapping[str, float], adapter_rate: Mapping[str, float],
                 cold_load_rate: Mapping[str, float], burst_s: float = 2.0,
                 overrides: Mapping[str, float] | None = None, max_buckets: int = 200_000
                 ) -> None:
        self.tenant_rate = dict(tenant_rate)
        self.adapter_rate = dict(adapter_rate)
        self.cold_load_rate = dict(cold_load_rate)
        self.burst_s = burst_s
        self.overrides = dict(overrides or {})
        self.max_buckets = max_buckets
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        """(kind, name) → bucket."""
        self._rates: dict[tuple[str, str | None], float] = {}
        """(kind, tier) → rate, as `_rate` answers it (the settings do not change)."""
        self.generation = 0
        """Moves when buckets are forgotten: an `Admission` bound before is bound again."""

    def _rate(self, kind: str, tier: str | None) -> float:
        rate = self._rates.get((kind, tier))
        if rate is None:
            rates = {"tenant": self.tenant_rate, "adapter": self.adapter_rate,
                     "cold": self.cold_load_rate}[kind]
            rate = self._rates[(kind, tier)] = rates.get(tier or DEFAULT_TIER,
                                                         rates.get(DEFAULT_TIER, 0.0))
        return rate

    def _bucket(self, kind: str, name: str, rate: float, now: float) -> TokenBucket:
        key = (kind, name)
        bucket = self._buckets.get(key)
        if bucket is not None and bucket.rate == rate:
            return bucket
        capacity = max(1.0, rate * self.burst_s)
        if bucket is None:
            if len(self._buckets) >= self.max_buckets:
                self._forget_full(now)
            bucket = self._buckets[key] = TokenBucket(rate, capacity, capacity, now)
        else:  # the tier of an adapter changed with a new version
            bucket.level(now)
            bucket.rate, bucket.capacity = rate, capacity
            bucket.tokens = min(bucket.tokens, capacity)
        return bucket

    def _forget_full(self, now: float) -> None:
        """A full bucket is the same as no bucket: drop those to bound memory."""
        for key, bucket in list(self._buckets.items()):
            if bucket.level(now) >= bucket.capacity:
                del self._buckets[key]
                self.generation += 1

    def admission(self, now: float, *, tenant: str, tenant_tier: str | None,
                  adapter: str | None = None, adapter_tier: str | None = None) -> Admission:
        """One caller's buckets and rates, for `admit_with` on each of its requests: built
        once per caller and adapter (the request path keeps it), so a warm admission looks
        nothing up."""
        entry = Admission(tenant, tenant_tier, adapter, adapter_tier)
        self._bind(entry, now)
        return entry

    def _bind(self, entry: Admission, now: float) -> None:
        """Point `entry` at the buckets as they are now. Making a bucket here may forget
        others (`_forget_full`), this entry's too: then it is bound again on its next use."""
        generation = self.generation
        entry.t_rate = self._rate("tenant", entry.tenant_tier)
        if self.overrides:
            entry.t_rate = self.overrides.get(f"tenant:{entry.tenant}", entry.t_rate)
        entry.t_bucket = self._bucket("tenant", entry.tenant, entry.t_rate, now)
        if entry.adapter is not None:
            entry.a_rate = self._rate("adapter", entry.adapter_tier)
            if self.overrides:
                entry.a_rate = self.overrides.get(f"adapter:{entry.adapter}", entry.a_rate)
            entry.a_bucket = self._bucket("adapter", entry.adapter, entry.a_rate, now)
        entry.c_rate = self._rate("cold", entry.tenant_tier)
        entry.c_bucket = None  # taken only by cold placements: looked up on the first
        entry.generation = generation

    def admit(self, now: float, *, tenant: str, tenant_tier: str | None,
              adapter: str | None = None, adapter_tier: str | None = None,
              cold: bool = False) -> Rejection | None:
        """Take a token from each bucket the request needs (tenant, adapter, and the cold-load
        cap when `cold`), or refuse and take none."""
        return self.admit_with(now, self.admission(now, tenant=tenant, tenant_tier=tenant_tier,
                                                   adapter=adapter, adapter_tier=adapter_tier),
                               cold)

    def admit_with(self, now: float, entry: Admission, cold: bool) -> Rejection | None:
        """`admit` for a kept `Admission`: one refill per bucket it takes from, nothing
        looked up."""
        if entry.generation != self.generation:  # buckets were forgotten since it was bound
            self._bind(entry, now)
        t_bucket = entry.t_bucket
        if t_bucket.rate != entry.t_rate:  # another caller of the tenant, at another tier
            self._bucket("tenant", entry.tenant, entry.t_rate, now)
        if t_bucket.level(now) < 1.0:
            return Rejection("tenant_rate", t_bucket.wait(now), f"tenant {entry.tenant} is "
                             f"over its rate limit of {entry.t_rate:g} requests/s")
        a_bucket = entry.a_bucket
        if a_bucket is not None:
            if a_bucket.rate != entry.a_rate:  # the adapter's tier changed with a version
                self._bucket("adapter", entry.adapter or "", entry.a_rate, now)
            if a_bucket.level(now) < 1.0:
                return Rejection("adapter_rate", a_bucket.wait(now), f"adapter "
                                 f"{entry.adapter} is over its rate limit of "
                                 f"{entry.a_rate:g} requests/s")
        c_bucket = None
        if cold:
            c_bucket = entry.c_bucket
            if c_bucket is None or c_bucket.rate != entry.c_rate:
                c_bucket = entry.c_bucket = self._bucket("cold", entry.tenant, entry.c_rate,
                                                         now)
            if c_bucket.level(now) < 1.0:
                return Rejection("cold_load_cap", c_bucket.wait(now), f"tenant {entry.tenant} "
                                 f"is over its cap of {entry.c_rate:g} cold adapter loads/s; "
                                 "retry, or use an adapter a worker already holds")
        t_bucket.tokens -= 1.0  # each was refilled to `now` just above
        if a_bucket is not None:
            a_bucket.tokens -= 1.0
        if c_bucket is not None:
            c_bucket.tokens -= 1.0
        return None
