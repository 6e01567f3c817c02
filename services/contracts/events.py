"""Event envelope and payloads: the code side of the contracts in `schemas/events/`.

Every event on the log is one `Envelope` whose `payload` is one of the payload classes
below, chosen by `type`. The JSON Schema files are generated from these classes
(`python -m services.contracts.schema_export`) and a test keeps the two identical, so the
files in `schemas/` are the published contract and these models never drift from it.

Compatibility rule: fields are only ever added (with defaults). A breaking change bumps
the payload's `schema_version` and registers an upcaster in `codec.py`, so old events in
the log stay readable forever.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from datetime import UTC, datetime
from functools import cache
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    StringConstraints,
    create_model,
    model_validator,
)

SLUG_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
"""Tenant org / team / project: also checked on REST paths and forms before any event."""
ID_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,127}$"
"""Adapter ids, aliases and base-model names."""
SHA256_PATTERN = r"^[0-9a-f]{64}$"
BaseWeights = Literal["dense", "int8"]
"""How a worker computes its base projections: dense in its serving dtype, or int8 weights
per output channel (activations and the LoRA pass in the serving dtype). The base digest
names the checkpoint either way; this names what was computed from it."""
BASE_WEIGHTS_DOC = ("How the worker computes the base projections from the checkpoint the "
                    "digest names: dense (in its serving dtype) or int8 (per-channel int8 "
                    "weights, activations and the LoRA pass in the serving dtype).")

MERGE_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,127}(@[1-9][0-9]{0,9})?$"
"""What merged mode names (`serve worker --merge`): `ADAPTER_ID` or `ADAPTER_ID@VERSION`."""

PATTERN_WORDS = {
    SLUG_PATTERN: "lowercase letters, digits, '.', '_', '-' (1 to 63 characters, the first a "
                  "letter or digit)",
    ID_PATTERN: "lowercase letters, digits, '.', '_', '-' (1 to 128 characters, the first a "
                "letter or digit)",
    SHA256_PATTERN: "64 lowercase hexadecimal digits (a SHA-256)",
}
"""What each pattern allows, in words: what an API says when a value does not match."""

Slug = Annotated[str, StringConstraints(pattern=SLUG_PATTERN)]
Sha256Hex = Annotated[str, StringConstraints(pattern=SHA256_PATTERN)]
AdapterId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
QosTier = Literal["platinum", "gold", "silver", "bronze"]
RequestSha256 = Annotated[Sha256Hex | None, Field(
    description="SHA-256 of the request that carried the Idempotency-Key; a later request "
                "with the same key and another fingerprint is refused.")]
Version = Annotated[int, Field(ge=1)]

ADAPTER_TOPIC = "adapter"
WORKER_TOPIC = "worker"
LIVENESS_TOPIC = "liveness"
"""Periodic proofs of life (leases, heartbeats): a topic of their own, compacted and short
lived, so the kept-forever adapter log and the audit record hold domain events only."""
ANY_TOPIC = "any"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TenantRef(_Frozen):
    """The tenant an event concerns: the unit of isolation, billing and purge."""

    org: Slug
    team: Slug
    project: Slug

    @property
    def key(self) -> str:
        return f"{self.org}/{self.team}/{self.project}"


class Payload(_Frozen):
    """Base of every payload; `schema_version` is the version new events are written at."""

    schema_version: ClassVar[int] = 1
    topic: ClassVar[str] = ADAPTER_TOPIC

    @classmethod
    def event_type(cls) -> str:
        return cls.__name__


# --- registry → adapter-events --------------------------------------------------------


class BaseModelRegistered(Payload):
    """An admin registered a base model; adapters are validated against its config."""

    name: AdapterId
    digest: Sha256Hex
    config: dict[str, Any]
    idempotency_key: str | None = Field(
        None, max_length=128, description="Client Idempotency-Key of the command (with the actor).")
    request_sha256: RequestSha256 = None


class AdapterVersionPublished(Payload):
    adapter_id: AdapterId
    version: Version
    label: str = Field(min_length=1, max_length=128)
    base_model: AdapterId
    base_model_digest: Sha256Hex
    sha256: Sha256Hex = Field(description="Digest of adapter_model.safetensors")
    config_sha256: Sha256Hex = Field(description="Digest of adapter_config.json")
    size_bytes: int = Field(ge=0)
    rank: int = Field(ge=1)
    lora_alpha: float
    target_modules: list[str] = Field(min_length=1)
    dtype: str
    qos_tier: QosTier = "silver"
    owner: str = Field(min_length=1, max_length=256)
    rollback_to: Version | None = None
    declared_base_model: str | None = Field(
        None, max_length=512,
        description="base_model_name_or_path from adapter_config.json: the model the adapter "
                    "says it was trained on (validated against `base_model`'s shapes).")
    idempotency_key: str | None = Field(
        None, max_length=128, description="Client Idempotency-Key of the command (with the actor).")
    request_sha256: RequestSha256 = None
    gate_required: bool = Field(
        False, description="Decided by the registry at publish: the version gets traffic (switch, "
                           "split, rollout) only after a passed quality gate or an admin "
                           "override. True when it carries a regression set or when "
                           "LORAPLANE_RELEASE_UNGATED=block; false in events written before "
                           "release gates existed.")
    quality_gate: GateRequest | None = Field(
        None, description="The gate run requested with the publish (a regression set was "
                          "uploaded with the version).")


class SplitEntry(_Frozen):
    adapter_id: AdapterId
    version: Version
    weight: int = Field(ge=0, le=100)


class TrafficSplitChanged(Payload):
    """An alias now sends `weight`% of its traffic to each listed version."""

    alias: AdapterId
    split: list[SplitEntry] = Field(min_length=1)
    previous: list[SplitEntry] = Field(default_factory=list)
    idempotency_key: str | None = Field(
        None, max_length=128, description="Client Idempotency-Key of the command (with the actor).")
    request_sha256: RequestSha256 = None
    rollout: RolloutStep | None = Field(
        None, description="Set when a canary rollout moved the split (started, advanced, rolled "
                          "back), with the figures it was decided on.")


class AdapterVersionSwitched(Payload):
    """The active version of an adapter changed; workers invalidate the old version's KV."""

    adapter_id: AdapterId
    from_version: Version | None
    to_version: Version
    alias: AdapterId | None = None
    idempotency_key: str | None = Field(
        None, max_length=128, description="Client Idempotency-Key of the command (with the actor).")
    request_sha256: RequestSha256 = None
    rollout: RolloutStep | None = Field(
        None, description="Set when a canary rollout completed: its last stage held, and the "
                          "canary became the adapter's active version.")


