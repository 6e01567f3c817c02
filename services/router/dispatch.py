"""The request path both fronts share: authorise, resolve, admit, place, forward, fail over.

gRPC (`services.router.server`) and the OpenAI HTTP API (`services.router.openai_http`)
hand every request to `Dispatcher.generate`, so both get the same resolution, placement,
limits and failover. State is folded from the log on the event loop's thread
(`services.router.fold`), so nothing here takes a lock: one decision sees one state.
Steps 1-4 below are the pure routing decision (`services.router.routing.Routing.decide`,
no I/O, no wire types); this module is the forwarder around it: the fold's effects on
the ring, step 5, the channel pool, prefetch hints, route traces. A refusal of an unknown
or inactive adapter stands only once the fold has caught up with the log
(`Dispatcher.decide_caught_up`).

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
import gc
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import grpc

from services import tls
from services.catalog.auth import Principal
from services.catalog.serving import purged_reason
from services.catalog.state import CatalogState
from services.config import Settings
from services.contracts.events import Envelope, ServedRequest, TenantRef
from services.contracts.generate import InvalidArgument, check_generate, check_limits
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.contracts.qos import TIER_TO_PROTO
from services.router.limits import Limits
from services.router.membership import Membership
from services.router.metrics import RouterMetrics
from services.router.prewarm import RecentAdapter, RecentUse, plan
from services.router.ring import Ring
from services.router.routing import (
    Asked,
    RouteDecision,
    RouteError,
    Routing,
    authorize_tenant,
)
from services.router.witness import CutWitness

log = logging.getLogger("loraplane.router")
trace_log = logging.getLogger("loraplane.router.trace")

__all__ = ["Asked", "Dispatcher", "RouteError", "RouteTrace", "asked_of", "authorize"]

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
                       grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED})
"""Worker failures worth one more try elsewhere; the rest would fail there too."""
MIN_RETRY_BUDGET_S = 0.05
"""A retry is not started with less time than this left before the deadline."""
CATCH_UP_S = 2.0
"""The longest a refused request waits for the fold to catch up with the log."""
CATCH_UP_CODES = frozenset({"NOT_FOUND", "FAILED_PRECONDITION"})
"""Refusals that a write the fold has not read yet may lift (unknown, or not active)."""
HINT_EVERY_S = 2.0
"""The same prefetch hint is not repeated to the same worker more often than this."""


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


def asked_of(signature: pb.TenantSignature, adapter: pb.AdapterRef,
             base_model: str | None = None) -> Asked:
    """A request's tenant signature and adapter reference as the routing decision takes
    them (plain values)."""
    which = adapter.WhichOneof("ref")
    named: str | tuple[str, int] | None = None
    if which == "alias":
        named = adapter.alias
    elif which is not None:
        pinned = adapter.pinned
        named = (pinned.adapter_id, pinned.version)
    return Asked(signature.org_id, signature.team_id, signature.project_id,
                 signature.qos_tier, signature.compliance_scope, signature.region_hint,
                 signature.user_id, named, base_model)


def authorize(principal: Principal, signature: pb.TenantSignature) -> TenantRef:
    """The tenant a request runs as: the token's scope, filled in (where `*`) by the request."""
    return authorize_tenant(principal, signature.org_id, signature.team_id,
                            signature.project_id)


def _checked(check: Callable[..., None], *args: object) -> None:
    """A rule of `services.contracts.generate` (the one the workers check too), its
    refusal as a RouteError."""
    try:
        check(*args)
    except InvalidArgument as exc:
        raise RouteError("INVALID_ARGUMENT", str(exc), "invalid",
                         field=exc.field) from None



