"""Personal fields are stored sealed: what the audit store hashes, stores and proves.

The append-only store must never hold a tenant's personal data in the clear, because
nothing in it can be changed without breaking the hash chain, so erasing by deletion is
impossible. Instead each personal field is stored as a *sealed token* encrypted under
the tenant's data key (`services.audit.keys`); a tenant purge destroys the key, after
which the tokens are unreadable (crypto-shredding) while the chain, the checkpoints and
every proof stay valid: they cover the stored bytes, tokens included.

What the chain hashes (the *stored form* of an event):
- an event with no personal field: the record value exactly as it was on the log;
- otherwise the same bytes with the JSON string of each personal field replaced by
  `"sealed:<key id>:<base64url ciphertext>"` (or by `"[erased]"` when the value is dated
  at or before a purge of its tenant that already destroyed the key). Only those string
  literals change; every other byte is the log's. (A record whose personal fields cannot
  be located one by one, e.g. written by a producer that omitted a defaulted field, is
  stored as the canonical JSON of the event with the defaults written out, then sealed
  the same way.)

Sealing is deterministic: AES-256-GCM-SIV (nonce-misuse resistant) with the nonce taken
from the event id and the field name and occurrence as associated data, so sealing the
same record again gives the same bytes. That is what lets `audit verify --against-kafka`
compare the store with the log record by record, and a re-projection after a crash
reproduce published checkpoints exactly.

Personal fields (`PERSONAL_FIELDS`): the end user of a traced request (`user_id`), and the
free text tenants write into the adapter log: version labels, owners and the reasons of
rollbacks, disables and enables. Identifiers the platform must keep naming things by
after a purge are not sealed: adapter ids, aliases, request and trace ids, actors.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCMSIV

from services.contracts.codec import canonical_bytes
from services.contracts.events import TenantRef
from services.contracts.structs import AnyEnvelope

SEALED_PREFIX = "sealed:"
ERASED = "[erased]"
"""Stored in place of a personal value whose key was destroyed before it was sealed, and
written by a replay in place of a token whose key is gone."""

PERSONAL_FIELDS: dict[str, tuple[str, ...]] = {
    "RequestServed": ("user_id",),
    "AdapterVersionPublished": ("label", "owner"),
    "AdapterRolledBack": ("reason",),
    "AdapterDisabled": ("reason",),
    "AdapterEnabled": ("reason",),
}
"""Event type → the payload fields sealed (in `RequestServed`, in each request)."""

_PATTERNS = {name: re.compile(rb'"' + name.encode() + rb'"\s*:\s*"((?:[^"\\]|\\.)*)"')
             for fields in PERSONAL_FIELDS.values() for name in fields}
_TOKEN = re.compile(rb'^sealed:([0-9a-f]{1,64}):([A-Za-z0-9_-]+)$')


class SealingError(ValueError):
    """A record whose personal fields cannot be located, or a token that does not open."""


@dataclass
class DataKey:
    """One generation of one tenant's data key."""

    key_id: str
    tenant: str
    aead: AESGCMSIV

    @functools.cached_property
    def prefix(self) -> str:
        return f"{SEALED_PREFIX}{self.key_id}:"

    @functools.cached_property
    def prefix_bytes(self) -> bytes:
        return self.prefix.encode()


KeyFor = Callable[[TenantRef, datetime], DataKey | None]
"""The key to seal a tenant's value dated `at` with; None: the tenant was purged after
that date (its key is destroyed), store ERASED."""


def _nonce(event_id: uuid.UUID) -> bytes:
    # GCM-SIV stays secure when a nonce repeats; the associated data below tells fields apart
    return event_id.bytes[4:]


@functools.cache
def _aad(field: str, occurrence: int) -> bytes:
    return f"loraplane-sealed/v1/{field}/{occurrence}".encode()


_USER_AADS = tuple(_aad("user_id", i) for i in range(64))
"""The associated data of the first user ids of a trace, looked up by index (hot path)."""


_URLSAFE = bytes.maketrans(b"+/", b"-_")


def seal_value(key: DataKey, event_id: uuid.UUID, field: str, occurrence: int,
               literal: bytes) -> str:
    """The token of one JSON string literal body (the bytes between its quotes)."""
    ciphertext = key.aead.encrypt(event_id.bytes[4:], literal, _aad(field, occurrence))
    b64 = binascii.b2a_base64(ciphertext, newline=False).translate(_URLSAFE).rstrip(b"=")
    return key.prefix + b64.decode()


def token_key_id(value: str | bytes) -> str | None:
    """The key id of a sealed token, or None when `value` is not one."""
    raw = value.encode() if isinstance(value, str) else value
    match = _TOKEN.match(raw)
    return match.group(1).decode() if match else None


