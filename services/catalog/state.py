"""The one fold of the adapter log: catalog state, and the rules every reader shares.

No I/O here. `CatalogState.apply` folds one event; the registry (to decide commands),
the workers and the router (to serve) and the tests all fold the same log with this
class, so "what is active, what is disabled, which versions an alias splits to" has one
answer everywhere. The registry's commands live in `services.registry.domain`; the
serving rules (which version a request gets) in `services.catalog.serving`.

Streams and their sequence numbers (gap-free per stream, `seq` = events so far + 1):
  `base-model/{name}`, `adapter/{adapter_id}`, `alias/{alias}`,
  `tenant/{org}/{team}/{project}` (purges); on the liveness topic `registry/lease` and
  `heartbeat/{worker_id}` (compacted: only the newest of each is kept).
The If-Match "version" of an adapter or alias is its stream's last `seq` (the ETag).

The fold does not depend on how the topics (or the partitions of one topic) interleave:
only the order within a partition is fixed, and every reader may consume partitions at
its own pace. So nothing here is "the last one read": a lease is the newest by (epoch,
expiry), a heartbeat the newest by timestamp, a purge's acks and a gate's results are kept
sorted and wait for their request when read before it, a rollout is rebuilt from its
steps in time order (its completion travels on the adapter's stream, its other steps on
the alias's), and the answer kept for an Idempotency-Key is the earliest event carrying
it. A property test folds the same events under shuffled interleavings and gets the same
state (`release_generation`, a cache key, counts fold steps and is left out).

Serving rules the router and workers share (applied in `services.catalog.serving`):
- Publishing stores a version; it does not serve it. An adapter's *active version* is set
  only by `AdapterVersionSwitched` (to_version) and `AdapterRolledBack` (to_version).
- An alias serves the versions of its latest `TrafficSplitChanged`, by weight.
- A disabled version is never served, whether active or in a split; nor is a version an
  `AdapterRolledBack` rolled away from, until it is switched to again.
- A version is *purged* (`AdapterVersion.purged_by`) when a purge of its tenant was
  requested at or after it was published (event timestamps, so the order the tenant's and
  the adapter's streams are read in does not matter). A purged version is gone for good:
  never served, loaded, prefetched, gated or fetched again, whatever else happens to it;
  a version published after the purge is not touched by it.

Rollback target ("previous stable version"), computed by `rollback_target`:
  1. if the current active version declared `rollback_to` at publish time, and that
     version exists and is not disabled, that version;
  2. otherwise the highest-numbered version below the current active version that is
     *stable*: it has been the adapter's active version at some point (switched to, or
     rolled back to) and it is not disabled now. Alias splits, canaries included, do not
     make a version stable: finishing a canary is an explicit switch.
  No such version → the rollback is refused (409). `rollback_candidates` lists rule 2's
  candidates, best first; the audit projection's SQL view of the same name must agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from services.catalog.gates import result_failures
from services.catalog.purge import (
    PurgeAck,
    PurgeStatus,
    deadline_of,
    live_workers,
    purge_status,
)
from services.contracts.events import (
    AdapterDisabled,
    AdapterEnabled,
    AdapterRolledBack,
    AdapterVersionPublished,
    AdapterVersionSwitched,
    BaseModelRegistered,
    Envelope,
    GateRequest,
    Judgement,
    QualityGateCompleted,
    QualityGateExpired,
    QualityGateRequested,
    RegistryLease,
    ReleaseOverridden,
    RolloutHalted,
    RolloutPlan,
    RolloutResumed,
    RolloutStep,
    SplitEntry,
    TenantBlobsDeleted,
    TenantPurged,
    TenantPurgeRequested,
    TenantRef,
    TrafficSplitChanged,
    WorkerHeartbeat,
    typed_envelope,
)

LEASE_STREAM = "registry/lease"


def heartbeat_stream(worker_id: str) -> str:
    """A worker's heartbeat stream on the liveness topic (compaction keeps the newest)."""
    return f"heartbeat/{worker_id}"

RefusalKind = Literal["not_found", "conflict", "precondition", "invalid", "forbidden",
                      "key_reused"]


