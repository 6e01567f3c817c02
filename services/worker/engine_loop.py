"""The engine loop: the one thread that owns the `Engine` (vLLM v1's EngineCore shape).

Everything that touches the engine happens here, between `step()`s: admitting requests,
adapter loads and evictions (`Residency`), switch-outs, purges, cancels. Other threads
only `post` closures to the inbox: the log follower hands over each folded batch, the
loader its fetch results, the gRPC front its tickets and cancels. Outputs go back per
request (`Ticket.sink`): the loop gathers each step's tokens and hands them to `deliver`
once per iteration (the gRPC front turns that into one hop onto its event loop), so the
engine never waits on a client and a client never calls into the engine.

Admission is authoritative here: the front resolves a request for quick refusals, but
the loop resolves it again against the current fold before batching it, so a request
that raced a switch gets the new version, never a version that is on its way out.

The loop's collaborators, each called only from its thread:
- `Residency` (`services.worker.residency`): adapter loads, evictions, switch-outs;
- `Parked` (`services.worker.tickets`): requests waiting for their adapter;
- `TenantPurges` (`services.worker.tenant_purges`): hard and soft tenant purges;
- `GatesInEngine` (`services.worker.gates_in_engine`): quality-gate runs among the traffic;
- `prefetch` (`services.worker.prefetch`): the routers' hints;
- `MergedServing` (`services.worker.merged`, merged mode only): whether a request is for
  the one version this worker serves; that version's requests wait until it is merged
  into the base weights.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loraplane_kernels.threads import compute_thread
from services.catalog.serving import (
    MergeSpec,
    ServingChoice,
    resolve_pinned,
    resolve_reference,
)
from services.catalog.state import CatalogState, Refusal
from services.config import Settings
from services.contracts.events import (
    ADAPTER_TOPIC,
    AdapterDisabled,
    AdapterEnabled,
    AdapterRolledBack,
    AdapterVersionPublished,
    AdapterVersionSwitched,
    Envelope,
    QualityGateCompleted,
    ServedRequest,
    TenantPurgeRequested,
    TrafficSplitChanged,
    WorkerHeartbeat,
)
from services.worker.engine import (
    AdapterDigest,
    AdapterNotLoadedError,
    Engine,
    GenerationRequest,
    GenerationResult,
    LoraAdapter,
    QosTier,
    RequestError,
)
from services.worker.events import WorkerEvents
from services.worker.follower import CatalogFollower
from services.worker.gate_runner import GateRun
from services.worker.gates_in_engine import GateInFlight, GatesInEngine
from services.worker.intake import WorkItem
from services.worker.lifecycle import AdapterState
from services.worker.merged import MergedServing
from services.worker.metrics import WorkerMetrics
from services.worker.pool.disk import DiskCache
from services.worker.pool.host import HostCache
from services.worker.pool.loader import AdapterLoader, FetchResult
from services.worker.pool.tiers import Tier
from services.worker.prefetch import PrefetchOutcome, prefetch
from services.worker.residency import Residency, owner_choice
from services.worker.tenant_purges import TenantPurges
from services.worker.tickets import (
    Deliver,
    Finished,
    Output,
    Parked,
    Refused,
    Ticket,
    deliver_to_queues,
)

__all__ = ["REFUSAL_CODE", "Deliver", "EngineLoop", "Finished", "Output", "PrefetchOutcome",
           "Refused", "Ticket", "choose", "deliver_to_queues"]

log = logging.getLogger("loraplane.worker.engine_loop")

REFUSAL_CODE = {"not_found": "NOT_FOUND", "precondition": "FAILED_PRECONDITION",
                "conflict": "FAILED_PRECONDITION", "invalid": "INVALID_ARGUMENT"}
"""`Refusal.kind` of the serving rule, as answered (`Refusal.public`) → gRPC status code
name; another tenant's adapter or alias (`forbidden`) is answered as NOT_FOUND."""