def open_token(aead: AESGCMSIV, event_id: uuid.UUID, field: str, occurrence: int,
               token: bytes) -> bytes:
    """The JSON string literal body a token seals; raises SealingError."""
    match = _TOKEN.match(token)
    if match is None:
        raise SealingError("not a sealed token")
    b64 = match.group(2)
    try:
        ciphertext = base64.urlsafe_b64decode(b64 + b"=" * (-len(b64) % 4))
        return aead.decrypt(_nonce(event_id), ciphertext, _aad(field, occurrence))
    except (binascii.Error, InvalidTag) as exc:
        raise SealingError(f"sealed {field} #{occurrence} does not open with its key") from exc


def literal_text(literal: bytes) -> str:
    """The string a JSON string literal body denotes."""
    return json.loads(b'"' + literal + b'"') if b"\\" in literal else literal.decode()


@dataclass(frozen=True)
class PersonalValue:
    field: str
    occurrence: int
    tenant: TenantRef | None
    dated: datetime
    value: str


def personal_values(envelope: AnyEnvelope) -> list[PersonalValue]:
    """The event's personal values, in the order they occur in its canonical JSON."""
    fields = PERSONAL_FIELDS.get(envelope.type)
    if not fields:
        return []
    p: Any = envelope.payload
    if envelope.type == "RequestServed":
        return [PersonalValue("user_id", i, r.tenant, r.started_at, r.user_id)
                for i, r in enumerate(p.requests)]
    return [PersonalValue(f, 0, envelope.tenant, envelope.occurred_at, getattr(p, f))
            for f in fields]


@dataclass(frozen=True)
class Sealed:
    stored: bytes
    """The stored form: what is hashed, stored and proven."""
    values: dict[tuple[str, int], str]
    """(field, occurrence) → the value stored in its place (token, ERASED or as given)."""


def _stored_value(key_for: KeyFor, event_id: uuid.UUID, pv: PersonalValue,
                  literal: bytes) -> str | None:
    """What replaces the literal, or None to keep it."""
    if pv.tenant is None or pv.value in ("", ERASED):
        return None  # nothing personal, or no tenant to key it by (an operator's text)
    key = key_for(pv.tenant, pv.dated)
    if key is None:
        return ERASED
    return seal_value(key, event_id, pv.field, pv.occurrence, literal)


def sealable(envelope: AnyEnvelope, value: bytes
             ) -> tuple[bytes, list[PersonalValue], list[tuple[int, int]]]:
    """(the bytes tokens are written into, the personal values, the span of each value's
    literal body in them): the record itself, or, when its personal fields cannot be
    located one by one, its canonical JSON with the defaults written out."""
    wanted = personal_values(envelope)
    if not wanted:
        return value, [], []
    located = _locate(value, wanted)
    if located is None:
        value = canonical_bytes(_with_defaults(json.loads(value), envelope))
        located = _locate(value, wanted)
        if located is None:
            raise SealingError(f"{envelope.type} {envelope.event_id}: personal fields not found")
    return value, wanted, located


NO_VALUES: dict[tuple[str, int], str] = {}
_ERASED_BYTES = ERASED.encode()


def seal(envelope: AnyEnvelope, value: bytes, key_for: KeyFor) -> Sealed:
    """The stored form of one record (see the module doc)."""
    kind = envelope.type
    if kind not in PERSONAL_FIELDS:
        return Sealed(value, NO_VALUES)
    if kind == "RequestServed":  # most sealed records: one field, straight through
        done = _seal_requests(envelope, value, key_for)
        if done is not None:
            return done
    value, wanted, located = sealable(envelope, value)
    edits: list[tuple[int, int, bytes]] = []
    stored: dict[tuple[str, int], str] = {}
    for pv, (start, end) in zip(wanted, located, strict=True):
        replacement = _stored_value(key_for, envelope.event_id, pv, value[start:end])
        stored[(pv.field, pv.occurrence)] = pv.value if replacement is None else replacement
        if replacement is not None:
            edits.append((start, end, replacement.encode()))
    return Sealed(splice(value, edits), stored)


_USER_KEY = b'"user_id":"'
"""How canonical JSON writes the key of a request's user id, up to its value's quote."""


def _seal_requests(envelope: AnyEnvelope, value: bytes, key_for: KeyFor) -> Sealed | None:
    """`seal` for RequestServed, or None when its user ids are not one per request in the
    record's bytes (then the general path writes the defaults out).

    The projector's hottest code (most records are traces of several requests): the
    record is split at its user id keys in one pass (C), each piece then starts with one
    request's user id, which is checked against the decoded request and replaced by its
    token; the pieces are joined back with the same key. Anything else (another count of
    keys, an escaped quote, a value that is not plain text) is left to the general path
    (`sealable`, `_stored_value`), which makes the same edit by located spans."""
    requests = envelope.payload.requests  # type: ignore[attr-defined]
    pieces = value.split(_USER_KEY)
    if len(pieces) != len(requests) + 1:
        return None
    nonce = envelope.event_id.bytes[4:]
    stored: dict[tuple[str, int], str] = {}
    b2a = binascii.b2a_base64
    for i, request in enumerate(requests):
        piece = pieces[i + 1]
        end = piece.find(b'"')
        user = request.user_id
        if end < 0 or piece[end - 1] == 0x5C or piece[:end] != user.encode():
            return None  # (the general path looks the keys up again: the same ones)
        if not user or user == ERASED:
            stored[("user_id", i)] = user
            continue
        key = key_for(request.tenant, request.started_at)
        if key is None:
            token = _ERASED_BYTES
        else:
            aad = _USER_AADS[i] if i < len(_USER_AADS) else _aad("user_id", i)
            token = key.prefix_bytes + b2a(key.aead.encrypt(nonce, piece[:end], aad),
                                           newline=False).translate(_URLSAFE).rstrip(b"=")
        stored[("user_id", i)] = token.decode()
        pieces[i + 1] = token + piece[end:]
    return Sealed(_USER_KEY.join(pieces), stored)