class Refusal(Exception):
    """A command the state does not allow; `kind` maps to one HTTP status at the edge.

    `message` is the real reason, for logs and the audit; `answer` is what the caller is
    told, the same words unless the refusal is `forbidden` (see `public`)."""

    def __init__(self, kind: RefusalKind, message: str, *, answer: str | None = None,
                 answer_kind: RefusalKind = "not_found") -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.answer = answer or message
        self.answer_kind = answer_kind

    def again(self) -> Refusal:
        """A new exception of the same refusal (a kept one re-raised grows its traceback)."""
        return Refusal(self.kind, self.message, answer=self.answer,
                       answer_kind=self.answer_kind)

    def public(self) -> Refusal:
        """The refusal as every front answers it: another tenant's resource (`forbidden`)
        is answered exactly as a missing one would be (`not_found`, or the kind a missing
        one gets where it is named inside a request, in the same words), so that no caller
        learns which names other tenants use. The one place this mapping is made; the
        real reason stays in `message` for the audit."""
        if self.kind == "forbidden":
            return Refusal(self.answer_kind, self.answer)
        return self


def missing(what: str, name: str) -> str:
    """How a missing resource is answered (`adapter 'x' does not exist`): one spelling, so
    that another tenant's resource, answered the same way, reads exactly alike."""
    return f"{what} {name!r} does not exist"


def foreign(what: str, name: str, owner: TenantRef | None, *, answer: str | None = None,
            answer_kind: RefusalKind = "not_found") -> Refusal:
    """Another tenant's resource: refused as `forbidden` with the real reason (the owner)
    for the audit, answered as a missing one, `missing(what, name)` unless the caller
    would be told `answer` (of `answer_kind`) were it missing."""
    owner_key = owner.key if owner is not None else "no tenant"
    return Refusal("forbidden", f"{what} {name!r} belongs to another tenant ({owner_key})",
                   answer=answer or missing(what, name), answer_kind=answer_kind)


def adapter_stream(adapter_id: str) -> str:
    return f"adapter/{adapter_id}"


def alias_stream(alias: str) -> str:
    return f"alias/{alias}"


def base_model_stream(name: str) -> str:
    return f"base-model/{name}"


def tenant_stream(tenant: TenantRef) -> str:
    return f"tenant/{tenant.key}"


@dataclass(frozen=True)
class LogPosition:
    """Where an event sits in the log: returned to clients as the event offset."""

    topic: str
    partition: int
    offset: int


@dataclass
class BaseModel:
    name: str
    digest: str
    config: dict[str, Any]
    registered_at: datetime
    seq: int


GateStatus = Literal["pending", "passed", "failed", "expired"]


@dataclass
class GateState:
    """One quality-gate run of a version (the latest request replaces older ones).

    The outcome depends only on event timestamps, never on the order a reader consumed
    the two topics in: a `QualityGateCompleted` counts when it comes from the assigned
    worker, no later than `requested_at + timeout_s`, and before any expiry of the gate;
    otherwise an expiry makes it `expired`; otherwise it is `pending`.
    """

    request: GateRequest
    requested_at: datetime
    requested_by: str
    event_id: str
    results: list[tuple[datetime, QualityGateCompleted]] = field(default_factory=list)
    expiry: tuple[datetime, QualityGateExpired] | None = None
    _judged: tuple[tuple[int, datetime | None], GateStatus, list[str]] | None = field(
        default=None, compare=False, repr=False)
    """The outcome for (results folded, expiry): judged once, read on every request."""

    @property
    def gate_id(self) -> str:
        return self.request.gate_id

    @property
    def deadline(self) -> datetime:
        return self.requested_at + timedelta(seconds=self.request.timeout_s)

    @property
    def result(self) -> tuple[datetime, QualityGateCompleted] | None:
        """The result that counts, if any (the first in time)."""
        counting = [(at, r) for at, r in self.results
                    if r.worker_id == self.request.worker_id and at <= self.deadline
                    and (self.expiry is None or at < self.expiry[0])]
        return min(counting, key=lambda item: item[0]) if counting else None

    def _outcome(self) -> tuple[GateStatus, list[str]]:
        key = (len(self.results), self.expiry[0] if self.expiry else None)
        if self._judged is None or self._judged[0] != key:
            found = self.result
            status: GateStatus
            if found is not None:
                failures = result_failures(found[1], self.request)
                status = "failed" if failures else "passed"
            elif self.expiry is not None:
                status = "expired"
                failures = [f"expired ({self.expiry[1].cause}): {self.expiry[1].reason}"]
            else:
                status, failures = "pending", []
            self._judged = (key, status, failures)
        return self._judged[1], self._judged[2]

    @property
    def failures(self) -> list[str]:
        return list(self._outcome()[1])

    @property
    def status(self) -> GateStatus:
        return self._outcome()[0]


