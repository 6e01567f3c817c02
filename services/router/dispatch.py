"""The request path both fronts share: authorise, resolve, admit, place, forward, fail over.

gRPC (`services.router.server`) and the OpenAI HTTP API (`services.router.openai_http`)
hand every request to `Dispatcher.generate`, so both get the same resolution, placement,
limits and failover. State is folded from the log on the event loop's thread
(`services.router.app`), so nothing here takes a lock: one decision sees one state.

Steps of a request (after `services.contracts.generate`'s check of the request, the one
the workers make too; its base model's limits are checked once step 2 knows the model):
1. Tenant from the token (`authorize`): a tenant-scoped token's org/team/project is the
   tenant; the request may only repeat it or fill the segments the token leaves as `*`.
2. Version (`services.catalog.serving`): an alias by its split, sticky per user; an
   adapter id by its active version; `adapter@version` pinned. The worker receives the
   result as `AdapterRef.pinned`, never the alias.
3. Placement (`services.router.ring.place`) among live workers on the version's base model.
   A version that workers in merged mode serve (`services.catalog.serving.merge_target`,
   on the router's own fold) goes to those workers, with a general worker as the
   fallback; they never get any other request.
4. Admission (`services.router.limits`): tenant and adapter buckets, and the cold-load cap
   when the placement is cold. A refusal is RESOURCE_EXHAUSTED with a retry-after.
5. Forwarding with the client's deadline. A worker that fails before its first response is
   replaced once by the next ring worker; after the first response the worker's error
   goes to the client as it is, and the request is traced `cut` by the router's witness
   (`services.router.witness`): a worker that died cannot trace it. Every attempt is
   written into the request's `RouteTrace`. A client that leaves (a gRPC cancel or
   deadline, an HTTP disconnect) closes the request's stream here, which cancels the
   worker's call: the worker aborts the sequence and traces it `cancelled`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import NamedTuple

import grpc

from services.catalog.serving import (
    MergeSpec,
    Resolution,
    ResolutionCache,
    ServingChoice,
    merge_target,
    purged_reason,
)
from services.catalog.state import CatalogState, Refusal
from services.config import Settings
from services.contracts.events import SLUG_PATTERN, Envelope, ServedRequest, TenantRef
from services.contracts.generate import (
    InvalidArgument,
    ModelLimits,
    check_generate,
    check_limits,
)
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.contracts.qos import TIER_TO_PROTO, lower_tier, tier_of
from services.contracts.roles import TENANT_SCOPED, Permission
from services.registry.auth import Principal
from services.router.limits import DEFAULT_TIER, Admission, Limits
from services.router.membership import Membership
from services.router.metrics import RouterMetrics
from services.router.prewarm import RecentAdapter, RecentUse, plan
from services.router.ring import Placement, Ring, Tier, place_on, ring_key
from services.router.witness import CutWitness

log = logging.getLogger("loraplane.router")
trace_log = logging.getLogger("loraplane.router.trace")

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
                       grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED})
"""Worker failures worth one more try elsewhere; the rest would fail there too."""
MIN_RETRY_BUDGET_S = 0.05
"""A retry is not started with less time than this left before the deadline."""
HINT_EVERY_S = 2.0
"""The same prefetch hint is not repeated to the same worker more often than this."""

_SLUG = re.compile(SLUG_PATTERN)
_REFUSAL_CODES = {"not_found": grpc.StatusCode.NOT_FOUND,
                  "precondition": grpc.StatusCode.FAILED_PRECONDITION,
                  "invalid": grpc.StatusCode.INVALID_ARGUMENT,
                  "conflict": grpc.StatusCode.FAILED_PRECONDITION}


class RouteError(Exception):
    """A request the router answers with an error; both fronts map it to their own shape."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str, *,
                 retry_after_s: float | None = None, retry_after: str | None = None,
                 after_first_token: bool = False, field: str | None = None,
                 audit: str | None = None) -> None:
        super().__init__(message)
        self.code = code
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


@dataclass
class Attempt:
    worker: str
    address: str
    outcome: str = "pending"
    """ok, failed_before_first_token, failed_after_first_token, cancelled."""
    code: str | None = None
    detail: str | None = None
    responses: int = 0