class AdapterRolledBack(Payload):
    adapter_id: AdapterId
    from_version: Version
    to_version: Version
    reason: str = Field(max_length=1024)
    idempotency_key: str | None = Field(
        None, max_length=128, description="Client Idempotency-Key of the command (with the actor).")
    request_sha256: RequestSha256 = None


class AdapterDisabled(Payload):
    adapter_id: AdapterId
    version: Version
    reason: str = Field(max_length=1024)
    idempotency_key: str | None = Field(
        None, max_length=128, description="Client Idempotency-Key of the command (with the actor).")
    request_sha256: RequestSha256 = None


class AdapterEnabled(Payload):
    adapter_id: AdapterId
    version: Version
    reason: str = Field("", max_length=1024)
    idempotency_key: str | None = Field(
        None, max_length=128, description="Client Idempotency-Key of the command (with the actor).")
    request_sha256: RequestSha256 = None


class TenantPurgeRequested(Payload):
    purge_id: str = Field(min_length=1, max_length=64)
    deadline_s: float = Field(gt=0, le=86400)
    hard: bool = Field(True, description="Abort running sequences instead of letting them end.")
    expected_workers: list[str] = Field(
        default_factory=list,
        description="Workers live when the registry decided the purge: each must acknowledge "
                    "(services/catalog/purge.py). Events written before this field list none.")
    idempotency_key: str | None = Field(
        None, max_length=128, description="Client Idempotency-Key of the command (with the actor).")
    request_sha256: RequestSha256 = None


class TenantBlobsDeleted(Payload):
    """The registry erased a purged tenant's adapter files from the blob store.

    Written on the tenant's stream right after its `TenantPurgeRequested` (so it is read
    after it), once the files are gone. A digest that a version the purge did not end also
    references (another tenant's, or one published after the purge) stays, listed with
    `kept`. A purge is met only once this is written (`services.catalog.purge`).
    """

    purge_id: str = Field(min_length=1, max_length=64)
    deleted: list[Sha256Hex] = Field(
        default_factory=list,
        description="The tenant's blobs no longer in the blob store (removed by this erasure).")
    kept: list[Sha256Hex] = Field(
        default_factory=list,
        description="The tenant's blobs left in place: a version the purge did not end holds "
                    "the same bytes (another tenant's, or one published after the purge).")


