"""Aliases: traffic splits over adapter versions (canary 5 → 25 → 50 → 100)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response
from pydantic import BaseModel, Field

from services.catalog.state import Refusal, alias_stream, missing
from services.contracts.events import ID_PATTERN, SplitEntry
from services.contracts.problems import problem_responses
from services.registry.deps import (
    ExpectedVersion,
    IdempotencyKey,
    Node,
    Reader,
    Replayed,
    TraceId,
    WriteDeadline,
    Writer,
    alias_in_scope,
    request_fingerprint,
    visible,
)
from services.registry.domain import set_split
from services.registry.views import (
    AliasView,
    Page,
    alias_view,
    answer_headers,
    page_of,
    split_changed_view,
)

router = APIRouter(prefix="/v1/aliases", tags=["aliases"], dependencies=[Replayed])
ERRORS = problem_responses(401, 403, 404, 409, 412, 422, 503)
AliasPath = Annotated[str, Path(pattern=ID_PATTERN)]


class SplitBody(BaseModel):
    split: list[SplitEntry] = Field(min_length=1, max_length=64,
                                    description="Weights in percent, summing to 100")


@router.put("/{alias}", response_model=AliasView, responses=ERRORS)
def put_split(alias: AliasPath, body: SplitBody, principal: Writer, node: Node,
              response: Response, expected: ExpectedVersion, key: IdempotencyKey,
              trace: TraceId, deadline: WriteDeadline) -> AliasView:
    """Set the alias's traffic split (TrafficSplitChanged)."""
    with node.state_lock:
        current = node.state.aliases.get(alias)
    if current is not None:
        alias_in_scope(principal, alias, current.tenant)
    committed = node.execute(
        "split", lambda s: set_split(s, alias, body.split, expected, key,
                                     usable=principal.may_write_for),
        actor=principal.actor, idempotency_key=key,
        expect=("TrafficSplitChanged", alias_stream(alias)), trace_id=trace,
        request_sha256=request_fingerprint("split", alias, body, expected), deadline=deadline)
    answer_headers(response, committed)
    return split_changed_view(committed.envelope, committed.position)


@router.get("", response_model=Page[AliasView], responses=ERRORS)
def list_aliases(
    principal: Reader, node: Node,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=128)] = None,
) -> Page[AliasView]:
    with node.state_lock:
        aliases = sorted((a for a in node.state.aliases.values()
                          if principal.may_read_for(a.tenant)
                          and (cursor is None or a.alias > cursor)), key=lambda a: a.alias)
        return page_of(aliases, limit, alias_view, lambda a: a.alias)


@router.get("/{alias}", response_model=AliasView, responses=ERRORS)
def get_alias(alias: AliasPath, principal: Reader, node: Node,
              response: Response) -> AliasView:
    with node.state_lock:
        found = node.state.aliases.get(alias)
        if found is None:
            raise Refusal("not_found", missing("alias", alias))
        visible(principal, found.tenant, "alias", alias)
        view = alias_view(found)
    response.headers["ETag"] = f'"{view.etag}"'
    return view