@dataclass(eq=False)
class AdapterVersion:
    published_at: datetime
    event_id: str
    position: LogPosition | None
    disabled: bool = False
    disabled_reason: str = ""
    ever_active: bool = False
    """Was the adapter's active version at some point (see module doc)."""
    rolled_back: bool = False
    """An `AdapterRolledBack` moved away from it and no switch has made it active since."""
    seq: int = 0
    gate: GateState | None = None
    """The latest quality-gate run (`services.catalog.release_rule` decides what it allows)."""
    override: tuple[datetime, str, str] | None = None
    """The latest `ReleaseOverridden`: when, by whom, why."""
    canary_rollback: tuple[datetime, str] | None = None
    """The latest canary rollout that rolled this version back: when, why."""
    purged_by: str | None = None
    """The purge that ended it: the earliest (by request time, then id) purge of its tenant
    requested at or after it was published (see the module doc). None: not purged."""
    release_generation: int = 0
    """Bumped by every fold step that can change the release rule's answer (a cache key:
    not part of the state's equality, nor of its snapshot)."""
    release_cache: tuple[int, str | None] | None = None
    """(generation, answer) of `services.catalog.release_rule.release_refusal`."""
    payload: AdapterVersionPublished | None = field(default=None, repr=False)
    published_json: dict[str, Any] | None = field(default=None, repr=False)
    """The publish payload, as a model or as JSON, whichever came first; the other is
    made on demand (a snapshot restores thousands of versions a reader may never read)."""

    @property
    def published(self) -> AdapterVersionPublished:
        if self.payload is None:
            assert self.published_json is not None
            self.payload = AdapterVersionPublished.model_validate(self.published_json)
        return self.payload

    def digests(self) -> tuple[str, str]:
        """(weights, config) blob digests, read from whichever form of the payload is held."""
        if self.payload is not None:
            return self.payload.sha256, self.payload.config_sha256
        assert self.published_json is not None
        return self.published_json["sha256"], self.published_json["config_sha256"]

    def published_document(self) -> dict[str, Any]:
        if self.published_json is None:
            self.published_json = self.published.model_dump(mode="json")
        return self.published_json

    def _key(self) -> tuple[Any, ...]:
        return (self.published_document(), self.published_at, self.event_id, self.position,
                self.disabled, self.disabled_reason, self.ever_active, self.rolled_back,
                self.seq, self.gate, self.override, self.canary_rollback, self.purged_by)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AdapterVersion):
            return NotImplemented
        return self._key() == other._key()


@dataclass
class Adapter:
    adapter_id: str
    tenant: TenantRef | None
    seq: int = 0
    versions: dict[int, AdapterVersion] = field(default_factory=dict)
    active_version: int | None = None

    def label_taken(self, label: str) -> int | None:
        for number, version in self.versions.items():
            if version.published.label == label:
                return number
        return None

    @property
    def latest_version(self) -> int:
        return max(self.versions, default=0)


@dataclass
class Alias:
    alias: str
    tenant: TenantRef | None
    seq: int
    split: tuple[SplitEntry, ...]
    changed_at: datetime


RolloutStatus = Literal["running", "halted", "rolled_back", "completed", "superseded"]


@dataclass
class Rollout:
    """A canary rollout of one version on one alias, as its steps on the log left it."""

    rollout_id: str
    alias: str
    adapter_id: str
    canary_version: int
    baseline_version: int
    plan: RolloutPlan
    tenant: TenantRef | None
    started_at: datetime
    stage: int = 0
    stage_started_at: datetime | None = None
    """When the current stage began (or the rollout last resumed): its clock."""
    status: RolloutStatus = "running"
    status_reason: str = ""
    last_judgement: Judgement | None = None
    """The figures of the last step decided on them (the 100% stage's baseline)."""
    steps: list[tuple[datetime, str, str]] = field(default_factory=list)
    """(when, action, actor) of every step, in time order."""
    facts: list[RolloutFact] = field(default_factory=list, repr=False)
    """Everything the log said about it, in time order: the fields above are rebuilt from
    these, so a completion (on the adapter's stream) read before the steps of the alias's
    stream changes nothing."""

    @property
    def weight(self) -> int:
        return self.plan.stages[self.stage]

    @property
    def final_stage(self) -> bool:
        return self.stage == len(self.plan.stages) - 1


FACT_ORDER = {"started": 0, "advanced": 1, "halted": 2, "resumed": 3, "rolled_back": 4,
              "completed": 5, "superseded": 6}