class RegistryLease(Payload):
    """Proof of a live, current registry; workers past the stale threshold stop serving.

    Written every `lease_interval_s` to the liveness topic (stream `registry/lease`)."""

    topic: ClassVar[str] = LIVENESS_TOPIC
    registry_id: str
    epoch: int = Field(ge=0)
    expires_at: datetime


# --- workers → worker-events -----------------------------------------------------------


class _WorkerPayload(Payload):
    topic: ClassVar[str] = WORKER_TOPIC
    worker_id: str = Field(min_length=1, max_length=128)


class LoadedAdapter(_Frozen):
    adapter_id: AdapterId
    version: Version
    sha256: Sha256Hex
    tier: Literal["device", "host", "disk"] = "device"


class MergedMode(_Frozen):
    """A worker in merged mode (`loraplane serve worker --merge ADAPTER[@VERSION]`): it
    serves this one adapter, merged into its base weights, and refuses every other request
    (other adapters and the bare base model)."""

    adapter_id: AdapterId
    pinned_version: Version | None = Field(
        None, description="The version it was started for; null: it follows the adapter's "
                          "active version (a switch or rollback re-merges).")
    version: Version | None = Field(
        None, description="The version merged now; null while none is (not servable, or "
                          "being loaded and merged).")
    sha256: Sha256Hex | None = Field(None, description="The merged version's weights digest.")


class WorkerHeartbeat(_WorkerPayload):
    """A worker's periodic state, on the liveness topic (stream `heartbeat/{worker_id}`)."""

    topic: ClassVar[str] = LIVENESS_TOPIC
    address: str
    base_model: str
    base_model_digest: Sha256Hex
    loaded: list[LoadedAdapter] = Field(default_factory=list)
    free_slots: int = Field(0, ge=0)
    free_kv_blocks: int = Field(0, ge=0)
    lease_epoch: int | None = None
    base_weights: BaseWeights = Field("dense", description=BASE_WEIGHTS_DOC)
    merged_mode: MergedMode | None = Field(
        None, description="Set when the worker is dedicated to one adapter merged into its "
                          "base weights: routers send it only that adapter's requests, and the "
                          "registry assigns it no quality gates.")
    draining: bool = Field(
        False, description="The worker is shutting down (SIGTERM): routers take it out of "
                           "their rings at once and send it nothing new; it finishes the "
                           "streams it has, then stops.")


class AdapterLoaded(_WorkerPayload):
    adapter_id: AdapterId
    version: Version
    sha256: Sha256Hex
    load_ms: float = Field(ge=0)
    tier: Literal["device", "host", "disk"] = "device"


class AdapterLoadFailed(_WorkerPayload):
    adapter_id: AdapterId
    version: Version
    error: str = Field(max_length=4096)
    retryable: bool = Field(
        False, description="True when the load stopped without a verdict on the bytes (registry "
                           "unreachable, slot pool full); false for a digest mismatch or an "
                           "invalid adapter, after which the worker never serves the version.")


class AdapterUnloaded(_WorkerPayload):
    adapter_id: AdapterId
    version: Version
    sha256: Sha256Hex
    reason: str = Field(max_length=1024)


class KVInvalidated(_WorkerPayload):
    reason: Literal["switch", "rollback", "disable", "unload", "purge"]
    adapter_sha256: Sha256Hex | None = None
    tenant_key: str | None = None
    blocks_freed: int = Field(ge=0)
    sequences_aborted: int = Field(0, ge=0)


class TenantPurged(_WorkerPayload):
    purge_id: str = Field(min_length=1, max_length=64)
    kv_blocks_freed: int = Field(ge=0)
    adapters_unloaded: int = Field(ge=0)
    sequences_aborted: int = Field(0, ge=0)
    refcounts_zero: bool


class ServedRequest(_Frozen):
    request_id: str
    trace_id: str
    tenant: TenantRef
    user_id: str = ""
    adapter_id: AdapterId | None
    version: Version | None
    adapter_sha256: Sha256Hex | None
    base_model_digest: Sha256Hex
    base_weights: BaseWeights = Field("dense", description=BASE_WEIGHTS_DOC)
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    started_at: datetime
    finished_at: datetime
    status: Literal["ok", "aborted", "rejected", "error", "cancelled", "cut"] = Field(
        "ok", description="ok: answered to its end (length or stop); aborted: ended by the "
                          "platform (a purge); rejected: refused after resolution; error: the "
                          "engine failed; cancelled: the client went away or its deadline "
                          "passed, and the sequence was aborted; cut: the worker's stream "
                          "broke after the answer began (the worker died), as a router "
                          "witnessed it.")