def choose(catalog: CatalogState, work: WorkItem, base_digest: str) -> ServingChoice | None:
    """The version a request is served with (None: the base model); raises Refusal."""
    ask = work.adapter
    if ask is None:
        return None
    if ask.pinned is not None:
        return resolve_pinned(catalog, work.tenant, ask.pinned[0], ask.pinned[1],
                              base_digest=base_digest)
    assert ask.reference is not None
    return resolve_reference(catalog, work.tenant, ask.reference, work.user_id,
                             base_digest=base_digest)


def catalog_changes(batch: list[Envelope]) -> tuple[set[str], list[tuple[str, int]], list[str]]:
    """What a folded batch asks of the loop: the adapters whose serving may have changed,
    the versions published, the purges requested."""
    touched: set[str] = set()
    published: list[tuple[str, int]] = []
    purges: list[str] = []
    for envelope in batch:
        p = envelope.payload
        if isinstance(p, AdapterVersionPublished):
            touched.add(p.adapter_id)
            published.append((p.adapter_id, p.version))
        elif isinstance(p, AdapterVersionSwitched | AdapterRolledBack | AdapterDisabled
                        | AdapterEnabled):
            touched.add(p.adapter_id)
        elif isinstance(p, TrafficSplitChanged):
            touched.update(e.adapter_id for e in (*p.split, *p.previous))
        elif isinstance(p, TenantPurgeRequested):
            purges.append(p.purge_id)
    return touched, published, purges