@dataclass(frozen=True)
class RolloutFact:
    """One event about a rollout: a step, a halt or resume, or a split set by hand."""

    at: datetime
    action: str
    actor: str
    step: RolloutStep | None = None
    reason: str = ""
    judgement: Judgement | None = None

    @property
    def order(self) -> tuple[datetime, int]:
        return (self.at, FACT_ORDER[self.action])


@dataclass
class Purge:
    purge_id: str
    tenant: TenantRef | None
    deadline_s: float
    hard: bool
    requested_at: datetime
    expected_workers: tuple[str, ...]
    """The workers that must acknowledge, as the request event lists them."""
    acks: list[PurgeAck] = field(default_factory=list)
    """Every acknowledgement, sorted (see `services.catalog.purge` for which count)."""
    blobs: TenantBlobsDeleted | None = None
    """What the registry erased from the blob store for this purge, once it has."""
    erased_at: datetime | None = None
    """When the registry recorded that erasure (its `TenantBlobsDeleted` event)."""

    @property
    def deadline(self) -> datetime:
        return deadline_of(self.requested_at, self.deadline_s)

    def covers(self, tenant: TenantRef | None, published_at: datetime) -> bool:
        """Does this purge end a version of `tenant` published at `published_at`?"""
        return tenant is not None and tenant == self.tenant and published_at <= self.requested_at

    def status(self, now: datetime) -> PurgeStatus:
        return purge_status(self.expected_workers, self.acks, self.requested_at,
                            self.deadline_s, now, erased_at=self.erased_at)


@dataclass
class Lease:
    registry_id: str
    epoch: int
    expires_at: datetime
    seq: int


class IdempotentAnswer:
    """The event a keyed command produced; the answer to a retry is rendered from it.

    Restored from a snapshot it holds the event's JSON document and builds the event only
    when a retry asks for it: most keys are never retried.
    """

    __slots__ = ("_document", "_envelope", "position")

    def __init__(self, envelope: Envelope | None, position: LogPosition | None, *,
                 document: dict[str, Any] | None = None) -> None:
        if envelope is None and document is None:
            raise ValueError("an answer needs its event or the event's document")
        self._envelope = envelope
        self._document = document
        self.position = position

    @property
    def envelope(self) -> Envelope:
        if self._envelope is None:
            assert self._document is not None
            self._envelope = typed_envelope(self._document["type"]).model_validate(
                self._document)
        return self._envelope

    @property
    def document(self) -> dict[str, Any]:
        if self._document is None:
            self._document = self.envelope.to_json()
        return self._document

    @property
    def order(self) -> tuple[datetime, str]:
        """(occurred_at, event_id): the earliest answer is the one kept."""
        doc = self._document
        if doc is not None:
            return (datetime.fromisoformat(doc["occurred_at"]), str(doc["event_id"]))
        e = self.envelope
        return (e.occurred_at, str(e.event_id))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IdempotentAnswer):
            return NotImplemented
        return self.position == other.position and self.document == other.document

    def __repr__(self) -> str:
        return f"IdempotentAnswer({self.document.get('type')}, {self.position})"


def _insort_result(results: list[tuple[datetime, QualityGateCompleted]],
                   result: tuple[datetime, QualityGateCompleted]) -> None:
    """Keep gate results in time order (they come from another topic than their request)."""
    results.append(result)
    results.sort(key=lambda item: (item[0], item[1].worker_id))


def _ack_order(ack: PurgeAck) -> tuple[datetime, str, int, int, int, bool]:
    return (ack.acked_at, ack.worker_id, ack.kv_blocks_freed, ack.adapters_unloaded,
            ack.sequences_aborted, ack.refcounts_zero)


