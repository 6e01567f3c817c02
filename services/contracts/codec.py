"""Encoding and validation of events against the JSON Schema files in `schemas/events/`.

Nothing is produced or consumed without passing through here: `encode` refuses an event
that does not match its schema with an error naming the field, and `decode` upcasts old
schema versions before validating, so readers only ever see current-version events.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Union

import jsonschema_rs
import pydantic_core
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from services.contracts.events import PAYLOAD_TYPES, Envelope, typed_envelope

SCHEMAS_DIR = Path(os.environ.get("LORAPLANE_SCHEMAS_DIR") or Path(__file__).resolve().parents[2]
                   / "schemas")
EVENT_SCHEMAS_DIR = SCHEMAS_DIR / "events"

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
UPCASTERS: dict[tuple[str, int], Upcaster] = {}
"""(event type, old schema_version) → function returning the document at version + 1."""


class EventValidationError(ValueError):
    """An event that does not match its contract; `field` is a dotted path into the event."""

    def __init__(self, event_type: str, field: str, message: str) -> None:
        self.event_type = event_type
        self.field = field
        self.message = message
        super().__init__(f"{event_type} event invalid at {field or '<root>'}: {message}")


def register_upcaster(event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    def wrap(fn: Upcaster) -> Upcaster:
        UPCASTERS[(event_type, from_version)] = fn
        return fn

    return wrap


@cache
def schema_for(event_type: str) -> dict[str, Any]:
    return json.loads((EVENT_SCHEMAS_DIR / f"{event_type}.json").read_text())


@cache
def _validator(event_type: str) -> Any:
    return jsonschema_rs.validator_for(schema_for(event_type))


def canonical_bytes(document: Mapping[str, Any]) -> bytes:
    """Deterministic JSON (sorted keys, no spaces, UTF-8): what is hashed and what is sent."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _dotted(path: Any) -> str:
    return ".".join(str(p) for p in path)


def upcast(document: dict[str, Any]) -> dict[str, Any]:
    event_type = str(document.get("type"))
    cls = PAYLOAD_TYPES.get(event_type)
    if cls is None:
        raise EventValidationError(event_type, "type", f"unknown event type {event_type!r}")
    version = document.get("schema_version")
    if not isinstance(version, int) or version < 1:
        raise EventValidationError(event_type, "schema_version", "must be a positive integer")
    if version > cls.schema_version:
        raise EventValidationError(
            event_type, "schema_version",
            f"version {version} is newer than this reader understands ({cls.schema_version})")
    while version < cls.schema_version:
        step = UPCASTERS.get((event_type, version))
        if step is None:
            raise EventValidationError(event_type, "schema_version",
                                       f"no upcaster from version {version}")
        document = step(document)
        version += 1
        document["schema_version"] = version
    return document


def validate_document(document: Mapping[str, Any]) -> None:
    """Check one event document against its type's schema; the first error names the field."""
    event_type = str(document.get("type"))
    if event_type not in PAYLOAD_TYPES:
        raise EventValidationError(event_type, "type", f"unknown event type {event_type!r}")
    for error in _validator(event_type).iter_errors(dict(document)):
        field, message = _dotted(error.instance_path), error.message
        # An optional object fails as a whole ("anyOf"); the model knows the inner field.
        try:
            typed_envelope(event_type).model_validate(document)
        except ValidationError as exc:
            inner = _dotted(exc.errors()[0]["loc"])
            if inner.startswith(field) and inner != field:
                field, message = inner, exc.errors()[0]["msg"]
        raise EventValidationError(event_type, field, message)


def to_envelope(document: Mapping[str, Any]) -> Envelope:
    """Validate against the schema file, then build the typed model (both must agree)."""
    document = upcast(dict(document))
    validate_document(document)
    try:
        return typed_envelope(str(document.get("type"))).model_validate(document)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise EventValidationError(str(document.get("type")), _dotted(first["loc"]),
                                   first["msg"]) from exc


def encode(event: Envelope | Mapping[str, Any]) -> tuple[Envelope, bytes]:
    """Validate and serialise an event for the log; raises EventValidationError."""
    document = event.to_json() if isinstance(event, Envelope) else dict(event)
    envelope = to_envelope(document)
    return envelope, canonical_bytes(envelope.to_json())


@cache
def _current_events() -> TypeAdapter[Any]:
    """Every event type at its current version, as one union discriminated by `type`.

    The JSON parser interns only object keys (`cache_strings="keys"`): field names repeat
    in every record, values (ids, digests, times) hardly ever, so looking each value up in
    the string cache cost more than it saved (about a tenth of decoding a trace record).
    """
    union = Union[tuple(typed_envelope(t) for t in PAYLOAD_TYPES)]  # noqa: UP007
    return TypeAdapter(Annotated[union, Field(discriminator="type")],
                       config=ConfigDict(cache_strings="keys"))


def decode(value: bytes | None) -> Envelope:
    """Parse, upcast and validate one record value; raises EventValidationError.

    Fast path: a current-version event is parsed and validated in one pass by
    pydantic-core, strictly (no coercion), against the very models the schema files are
    generated from. Anything else (an old version to upcast, or an invalid record whose
    error must name the field) takes the full path through the schema file.
    """
    if value is None:
        raise EventValidationError("?", "", "empty record (tombstone)")
    try:
        envelope: Envelope = _current_events().validate_json(value, strict=True)
        return envelope
    except ValidationError:
        pass
    try:
        document = pydantic_core.from_json(value)  # the Rust parser: ~2x json.loads
    except ValueError as exc:
        raise EventValidationError("?", "", f"not JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise EventValidationError("?", "", "event must be a JSON object")
    return to_envelope(document)