@dataclass
class RouteTrace:
    """What the router did with one request: kept in memory and logged."""

    trace_id: str
    request_id: str
    front: str
    tenant: str
    ring_key: str
    adapter: str | None
    alias: str | None
    placement_tier: str | None = None
    diverted: bool = False
    attempts: list[Attempt] = field(default_factory=list)
    status: str = "pending"
    error: str | None = None
    started_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class Decision(NamedTuple):
    """What `Dispatcher.decide` chose (one per request: a tuple, the cheapest to build)."""

    tenant: TenantRef
    tier: str
    key: str
    choice: ServingChoice | None
    base_digest: str | None
    placement: Placement


@dataclass(frozen=True)
class Asked:
    """What a request asks for, in the fronts' common terms."""

    signature: pb.TenantSignature
    adapter: pb.AdapterRef
    base_model: str | None = None
    """The base model the caller named (HTTP `model`); None = any base (gRPC)."""


def _on_device(_: str) -> Tier:
    """Where a request without an adapter finds it: nothing to load, every worker is warm."""
    return "device"


def authorize(principal: Principal, signature: pb.TenantSignature) -> TenantRef:
    """The tenant a request runs as: the token's scope, filled in (where `*`) by the request."""
    return _authorize(principal, signature.org_id, signature.team_id, signature.project_id)


@functools.lru_cache(maxsize=65536)
def _authorize(principal: Principal, *asked: str) -> TenantRef:
    """Cached per token and asked tenant: the same callers ask again and again, and a refusal
    (an exception) is never cached."""
    names = ("org", "team", "project")
    if not principal.holds(Permission.INFER):
        raise RouteError(grpc.StatusCode.PERMISSION_DENIED,
                         f"role {principal.role} may not run inference", "forbidden")
    if principal.role not in TENANT_SCOPED:
        if not all(asked):
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"an {principal.role} token must name the tenant (org, team, "
                             "project)", "invalid")
        values = list(asked)
    else:
        assert principal.tenant_pattern is not None  # TokenBook gives scoped roles one
        values = []
        for name, scope, value in zip(names, principal.tenant_pattern, asked, strict=True):
            if scope != "*":
                if value and value != scope:
                    raise RouteError(grpc.StatusCode.PERMISSION_DENIED,
                                     f"token is scoped to {name} {scope!r}, not {value!r}",
                                     "forbidden")
                values.append(scope)
            elif not value:
                raise RouteError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"token covers any {name}: name the {name} in the request",
                                 "invalid")
            else:
                values.append(value)
    return _tenant(values[0], values[1], values[2])


class Caller(NamedTuple):
    """Who a request runs as, and the names the request path keys on."""

    tenant: TenantRef
    tenant_key: str
    """`tenant.key`: the limits' and metrics' name of the tenant."""
    tier: str
    """The QoS tier: the token's, or lower where the request asks for less."""
    ring_key: str


@functools.lru_cache(maxsize=65536)
def _caller(principal: Principal, org: str, team: str, project: str, qos_tier: int,
            compliance_scope: str, region_hint: str) -> Caller:
    """Steps that depend only on the token and the signature, done once per distinct pair
    (a refusal, an exception, is never cached)."""
    tenant = _authorize(principal, org, team, project)
    tier = lower_tier(principal.qos_tier or DEFAULT_TIER, tier_of(qos_tier))
    return Caller(tenant, tenant.key, tier, ring_key(tenant.org, tenant.team, tenant.project,
                                                     compliance_scope, region_hint))


@functools.lru_cache(maxsize=65536)
def _tenant(org: str, team: str, project: str) -> TenantRef:
    """Validated once per tenant: requests repeat the same few tenants many times."""
    for name, value in (("org", org), ("team", team), ("project", project)):
        if not _SLUG.match(value):
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT, f"bad {name} {value!r}",
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


def _checked(check: Callable[..., None], *args: object) -> None:
    """A rule of `services.contracts.generate` (the one the workers check too), its
    refusal as a RouteError."""
    try:
        check(*args)
    except InvalidArgument as exc:
        raise RouteError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "invalid",
                         field=exc.field) from None


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
        return RouteError(grpc.StatusCode.UNAVAILABLE, "no live worker serves this base "
                          "model", "no_worker", retry_after_s=interval_s, retry_after="1")
    return RouteError(grpc.StatusCode.UNAVAILABLE, "no worker in the ring serves this base "
                      "model yet", "no_worker", retry_after_s=1.0, retry_after="1")


