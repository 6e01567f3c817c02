"""Release safety over REST: quality gates, overrides and canary rollouts.

- `POST /v1/adapters/{id}/versions/{v}/gate`: a regression set for a version that is not
  serving, or a re-run of the stored one (QualityGateRequested);
- `GET /v1/adapters/{id}/versions/{v}/gate`: the gate, every case's outputs and verdicts,
  and whether the version may get traffic;
- `POST /v1/adapters/{id}/versions/{v}/override`: admin only, clear it for traffic with a
  reason (ReleaseOverridden);
- `POST /v1/aliases/{alias}/rollout`: start a canary rollout (TrafficSplitChanged carrying
  the plan); `GET` the alias's latest rollout, its stage and every step;
- `POST /v1/aliases/{alias}/rollout/advance`, `…/rollback`, `…/halt`, `…/resume`: steps; the
  canary controller sends the figures and the registry re-judges them.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Path, Response, UploadFile
from pydantic import BaseModel, Field

from services.catalog.auth import Principal
from services.catalog.regression import RegressionSet, RegressionSetError, parse_regression_set
from services.catalog.release_rule import GateSpec, release_refusal
from services.catalog.state import (
    Adapter,
    AdapterVersion,
    CatalogState,
    Refusal,
    Rollout,
    adapter_stream,
    alias_stream,
)
from services.config import Settings
from services.contracts.capacity import OverCapacity, check_context, serving_context
from services.contracts.events import (
    ID_PATTERN,
    GateCaseResult,
    Judgement,
    RolloutPlan,
    SplitEntry,
    TenantRef,
    uuid7,
)
from services.contracts.problems import ProblemError, problem_responses
from services.contracts.roles import Permission
from services.registry.deps import (
    Blobs,
    ExpectedVersion,
    IdempotencyKey,
    Node,
    Reader,
    ReleaseOverrider,
    Replayed,
    RolloutStepper,
    TraceId,
    Writer,
    alias_in_scope,
    request_fingerprint,
    visible,
    writable_adapter,
)
from services.registry.node import Committed, RegistryNode
from services.registry.release_commands import (
    advance_rollout,
    halt_rollout,
    no_rollout,
    override_release,
    request_gate,
    resume_rollout,
    roll_back_rollout,
    start_rollout,
)
from services.registry.views import EventRef, answer_headers, event_ref

router = APIRouter(prefix="/v1", tags=["release"], dependencies=[Replayed])
ERRORS = problem_responses(401, 403, 404, 409, 412, 413, 422, 503)
AdapterIdPath = Annotated[str, Path(pattern=ID_PATTERN)]
AliasPath = Annotated[str, Path(pattern=ID_PATTERN)]
VersionPath = Annotated[int, Path(ge=1, le=2**31)]


# --- regression sets -------------------------------------------------------------------------


def read_regression_set(upload: UploadFile, settings: Settings) -> tuple[bytes, RegressionSet]:
    """The uploaded set, validated (422 naming the line) before anything is stored."""
    data = upload.file.read(settings.gate_max_set_bytes + 1)
    if len(data) > settings.gate_max_set_bytes:
        raise ProblemError(413, "too_large", f"regression set over {settings.gate_max_set_bytes} "
                           "bytes", field="regression_set")
    try:
        return data, parse_regression_set(data, max_cases=settings.gate_max_cases)
    except RegressionSetError as exc:
        raise Refusal("invalid", f"regression set {exc}") from None


def fits_context(parsed: RegressionSet, base_config: Mapping[str, Any],
                 settings: Settings) -> None:
    """Every case must fit the context a worker serves on the version's base model (the
    one capacity rule, `services.contracts.capacity`), or no worker could run the gate:
    422 naming the line. A text prompt counts as one token here (the registry has no
    tokenizer); the worker refuses a longer one when it runs the case."""
    context = serving_context(settings, base_config)
    for numbered in parsed.cases:
        case = numbered.case
        prompt = len(case.prompt_token_ids) if case.prompt_token_ids is not None else 1
        try:
            check_context(prompt, case.max_tokens, context)
        except OverCapacity as exc:
            raise Refusal("invalid", f"regression set line {numbered.line}: "
                                     f"{exc.message}") from None


def gate_spec(data: bytes, parsed: RegressionSet, blobs: Blobs, settings: Settings) -> GateSpec:
    """Store the set by digest (a blob the assigned worker fetches) and describe its run."""
    stored = blobs.put(data)
    assert stored == parsed.sha256
    return GateSpec(parsed.sha256, len(parsed.cases), uuid7().hex, settings.gate_timeout_s)


# --- views -------------------------------------------------------------------------------------


class OverrideView(BaseModel):
    at: datetime
    by: str
    reason: str


class GateView(BaseModel):
    adapter_id: str
    version: int
    gate_required: bool
    may_get_traffic: bool
    refusal: str | None = Field(None, description="Why it may get no traffic, naming the gate")
    gate_id: str | None = None
    status: str = Field("none", description="none | pending | passed | failed | expired")
    requested_at: datetime | None = None
    requested_by: str | None = None
    deadline: datetime | None = None
    worker_id: str | None = None
    baseline_version: int | None = None
    regression_set_sha256: str | None = None
    cases: int | None = None
    failures: list[str] = Field(default_factory=list)
    completed_at: datetime | None = None
    duration_ms: float | None = None
    base_model_digest: str | None = None
    adapter_sha256: str | None = None
    error: str | None = None
    results: list[GateCaseResult] = Field(default_factory=list)
    override: OverrideView | None = None
    event: EventRef | None = None


def gate_view(adapter: Adapter, number: int, version: AdapterVersion,
              event: EventRef | None = None) -> GateView:
    refusal = release_refusal(adapter, number, version)
    view = GateView(adapter_id=adapter.adapter_id, version=number,
                    gate_required=version.published.gate_required,
                    may_get_traffic=refusal is None, refusal=refusal, event=event)
    if version.override is not None:
        at, by, reason = version.override
        view.override = OverrideView(at=at, by=by, reason=reason)
    gate = version.gate
    if gate is None:
        return view
    request = gate.request
    view.gate_id, view.status = gate.gate_id, gate.status
    view.requested_at, view.requested_by, view.deadline = (gate.requested_at,
                                                            gate.requested_by, gate.deadline)
    view.worker_id, view.baseline_version = request.worker_id, request.baseline_version
    view.regression_set_sha256, view.cases = request.regression_set_sha256, request.cases
    view.failures = gate.failures
    found = gate.result
    if found is not None:
        at, result = found
        view.completed_at, view.duration_ms = at, result.duration_ms
        view.base_model_digest, view.adapter_sha256 = (result.base_model_digest,
                                                       result.adapter_sha256)
        view.error, view.results = result.error, list(result.cases)
    return view


class StepView(BaseModel):
    at: datetime
    action: str
    actor: str


class RolloutView(BaseModel):
    rollout_id: str
    alias: str
    tenant: TenantRef | None
    adapter_id: str
    canary_version: int
    baseline_version: int
    plan: RolloutPlan
    stage: int
    weight: int
    status: str
    status_reason: str
    started_at: datetime
    stage_started_at: datetime | None
    last_judgement: Judgement | None
    steps: list[StepView]
    split: list[SplitEntry]
    etag: int
    event: EventRef | None = None


def rollout_view(state: CatalogState, rollout: Rollout, event: EventRef | None = None
                 ) -> RolloutView:
    alias = state.aliases[rollout.alias]
    return RolloutView(
        rollout_id=rollout.rollout_id, alias=rollout.alias, tenant=rollout.tenant,
        adapter_id=rollout.adapter_id, canary_version=rollout.canary_version,
        baseline_version=rollout.baseline_version, plan=rollout.plan, stage=rollout.stage,
        weight=rollout.weight, status=rollout.status, status_reason=rollout.status_reason,
        started_at=rollout.started_at, stage_started_at=rollout.stage_started_at,
        last_judgement=rollout.last_judgement,
        steps=[StepView(at=at, action=action, actor=actor) for at, action, actor in rollout.steps],
        split=list(alias.split), etag=alias.seq, event=event)


# --- gates -------------------------------------------------------------------------------------


@router.post("/adapters/{adapter_id}/versions/{version}/gate", status_code=202,
             response_model=GateView, responses=ERRORS, tags=["adapters"])
def post_gate(adapter_id: AdapterIdPath, version: VersionPath, principal: Writer, node: Node,
              blobs: Blobs, response: Response, expected: ExpectedVersion,
              key: IdempotencyKey, trace: TraceId,
              regression_set: Annotated[UploadFile | None, File(
                  description="JSONL regression set; absent: re-run the stored one")] = None,
              reason: Annotated[str, Form(max_length=1024)] = "") -> GateView:
    """Gate a version that is not serving: a new regression set, or a re-run."""
    writable_adapter(node, principal, adapter_id)
    settings = node.settings
    if regression_set is not None:
        data, parsed = read_regression_set(regression_set, settings)
        with node.state_lock:
            base = node.state.version(adapter_id, version).published.base_model
            base_config = node.state.base_models[base].config
        fits_context(parsed, base_config, settings)
        spec = gate_spec(data, parsed, blobs, settings)
    else:
        with node.state_lock:
            gate = node.state.version(adapter_id, version).gate
        if gate is None:
            raise Refusal("invalid", f"{adapter_id}@{version} has no regression set to re-run; "
                                     "upload one as `regression_set`")
        spec = GateSpec(gate.request.regression_set_sha256, gate.request.cases, uuid7().hex,
                        settings.gate_timeout_s)
    committed = node.execute(
        "gate", lambda s: request_gate(s, adapter_id, version, spec, reason=reason,
                                       now=datetime.now(UTC), expected=expected,
                                       idempotency_key=key),
        actor=principal.actor, idempotency_key=key,
        expect=("QualityGateRequested", adapter_stream(adapter_id)), trace_id=trace,
        request_sha256=request_fingerprint("gate", adapter_id, version, expected, reason,
                                           spec.regression_set_sha256 if regression_set
                                           is not None else None))
    return _gate_answer(node, response, committed, adapter_id, version)


def _gate_answer(node: RegistryNode, response: Response, committed: Committed,
                 adapter_id: str, version: int) -> GateView:
    answer_headers(response, committed)
    with node.state_lock:
        adapter = node.state.adapter(adapter_id)
        return gate_view(adapter, version, adapter.versions[version],
                         event_ref(committed.envelope, committed.position))


@router.get("/adapters/{adapter_id}/versions/{version}/gate", response_model=GateView,
            responses=ERRORS, tags=["adapters"])
def get_gate(adapter_id: AdapterIdPath, version: VersionPath, principal: Reader,
             node: Node) -> GateView:
    """The version's gate: status, every case's outputs and verdicts, traffic eligibility."""
    with node.state_lock:
        adapter = node.state.adapter(adapter_id)
        visible(principal, adapter.tenant, "adapter", adapter_id)
        return gate_view(adapter, version, node.state.version(adapter_id, version))


class OverrideBody(BaseModel):
    reason: str = Field(min_length=1, max_length=1024)


@router.post("/adapters/{adapter_id}/versions/{version}/override", response_model=GateView,
             responses=ERRORS, tags=["adapters"])
def post_override(adapter_id: AdapterIdPath, version: VersionPath, body: OverrideBody,
                  principal: ReleaseOverrider, node: Node, response: Response,
                  expected: ExpectedVersion,
                  key: IdempotencyKey, trace: TraceId) -> GateView:
    """Admin only: let the version get traffic despite its gate or a canary rollback."""
    committed = node.execute(
        "override", lambda s: override_release(s, adapter_id, version, body.reason,
                                               expected=expected, idempotency_key=key),
        actor=principal.actor, idempotency_key=key,
        expect=("ReleaseOverridden", adapter_stream(adapter_id)), trace_id=trace,
        request_sha256=request_fingerprint("override", adapter_id, version, body, expected))
    return _gate_answer(node, response, committed, adapter_id, version)


# --- rollouts ----------------------------------------------------------------------------------


class RolloutBody(BaseModel):
    adapter_id: str = Field(pattern=ID_PATTERN)
    version: int = Field(ge=1, le=2**31, description="The canary")
    baseline_version: int | None = Field(None, ge=1, le=2**31,
                                         description="Default: the adapter's active version")
    stages: list[int] | None = None
    min_stage_s: float | None = Field(None, gt=0)
    window_s: float | None = Field(None, gt=0)
    max_error_ratio: float | None = Field(None, gt=0)
    error_rate_floor: float | None = Field(None, ge=0, le=1)
    min_requests: int | None = Field(None, ge=1)
    max_p95_ms: float | None = Field(None, gt=0)
    max_p95_ratio: float | None = Field(None, gt=0)
    reason: str = Field("", max_length=2048)


def plan_of(body: RolloutBody, settings: Settings) -> RolloutPlan:
    """The body's plan, settings filling what it leaves out; written whole into the event."""
    min_stage = body.min_stage_s or settings.canary_min_stage_s
    return RolloutPlan(
        stages=body.stages or settings.canary_stages, min_stage_s=min_stage,
        window_s=body.window_s or settings.canary_window_s or min_stage,
        max_error_ratio=body.max_error_ratio or settings.canary_max_error_ratio,
        error_rate_floor=settings.canary_error_rate_floor if body.error_rate_floor is None
        else body.error_rate_floor,
        min_requests=body.min_requests or settings.canary_min_requests,
        max_p95_ms=body.max_p95_ms or settings.canary_max_p95_ms,
        max_p95_ratio=body.max_p95_ratio or settings.canary_max_p95_ratio)