class EngineLoop:
    def __init__(self, settings: Settings, engine: Engine, follower: CatalogFollower,
                 events: WorkerEvents, metrics: WorkerMetrics, host: HostCache,
                 disk: DiskCache, loader: AdapterLoader, worker_id: str, *,
                 model_dir: Path | str = "", deliver: Deliver = deliver_to_queues) -> None:
        self.settings = settings
        self.engine = engine
        self.follower = follower
        self.events = events
        self.metrics = metrics
        self.worker_id = worker_id
        self.model_dir = str(model_dir)
        self.deliver = deliver
        self.base_digest = engine.base_digest
        spec = MergeSpec.parse(settings.worker_merge) if settings.worker_merge else None
        self.residency = Residency(engine, host, disk, loader, events, metrics, worker_id,
                                   waiters=self,
                                   only_adapter=spec.adapter_id if spec else None)
        self.merge = (MergedServing(spec, engine, self.residency, metrics)
                      if spec is not None else None)
        """Merged mode (`--merge`): the one adapter this worker serves; None otherwise."""
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._running: dict[str, Ticket] = {}
        self._unadmitted: dict[str, Ticket] = {}
        self._parked = Parked()
        self._out: dict[int, tuple[Ticket, list[Output]]] = {}
        self._load_reported = 0.0
        self.purges = TenantPurges(follower, self.residency, self._parked, self._refuse,
                                   self._sweep)
        self.gates = GatesInEngine(engine, self.residency, lambda: (
            self.merge.gate_refusal(worker_id) if self.merge is not None else None))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.synced = False
        self.draining = False
        """SIGTERM: heartbeats say so (routers take this worker out of their rings)."""
        self.admitting = True
        """False once the drain stops admitting: new requests are refused UNAVAILABLE."""
        self.ready = threading.Event()
        self.not_ready_reason = "replaying the adapter log"
        self.base_model_name: str | None = None
        self.max_context = engine.config.num_kv_blocks * engine.config.block_size
        self._page_in = {
            Tier.DEVICE: settings.worker_page_in_timeout_host_s,
            Tier.HOST: settings.worker_page_in_timeout_host_s,
            Tier.DISK: settings.worker_page_in_timeout_disk_s,
            Tier.BLOB: settings.worker_page_in_timeout_blob_s}

    # --- the thread --------------------------------------------------------------------

    def start(self) -> None:
        # with this thread's torch thread count, not that of an adapter parse running now
        self._thread = compute_thread(self._run, name="engine-loop")
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def post(self, command: Callable[[], None]) -> None:
        """Run `command` in the loop thread before the next step (any thread)."""
        self._inbox.put(command)

    def schedule(self, command: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run `command` in the loop thread; its value arrives in the future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(command())
            except BaseException as exc:
                future.set_exception(exc)

        self.post(run)
        return future

    def call(self, command: Callable[[], Any], timeout_s: float = 5.0) -> Any:
        """Run `command` in the loop thread and wait for its value (not from the loop)."""
        return self.schedule(command).result(timeout=timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            idle = not self.engine.has_work
            try:
                self._drain_inbox(wait=0.05 if idle else 0.0)
                self._service()
                if self.engine.has_work:
                    self._step()
            except Exception:  # one bad command or step must not stop serving
                log.exception("engine loop")
            self._flush()
            self._report_load()
        self._shutdown()

    def _report_load(self) -> None:
        """The gateway gauges (`vllm:*`): requests batched and waiting, KV in use, the
        adapters ready on the device and those requests wait for; at most every 50 ms."""
        now = time.monotonic()
        if now - self._load_reported < 0.05:
            return
        self._load_reported = now
        stats = self.engine.stats()
        ready = [key[0] for key, state in self.residency.states
                 if state is AdapterState.LOADED]
        parked = self._parked.adapter_ids()
        self.metrics.vllm.load(
            running=stats.running, waiting=stats.waiting + len(parked),
            kv_usage=1.0 - stats.free_kv_blocks / max(1, stats.total_kv_blocks),
            running_adapters=ready, waiting_adapters=parked)

    def _drain_inbox(self, wait: float) -> None:
        try:
            command = self._inbox.get(timeout=wait) if wait else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                command()
            except Exception:
                log.exception("engine loop command")
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _shutdown(self) -> None:
        for rid, ticket in list(self._running.items()):
            self.engine.abort(rid)
            self._finish(ticket, self.engine.pop_result(rid))
        for ticket in self._parked.take_all():
            self._refuse(ticket, "UNAVAILABLE", "worker is shutting down", 1.0)
        self._flush()

    # --- outputs -------------------------------------------------------------------------

    def _emit(self, ticket: Ticket, output: Output) -> None:
        slot = self._out.get(id(ticket))
        if slot is None:
            self._out[id(ticket)] = (ticket, [output])
        else:
            slot[1].append(output)

    def _flush(self) -> None:
        if not self._out:
            return
        batch = list(self._out.values())
        self._out = {}
        try:
            self.deliver(batch)
        except Exception:  # the front went away (shutdown)
            log.exception("delivering outputs")

    # --- the catalog ---------------------------------------------------------------------

    def initial_sync(self) -> None:
        """After replay: restore this worker's adapter states from its own events, load
        what it held and the servable gold/platinum versions, redo unacknowledged purges.
        Runs in the loop (posted by the app once the follower caught up)."""
        with self.follower.lock:
            catalog, own = self.follower.state, self.follower.own
            self.residency.restore_failed(catalog, own.failed)
            for key in sorted(own.on_device):
                if self.merge is not None and not self.merge.serves(key[0]):
                    continue
                try:
                    choice = owner_choice(catalog, key, self.base_digest)
                except Refusal:
                    continue  # switched away or disabled while this worker was down
                self.residency.load(choice, urgent=False)
            self.residency.reconcile(catalog)
            self._follow_merge(catalog)
            for purge in catalog.purges.values():
                if purge.purge_id not in own.acked_purges:
                    self.residency.replay_purge(
                        catalog, purge, expected=self.worker_id in purge.expected_workers)
                else:
                    self.residency.mark_purge_handled(purge.purge_id)
            self.synced = True
            self._update_readiness(catalog)

    def on_catalog(self, batch: list[Envelope]) -> None:
        """A folded batch from the follower (called in the follower thread): post it."""
        self.post(lambda: self._apply_catalog(batch))

    def _apply_catalog(self, batch: list[Envelope]) -> None:
        touched, published, purges = catalog_changes(batch)
        if self.synced:
            with self.follower.lock:
                catalog = self.follower.state
                for adapter_id, number in published:
                    self.residency.published(catalog, adapter_id, number)
                if touched:
                    self.residency.reconcile(catalog, touched)
                for purge_id in purges:
                    purge = catalog.purges.get(purge_id)
                    if purge is not None:
                        self.purges.start(catalog, purge)
                self._follow_merge(catalog)
                self._update_readiness(catalog)
            self._sweep()
        now = datetime.now(UTC)
        for envelope in batch:
            if type(envelope.payload).topic == ADAPTER_TOPIC:
                self.metrics.catalog_lag_seconds.observe(
                    max(0.0, (now - envelope.occurred_at).total_seconds()))

    def _update_readiness(self, catalog: CatalogState) -> None:
        registered = next((m for m in catalog.base_models.values()
                           if m.digest == self.base_digest), None)
        if registered is None:
            self.not_ready_reason = (
                f"base model digest {self.base_digest} of {self.model_dir or 'the model'} is "
                "not registered; register it: `loraplane base-digest DIR --json` gives the "
                "body for POST /v1/base-models")
            self.ready.clear()
        else:
            self.base_model_name = registered.name
            self.not_ready_reason = ""
            self.ready.set()
        self.metrics.ready.set(1 if self.ready.is_set() else 0)

    # --- merged mode ----------------------------------------------------------------------

    def _follow_merge(self, catalog: CatalogState) -> None:
        if self.merge is not None:
            self.merge.follow(catalog)
            self._advance_merge()

    def _advance_merge(self) -> None:
        """Merge (or unmerge) as far as the engine allows now; once the target is merged,
        the requests waiting for it start."""
        merge = self.merge
        if merge is None:
            return
        merge.advance()
        ready = merge.ready()
        if ready is not None:
            for ticket in self._parked.take(ready):
                if not ticket.cancelled:
                    self._start(ticket)

    # --- admission -------------------------------------------------------------------------

    def submit(self, ticket: Ticket) -> None:
        """Admit a request (any thread)."""
        self.post(lambda: self._admit(ticket))

    def cancel(self, ticket: Ticket) -> None:
        """The client went away or its deadline passed (any thread)."""
        self.post(lambda: self._cancel(ticket))

    def _admit(self, ticket: Ticket) -> None:
        if ticket.cancelled or self._stop.is_set():
            return
        if not self.admitting:
            self._refuse(ticket, "UNAVAILABLE", f"worker {self.worker_id} is draining (shutting "
                         "down): retry on another worker", 0.05)
            return
        if not self.ready.is_set():
            self._refuse(ticket, "UNAVAILABLE", f"worker not ready: {self.not_ready_reason}",
                         1.0)
            return
        work = ticket.work
        if self.purges.draining(work.tenant.key):
            self._refuse(ticket, "UNAVAILABLE", f"tenant {work.tenant.key} is being purged",
                         1.0)
            return
        try:
            with self.follower.lock:
                choice = choose(self.follower.state, work, self.base_digest)
                if choice is not None:
                    self.residency.reconcile(self.follower.state, {choice.adapter_id})
        except Refusal as refusal:
            answer = refusal.public()
            if answer is not refusal:
                log.info("request %s refused: %s", ticket.work.request_id, refusal.message)
            self._refuse(ticket, REFUSAL_CODE[answer.kind], answer.message)
            return
        ticket.choice = choice
        if self.merge is not None:
            refusal = self.merge.refusal(choice)
            if refusal is not None:
                self._refuse(ticket, "FAILED_PRECONDITION", refusal)
                return
        if choice is None:
            self._start(ticket)
            return
        key = (choice.adapter_id, choice.version)
        digest = AdapterDigest(choice.sha256, choice.config_sha256)
        ticket.digest = digest
        state = self.residency.state(key)
        if state is AdapterState.FAILED:
            self._refuse(ticket, "FAILED_PRECONDITION",
                         f"{choice.pinned} failed to load on this worker and is never served: "
                         f"{self.residency.failure(key)}")
            return
        if state is AdapterState.LOADED and (self.merge is None or self.merge.serving):
            self._start(ticket)
            return
        if state not in (AdapterState.UNLOADED, AdapterState.LOADING, AdapterState.LOADED):
            self._refuse(ticket, "UNAVAILABLE", f"{choice.pinned} is leaving this worker", 1.0)
            return
        # not in a slot yet, or (merged mode) in one but not merged yet: wait for it
        self._park(ticket, digest)
        if state is AdapterState.LOADED:
            self._advance_merge()
        else:
            self.residency.load(choice, urgent=True)

    def _park(self, ticket: Ticket, digest: AdapterDigest) -> None:
        """Wait for the adapter, within the page-in budget of the tier it comes from (and
        the client's deadline)."""
        ticket.page_in_tier = self.residency.source_tier(digest)
        wait = self._page_in[ticket.page_in_tier]
        if ticket.time_limit_s is not None:
            wait = min(wait, max(0.0, ticket.time_limit_s - (time.monotonic() - ticket.arrival)))
        ticket.page_in_deadline = time.monotonic() + wait
        ticket.status = "parked"
        self._parked.add(digest, ticket)

    def _start(self, ticket: Ticket) -> None:
        work = ticket.work
        rid = work.request_id
        if rid in self._running:
            self._refuse(ticket, "ALREADY_EXISTS", f"request {rid} is already running")
            return
        tier = ticket.choice.qos_tier if ticket.choice is not None else work.qos_tier
        request = GenerationRequest(
            prompt_token_ids=work.prompt_ids, sampling=work.sampling,
            adapter_digest=ticket.digest, tenant_key=work.tenant.key,
            sharing_scope=work.sharing_scope, qos_tier=QosTier.of(tier), request_id=rid)
        try:
            self.engine.submit(request)
        except AdapterNotLoadedError as exc:
            self._refuse(ticket, "UNAVAILABLE", str(exc), 1.0)
            return
        except RequestError as exc:
            self._refuse(ticket, "INVALID_ARGUMENT", str(exc))
            return
        ticket.status = "running"
        self._running[rid] = ticket
        self._unadmitted[rid] = ticket
        if ticket.digest is not None:
            self.residency.touch(ticket.digest)

    def _cancel(self, ticket: Ticket) -> None:
        ticket.cancelled = True
        if ticket.status == "running":
            rid = ticket.work.request_id
            self.engine.abort(rid)
            self._finish(ticket, self.engine.pop_result(rid))
        elif ticket.status == "parked" and ticket.digest is not None:
            self._parked.remove(ticket)
            self._trace(ticket, "cancelled", 0, 0)
            ticket.status = "done"
            self.metrics.requests.labels("CANCELLED").inc()

    def _refuse(self, ticket: Ticket, code: str, message: str,
                retry_after_s: float | None = None) -> None:
        ticket.status = "done"
        self.metrics.requests.labels(code).inc()
        if ticket.choice is not None:
            self._trace(ticket, "rejected", len(ticket.work.prompt_ids), 0)
        self._emit(ticket, Refused(code, message, retry_after_s))

    # Waiters (called by Residency, in this thread)

    def adapter_ready(self, digest: AdapterDigest) -> None:
        if self.merge is not None:  # in a slot is not enough: it must be merged first
            self._advance_merge()
            return
        for ticket in self._parked.take(digest):
            if ticket.cancelled:
                continue
            assert ticket.choice is not None
            key = (ticket.choice.adapter_id, ticket.choice.version)
            if self.residency.state(key) is AdapterState.LOADED:
                self._start(ticket)
            else:
                self._refuse(ticket, "UNAVAILABLE", f"{ticket.choice.pinned} is not loaded",
                             1.0)

    def adapter_unavailable(self, digest: AdapterDigest, code: str, message: str,
                            retry_after_s: float | None = None) -> None:
        for ticket in self._parked.take(digest):
            if not ticket.cancelled:
                self._refuse(ticket, code, message, retry_after_s)

    def has_waiters(self, digest: AdapterDigest) -> bool:
        return self._parked.has_waiters(digest)

    def fetched(self, result: FetchResult) -> None:
        """The loader's callback (loader thread): hand the result to the loop."""
        self.post(lambda: self._fetched(result))

    def _fetched(self, result: FetchResult) -> None:
        # A waiter whose page-in budget ran out before the bytes came is refused first, as
        # the housekeeping between steps would have: the budget holds however fast the
        # loop comes round, and the router has already been told to retry elsewhere.
        self._expire_parked()
        self.residency.fetched(result)
        self._sweep()

    # --- housekeeping between steps -----------------------------------------------------

    def _expire_parked(self) -> None:
        """Refuse every parked request whose page-in budget has run out."""
        for digest, ticket in self._parked.take_late(time.monotonic()):
            if ticket.cancelled:
                continue
            tier = ticket.page_in_tier or self.residency.source_tier(digest)
            what = ticket.choice.pinned if ticket.choice else str(digest)
            if self.merge is not None and tier is Tier.DEVICE:
                why = (f"{what} was not merged into the base weights in time (requests of "
                       "the previous version still running); retry")
            else:
                why = f"{what} did not page in from the {tier.value} tier in time; retry"
            self._refuse(ticket, "UNAVAILABLE", why, 1.0)

    def _service(self) -> None:
        self._expire_parked()
        self.residency.retry_slot_waits(self.settings.worker_page_in_timeout_blob_s)
        self.gates.retry_waiting()
        self.residency.finish_switches()
        self._advance_merge()
        self.purges.service(self._running.values())

    def _sweep(self) -> None:
        """Finish tickets whose sequence the engine ended outside a step (abort, purge)."""
        for rid, ticket in list(self._running.items()):
            result = self.engine.pop_result(rid)
            if result is not None:
                self._finish(ticket, result)
        self.gates.sweep()

    def _step(self) -> None:
        started = time.monotonic()
        try:
            events = self.engine.step()
        except Exception:
            log.exception("engine step failed; ending the batch's requests with an error")
            for rid, ticket in list(self._running.items()):
                self.engine.abort(rid)
                self.engine.pop_result(rid)
                self._finish(ticket, None)
            return
        now = time.monotonic()
        if self._unadmitted:
            waiting = {s.request_id for s in self.engine.scheduler.waiting}
            for rid, ticket in list(self._unadmitted.items()):
                if rid not in waiting:
                    del self._unadmitted[rid]
                    self.metrics.queue_seconds.observe(started - ticket.arrival)
        tokens = 0
        for event in events:
            ticket = self._running.get(event.request_id)
            if ticket is None:
                if event.finished and self.gates.owns(event.request_id):
                    result = self.engine.pop_result(event.request_id)
                    if result is not None:
                        self.gates.finished(event.request_id, result)
                continue
            if event.token_id is not None:
                tokens += 1
                ticket.completion_tokens += 1
                if ticket.first_token_at is None:
                    ticket.first_token_at = now
                    self.metrics.ttft_seconds.observe(now - ticket.arrival)
                else:
                    self.metrics.itl_seconds.observe(now - (ticket.last_token_at or now))
                ticket.last_token_at = now
                self._emit(ticket, event)
            if event.finished:
                self._finish(ticket, self.engine.pop_result(event.request_id))
        if tokens:
            self.metrics.batch_size.observe(tokens)
            self.metrics.generated_tokens.inc(tokens)

    def _finish(self, ticket: Ticket, result: GenerationResult | None) -> None:
        rid = ticket.work.request_id
        if self._running.get(rid) is ticket:
            del self._running[rid]
        self._unadmitted.pop(rid, None)
        ticket.status = "done"
        now = time.monotonic()
        reason = "error" if result is None else result.finish_reason.value
        prompt = result.prompt_tokens if result is not None else len(ticket.work.prompt_ids)
        cached = result.cached_prompt_tokens if result is not None else 0
        completion = (sum(len(c.token_ids) for c in result.choices) or len(result.token_ids)
                      if result is not None else ticket.completion_tokens)
        self.metrics.request_finished(ticket.work.tenant.key, prompt, cached)
        self.metrics.vllm.finished(reason, prompt, completion, now - ticket.arrival)
        self.metrics.requests.labels(
            "CANCELLED" if ticket.cancelled else ("INTERNAL" if result is None else "OK")).inc()
        status = {"length": "ok", "stop": "ok", "abort": "aborted"}.get(reason, "error")
        if ticket.cancelled:  # the client left or its deadline passed: nobody reads on
            status = "cancelled"
        durable = self._trace(ticket, status, prompt, completion)
        ttft = ((ticket.first_token_at - ticket.arrival) * 1e3
                if ticket.first_token_at is not None else 0.0)
        self._emit(ticket, Finished(reason, prompt, completion, cached, ticket.choice, ttft,
                                    (now - ticket.arrival) * 1e3,
                                    tuple(result.choices) if result is not None else (),
                                    durable))

    def _trace(self, ticket: Ticket, status: str, prompt: int, completion: int
               ) -> concurrent.futures.Future[None] | None:
        choice = ticket.choice
        work = ticket.work
        return self.events.trace(ServedRequest(
            request_id=work.request_id, trace_id=work.trace_id, tenant=work.tenant,
            user_id=work.user_id, adapter_id=choice.adapter_id if choice else None,
            version=choice.version if choice else None,
            adapter_sha256=choice.sha256 if choice else None,
            base_model_digest=self.base_digest,
            base_weights=self.engine.base_weights,  # type: ignore[arg-type]
            prompt_tokens=prompt,
            completion_tokens=completion, started_at=ticket.started_at,
            finished_at=datetime.now(UTC), status=status))  # type: ignore[arg-type]

    # --- quality gates (runs handed over by services.worker.gates) -----------------------

    def start_gate(self, run: GateRun, adapters: dict[AdapterDigest, LoraAdapter],
                   done: Callable[[QualityGateCompleted], None]) -> None:
        """Run a gate among the serving traffic (any thread); `done` gets the result."""
        self.post(lambda: self.gates.start(GateInFlight(run, adapters, done)))

    # --- router hints ----------------------------------------------------------------------

    def prefetch(self, wanted: list[tuple[str, int]], device: bool) -> list[PrefetchOutcome]:
        """Bring versions into the host tier (or onto the device, when servable) ahead of
        traffic (`services.worker.prefetch`); runs in the loop."""
        with self.follower.lock:
            return prefetch(self.follower.state, self.residency, self.base_digest, self.merge,
                            wanted, device)

    # --- drain ----------------------------------------------------------------------------

    def in_flight(self) -> int:
        """Requests admitted and not finished: running, queued, or waiting for an adapter
        (any thread; an estimate between two iterations, exact once admission stopped)."""
        return len(self._running) + self._parked.count()

    # --- reports (built in the loop, asked for from other threads) -----------------------

    def heartbeat(self) -> WorkerHeartbeat | None:
        """The next heartbeat, or None when the loop is too busy to say (any thread)."""
        if not self.synced:
            return None
        try:
            beat: WorkerHeartbeat = self.call(self._heartbeat, timeout_s=2.0)
        except concurrent.futures.TimeoutError:
            return None
        return beat

    def _heartbeat(self) -> WorkerHeartbeat:
        with self.follower.lock:
            loaded = self.residency.loaded_report(self.follower.state)
            epoch = self.follower.lease_epoch
        stats = self.engine.stats()
        self.metrics.free_kv_blocks.set(stats.free_kv_blocks)
        self.metrics.workspace_bytes.set(stats.workspace_bytes)
        self.metrics.events_unsent.set(self.events.unsent)
        return WorkerHeartbeat(
            worker_id=self.worker_id, address=self.settings.worker_advertised,
            base_model=self.base_model_name or "unregistered",
            base_model_digest=self.base_digest, loaded=loaded,
            free_slots=self.engine.adapters.free_slots,
            free_kv_blocks=stats.free_kv_blocks, lease_epoch=epoch,
            base_weights=self.engine.base_weights,  # type: ignore[arg-type]
            merged_mode=self.merge.report() if self.merge is not None else None,
            draining=self.draining)

