"""One error contract for every loraplane HTTP API: RFC 9457 problem details.

Every error answer is `application/problem+json`:

    {"type": "urn:loraplane:problem:not_found", "title": "Not Found", "status": 404,
     "detail": "adapter 'bot' does not exist", "instance": "/v1/adapters/bot",
     "code": "not_found"}

`code` is the stable, machine-readable name of the problem (the `type` URI carries the
same name); `detail` says what happened and what to do, for a person. Problems that
concern one input name it: `field` (a request field, e.g. `org` or `split[0].weight`),
`tensor` (a tensor of an uploaded adapter), and `errors` lists every field that failed
validation. Other members may be added; clients ignore those they do not know.

`install_problems(app)` makes a FastAPI app speak it: `ProblemError`, Starlette's
HTTPException, request validation (with messages a person can act on, not a regex) and
unexpected exceptions all answer a problem, and the OpenAPI document declares the
problem schema under `application/problem+json` for every error status of every
operation, validation errors included. The router's OpenAI-compatible API keeps
OpenAI's own error shape and does not use this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

PROBLEM_MEDIA_TYPE = "application/problem+json"
TYPE_PREFIX = "urn:loraplane:problem:"

STATUS_CODES: dict[int, str] = {
    400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
    405: "method_not_allowed", 406: "not_acceptable", 409: "conflict",
    412: "precondition", 413: "too_large", 415: "unsupported_media_type",
    422: "invalid_request", 429: "rate_limited", 500: "internal", 503: "unavailable",
}
"""The code a bare HTTP status gets when nothing more specific is known."""


class FieldProblem(BaseModel):
    field: str = Field(description="The input, e.g. `org`, `split[0].weight`, "
                                   "`Idempotency-Key` header")
    message: str


class Problem(BaseModel):
    """RFC 9457 problem details, with a stable `code`."""

    type: str = Field(description=f"A URI naming the problem: `{TYPE_PREFIX}<code>`")
    title: str = Field(description="The HTTP status phrase")
    status: int
    detail: str = Field(description="What happened and what to do, for a person")
    instance: str | None = Field(None, description="The request path")
    code: str = Field(description="Stable machine-readable name of the problem")
    field: str | None = Field(None, description="The request field at fault, if one is")
    tensor: str | None = Field(None, description="The adapter tensor at fault, if one is")
    errors: list[FieldProblem] | None = Field(
        None, description="Every field that failed validation")

    model_config = {"extra": "allow"}


class ProblemError(Exception):
    """Raise anywhere in a request to answer this problem."""

    def __init__(self, status: int, code: str, detail: str, *,
                 headers: Mapping[str, str] | None = None, **extensions: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = dict(headers or {})
        self.extensions = {k: v for k, v in extensions.items() if v is not None}


def problem_response(status: int, code: str, detail: str, *, instance: str | None = None,
                     headers: Mapping[str, str] | None = None,
                     **extensions: Any) -> JSONResponse:
    body: dict[str, Any] = {
        "type": f"{TYPE_PREFIX}{code}", "title": _title(status), "status": status,
        "detail": detail, "code": code}
    if instance:
        body["instance"] = instance
    body.update({k: v for k, v in extensions.items() if v is not None})
    return JSONResponse(body, status_code=status, headers=dict(headers or {}),
                        media_type=PROBLEM_MEDIA_TYPE)


def problem_bytes(status: int, code: str, detail: str) -> bytes:
    """A problem as bytes, for ASGI middleware that answers before the app runs."""
    response = problem_response(status, code, detail)
    return bytes(response.body)


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for a route's error statuses (the schema is added by
    `install_problems`)."""
    return {status: {"description": _title(status)} for status in statuses}


def _title(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


# --- validation messages a person can act on ------------------------------------------------


def field_name(loc: Sequence[Any]) -> str:
    """`("body", "split", 0, "weight")` → `split[0].weight`; headers say so."""
    parts = list(loc)
    where = parts.pop(0) if parts and parts[0] in ("body", "query", "path", "header",
                                                    "cookie") else None
    name = ""
    for part in parts:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    if where == "header":
        return f"{name} header"
    return name or (where or "request")


def _message(error: Mapping[str, Any], pattern_words: Mapping[str, str]) -> str:
    kind = error.get("type", "")
    ctx = error.get("ctx") or {}
    if kind == "missing":
        return "is required"
    if kind == "string_pattern_mismatch":
        words = pattern_words.get(str(ctx.get("pattern")))
        return f"must be {words}" if words else "does not have the expected format"
    if kind == "json_invalid":
        return "is not valid JSON"
    message = str(error.get("msg", "is invalid"))
    for prefix, replacement in (("Input should be", "must be"), ("Value should be", "must be"),
                                ("String should have", "must have"),
                                ("List should have", "must have"), ("Value error,", "")):
        if message.startswith(prefix):
            return f"{replacement} {message.removeprefix(prefix).strip()}".strip()
    return message[:1].lower() + message[1:]


def validation_problem(errors: Sequence[Mapping[str, Any]],
                       pattern_words: Mapping[str, str]) -> tuple[str, list[FieldProblem]]:
    """The detail line and the per-field list of a request that failed validation."""
    fields = [FieldProblem(field=field_name(e.get("loc", ())),
                           message=_message(e, pattern_words)) for e in errors]
    if not fields:
        return "the request is invalid", []
    lines = [f"{f.field}: {f.message}" for f in fields]
    detail = lines[0] if len(lines) == 1 else f"{len(lines)} problems: " + "; ".join(lines)
    return detail, fields


# --- wiring -------------------------------------------------------------------------------------


def install_problems(app: FastAPI, *, pattern_words: Mapping[str, str] | None = None) -> None:
    """Answer every error of `app` as a problem and declare it in the OpenAPI document."""
    words = dict(pattern_words or {})

    @app.exception_handler(ProblemError)
    async def raised(request: Request, exc: ProblemError) -> JSONResponse:
        return problem_response(exc.status, exc.code, exc.detail, instance=request.url.path,
                                headers=exc.headers, **exc.extensions)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return problem_response(exc.status_code, STATUS_CODES.get(exc.status_code, "error"),
                                str(exc.detail), instance=request.url.path,
                                headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        detail, fields = validation_problem(exc.errors(), words)
        return problem_response(
            422, "invalid_request", detail, instance=request.url.path,
            field=fields[0].field if fields else None,
            errors=[f.model_dump() for f in fields])

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem_response(500, "internal", "an unexpected error; it was logged",
                                instance=request.url.path)

    app.openapi = _problem_openapi(app)  # type: ignore[method-assign]


def _problem_openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                             description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        components["FieldProblem"] = FieldProblem.model_json_schema()
        problem = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
        problem.pop("$defs", None)
        components["Problem"] = problem
        content = {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                has_input = bool(operation.get("parameters") or operation.get("requestBody"))
                if has_input and "422" not in responses:
                    responses["422"] = {}
                responses.setdefault("500", {})
                for status, response in responses.items():
                    if status.isdigit() and int(status) >= 400:
                        response["description"] = response.get("description") or \
                            _title(int(status))
                        if response["description"] in ("Validation Error",
                                                       "Unprocessable Entity"):
                            response["description"] = "Invalid request or input"
                        response["content"] = content
        app.openapi_schema = schema
        return schema

    return openapi