def _rollout_answer(node: RegistryNode, response: Response, committed: Committed,
                    alias: str) -> RolloutView:
    answer_headers(response, committed)
    with node.state_lock:
        rollout = node.state.rollouts[alias]
        return rollout_view(node.state, rollout, event_ref(committed.envelope,
                                                           committed.position))


@router.post("/aliases/{alias}/rollout", status_code=201, response_model=RolloutView,
             responses=ERRORS, tags=["aliases"])
def post_rollout(alias: AliasPath, body: RolloutBody, principal: Writer, node: Node,
                 response: Response, expected: ExpectedVersion, key: IdempotencyKey,
                 trace: TraceId) -> RolloutView:
    """Start a canary rollout: the canary at the first stage, the baseline the rest."""
    adapter = writable_adapter(node, principal, body.adapter_id)
    with node.state_lock:
        current = node.state.aliases.get(alias)
    if current is not None:
        alias_in_scope(principal, alias, current.tenant)
    plan = plan_of(body, node.settings)
    rollout_id = uuid7().hex
    committed = node.execute(
        "rollout_start", lambda s: start_rollout(
            s, alias, adapter.adapter_id, body.version, plan, rollout_id,
            baseline=body.baseline_version, reason=body.reason, expected=expected,
            idempotency_key=key),
        actor=principal.actor, idempotency_key=key,
        expect=("TrafficSplitChanged", alias_stream(alias)), trace_id=trace,
        request_sha256=request_fingerprint("rollout_start", alias, body, expected))
    return _rollout_answer(node, response, committed, alias)