class Dispatcher:
    """The router's request path over its `Routing` state: fold, forwarding, failover,
    the channel pool, prefetch hints and trace logging."""

    def __init__(self, settings: Settings, metrics: RouterMetrics | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.metrics = metrics or RouterMetrics()
        self.clock = clock
        self.routing = Routing(settings)
        self.traces: deque[RouteTrace] = deque(maxlen=2000)
        self._channels: dict[str, tuple[str, grpc.aio.Channel]] = {}
        self._hinted: dict[tuple[str, str, int], float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.witness: CutWitness | None = None
        """Traces requests cut mid-stream (set by the app; None: not traced)."""
        self.catch_up: Callable[[float], Awaitable[bool]] | None = None
        """Folds everything committed to the log before the call, within the seconds given
        (set by the app; None: the fold is fed directly, as in tests of the fold)."""

    def reset(self, catalog: CatalogState | None = None) -> None:
        """Start the fold again from `catalog` (a snapshot's) or from nothing: before the
        router is ready, when its reader restarts its replay."""
        self.routing = Routing(self.settings, catalog)

    # the routing state, as the fronts and tests read it
    @property
    def catalog(self) -> CatalogState:
        return self.routing.catalog

    @property
    def membership(self) -> Membership:
        return self.routing.membership

    @property
    def ring(self) -> Ring:
        return self.routing.ring

    @property
    def limits(self) -> Limits:
        return self.routing.limits

    @property
    def recent(self) -> RecentUse:
        return self.routing.recent

    @property
    def ready(self) -> bool:
        return self.routing.ready

    @ready.setter
    def ready(self, value: bool) -> None:
        self.routing.ready = value

    def start_draining(self) -> None:
        """Refuse new calls (UNAVAILABLE, from this router's own code) from now on."""
        self.routing.draining = True
        self.routing.ready = False

    @property
    def in_flight(self) -> int:
        """Calls placed on a worker and not finished."""
        return sum(self.membership.in_flight.values())

    def decide(self, principal: Principal, asked: Asked, now: float) -> RouteDecision:
        """`Routing.decide`: steps 1-4 of the module doc, no I/O; raises `RouteError`."""
        return self.routing.decide(principal, asked, now)

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

    def fold(self, envelope: Envelope, seen_at: float,
             source: tuple[str, int] | None = None) -> None:
        """One event; `source` (topic, partition) tells membership where it was read."""
        self.catalog.apply(envelope)
        if self.membership.observe(envelope, seen_at, source):
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
            log.warning("workers left the ring (draining, or %d heartbeats missed): %s",
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

    async def decide_caught_up(self, principal: Principal, asked: Asked, started: float,
                               deadline: float) -> RouteDecision:
        """`Routing.decide`, reading the caller's own writes: a refusal of an adapter,
        alias, version or base model this router's fold does not know or hold active
        (NOT_FOUND, FAILED_PRECONDITION) stands only once the fold holds everything
        committed to the log before the call (`catch_up`, at most `CATCH_UP_S` and within
        the deadline): a publish or switch the registry has just answered may still be on
        its way here. Only such refusals pay for the look at the log's ends."""
        try:
            return self.routing.decide(principal, asked, started)
        except RouteError as error:
            if error.code not in CATCH_UP_CODES or self.catch_up is None:
                raise
            refused = error
        finally:
            self.metrics.route_seconds.observe(self.clock() - started)
        limit = min(CATCH_UP_S, deadline - self.clock() - 0.1)
        if limit <= 0:
            raise refused
        await self.catch_up(limit)
        return self.routing.decide(principal, asked, self.clock())

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
        asked = asked_of(request.tenant, request.adapter, base_model)
        tenant_label = adapter_label = "-"
        try:
            _checked(check_generate, request)
            decision = await self.decide_caught_up(principal, asked, started, deadline)
            limits = self.routing.model_limits(decision.base_digest)
            if limits is not None:
                _checked(check_limits, request, limits)
        except RouteError as error:
            self.metrics.rejections.labels(error.reason).inc()
            self.metrics.requests.labels(tenant_label, adapter_label, front,
                                         error.reason).inc()
            if error.audit is not None:  # the caller was told less: the real reason here
                trace_log.info("%s", json.dumps({
                    "trace_id": trace_id, "request_id": request_id, "front": front,
                    "tenant": authorize(principal, request.tenant).key,
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
            trace.error = f"{error.code}: {error.message}"
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

    def _after_placement(self, decision: RouteDecision) -> None:
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

    def _forwarded(self, request: pb.GenerateRequest, decision: RouteDecision, request_id: str,
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

    async def _forward(self, request: pb.GenerateRequest, decision: RouteDecision,
                       workers: list[str], deadline: float, trace: RouteTrace, started: float,
                       front: str) -> AsyncIterator[pb.GenerateResponse]:
        for index, worker in enumerate(workers):
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise RouteError("DEADLINE_EXCEEDED",
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
                    raise RouteError(code.name, detail, "worker_error",
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
                raise RouteError(code.name, f"worker {worker}: {detail}", reason) from None
            except (asyncio.CancelledError, GeneratorExit):
                attempt.outcome = "cancelled"
                raise
            finally:
                call.cancel()
                self.membership.release(worker)
                self.metrics.in_flight.labels(worker).dec()

    def _witness_cut(self, request: pb.GenerateRequest, decision: RouteDecision, trace: RouteTrace,
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
        # with TLS, rotated client certificate files make new channels (services.tls)
        key = tls.channel_key(address, self.settings)
        known = self._channels.get(worker)
        if known is not None and known[0] == key:
            return known[1]
        if known is not None:
            self._spawn(known[1].close())
        channel = tls.aio_channel(address, self.settings, options=[
            ("grpc.keepalive_time_ms", 30_000), ("grpc.http2.max_pings_without_data", 0)])
        self._channels[worker] = (key, channel)
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