class Dispatcher:
    """The router's state (catalog, membership, ring) and its request path."""

    def __init__(self, settings: Settings, metrics: RouterMetrics | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.metrics = metrics or RouterMetrics()
        self.clock = clock
        self.catalog = CatalogState(stale_after_s=settings.stale_lease_threshold_s)
        self.resolutions = ResolutionCache(self.catalog)
        self._epsilon = settings.router_load_epsilon
        self._window = settings.router_affinity_window
        self.membership = Membership(interval_s=settings.heartbeat_interval_s,
                                     misses=settings.router_missed_heartbeats)
        self.ring = Ring(vnodes=settings.router_ring_vnodes)
        self.limits = Limits(tenant_rate=settings.router_tenant_rate,
                             adapter_rate=settings.router_adapter_rate,
                             cold_load_rate=settings.router_cold_load_rate,
                             burst_s=settings.router_burst_s,
                             overrides=settings.router_rate_overrides)
        self.recent = RecentUse(per_key=settings.router_recent_adapters)
        self.ready = False
        self.traces: deque[RouteTrace] = deque(maxlen=2000)
        self._channels: dict[str, tuple[str, grpc.aio.Channel]] = {}
        self._hinted: dict[tuple[str, str, int], float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._routes: dict[tuple[object, ...], CallerRoute] = {}
        self._limits: dict[str, ModelLimits] = {}
        self.witness: CutWitness | None = None
        """Traces requests cut mid-stream (set by the app; None: not traced)."""

    def start_serving(self) -> None:
        """The log is replayed: answer requests from now on. The replayed state is most of the
        heap and lives as long as the process, so it is frozen out of the cyclic garbage
        collector (`router_gc_freeze`): a full collection that walked it stalled every
        request in flight for 120-150 ms with 10,000 tenants (`bench/router.py`)."""
        if self.settings.router_gc_freeze:
            gc.collect()
            gc.freeze()
        self.ready = True

    # --- folding the log (on the event loop's thread) -------------------------------------

    def fold(self, envelope: Envelope, seen_at: float) -> None:
        self.catalog.apply(envelope)
        if self.membership.observe(envelope, seen_at):
            worker = envelope.payload.worker_id  # type: ignore[attr-defined]
            self._change_ring(lambda ring: ring.add(worker), "join")
        self.metrics.events_folded.labels(envelope.type).inc()

    def tick(self, now: float | None = None) -> None:
        """Expire silent workers and close channels nobody uses any more."""
        now = self.clock() if now is None else now
        gone = self.membership.expire(now)
        if gone:
            def drop(ring: Ring) -> None:
                for worker in gone:
                    ring.remove(worker)
            self._change_ring(drop, "leave")
            log.warning("workers left the ring after %d missed heartbeats: %s",
                        self.membership.misses, ", ".join(gone))
        for worker in list(self._channels):
            if (worker not in self.membership.live
                    and not self.membership.in_flight.get(worker)):
                _, channel = self._channels.pop(worker)
                self._spawn(channel.close())

    def _change_ring(self, change: Callable[[Ring], None], kind: str) -> None:
        old = self.ring.copy()
        change(self.ring)
        self.metrics.ring_size.set(len(self.ring))
        self.metrics.ring_changes.labels(kind).inc(abs(len(self.ring) - len(old)))
        if self.ready and self.settings.router_prewarm:
            reason = "ring join" if kind == "join" else "ring leave"
            for worker, adapters in plan(old, self.ring, self.recent,
                                         self.membership.serves_base).items():
                self._hint(worker, adapters, pb.PREFETCH_TIER_HOST, reason)

    # --- the request path ------------------------------------------------------------------

    def decide(self, principal: Principal, asked: Asked, now: float) -> Decision:
        """Steps 1-4 of the module doc: no I/O; raises `RouteError`. Every request of both
        fronts pays for this, so a caller that asked before (same token, signature, adapter
        reference and base model) costs one lookup of its `CallerRoute`, then straight-line
        code: the user's pick on a canary line, the walk, one admission, tuples."""
        if not self.ready:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "router is replaying the log",
                             "not_ready", retry_after_s=1.0, retry_after="1")
        sig = asked.signature
        ref = asked.adapter
        which = ref.WhichOneof("ref")
        named: str | tuple[str, int] | None = None
        if which == "alias":
            named = ref.alias
        elif which is not None:
            pinned = ref.pinned
            named = (pinned.adapter_id, pinned.version)
        key = (principal.token_id, sig.org_id, sig.team_id, sig.project_id, sig.qos_tier,
               sig.compliance_scope, sig.region_hint, named, asked.base_model)
        route = self._routes.get(key)
        membership = self.membership
        if (route is None or route.principal is not principal or route.ring != self.ring.version
                or route.pools != membership.generation):
            route = self._route(principal, asked, key)
        elif route.serving != self.catalog.serving_generation:
            self._resolve(route, asked)
        resolution = route.resolution
        index = 0 if resolution is None else resolution.entry(sig.user_id)
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
            raise RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message,
                             refusal.reason, retry_after_s=refusal.retry_after_s,
                             retry_after=refusal.retry_after_header)
        if recent is not None:
            self.recent.touch(route.key, recent)
        return Decision(route.tenant, route.tier, route.key, choice, base_digest, placement)

    def _route(self, principal: Principal, asked: Asked, key: tuple[object, ...]
               ) -> CallerRoute:
        """Build (and keep) a caller's route: tenant from the token, the version by
        `services.catalog.serving`'s rule for every user at once, the ring's walk. A
        refusal raises here and is not kept."""
        sig = asked.signature
        tenant, tenant_key, tier, ring_key_ = _caller(
            principal, sig.org_id, sig.team_id, sig.project_id, sig.qos_tier,
            sig.compliance_scope, sig.region_hint)
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
                raise RouteError(grpc.StatusCode.NOT_FOUND,
                                 f"base model {asked.base_model!r} does not exist", "not_found")
            base_digest = base.digest
        ref = asked.adapter
        which = ref.WhichOneof("ref")
        resolution = None
        outcomes: tuple[ServingChoice | Refusal | None, ...] = (None,)
        try:
            if which == "alias":
                found = self.resolutions.resolution(route.tenant, ref.alias,
                                                    base_digest=base_digest)
                outcomes = found.outcomes
                resolution = found if found.edges else None
            elif which is not None:
                pinned = ref.pinned
                if pinned.version == 0:
                    raise Refusal("invalid", "a pinned version starts at 1")
                outcomes = (self.resolutions.pinned(route.tenant, pinned.adapter_id,
                                                    pinned.version, base_digest=base_digest),)
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

    async def generate(self, principal: Principal, request: pb.GenerateRequest, *,
                       timeout_s: float | None, front: str, base_model: str | None = None
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Route one request and stream the worker's answer; see the module doc.

        Raises `RouteError` before the first response (nothing was sent) or after it
        (`after_first_token`: the worker's own status, passed on as it is).
        """
        started = self.clock()
        deadline = started + (timeout_s if timeout_s is not None
                              else self.settings.router_request_timeout_s)
        request_id = request.request_id or uuid.uuid4().hex
        trace_id = request.trace_id or uuid.uuid4().hex
        asked = Asked(request.tenant, request.adapter, base_model)
        tenant_label = adapter_label = "-"
        try:
            _checked(check_generate, request)
            try:
                decision = self.decide(principal, asked, started)
            finally:
                self.metrics.route_seconds.observe(self.clock() - started)
            limits = self._model_limits(decision.base_digest)
            if limits is not None:
                _checked(check_limits, request, limits)
        except RouteError as error:
            self.metrics.rejections.labels(error.reason).inc()
            self.metrics.requests.labels(tenant_label, adapter_label, front,
                                         error.reason).inc()
            if error.audit is not None:  # the caller was told less: the real reason here
                trace_log.info("%s", json.dumps({
                    "trace_id": trace_id, "request_id": request_id, "front": front,
                    "tenant": authorize(principal, asked.signature).key,
                    "status": error.reason, "answered": error.message,
                    "reason": error.audit}))
            raise
        choice, placement = decision.choice, decision.placement
        tenant_label = decision.tenant.key
        adapter_label = choice.adapter_id if choice else "-"
        trace = RouteTrace(trace_id, request_id, front, decision.tenant.key, decision.key,
                           choice.pinned if choice else None, choice.alias if choice else None,
                           placement.tier, placement.diverted)
        self.traces.append(trace)
        self.metrics.placements.labels(placement.tier or "cold").inc()
        self._after_placement(decision)
        forwarded = self._forwarded(request, decision, request_id, trace_id)
        workers = [placement.worker] + ([placement.fallback] if placement.fallback else [])
        outcome = "error"
        try:
            async for response in self._forward(forwarded, decision, workers, deadline, trace,
                                                started, front):
                yield response
            outcome = "ok"
        except RouteError as error:
            outcome = error.reason
            trace.error = f"{error.code.name}: {error.message}"
            if not error.after_first_token:
                self.metrics.rejections.labels(error.reason).inc()
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            trace.status = outcome
            self.metrics.requests.labels(tenant_label, adapter_label, front, outcome).inc()
            level = logging.INFO if outcome in ("ok", "cancelled") else logging.WARNING
            if trace_log.isEnabledFor(level):
                trace_log.log(level, "%s", json.dumps(trace.as_dict(), default=str))

    def _model_limits(self, digest: str | None) -> ModelLimits | None:
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

    def _after_placement(self, decision: Decision) -> None:
        """Hints: a cold home prefetches what it is about to load; a cold home passed over
        for a warm neighbour prefetches into host memory so traffic can move back."""
        choice, placement = decision.choice, decision.placement
        if choice is None:
            return
        adapter = RecentAdapter(choice.adapter_id, choice.version, choice.sha256,
                                decision.base_digest or "")
        if placement.cold:
            self.membership.note_sent(placement.worker, choice.sha256, self.clock())
            self._hint(placement.worker, [adapter], pb.PREFETCH_TIER_DEVICE, "cold placement")
        elif placement.diverted and self.settings.router_prewarm:
            self._hint(placement.home, [adapter], pb.PREFETCH_TIER_HOST,
                       "warm neighbour serving")

    def _forwarded(self, request: pb.GenerateRequest, decision: Decision, request_id: str,
                   trace_id: str) -> pb.GenerateRequest:
        forwarded = pb.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.request_id = request_id
        forwarded.trace_id = trace_id
        sig = forwarded.tenant
        sig.org_id, sig.team_id, sig.project_id = (decision.tenant.org, decision.tenant.team,
                                                   decision.tenant.project)
        sig.qos_tier = TIER_TO_PROTO[decision.tier]
        if decision.choice is not None:
            forwarded.adapter.pinned.adapter_id = decision.choice.adapter_id
            forwarded.adapter.pinned.version = decision.choice.version
        return forwarded

    async def _forward(self, request: pb.GenerateRequest, decision: Decision,
                       workers: list[str], deadline: float, trace: RouteTrace, started: float,
                       front: str) -> AsyncIterator[pb.GenerateResponse]:
        for index, worker in enumerate(workers):
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 "deadline passed before a worker answered", "deadline")
            address = self.membership.address(worker)
            attempt = Attempt(worker, address)
            trace.attempts.append(attempt)
            call = pb_grpc.InferenceStub(self._channel(worker, address)).Generate(
                request, timeout=remaining)
            self.membership.acquire(worker)
            self.metrics.in_flight.labels(worker).inc()
            response = None
            try:
                async for response in call:
                    if attempt.responses == 0:
                        self.metrics.first_token_seconds.labels(front).observe(
                            self.clock() - started)
                    attempt.responses += 1
                    yield response
                attempt.outcome = "ok"
                return
            except grpc.aio.AioRpcError as exc:
                code, detail = exc.code(), exc.details() or ""
                attempt.code, attempt.detail = code.name, detail
                if attempt.responses:
                    attempt.outcome = "failed_after_first_token"
                    self.metrics.midstream_errors.labels(code.name).inc()
                    tokens = attempt.responses - (response is not None
                                                  and response.HasField("final"))
                    self._witness_cut(request, decision, trace, worker, tokens)
                    raise RouteError(code, detail, "worker_error",
                                     after_first_token=True) from None
                attempt.outcome = "failed_before_first_token"
                more = index + 1 < len(workers)
                if (more and code in RETRYABLE
                        and deadline - self.clock() > MIN_RETRY_BUDGET_S):
                    self.metrics.retries.labels(code.name).inc()
                    log.info("retrying %s on %s: %s failed before its first token (%s)",
                             trace.request_id, workers[index + 1], worker, code.name)
                    continue
                reason = ("deadline" if code == grpc.StatusCode.DEADLINE_EXCEEDED else
                          "model_not_found" if code == grpc.StatusCode.NOT_FOUND else
                          "worker_error")
                raise RouteError(code, f"worker {worker}: {detail}", reason) from None
            except (asyncio.CancelledError, GeneratorExit):
                attempt.outcome = "cancelled"
                raise
            finally:
                call.cancel()
                self.membership.release(worker)
                self.metrics.in_flight.labels(worker).dec()

    def _witness_cut(self, request: pb.GenerateRequest, decision: Decision, trace: RouteTrace,
                     worker: str, tokens: int) -> None:
        """Trace a request whose worker's stream broke after `tokens` tokens reached the
        client: the version this router pinned, the worker's base digest."""
        if self.witness is None:
            return
        choice = decision.choice
        view = self.membership.workers.get(worker)
        base_digest = view.base_digest if view is not None else decision.base_digest
        if base_digest is None:  # pragma: no cover - a placed worker has a heartbeat
            log.warning("cannot trace cut request %s: no base digest", request.request_id)
            return
        self.witness.record(worker, ServedRequest(
            request_id=request.request_id, trace_id=request.trace_id, tenant=decision.tenant,
            user_id=request.tenant.user_id,
            adapter_id=choice.adapter_id if choice else None,
            version=choice.version if choice else None,
            adapter_sha256=choice.sha256 if choice else None, base_model_digest=base_digest,
            base_weights=view.base_weights if view is not None else "dense",  # type: ignore[arg-type]
            prompt_tokens=0, completion_tokens=tokens,
            started_at=datetime.fromtimestamp(trace.started_at, UTC),
            finished_at=datetime.now(UTC), status="cut"))

    # --- connections and hints -------------------------------------------------------------

    def _channel(self, worker: str, address: str) -> grpc.aio.Channel:
        known = self._channels.get(worker)
        if known is not None and known[0] == address:
            return known[1]
        if known is not None:
            self._spawn(known[1].close())
        channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.keepalive_time_ms", 30_000), ("grpc.http2.max_pings_without_data", 0)])
        self._channels[worker] = (address, channel)
        return channel

    def _hint(self, worker: str, adapters: list[RecentAdapter], tier: int,
              reason: str) -> None:
        """Send a Prefetch to `worker` in the background (at most one per HINT_EVERY_S)."""
        if worker not in self.membership.live:
            return
        now = self.clock()
        fresh = []
        for adapter in adapters:
            if self._purged(adapter):
                continue
            key = (worker, adapter.sha256, tier)
            if now - self._hinted.get(key, -HINT_EVERY_S) >= HINT_EVERY_S:
                self._hinted[key] = now
                fresh.append(adapter)
        if len(self._hinted) > 100_000:
            self._hinted = {k: t for k, t in self._hinted.items() if now - t < HINT_EVERY_S}
        if not fresh:
            return
        request = pb.PrefetchRequest(tier=tier, reason=reason, adapters=[
            pb.PinnedVersion(adapter_id=a.adapter_id, version=a.version) for a in fresh])
        self._spawn(self._send_hint(worker, request, reason))

    def _purged(self, recent: RecentAdapter) -> bool:
        """A version a purge ended is never prefetched (pre-warming remembers what it served
        before the purge)."""
        adapter = self.catalog.adapters.get(recent.adapter_id)
        if adapter is None or recent.version not in adapter.versions:
            return False
        return purged_reason(adapter, recent.version, adapter.versions[recent.version]) is not None

    async def _send_hint(self, worker: str, request: pb.PrefetchRequest, reason: str) -> None:
        address = self.membership.address(worker)
        stub = pb_grpc.WorkerControlStub(self._channel(worker, address))
        try:
            reply = await stub.Prefetch(request, timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            self.metrics.prefetch_hints.labels(reason, "failed").inc()
            log.info("prefetch hint to %s failed: %s", worker, exc.code().name)
            return
        accepted = sum(1 for s in reply.adapters if s.accepted)
        self.metrics.prefetch_hints.labels(reason, "accepted").inc(accepted)
        if accepted < len(reply.adapters):
            self.metrics.prefetch_hints.labels(reason, "declined").inc(
                len(reply.adapters) - accepted)

    def _spawn(self, coro: object) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        except RuntimeError:  # no loop (pure tests of the fold): nothing to send
            with contextlib.suppress(Exception):
                coro.close()  # type: ignore[attr-defined]
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for _, channel in self._channels.values():
            await channel.close()
        self._channels.clear()