@router.get("/aliases/{alias}/rollout", response_model=RolloutView, responses=ERRORS,
            tags=["aliases"])
def get_rollout(alias: AliasPath, principal: Reader, node: Node) -> RolloutView:
    with node.state_lock:
        rollout = node.state.rollouts.get(alias)
        if rollout is None:
            raise Refusal("not_found", no_rollout(alias))
        visible(principal, rollout.tenant, "alias", alias, answer=no_rollout(alias))
        return rollout_view(node.state, rollout)


class StepBody(BaseModel):
    rollout_id: str = Field(min_length=1, max_length=64)
    from_stage: int = Field(ge=0, description="The stage the step starts from (a stale "
                                              "controller's step is refused)")
    judgement: Judgement | None = None
    reason: str = Field("", max_length=2048)


def _drive(node: RegistryNode, principal: Principal, alias: str) -> None:
    """Who may step a rollout: a role with the route's permission (`Allowed`), and for a
    tenant-scoped one (the publisher) only its own tenant's: another tenant's rollout is
    answered as a missing one."""
    with node.state_lock:
        rollout = node.state.rollouts.get(alias)
    if rollout is None:
        raise Refusal("not_found", no_rollout(alias))
    visible(principal, rollout.tenant, "alias", alias, permission=Permission.STEP_ROLLOUT,
            answer=no_rollout(alias))