@dataclass
class CatalogState:
    """Everything the log says about the catalog, folded from both topics."""

    base_models: dict[str, BaseModel] = field(default_factory=dict)
    adapters: dict[str, Adapter] = field(default_factory=dict)
    aliases: dict[str, Alias] = field(default_factory=dict)
    purges: dict[str, Purge] = field(default_factory=dict)
    early_acks: dict[str, list[PurgeAck]] = field(default_factory=dict)
    """Acks read before their purge request (another topic, read at another pace)."""
    tenant_seqs: dict[str, int] = field(default_factory=dict)
    idempotency: dict[tuple[str, str], IdempotentAnswer] = field(default_factory=dict)
    heartbeats: dict[str, datetime] = field(default_factory=dict)
    """Each worker's newest heartbeat by its timestamp, whatever order they were read in."""
    worker_bases: dict[str, str] = field(default_factory=dict)
    """Each worker's base model digest, from its newest heartbeat."""
    worker_weights: dict[str, str] = field(default_factory=dict)
    """Each worker's base weights format (dense, int8), from its newest heartbeat."""
    merged_workers: dict[str, str] = field(default_factory=dict)
    """Workers in merged mode, from their newest heartbeat: worker → the one adapter id it
    serves (they run no quality gates: their weights are not the plain base model's)."""
    gates: dict[str, tuple[str, int]] = field(default_factory=dict)
    """gate_id → (adapter_id, version) of every gate ever requested."""
    orphan_results: dict[str, list[tuple[datetime, QualityGateCompleted]]] = field(
        default_factory=dict)
    """Gate results read before their request (the topics are read in no fixed order)."""
    rollouts: dict[str, Rollout] = field(default_factory=dict)
    """alias → its latest rollout."""
    rollouts_by_id: dict[str, Rollout] = field(default_factory=dict)
    lease: Lease | None = None
    stale_after_s: float = 30.0
    """Heartbeat age after which a worker is no longer expected to ack a purge."""
    serving_generation: int = field(default=0, compare=False, repr=False)
    """Bumped by every fold step that can change a serving answer (anything but heartbeats,
    leases and purge acks): the key of caches of `services.catalog.serving` (not part of
    the state's equality, nor of its snapshot)."""

    # --- fold --------------------------------------------------------------------------

    def apply(self, envelope: Envelope, position: LogPosition | None = None) -> None:
        """Fold one event. Total: an event about something unknown is still recorded."""
        step = _STEPS.get(envelope.type)
        if step is not None:
            step(self, envelope, position)
            if envelope.type not in SERVING_NEUTRAL:
                self.serving_generation += 1
        key = getattr(envelope.payload, "idempotency_key", None)
        if key:
            answer = IdempotentAnswer(envelope, position)
            kept = self.idempotency.get((envelope.actor, key))
            if kept is None or answer.order < kept.order:
                self.idempotency[(envelope.actor, key)] = answer

    def _base_model_registered(self, e: Envelope, position: LogPosition | None) -> None:
        p = e.payload
        assert isinstance(p, BaseModelRegistered)
        self.base_models[p.name] = BaseModel(p.name, p.digest, dict(p.config), e.occurred_at,
                                             e.seq)

    def _version_published(self, e: Envelope, position: LogPosition | None) -> None:
        p = e.payload
        assert isinstance(p, AdapterVersionPublished)
        adapter = self.adapters.get(p.adapter_id)
        if adapter is None:
            adapter = self.adapters[p.adapter_id] = Adapter(p.adapter_id, e.tenant)
        version = adapter.versions[p.version] = AdapterVersion(
            e.occurred_at, str(e.event_id), position, seq=e.seq, payload=p)
        for purge in self.purges.values():  # a purge read before the version it ends
            if purge.covers(adapter.tenant, e.occurred_at):
                self._mark_purged(version, purge)
        adapter.seq = e.seq
        if p.quality_gate is not None:
            self._request_gate(p.adapter_id, p.version, p.quality_gate, e)

    def _activated(self, e: Envelope, position: LogPosition | None) -> None:
        p = e.payload
        assert isinstance(p, AdapterVersionSwitched | AdapterRolledBack)
        adapter = self._adapter_for(p.adapter_id, e)
        adapter.active_version = p.to_version
        if p.to_version in adapter.versions:
            adapter.versions[p.to_version].ever_active = True
            adapter.versions[p.to_version].rolled_back = False
        if isinstance(p, AdapterRolledBack) and p.from_version in adapter.versions:
            adapter.versions[p.from_version].rolled_back = True
        if isinstance(p, AdapterVersionSwitched) and p.rollout is not None:
            self._apply_rollout_step(p.rollout, e)

    def _toggled(self, e: Envelope, position: LogPosition | None) -> None:
        p = e.payload
        assert isinstance(p, AdapterDisabled | AdapterEnabled)
        adapter = self._adapter_for(p.adapter_id, e)
        version = adapter.versions.get(p.version)
        if version is not None:
            version.disabled = isinstance(p, AdapterDisabled)
            version.disabled_reason = p.reason if version.disabled else ""

    def _split_changed(self, e: Envelope, position: LogPosition | None) -> None:
        p = e.payload
        assert isinstance(p, TrafficSplitChanged)
        self.aliases[p.alias] = Alias(p.alias, e.tenant, e.seq, tuple(p.split), e.occurred_at)
        if p.rollout is not None:
            self._apply_rollout_step(p.rollout, e)
        else:
            current = self.rollouts.get(p.alias)
            if current is not None:
                self._add_fact(current, RolloutFact(e.occurred_at, "superseded", e.actor))

    def _purge_requested(self, e: Envelope, position: LogPosition | None) -> None:
        p = e.payload
        assert isinstance(p, TenantPurgeRequested)
        self.tenant_seqs[e.stream] = e.seq
        purge = self.purges[p.purge_id] = Purge(p.purge_id, e.tenant, p.deadline_s, p.hard,
                                                e.occurred_at, tuple(p.expected_workers),
                                                sorted(self.early_acks.pop(p.purge_id, []),
                                                       key=_ack_order))
        for adapter in self.adapters.values():
            for version in adapter.versions.values():
                if purge.covers(adapter.tenant, version.published_at):
                    self._mark_purged(version, purge)

    def _mark_purged(self, version: AdapterVersion, purge: Purge) -> None:
        """Record the purge that ends a version: the earliest covering one, whatever order
        the purges were read in."""
        current = self.purges.get(version.purged_by) if version.purged_by else None
        if current is None or (purge.requested_at, purge.purge_id) < (current.requested_at,
                                                                      current.purge_id):
            version.purged_by = purge.purge_id

    def _purged(self, e: Envelope, position: LogPosition | None) -> None:
        p = e.payload
        assert isinstance(p, TenantPurged)
        ack = PurgeAck(p.worker_id, e.occurred_at, p.kv_blocks_freed, p.adapters_unloaded,
                       p.sequences_aborted, p.refcounts_zero)
        purge = self.purges.get(p.purge_id)
        acks = purge.acks if purge is not None else self.early_acks.setdefault(p.purge_id, [])
        acks.append(ack)
        acks.sort(key=_ack_order)

    def _blobs_deleted(self, e: Envelope, position: LogPosition | None) -> None:
        p = e.payload
        assert isinstance(p, TenantBlobsDeleted)
        self.tenant_seqs[e.stream] = e.seq
        if p.purge_id in self.purges:  # same stream as its request: read after it
            self.purges[p.purge_id].blobs = p
            self.purges[p.purge_id].erased_at = e.occurred_at

    def _leased(self, e: Envelope, position: LogPosition | None) -> None:
        p = e.payload
        assert isinstance(p, RegistryLease)
        lease = self.lease
        if lease is None or (p.epoch, p.expires_at, e.seq) > (lease.epoch, lease.expires_at,
                                                               lease.seq):
            self.lease = Lease(p.registry_id, p.epoch, p.expires_at, e.seq)

    def _heartbeat(self, e: Envelope, position: LogPosition | None) -> None:
        p = e.payload
        assert isinstance(p, WorkerHeartbeat)
        at = e.occurred_at
        if at > self.heartbeats.get(p.worker_id, at - timedelta(days=1)):
            self.heartbeats[p.worker_id] = at
            self.worker_bases[p.worker_id] = p.base_model_digest
            self.worker_weights[p.worker_id] = p.base_weights
            if p.merged_mode is not None:
                self.merged_workers[p.worker_id] = p.merged_mode.adapter_id
            else:
                self.merged_workers.pop(p.worker_id, None)

    # --- release safety (rules in services.catalog.release_rule) -----------------------------

    def _request_gate(self, adapter_id: str, number: int, request: GateRequest,
                      envelope: Envelope) -> None:
        version = self.adapters[adapter_id].versions.get(number)
        if version is None:
            return
        gate = GateState(request, envelope.occurred_at, envelope.actor, str(envelope.event_id))
        gate.results.extend(self.orphan_results.pop(request.gate_id, []))
        version.gate = gate
        version.release_generation += 1
        self.gates[request.gate_id] = (adapter_id, number)

    def _gate_changed(self, gate_id: str) -> None:
        adapter_id, number = self.gates[gate_id]
        self.adapters[adapter_id].versions[number].release_generation += 1

    def gate(self, gate_id: str) -> GateState | None:
        """The gate run with this id, if it is still its version's latest."""
        where = self.gates.get(gate_id)
        if where is None:
            return None
        version = self.adapters[where[0]].versions.get(where[1])
        if version is None or version.gate is None or version.gate.gate_id != gate_id:
            return None
        return version.gate

    def _apply_release(self, envelope: Envelope, position: LogPosition | None = None) -> None:
        p = envelope.payload
        at = envelope.occurred_at
        if isinstance(p, QualityGateRequested):
            adapter = self._adapter_for(p.adapter_id, envelope)
            if p.version in adapter.versions:
                self._request_gate(p.adapter_id, p.version, p.gate, envelope)
        elif isinstance(p, QualityGateCompleted):
            gate = self.gate(p.gate_id)
            if gate is not None:
                _insort_result(gate.results, (at, p))
                self._gate_changed(p.gate_id)
            elif p.gate_id not in self.gates:
                _insort_result(self.orphan_results.setdefault(p.gate_id, []), (at, p))
        elif isinstance(p, QualityGateExpired):
            self._adapter_for(p.adapter_id, envelope)
            gate = self.gate(p.gate_id)
            if gate is not None and (gate.expiry is None or at < gate.expiry[0]):
                gate.expiry = (at, p)
                self._gate_changed(p.gate_id)
        elif isinstance(p, ReleaseOverridden):
            adapter = self._adapter_for(p.adapter_id, envelope)
            version = adapter.versions.get(p.version)
            if version is not None and (version.override is None or at >= version.override[0]):
                version.override = (at, envelope.actor, p.reason)
                version.release_generation += 1
        elif isinstance(p, RolloutHalted | RolloutResumed):
            alias = self.aliases.get(p.alias)
            if alias is not None:
                alias.seq = envelope.seq
            rollout = self.rollouts_by_id.get(p.rollout_id)
            if rollout is None:
                return
            halted = isinstance(p, RolloutHalted)
            self._add_fact(rollout, RolloutFact(
                at, "halted" if halted else "resumed", envelope.actor, reason=p.reason,
                judgement=p.judgement if isinstance(p, RolloutHalted) else None))

    def _apply_rollout_step(self, step: RolloutStep, envelope: Envelope) -> None:
        rollout = self.rollouts_by_id.get(step.rollout_id)
        if rollout is None:
            rollout = Rollout(step.rollout_id, step.alias, step.adapter_id, step.canary_version,
                              step.baseline_version, step.plan, envelope.tenant,
                              envelope.occurred_at)
            self.rollouts_by_id[step.rollout_id] = rollout
        self._add_fact(rollout, RolloutFact(envelope.occurred_at, step.action, envelope.actor,
                                            step=step))
        if step.action == "rolled_back":
            canary = self.adapters.get(step.adapter_id)
            version = canary.versions.get(step.canary_version) if canary else None
            if version is not None:
                version.release_generation += 1

    def _add_fact(self, rollout: Rollout, fact: RolloutFact) -> None:
        """Record what the log said about a rollout and rebuild it, in time order."""
        rollout.facts.append(fact)
        rollout.facts.sort(key=lambda f: f.order)
        rollout.stage, rollout.stage_started_at = 0, None
        rollout.status, rollout.status_reason = "running", ""
        rollout.last_judgement, rollout.steps = None, []
        for f in rollout.facts:
            if f.action == "superseded":
                if rollout.status in ("running", "halted"):
                    rollout.status, rollout.status_reason = "superseded", "split set by hand"
                continue
            rollout.steps.append((f.at, f.action, f.actor))
            if f.action in ("halted", "resumed"):
                if f.action == "halted" and rollout.status == "running":
                    rollout.status, rollout.status_reason = "halted", f.reason
                    if f.judgement is not None:
                        rollout.last_judgement = f.judgement
                elif f.action == "resumed" and rollout.status == "halted":
                    rollout.status, rollout.status_reason = "running", f.reason
                    rollout.stage_started_at = f.at
                continue
            step = f.step
            assert step is not None
            rollout.stage = step.stage
            if step.judgement is not None:
                rollout.last_judgement = step.judgement
            if step.action == "started":
                rollout.started_at = f.at
            if step.action in ("started", "advanced"):
                rollout.stage_started_at = f.at
            elif step.action == "rolled_back":
                rollout.status, rollout.status_reason = "rolled_back", step.reason
                self._mark_rolled_back(step, f.at)
            elif step.action == "completed":
                rollout.status, rollout.status_reason = "completed", step.reason
        latest = max((r for r in self.rollouts_by_id.values() if r.alias == rollout.alias),
                     key=lambda r: (r.started_at, r.rollout_id))
        self.rollouts[rollout.alias] = latest

    def _mark_rolled_back(self, step: RolloutStep, at: datetime) -> None:
        canary = self.adapters.get(step.adapter_id)
        version = canary.versions.get(step.canary_version) if canary else None
        if version is not None and (version.canary_rollback is None
                                    or at >= version.canary_rollback[0]):
            version.canary_rollback = (at, f"canary rollout {step.rollout_id} rolled it back at "
                                           f"{step.plan.stages[step.stage]}%: {step.reason}")

    def _adapter_for(self, adapter_id: str, envelope: Envelope) -> Adapter:
        adapter = self.adapters.get(adapter_id)
        if adapter is None:
            adapter = self.adapters[adapter_id] = Adapter(adapter_id, envelope.tenant)
        adapter.seq = envelope.seq
        return adapter

    def live_workers(self, now: datetime) -> tuple[str, ...]:
        """Workers a purge decided at `now` must wait for (`services.catalog.purge`)."""
        return live_workers(self.heartbeats, now, self.stale_after_s)

    # --- queries -----------------------------------------------------------------------

    def adapter(self, adapter_id: str) -> Adapter:
        adapter = self.adapters.get(adapter_id)
        if adapter is None or not adapter.versions:
            raise Refusal("not_found", missing("adapter", adapter_id))
        return adapter

    def version(self, adapter_id: str, version: int) -> AdapterVersion:
        found = self.adapter(adapter_id).versions.get(version)
        if found is None:
            raise Refusal("not_found", f"adapter {adapter_id!r} has no version {version}")
        return found

    def prior_answer(self, actor: str, key: str | None, event_type: str, stream: str, *,
                     request_sha256: str | None = None) -> IdempotentAnswer | None:
        """The first answer to a keyed command, or None. A key reused for another command,
        or (when both fingerprints are known) for another request, is refused."""
        if not key:
            return None
        prior = self.idempotency.get((actor, key))
        if prior is None:
            return None
        if prior.envelope.type != event_type or prior.envelope.stream != stream:
            raise Refusal("key_reused", f"Idempotency-Key {key!r} was already used for a "
                                        f"different request ({prior.envelope.type} on "
                                        f"{prior.envelope.stream})")
        recorded = getattr(prior.envelope.payload, "request_sha256", None)
        if request_sha256 and recorded and recorded != request_sha256:
            raise Refusal("key_reused", f"Idempotency-Key {key!r} was already used with a "
                                        "different request body; use a new key for a new "
                                        "request")
        return prior


