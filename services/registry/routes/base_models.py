"""Base models: adapters are validated against a registered base model's config.json."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Response
from pydantic import BaseModel, Field

from services.catalog.state import base_model_stream
from services.contracts.events import ID_PATTERN, SHA256_PATTERN
from services.contracts.problems import ProblemError, problem_responses
from services.registry.deps import (
    BaseModelRegistrar,
    IdempotencyKey,
    Node,
    Reader,
    Replayed,
    TraceId,
    WriteDeadline,
    request_fingerprint,
)
from services.registry.domain import register_base_model
from services.registry.validation import BaseModelShape
from services.registry.views import (
    BaseModelView,
    answer_headers,
    base_model_registered_view,
    base_model_view,
)

router = APIRouter(prefix="/v1/base-models", tags=["base models"], dependencies=[Replayed])
ERRORS = problem_responses(401, 403, 404, 409, 422, 503)
NamePath = Annotated[str, Path(pattern=ID_PATTERN)]


class BaseModelBody(BaseModel):
    name: str = Field(pattern=ID_PATTERN)
    digest: str = Field(pattern=SHA256_PATTERN, description="sha256 of the base weights")
    config: dict[str, Any] = Field(description="The model's config.json")


@router.post("", status_code=201, response_model=BaseModelView, responses=ERRORS)
def register(body: BaseModelBody, principal: BaseModelRegistrar, node: Node, response: Response,
             key: IdempotencyKey, trace: TraceId, deadline: WriteDeadline) -> BaseModelView:
    """Register a base model (admin); its config must give the projection shapes."""
    try:
        BaseModelShape.from_config(body.config)
    except ValueError as exc:
        raise ProblemError(422, "invalid", f"config: {exc}", field="config") from exc
    committed = node.execute(
        "register_base_model",
        lambda s: register_base_model(s, body.name, body.digest, body.config, key),
        actor=principal.actor, idempotency_key=key,
        expect=("BaseModelRegistered", base_model_stream(body.name)), trace_id=trace,
        request_sha256=request_fingerprint("register_base_model", body), deadline=deadline)
    answer_headers(response, committed, etag=False)
    return base_model_registered_view(committed.envelope, committed.position)


@router.get("", response_model=list[BaseModelView], responses=ERRORS)
def list_base_models(principal: Reader, node: Node) -> list[BaseModelView]:
    with node.state_lock:
        now = datetime.now(UTC)
        return [base_model_view(m, node.state, now)
                for _, m in sorted(node.state.base_models.items())]


@router.get("/{name}", response_model=BaseModelView, responses=ERRORS)
def get_base_model(name: NamePath, principal: Reader, node: Node) -> BaseModelView:
    with node.state_lock:
        model = node.state.base_models.get(name)
        if model is None:
            raise ProblemError(404, "not_found", f"base model {name!r} is not registered")
        return base_model_view(model, node.state, datetime.now(UTC))