def _stepped(node: RegistryNode, principal: Principal, alias: str, command: str,
             decide: Any, response: Response, key: str | None, trace: str, body: StepBody,
             event_type: str = "TrafficSplitChanged") -> RolloutView:
    _drive(node, principal, alias)
    with node.state_lock:
        rollout = node.state.rollouts.get(alias)
        stream = adapter_stream(rollout.adapter_id) if rollout and event_type == \
            "AdapterVersionSwitched" else alias_stream(alias)
    committed = node.execute(command, decide, actor=principal.actor, idempotency_key=key,
                             expect=(event_type, stream), trace_id=trace,
                             request_sha256=request_fingerprint(command, alias, body))
    return _rollout_answer(node, response, committed, alias)


@router.post("/aliases/{alias}/rollout/advance", response_model=RolloutView, responses=ERRORS,
             tags=["aliases"])
def post_advance(alias: AliasPath, body: StepBody, principal: RolloutStepper, node: Node,
                 response: Response, key: IdempotencyKey, trace: TraceId) -> RolloutView:
    """Next stage (at the last: the canary becomes active), if the figures justify it."""
    if body.judgement is None:
        raise Refusal("invalid", "an advance needs the judgement (figures) it is based on")
    judgement = body.judgement
    with node.state_lock:
        rollout = node.state.rollouts.get(alias)
        final = rollout is not None and rollout.final_stage
    return _stepped(
        node, principal, alias, "rollout_advance",
        lambda s: advance_rollout(s, alias, body.rollout_id, body.from_stage, judgement,
                                  now=datetime.now(UTC), automatic=principal.role == "canary",
                                  idempotency_key=key),
        response, key, trace, body,
        "AdapterVersionSwitched" if final else "TrafficSplitChanged")