_Step = Callable[[CatalogState, Envelope, "LogPosition | None"], None]
_STEPS: dict[str, _Step] = {
    BaseModelRegistered.event_type(): CatalogState._base_model_registered,
    AdapterVersionPublished.event_type(): CatalogState._version_published,
    AdapterVersionSwitched.event_type(): CatalogState._activated,
    AdapterRolledBack.event_type(): CatalogState._activated,
    AdapterDisabled.event_type(): CatalogState._toggled,
    AdapterEnabled.event_type(): CatalogState._toggled,
    TrafficSplitChanged.event_type(): CatalogState._split_changed,
    TenantPurgeRequested.event_type(): CatalogState._purge_requested,
    TenantPurged.event_type(): CatalogState._purged,
    TenantBlobsDeleted.event_type(): CatalogState._blobs_deleted,
    RegistryLease.event_type(): CatalogState._leased,
    WorkerHeartbeat.event_type(): CatalogState._heartbeat,
    **{cls.event_type(): CatalogState._apply_release
       for cls in (QualityGateRequested, QualityGateCompleted, QualityGateExpired,
                   ReleaseOverridden, RolloutHalted, RolloutResumed)},
}

FOLDED_TYPES = frozenset(_STEPS)
"""The event types `CatalogState.apply` takes; a reader may skip every other undecoded."""
SERVING_NEUTRAL = frozenset({WorkerHeartbeat.event_type(), RegistryLease.event_type(),
                             TenantPurged.event_type()})
"""Folded types that cannot change which version a request is served (they come every
second from every worker; bumping `serving_generation` on them would empty the caches)."""


# --- rollback lineage ----------------------------------------------------------------------


def rollback_candidates(adapter: Adapter) -> list[int]:
    """Stable versions below the active one, best (highest) first; see the module doc."""
    current = adapter.active_version
    if current is None:
        return []
    return sorted((n for n, v in adapter.versions.items()
                   if n < current and v.ever_active and not v.disabled), reverse=True)


def rollback_target(adapter: Adapter) -> int | None:
    current = adapter.active_version
    if current is None:
        return None
    active = adapter.versions.get(current)
    declared = active.published.rollback_to if active is not None else None
    if declared is not None and declared != current:
        target = adapter.versions.get(declared)
        if target is not None and not target.disabled:
            return declared
    candidates = rollback_candidates(adapter)
    return candidates[0] if candidates else None
