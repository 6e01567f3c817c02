"""The pure routing decision: which version and which worker a request gets, or why not.

`Routing.decide` is steps 1-4 of `services.router.dispatch`'s module doc (tenant from the
token, the version by `services.catalog.serving`'s rule, placement on the ring, admission)
over the router's fold: the catalog, the membership of workers, the ring, the limits. It
does no I/O and knows no wire format: a request arrives as `Asked` (plain values, built by
each front) and leaves as a `RouteDecision` or a `RouteError` whose `code` is a status
name the fronts map to their own (gRPC as it is, HTTP by `openai_http`). The forwarder
(`services.router.dispatch.Dispatcher`) owns the network: channels, calls, failover,
traces, prefetch hints.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

from services.catalog.auth import Principal
from services.catalog.serving import (
    MergeSpec,
    Resolution,
    ResolutionCache,
    ServingChoice,
    merge_target,
)
from services.catalog.state import CatalogState, Refusal
from services.config import Settings
from services.contracts.events import SLUG_PATTERN, TenantRef
from services.contracts.generate import ModelLimits
from services.contracts.qos import lower_tier, tier_of
from services.contracts.roles import TENANT_SCOPED, Permission
from services.router.limits import DEFAULT_TIER, Admission, Limits
from services.router.membership import Membership
from services.router.prewarm import RecentAdapter, RecentUse
from services.router.ring import Placement, Ring, Tier, place_on, ring_key

_SLUG = re.compile(SLUG_PATTERN)
_REFUSAL_CODES = {"not_found": "NOT_FOUND", "precondition": "FAILED_PRECONDITION",
                  "invalid": "INVALID_ARGUMENT", "conflict": "FAILED_PRECONDITION"}
"""`Refusal.kind` of the serving rule → the status code name it is answered with."""


class RouteError(Exception):
    """A request the router answers with an error; both fronts map it to their own shape."""

    def __init__(self, code: str, message: str, reason: str, *,
                 retry_after_s: float | None = None, retry_after: str | None = None,
                 after_first_token: bool = False, field: str | None = None,
                 audit: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        """The gRPC status code's name (`NOT_FOUND`): what the gRPC front answers, and what
        the HTTP front maps to an HTTP status."""
        self.message = message
        self.reason = reason
        self.field = field
        """The request field at fault (its proto path), where one is."""
        self.audit = audit
        """The real reason where the caller is told less (another tenant's adapter or
        alias, answered as a missing one): logged to the route trace log, never sent."""
        self.retry_after_s = retry_after_s
        self.retry_after = retry_after
        """Whole seconds for HTTP `Retry-After` / gRPC `retry-after` metadata."""
        self.after_first_token = after_first_token



class Asked(NamedTuple):
    """What a request asks for, in plain values (each front builds it from its own shape)."""

    org: str
    team: str
    project: str
    qos_tier: int
    """The QoS tier asked for, as the wire numbers it (0: the token's)."""
    compliance_scope: str
    region_hint: str
    user_id: str
    adapter: str | tuple[str, int] | None
    """An alias or adapter id (str), a pinned (adapter id, version), or None: the base."""
    base_model: str | None = None
    """The base model the caller named (HTTP `model`); None = any base (gRPC)."""


class RouteDecision(NamedTuple):
    """What `Routing.decide` chose (one per request: a tuple, the cheapest to build)."""

    tenant: TenantRef
    tier: str
    key: str
    choice: ServingChoice | None
    base_digest: str | None
    placement: Placement


def _on_device(_: str) -> Tier:
    """Where a request without an adapter finds it: nothing to load, every worker is warm."""
    return "device"



@functools.lru_cache(maxsize=65536)
def authorize_tenant(principal: Principal, *asked: str) -> TenantRef:
    """The tenant a request runs as (org, team, project asked): the token's scope, filled
    in (where `*`) by the request. Cached per token and asked tenant: the same callers ask
    again and again, and a refusal (an exception) is never cached."""
    names = ("org", "team", "project")
    if not principal.holds(Permission.INFER):
        raise RouteError("PERMISSION_DENIED",
                         f"role {principal.role} may not run inference", "forbidden")
    if principal.role not in TENANT_SCOPED:
        if not all(asked):
            raise RouteError("INVALID_ARGUMENT",
                             f"an {principal.role} token must name the tenant (org, team, "
                             "project)", "invalid")
        values = list(asked)
    else:
        assert principal.tenant_pattern is not None  # TokenBook gives scoped roles one
        values = []
        for name, scope, value in zip(names, principal.tenant_pattern, asked, strict=True):
            if scope != "*":
                if value and value != scope:
                    raise RouteError("PERMISSION_DENIED",
                                     f"token is scoped to {name} {scope!r}, not {value!r}",
                                     "forbidden")
                values.append(scope)
            elif not value:
                raise RouteError("INVALID_ARGUMENT",
                                 f"token covers any {name}: name the {name} in the request",
                                 "invalid")
            else:
                values.append(value)
    return _tenant(values[0], values[1], values[2])



class CallerScope(NamedTuple):
    """Who a request runs as, and the names the request path keys on."""

    tenant: TenantRef
    tenant_key: str
    """`tenant.key`: the limits' and metrics' name of the tenant."""
    tier: str
    """The QoS tier: the token's, or lower where the request asks for less."""
    ring_key: str


@functools.lru_cache(maxsize=65536)
def caller_scope(principal: Principal, org: str, team: str, project: str, qos_tier: int,
            compliance_scope: str, region_hint: str) -> CallerScope:
    """Steps that depend only on the token and the signature, done once per distinct pair
    (a refusal, an exception, is never cached)."""
    tenant = authorize_tenant(principal, org, team, project)
    tier = lower_tier(principal.qos_tier or DEFAULT_TIER, tier_of(qos_tier))
    return CallerScope(tenant, tenant.key, tier, ring_key(tenant.org, tenant.team, tenant.project,
                                                     compliance_scope, region_hint))


@functools.lru_cache(maxsize=65536)
def _tenant(org: str, team: str, project: str) -> TenantRef:
    """Validated once per tenant: requests repeat the same few tenants many times."""
    for name, value in (("org", org), ("team", team), ("project", project)):
        if not _SLUG.match(value):
            raise RouteError("INVALID_ARGUMENT", f"bad {name} {value!r}",
                             "invalid")
    return TenantRef(org=org, team=team, project=project)

MAX_ROUTES = 65_536
"""Callers' routes kept at most (then all are dropped and rebuilt as callers come back)."""


class Target(NamedTuple):
    """What one caller's requests that resolve to the same outcome share."""

    choice: ServingChoice | None
    sha256: str | None
    """`choice.sha256`, kept here: one object fewer to read per request."""
    base_digest: str | None
    pool: tuple[frozenset[str], list[int]]
    """`Membership.pool_entry` of the base model: eligible workers, [their in-flight sum]."""
    merged: bool
    """Workers in merged mode serve this adapter: placement takes the long way."""
    admission: Admission
    recent: RecentAdapter | None


class CallerRoute:
    """Everything a request's decision reuses from the previous request of the same caller
    (token, tenant signature less the user, adapter reference, base model). Built again when
    the ring or the worker pools change or another principal comes with the token id;
    resolved again when the fold's serving generation moves; `Limits` re-binds its buckets
    itself. `targets` follow the resolution's `outcomes` (each built on first use)."""

    __slots__ = ("base_digest", "key", "order", "outcomes", "pools", "principal",
                 "resolution", "ring", "serving", "targets", "tenant", "tenant_key", "tier")

    def __init__(self, principal: Principal, serving: int, ring: int, pools: int,
                 tenant: TenantRef, tenant_key: str, tier: str, key: str,
                 order: tuple[str, ...]) -> None:
        self.principal = principal
        self.serving, self.ring, self.pools = serving, ring, pools
        self.tenant, self.tenant_key, self.tier, self.key = tenant, tenant_key, tier, key
        self.order = order
        """The ring's walk from `key`."""
        self.base_digest: str | None = None
        """The base model the request named (None = any)."""
        self.resolution: Resolution | None = None
        """The canary line users are placed on; None where every user gets `outcomes[0]`."""
        self.outcomes: tuple[ServingChoice | Refusal | None, ...] = ()
        self.targets: list[Target | None] = []


def _same(kept: tuple[object, ...], fresh: tuple[object, ...]) -> bool:
    """Do two resolutions' outcomes give every user the same target? (A refusal is never
    the same: its target is not kept anyway.)"""
    return len(kept) == len(fresh) and all(
        (a is None and b is None) or (isinstance(a, ServingChoice) and isinstance(
            b, ServingChoice) and a == b and a.base_model_digest == b.base_model_digest)
        for a, b in zip(kept, fresh, strict=True))



def _refused(refusal: Refusal) -> RouteError:
    """The serving rule's refusal as the caller is answered (`Refusal.public`: another
    tenant's name reads as a missing one), the real reason kept in `audit`; `not_found`
    (no such adapter, alias or version, or one a purge erased) is OpenAI's
    `model_not_found` on the HTTP front."""
    answer = refusal.public()
    reason = "model_not_found" if answer.kind == "not_found" else answer.kind
    return RouteError(_REFUSAL_CODES[answer.kind], answer.message, reason,
                      audit=refusal.message if answer is not refusal else None)


def _no_worker(pooled: bool, interval_s: float) -> RouteError:
    """No worker for the request: none live on its base model, or (`pooled`) live ones
    the ring does not have yet."""
    if not pooled:
        return RouteError("UNAVAILABLE", "no live worker serves this base "
                          "model", "no_worker", retry_after_s=interval_s, retry_after="1")
    return RouteError("UNAVAILABLE", "no worker in the ring serves this base "
                      "model yet", "no_worker", retry_after_s=1.0, retry_after="1")



class Routing:
    """The router's fold as routing reads it (catalog, membership, ring, limits, recent use)
    and the decision over it. Changed only on the router's event-loop thread, so nothing
    here takes a lock: one decision sees one state."""

    def __init__(self, settings: Settings, catalog: CatalogState | None = None) -> None:
        self.settings = settings
        self.catalog = catalog or CatalogState(stale_after_s=settings.stale_lease_threshold_s)
        self.catalog.stale_after_s = settings.stale_lease_threshold_s  # the setting's, always
        self.resolutions = ResolutionCache(self.catalog)
        self._epsilon = settings.router_load_epsilon
        self._window = settings.router_affinity_window
        self.membership = Membership(stall_grace_s=settings.router_heartbeat_stall_grace_s,
                                     interval_s=settings.heartbeat_interval_s,
                                     misses=settings.router_missed_heartbeats)
        self.ring = Ring(vnodes=settings.router_ring_vnodes)
        self.limits = Limits(tenant_rate=settings.router_tenant_rate,
                             adapter_rate=settings.router_adapter_rate,
                             cold_load_rate=settings.router_cold_load_rate,
                             burst_s=settings.router_burst_s,
                             overrides=settings.router_rate_overrides)
        self.recent = RecentUse(per_key=settings.router_recent_adapters)
        self.ready = False
        self.draining = False
        """Set at stop: new calls are refused while the ones in flight finish."""
        self._routes: dict[tuple[object, ...], CallerRoute] = {}
        self._limits: dict[str, ModelLimits] = {}

    def decide(self, principal: Principal, asked: Asked, now: float) -> RouteDecision:
        """Steps 1-4 of the module doc: no I/O; raises `RouteError`. Every request of both
        fronts pays for this, so a caller that asked before (same token, signature, adapter
        reference and base model) costs one lookup of its `CallerRoute`, then straight-line
        code: the user's pick on a canary line, the walk, one admission, tuples."""
        if not self.ready:
            raise RouteError("UNAVAILABLE", "router is draining; send it to another router"
                             if self.draining else "router is replaying the log",
                             "not_ready", retry_after_s=1.0, retry_after="1")
        key = (principal.token_id, asked.org, asked.team, asked.project, asked.qos_tier,
               asked.compliance_scope, asked.region_hint, asked.adapter, asked.base_model)
        route = self._routes.get(key)
        membership = self.membership
        if (route is None or route.principal is not principal or route.ring != self.ring.version
                or route.pools != membership.generation):
            route = self._route(principal, asked, key)
        elif route.serving != self.catalog.serving_generation:
            self._resolve(route, asked)
        resolution = route.resolution
        index = 0 if resolution is None else resolution.entry(asked.user_id)
        target = route.targets[index]
        if target.__class__ is not Target:
            target = self._target(route, index, now)
        choice, sha256, base_digest, (eligible, in_pool), merged, admission, recent = target
        placement = None
        if eligible:
            placement = place_on(route.order, eligible=eligible.__contains__,
                                 loads=membership.in_flight,
                                 holding=_on_device if sha256 is None else
                                 membership.holding(sha256, now),
                                 epsilon=self._epsilon, window=self._window,
                                 eligible_count=len(eligible), total_in_flight=in_pool[0])
        if merged:
            placement = self._merged_placement(route, choice, placement, bool(eligible))
        elif placement is None:
            raise _no_worker(bool(eligible), membership.interval_s)
        refusal = self.limits.admit_with(now, admission, placement.cold)
        if refusal is not None:
            raise RouteError("RESOURCE_EXHAUSTED", refusal.message,
                             refusal.reason, retry_after_s=refusal.retry_after_s,
                             retry_after=refusal.retry_after_header)
        if recent is not None:
            self.recent.touch(route.key, recent)
        return RouteDecision(route.tenant, route.tier, route.key, choice, base_digest, placement)

    def _route(self, principal: Principal, asked: Asked, key: tuple[object, ...]
               ) -> CallerRoute:
        """Build (and keep) a caller's route: tenant from the token, the version by
        `services.catalog.serving`'s rule for every user at once, the ring's walk. A
        refusal raises here and is not kept."""
        tenant, tenant_key, tier, ring_key_ = caller_scope(
            principal, asked.org, asked.team, asked.project, asked.qos_tier,
            asked.compliance_scope, asked.region_hint)
        ring = self.ring
        route = CallerRoute(principal, -1, ring.version, self.membership.generation, tenant,
                            tenant_key, tier, ring_key_,
                            ring.order(ring_key_) if ring.members else ())
        self._resolve(route, asked)
        if len(self._routes) >= MAX_ROUTES:
            self._routes.clear()
        self._routes[key] = route
        return route

    def _resolve(self, route: CallerRoute, asked: Asked) -> None:
        """(Re)resolve the route's version on the fold as it is now. Any catalog event moves
        the serving generation, and most leave this caller's outcomes as they were: its
        targets (pools, admissions) are kept then."""
        base_digest = None
        if asked.base_model is not None:
            base = self.catalog.base_models.get(asked.base_model)
            if base is None:
                raise RouteError("NOT_FOUND",
                                 f"base model {asked.base_model!r} does not exist", "not_found")
            base_digest = base.digest
        named = asked.adapter
        resolution = None
        outcomes: tuple[ServingChoice | Refusal | None, ...] = (None,)
        try:
            if isinstance(named, str):
                found = self.resolutions.resolution(route.tenant, named,
                                                    base_digest=base_digest)
                outcomes = found.outcomes
                resolution = found if found.edges else None
            elif named is not None:
                adapter_id, version = named
                if version == 0:
                    raise Refusal("invalid", "a pinned version starts at 1")
                outcomes = (self.resolutions.pinned(route.tenant, adapter_id, version,
                                                    base_digest=base_digest),)
        except Refusal as refusal:
            raise _refused(refusal) from None
        if base_digest != route.base_digest or not _same(route.outcomes, outcomes):
            route.targets = [None] * len(outcomes)
        route.base_digest, route.resolution, route.outcomes = base_digest, resolution, outcomes
        route.serving = self.catalog.serving_generation

    def _target(self, route: CallerRoute, index: int, now: float) -> Target:
        """What the route's requests with outcome `index` share (built on the first)."""
        outcome = route.outcomes[index]
        if isinstance(outcome, Refusal):
            raise _refused(outcome)
        membership = self.membership
        if outcome is None:
            target = Target(None, None, route.base_digest, membership.pool_entry(route.base_digest),
                            False, self.limits.admission(now, tenant=route.tenant_key,
                                                         tenant_tier=route.tier), None)
        else:
            digest = outcome.base_model_digest
            target = Target(outcome, outcome.sha256, digest, membership.pool_entry(digest),
                            bool(membership.merged_for(outcome.adapter_id)),
                            self.limits.admission(now, tenant=route.tenant_key,
                                                  tenant_tier=route.tier,
                                                  adapter=outcome.adapter_id,
                                                  adapter_tier=outcome.qos_tier),
                            RecentAdapter(outcome.adapter_id, outcome.version, outcome.sha256,
                                          digest or ""))
        route.targets[index] = target
        return target

    def _merged_placement(self, route: CallerRoute, choice: ServingChoice | None,
                          general: Placement | None, pooled: bool) -> Placement:
        """Placement when workers in merged mode serve the adapter: those of them that serve
        this version now take it, the general placement is their fallback."""
        assert choice is not None
        merged = self._merged_workers(choice)
        if not merged:
            if general is None:
                raise _no_worker(pooled, self.membership.interval_s)
            return general
        in_flight = self.membership.in_flight
        placement = place_on(route.order, eligible=frozenset(merged).__contains__,
                             loads=in_flight, holding=_on_device, epsilon=self._epsilon,
                             window=1, eligible_count=len(merged),
                             total_in_flight=sum(in_flight.get(w, 0) for w in merged))
        if placement is not None and placement.fallback is None and general is not None:
            placement = placement._replace(fallback=general.worker)
        placement = placement or general
        if placement is None:
            raise _no_worker(True, self.membership.interval_s)
        return placement

    def _merged_workers(self, choice: ServingChoice) -> tuple[str, ...]:
        """Live workers in merged mode that serve this version now, by the merge rule on
        this router's fold (a switch moves the traffic without waiting for heartbeats)."""
        found = []
        for worker in self.membership.merged_for(choice.adapter_id):
            view = self.membership.workers[worker]
            dedication = view.dedication
            assert dedication is not None
            try:
                target = merge_target(self.catalog, MergeSpec(*dedication),
                                      base_digest=view.base_digest)
            except Refusal:
                continue
            if target.version == choice.version:
                found.append(worker)
        return tuple(found)

    def model_limits(self, digest: str | None) -> ModelLimits | None:
        """The base model's limits from its registered config (kept per digest: a
        registration never changes)."""
        if digest is None:
            return None
        limits = self._limits.get(digest)
        if limits is None:
            base = next((b for b in self.catalog.base_models.values() if b.digest == digest),
                        None)
            if base is None:
                return None
            limits = self._limits[digest] = ModelLimits.from_config(base.config)
        return limits