@router.post("/aliases/{alias}/rollout/rollback", response_model=RolloutView,
             responses=ERRORS, tags=["aliases"])
def post_rollback(alias: AliasPath, body: StepBody, principal: RolloutStepper, node: Node,
                  response: Response, key: IdempotencyKey, trace: TraceId) -> RolloutView:
    """All traffic back to the baseline; the canary is never served by the split again."""
    return _stepped(
        node, principal, alias, "rollout_rollback",
        lambda s: roll_back_rollout(s, alias, body.rollout_id, body.from_stage,
                                    reason=body.reason, judgement=body.judgement,
                                    now=datetime.now(UTC),
                                    automatic=principal.role == "canary",
                                    idempotency_key=key),
        response, key, trace, body)


@router.post("/aliases/{alias}/rollout/halt", response_model=RolloutView, responses=ERRORS,
             tags=["aliases"])
def post_halt(alias: AliasPath, body: StepBody, principal: RolloutStepper, node: Node,
              response: Response, key: IdempotencyKey, trace: TraceId) -> RolloutView:
    """Stop advancing; traffic stays until resumed or rolled back."""
    if not body.reason:
        raise Refusal("invalid", "a halt needs a reason")
    return _stepped(
        node, principal, alias, "rollout_halt",
        lambda s: halt_rollout(s, alias, body.rollout_id, body.from_stage, reason=body.reason,
                               automatic=principal.role == "canary", judgement=body.judgement,
                               idempotency_key=key),
        response, key, trace, body, "RolloutHalted")


@router.post("/aliases/{alias}/rollout/resume", response_model=RolloutView, responses=ERRORS,
             tags=["aliases"])
def post_resume(alias: AliasPath, body: StepBody, principal: Writer, node: Node,
                response: Response, key: IdempotencyKey, trace: TraceId) -> RolloutView:
    """A halted rollout continues; its stage clock starts again."""
    return _stepped(
        node, principal, alias, "rollout_resume",
        lambda s: resume_rollout(s, alias, body.rollout_id, body.from_stage, reason=body.reason,
                                 idempotency_key=key),
        response, key, trace, body, "RolloutResumed")