def splice(data: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    """`data` with each (start, end) span replaced (spans do not overlap)."""
    if not edits:
        return data
    out, at = [], 0
    for start, end, replacement in sorted(edits):
        out += (data[at:start], replacement)
        at = end
    out.append(data[at:])
    return b"".join(out)


def _canonical_spans(value: bytes, needle: bytes) -> list[tuple[int, int]]:
    """Spans of the string values after `needle` (a key as canonical JSON writes it, no
    spaces): a plain byte search, many times faster than the regex on a 2 KB record. The
    caller checks each value against the decoded event, so a miss only costs the regex."""
    spans = []
    find = value.find
    at = find(needle)
    while at >= 0:
        start = at + len(needle)
        end = find(b'"', start)
        while end > 0 and value[end - 1] == 0x5C:  # a backslash: is the quote escaped?
            slashes = len(value[start:end]) - len(value[start:end].rstrip(b"\\"))
            if slashes % 2 == 0:
                break
            end = find(b'"', end + 1)
        if end < 0:
            return []
        spans.append((start, end))
        at = find(needle, end)
    return spans


def _locate(value: bytes, wanted: list[PersonalValue]) -> list[tuple[int, int]] | None:
    """(start, end) of each wanted value's literal body, in `wanted` order, or None when
    the occurrences in the bytes are not exactly the wanted values."""
    spans: list[tuple[int, int]] = []
    by_field: dict[str, list[tuple[int, int]]] = {}
    for pv in wanted:
        if pv.field not in by_field:
            by_field[pv.field] = (_canonical_spans(value, b'"' + pv.field.encode() + b'":"')
                                  or [m.span(1) for m in _PATTERNS[pv.field].finditer(value)])
    counts = {f: sum(1 for pv in wanted if pv.field == f) for f in by_field}
    if any(len(spans_) != counts[f] for f, spans_ in by_field.items()):
        return None
    for pv in wanted:
        start, end = by_field[pv.field][pv.occurrence]
        if literal_text(value[start:end]) != pv.value:
            return None
        spans.append((start, end))
    return spans


def _with_defaults(document: dict[str, Any], envelope: AnyEnvelope) -> dict[str, Any]:
    payload = document.get("payload") or {}
    if envelope.type == "RequestServed":
        for request in payload.get("requests") or ():
            request.setdefault("user_id", "")
    else:
        for name in PERSONAL_FIELDS[envelope.type]:
            payload.setdefault(name, "")
    return document


# --- reading sealed events back ----------------------------------------------------------

KeyById = Callable[[str], AESGCMSIV | None]
"""A key by id; None when it was destroyed."""


def unseal(event_type: str, event_id: uuid.UUID, stored: bytes, key_by_id: KeyById, *,
           erased: bytes = ERASED.encode()) -> bytes:
    """The stored form with every token opened (the log's bytes again), or replaced by
    `erased` where the key was destroyed. Raises SealingError on a token that does not
    open with a live key (tampered)."""
    fields = PERSONAL_FIELDS.get(event_type, ())
    edits: list[tuple[int, int, bytes]] = []
    for field in fields:
        for occurrence, match in enumerate(_PATTERNS[field].finditer(stored)):
            literal = match.group(1)
            key_id = token_key_id(literal)
            if key_id is None:
                continue
            aead = key_by_id(key_id)
            opened = (erased if aead is None
                      else open_token(aead, event_id, field, occurrence, literal))
            edits.append((*match.span(1), opened))
    return splice(stored, edits)


def personal_literals(event_type: str, data: bytes) -> list[tuple[str, int, bytes]]:
    """(field, occurrence, literal body) of every personal value in an event's bytes."""
    return [(field, i, m.group(1)) for field in PERSONAL_FIELDS.get(event_type, ())
            for i, m in enumerate(_PATTERNS[field].finditer(data))]


def masked(event_type: str, stored: bytes) -> bytes:
    """The stored form with every personal value replaced by one placeholder: equal for
    two forms of one event whatever was sealed, opened or erased in them."""
    for field in PERSONAL_FIELDS.get(event_type, ()):
        stored = _PATTERNS[field].sub(b'"' + field.encode() + b'":"*"', stored)
    return stored