class RequestServed(_WorkerPayload):
    """A batch of request traces: which adapter version and digest served which request."""

    requests: list[ServedRequest] = Field(min_length=1)
    witness: Literal["worker", "router"] = Field(
        "worker", description="Who wrote the traces: the worker that served them (worker_id), "
                              "or a router whose stream from that worker broke mid-answer, "
                              "which the worker can no longer trace itself (the envelope's "
                              "actor names the router). A request traced by both is the "
                              "same request: readers keep the worker's trace.")


# --- release safety: quality gates and canary rollouts (services/release) ---------------


class GateRequest(_Frozen):
    """A quality-gate run the registry assigns to one live worker on the version's base."""

    gate_id: str = Field(min_length=1, max_length=64)
    regression_set_sha256: Sha256Hex = Field(description="The JSONL set, in the blob store.")
    cases: int = Field(ge=1, description="Number of cases in the set.")
    worker_id: str | None = Field(
        None, max_length=128, description="The worker that must run it, chosen from live "
        "heartbeats on the version's base model; none = no such worker (the gate expires).")
    baseline_version: Version | None = Field(
        None, description="Previous stable version compared against: the active version when "
                          "the gate was requested; none for an adapter's first version.")
    timeout_s: float = Field(gt=0, le=86400, description="After this the gate is FAILED.")


class QualityGateRequested(Payload):
    """A (new) gate run for a version that is not serving: a regression set given later over
    REST, or a re-run of the stored one."""

    adapter_id: AdapterId
    version: Version
    gate: GateRequest
    reason: str = Field("", max_length=1024)
    idempotency_key: str | None = Field(
        None, max_length=128, description="Client Idempotency-Key of the command (with the actor).")
    request_sha256: RequestSha256 = None


class QualityGateExpired(Payload):
    """The registry gave up on a gate run: it counts as FAILED, never as passed."""

    adapter_id: AdapterId
    version: Version
    gate_id: str = Field(min_length=1, max_length=64)
    cause: Literal["no_worker", "timeout", "worker_lost"]
    reason: str = Field(max_length=1024)


class ReleaseOverridden(Payload):
    """An admin cleared a version for traffic despite its gate (missing, pending, failed,
    expired) or a canary rollback; the reason is mandatory."""

    adapter_id: AdapterId
    version: Version
    reason: str = Field(min_length=1, max_length=1024)
    lifted: list[str] = Field(default_factory=list,
                              description="What the override lifted, as the refusals read.")
    idempotency_key: str | None = Field(
        None, max_length=128, description="Client Idempotency-Key of the command (with the actor).")
    request_sha256: RequestSha256 = None


class RolloutPlan(_Frozen):
    """How a canary walks: traffic stages and what each must show before the next."""

    stages: list[Annotated[int, Field(ge=1, le=100)]] = Field(min_length=2, max_length=20)
    min_stage_s: float = Field(gt=0, description="Least time at a stage before advancing.")
    window_s: float = Field(gt=0, description="Traces judged: the stage's last window_s.")
    max_error_ratio: float = Field(gt=0, description="Canary error rate / baseline's, at most.")
    error_rate_floor: float = Field(0.0, ge=0, le=1, description="A canary error rate up to "
                                    "this never fails the ratio (baseline near zero).")
    min_requests: int = Field(ge=1, description="Per arm, before judging.")
    max_p95_ms: float = Field(gt=0, description="Canary p95 latency bound.")
    max_p95_ratio: float | None = Field(None, gt=0, description="Canary p95 / baseline p95.")

    @model_validator(mode="after")
    def _stages_climb_to_100(self) -> RolloutPlan:
        if any(b <= a for a, b in zip(self.stages, self.stages[1:], strict=False)):
            raise ValueError("stages must increase")
        if self.stages[-1] != 100:
            raise ValueError("the last stage must be 100")
        return self


class ArmFigures(_Frozen):
    """One version's request traces over a judgement window."""

    version: Version
    requests: int = Field(ge=0, description="ok + error traces (aborted and rejected excluded)")
    errors: int = Field(ge=0)
    error_rate: float | None = Field(None, ge=0, le=1)
    p95_ms: float | None = Field(None, ge=0)


class Judgement(_Frozen):
    """What a canary stage was decided on: both arms over the same window of traces."""

    window_start: datetime
    window_end: datetime
    canary: ArmFigures
    baseline: ArmFigures
    baseline_from_window: bool = Field(
        True, description="False at the 100% stage: the baseline figures are those of the "
                          "last judged stage, since the baseline serves nothing now.")
    verdict: Literal["advance", "rollback", "wait"]
    reasons: list[str] = Field(default_factory=list)


class RolloutStep(_Frozen):
    """One decision of a canary rollout, carried by the event that applies it."""

    rollout_id: str = Field(min_length=1, max_length=64)
    action: Literal["started", "advanced", "rolled_back", "completed"]
    alias: AdapterId
    adapter_id: AdapterId
    canary_version: Version
    baseline_version: Version
    stage: int = Field(ge=0, description="Stage index after the step (into plan.stages).")
    weight: int = Field(ge=0, le=100, description="Canary weight after the step.")
    plan: RolloutPlan
    judgement: Judgement | None = None
    automatic: bool = Field(False, description="Decided by the canary controller.")
    reason: str = Field("", max_length=2048)


class RolloutHalted(Payload):
    """A rollout stops advancing; traffic stays where it is until resumed or rolled back."""

    alias: AdapterId
    rollout_id: str = Field(min_length=1, max_length=64)
    stage: int = Field(ge=0)
    reason: str = Field(min_length=1, max_length=2048)
    automatic: bool = False
    judgement: Judgement | None = None
    idempotency_key: str | None = Field(
        None, max_length=128, description="Client Idempotency-Key of the command (with the actor).")
    request_sha256: RequestSha256 = None


class RolloutResumed(Payload):
    """A halted rollout continues; its stage clock starts again."""

    alias: AdapterId
    rollout_id: str = Field(min_length=1, max_length=64)
    stage: int = Field(ge=0)
    reason: str = Field("", max_length=2048)
    idempotency_key: str | None = Field(
        None, max_length=128, description="Client Idempotency-Key of the command (with the actor).")
    request_sha256: RequestSha256 = None


GATE_TEXT_CHARS = 512
"""Output text kept per version per case in a gate result (digests cover the whole)."""


class GateOutput(_Frozen):
    """One version's greedy output for one case."""

    role: Literal["base", "previous", "new"]
    version: Version | None = None
    tokens: int = Field(ge=0)
    tokens_sha256: Sha256Hex = Field(description="SHA-256 of the token ids, comma-joined.")
    text_sha256: Sha256Hex = Field(description="SHA-256 of the whole output text (UTF-8).")
    text: str = Field(max_length=GATE_TEXT_CHARS, description="The text, cut to the limit.")
    truncated: bool = False
    finish_reason: str = Field(max_length=16)


class GateCheckResult(_Frozen):
    kind: Literal["exact", "regex", "json_schema", "max_divergence"]
    verdict: Literal["pass", "fail", "skipped"]
    detail: str = Field("", max_length=1024)
    measured: float | None = None
    limit: float | None = None


class GateCaseResult(_Frozen):
    case_id: str = Field(min_length=1, max_length=128)
    line: int = Field(ge=1, description="Line of the case in the JSONL set.")
    prompt_sha256: Sha256Hex
    outputs: list[GateOutput] = Field(min_length=1, max_length=3)
    checks: list[GateCheckResult] = Field(default_factory=list)
    passed: bool


class QualityGateCompleted(_WorkerPayload):
    """A worker ran a gate: every case's outputs (digests and bounded text) and verdicts."""

    gate_id: str = Field(min_length=1, max_length=64)
    adapter_id: AdapterId
    version: Version
    baseline_version: Version | None = None
    base_model_digest: Sha256Hex
    regression_set_sha256: Sha256Hex
    adapter_sha256: Sha256Hex
    passed: bool
    error: str | None = Field(None, max_length=4096, description="Why the run could not finish "
                              "(a FAILED gate): adapter files refused, engine error.")
    cases: list[GateCaseResult] = Field(default_factory=list)
    duration_ms: float = Field(0.0, ge=0)


for _model in (AdapterVersionPublished, TrafficSplitChanged, AdapterVersionSwitched):
    _model.model_rebuild()  # they name release models defined further down


# --- any topic ---------------------------------------------------------------------------


class ReplayBarrier(Payload):
    """A marker earlier readers wrote to every partition to know they had caught up.

    No longer written (readers now wait for a partition end reported by a fetch of their
    own, see `services/eventlog/consumer.py`); kept so logs that hold barriers stay
    readable. Not a domain event: every reader skips it.
    """

    topic: ClassVar[str] = ANY_TOPIC
    reader: str
    nonce: str
    partition: int = Field(ge=0)


PAYLOAD_TYPES: dict[str, type[Payload]] = {
    cls.event_type(): cls
    for cls in (
        BaseModelRegistered,
        AdapterVersionPublished,
        TrafficSplitChanged,
        AdapterVersionSwitched,
        AdapterRolledBack,
        AdapterDisabled,
        AdapterEnabled,
        TenantPurgeRequested,
        TenantBlobsDeleted,
        RegistryLease,
        WorkerHeartbeat,
        AdapterLoaded,
        AdapterLoadFailed,
        AdapterUnloaded,
        KVInvalidated,
        TenantPurged,
        RequestServed,
        QualityGateRequested,
        QualityGateExpired,
        ReleaseOverridden,
        RolloutHalted,
        RolloutResumed,
        QualityGateCompleted,
        ReplayBarrier,
    )
}


class UnknownEventType(ValueError):
    pass


def payload_class(event_type: str) -> type[Payload]:
    try:
        return PAYLOAD_TYPES[event_type]
    except KeyError:
        raise UnknownEventType(f"unknown event type {event_type!r}") from None


# --- UUIDv7 ------------------------------------------------------------------------------

_uuid7_lock = threading.Lock()
_uuid7_last = [0, 0]  # [unix_ms, counter]


def uuid7() -> uuid.UUID:
    """A time-ordered UUIDv7 (RFC 9562), monotonic within this process.

    Time order makes event ids sort like the log and keeps index inserts local in Postgres.
    """
    with _uuid7_lock:
        ms = time.time_ns() // 1_000_000
        if ms <= _uuid7_last[0]:
            ms = _uuid7_last[0]
            _uuid7_last[1] += 1
            if _uuid7_last[1] >= 1 << 12:  # counter exhausted: borrow the next millisecond
                ms += 1
                _uuid7_last[1] = 0
        else:
            _uuid7_last[1] = int.from_bytes(os.urandom(2), "big") & 0x3FF
        _uuid7_last[0] = ms
        counter = _uuid7_last[1]
    rand = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | rand
    return uuid.UUID(int=value)


# --- the envelope ------------------------------------------------------------------------


# Events are built with `Envelope.new` or read with `codec.decode` / `codec.to_envelope`,
# which both give the per-type subclass from `typed_envelope`, its payload typed. (The
# docstring below is the published schema's description, hence this comment.)
class Envelope(_Frozen):
    """One event on the log. Key = `stream`, so a stream stays ordered in one partition."""

    event_id: uuid.UUID
    type: str
    schema_version: int = Field(ge=1)
    stream: str = Field(min_length=1, max_length=256)
    seq: int = Field(ge=1, description="Per stream, gap-free, starting at 1.")
    occurred_at: datetime
    actor: str = Field(min_length=1, max_length=256)
    tenant: TenantRef | None = None
    trace_id: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")
    payload: SerializeAsAny[Payload]

    @model_validator(mode="after")
    def _type_matches_payload(self) -> Envelope:
        if self.payload.event_type() != self.type:
            raise ValueError(f"type {self.type!r} does not match payload "
                             f"{self.payload.event_type()!r}")
        return self

    @staticmethod
    def new(
        payload: Payload,
        *,
        stream: str,
        seq: int,
        actor: str,
        tenant: TenantRef | None = None,
        trace_id: str | None = None,
        occurred_at: datetime | None = None,
    ) -> Envelope:
        return typed_envelope(payload.event_type())(
            event_id=uuid7(),
            type=payload.event_type(),
            schema_version=payload.schema_version,
            stream=stream,
            seq=seq,
            occurred_at=occurred_at or datetime.now(UTC),
            actor=actor,
            tenant=tenant,
            trace_id=trace_id,
            payload=payload,
        )

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @property
    def is_barrier(self) -> bool:
        return isinstance(self.payload, ReplayBarrier)


@cache
def typed_envelope(event_type: str) -> type[Envelope]:
    """The envelope of one event type: `type` and `schema_version` fixed, payload typed.

    Every event in the process is one of these (what `Envelope.new` and the decoder
    build), and the JSON Schema files in `schemas/events/` are generated from them.
    """
    cls = payload_class(event_type)
    model: type[Envelope] = create_model(  # type: ignore[call-overload]
        f"{event_type}Event",
        __base__=Envelope,
        type=(Literal[event_type], ...),  # type: ignore[valid-type]
        schema_version=(Literal[cls.schema_version], ...),  # type: ignore[valid-type]
        payload=(cls, ...),
    )
    return model
