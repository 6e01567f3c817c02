"""A second, faster decoder of the event contracts: msgspec Structs generated from the models.

Validating a record by building the pydantic models (`codec.decode`) costs about 100 µs
for a 2.3 KB request-trace record; a msgspec Struct decoder with the same constraints
checks and builds the same record in about a fifth of that. The audit projector reads
every record of every topic, so it decodes with this one (`decode`).

One contract, two decoders: the Structs are *generated* from the pydantic models in
`services.contracts.events` (the models the schema files come from), field by field:
types, required fields and defaults, strictness (msgspec never coerces), numeric bounds,
lengths, patterns, literals, nested models, `extra="forbid"`, frozen instances, and the
models' after-validators (run from `__post_init__`). Generation refuses any constraint it
does not know how to carry, so a new kind of constraint on a model cannot be dropped
silently. `tests/contracts/test_structs.py` pins the two decoders to each other: documents
generated from every schema file are accepted by both with equal values, and a corpus of
invalid ones is refused by both.

Every record the Structs refuse goes through `codec.decode`, which either accepts it (an
older schema version to upcast, a number or time format only pydantic reads) or raises the
same `EventValidationError`, with the same message, as every other reader: what is
dead-lettered and why does not depend on the decoder. Where the two could differ on what
they accept or the values they give, the Structs are the stricter (a pattern's final `$`:
Python's `re` matches before a final newline, pydantic's Rust regex does not, so the
generated patterns end in `\\Z`; `true` for the literal 1, which pydantic accepts), or
the record is left to pydantic (seven-digit fractions of a second, a repeated `type`
key: see `decode`).

The generated envelopes answer what the code reading events asks of one (`type`,
`event_id`, `tenant.org`, `payload.requests[i].user_id`, `is_barrier` …) but they are not
`Envelope` instances: readers that use them go by `type`, never by `isinstance`.
"""

from __future__ import annotations

import contextlib
import re
import types
import uuid
from datetime import datetime
from functools import cache
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

import annotated_types
import msgspec
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from services.contracts.codec import decode as decode_model
from services.contracts.events import PAYLOAD_TYPES, Envelope, typed_envelope


class EventStruct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                  gc=False, tag_field="type"):
    """Base of the generated envelopes; `type` is the tag (a class attribute)."""

    type: ClassVar[str]

    @property
    def is_barrier(self) -> bool:
        return self.type == "ReplayBarrier"


AnyEnvelope = Envelope | EventStruct
"""What `decode` returns: a generated Struct, or the model where only pydantic reads it."""

_STRUCT_OPTIONS: dict[str, Any] = {"frozen": True, "kw_only": True,
                                   "forbid_unknown_fields": True, "gc": False}
"""`gc=False`: a decoded event is a tree of frozen values that can hold no reference
cycle, so the cyclic collector need not track (and walk) the thousands per batch."""
_SCALARS = (str, int, float, bool, uuid.UUID, datetime)
_KNOWN_META = {
    annotated_types.Ge: "ge", annotated_types.Gt: "gt", annotated_types.Le: "le",
    annotated_types.Lt: "lt", annotated_types.MinLen: "min_length",
    annotated_types.MaxLen: "max_length",
}


class UnsupportedConstraint(TypeError):
    """A model carries a constraint the generator cannot reproduce in msgspec."""


def struct_pattern(pattern: str) -> str:
    """A pattern with pydantic's (Rust regex) meaning under Python's `re.search`: a final
    `$` becomes `\\Z`, which, like Rust's `$`, does not match before a trailing newline."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        return pattern[:-1] + r"\Z"
    return pattern


def _constraints(metadata: list[Any], where: str) -> dict[str, Any]:
    """msgspec.Meta keywords for pydantic/annotated-types metadata; refuses the unknown."""
    out: dict[str, Any] = {}
    for item in metadata:
        if isinstance(item, FieldInfo):
            out.update(_constraints(item.metadata, where))
            continue
        name = _KNOWN_META.get(type(item))
        if name is not None:
            out[name] = getattr(item, name)
            continue
        # StringConstraints and pydantic's general metadata (`Field(pattern=...)`)
        fields = {k: v for k, v in vars(item).items() if v is not None} \
            if hasattr(item, "__dict__") else None
        if fields is None:
            raise UnsupportedConstraint(f"{where}: {item!r}")
        for key, value in fields.items():
            if key == "pattern":
                out["pattern"] = struct_pattern(value)
            elif key in ("min_length", "max_length", "ge", "gt", "le", "lt"):
                out[key] = value
            elif key in ("strict",) and value is True:
                continue  # the fast decoder is strict throughout
            else:
                raise UnsupportedConstraint(f"{where}: {key}={value!r}")
    return out


class PatternStr(str):
    """A string field with a pattern. msgspec would run `re.search` on every value (most
    of its decoding time on a trace record: ~0.7 µs a value, a dozen values a request);
    instead `_dec_hook` checks each distinct value once and hands back one shared
    instance of this `str` subclass for it (what msgspec asks of a hook's result)."""

    pattern: ClassVar[re.Pattern[str]]
    min_length: ClassVar[int] = 0
    max_length: ClassVar[int | None] = None
    known: ClassVar[dict[str, PatternStr]]

    @classmethod
    def checked(cls, value: Any) -> PatternStr:
        if type(value) is not str or len(value) < cls.min_length or (
                cls.max_length is not None and len(value) > cls.max_length) \
                or cls.pattern.search(value) is None:
            raise ValueError(f"expected a string matching {cls.pattern.pattern!r}")
        if len(cls.known) >= KNOWN_VALUES:
            cls.known.clear()  # ids and digests repeat; a flood of new ones must not grow it
        instance = cls.known[value] = cls(value)
        return instance


KNOWN_VALUES = 50_000
"""Checked values remembered per pattern type."""


@cache
def pattern_str(pattern: str, min_length: int = 0, max_length: int | None = None
                ) -> type[PatternStr]:
    return type("PatternStr", (PatternStr,), {  # type: ignore[return-value]
        "pattern": re.compile(pattern), "min_length": min_length, "max_length": max_length,
        "known": {}})


def _dec_hook(tp: type[PatternStr], value: Any) -> PatternStr:
    try:
        known = tp.known.get(value)  # no KeyError: values seen once (trace ids) miss often
    except TypeError:  # not a string at all (an object, a list)
        known = None
    return known if known is not None else tp.checked(value)


def _annotated(tp: Any, metadata: list[Any], where: str) -> Any:
    meta = _constraints(metadata, where)
    if tp is str and "pattern" in meta:
        if set(meta) - {"pattern", "min_length", "max_length"}:
            raise UnsupportedConstraint(f"{where}: {meta}")
        return pattern_str(**meta)
    return Annotated[tp, msgspec.Meta(**meta)] if meta else tp


def struct_type(tp: Any, metadata: list[Any], where: str) -> Any:
    """The msgspec type of one pydantic field type with its constraints."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *inner = get_args(tp)
        return struct_type(base, [*inner, *metadata], where)
    if origin in (Union, types.UnionType):
        members = get_args(tp)
        if type(None) not in members:
            raise UnsupportedConstraint(f"{where}: a union other than Optional: {tp!r}")
        # pydantic applies a nullable field's constraints to its non-null member
        others = [struct_type(m, metadata, where) for m in members if m is not type(None)]
        return Union[(*others, None)]
    if origin is list:
        (item,) = get_args(tp)
        return _annotated(list[struct_type(item, [], where + "[]")], metadata, where)  # type: ignore[misc]
    if origin is dict:
        key, value = get_args(tp)
        if key is not str:
            raise UnsupportedConstraint(f"{where}: dict keyed by {key!r}")
        return _annotated(dict[str, struct_type(value, [], where + "{}")], metadata, where)  # type: ignore[misc]
    if origin is Literal:
        if metadata:
            raise UnsupportedConstraint(f"{where}: constraints on a Literal")
        return tp
    if tp is Any:
        if metadata:
            raise UnsupportedConstraint(f"{where}: constraints on Any")
        return Any
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        if metadata:
            raise UnsupportedConstraint(f"{where}: constraints on a model")
        return struct_of(tp)
    if tp in _SCALARS:
        return _annotated(tp, metadata, where)
    raise UnsupportedConstraint(f"{where}: type {tp!r}")


def _fields(model: type[BaseModel], skip: tuple[str, ...] = ()) -> list[tuple[Any, ...]]:
    if model.model_config.get("extra") != "forbid":
        raise UnsupportedConstraint(f"{model.__name__}: extra fields must be forbidden")
    out: list[tuple[Any, ...]] = []
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        if info.alias not in (None, name) or info.validation_alias not in (None, name):
            raise UnsupportedConstraint(f"{model.__name__}.{name}: an alias")
        tp = struct_type(info.annotation, list(info.metadata), f"{model.__name__}.{name}")
        if info.default_factory is not None:
            out.append((name, tp, msgspec.field(default_factory=info.default_factory)))
        elif info.is_required():
            out.append((name, tp))
        else:
            out.append((name, tp, info.default))
    return out


def _after_validators(model: type[BaseModel], skip: tuple[str, ...] = ()) -> list[Any]:
    decorators = model.__pydantic_decorators__
    if decorators.field_validators or decorators.root_validators:
        raise UnsupportedConstraint(f"{model.__name__}: field validators")
    found = []
    for name, dec in decorators.model_validators.items():
        if name in skip:
            continue
        if dec.info.mode != "after":
            raise UnsupportedConstraint(f"{model.__name__}.{name}: a {dec.info.mode} validator")
        found.append(dec.func)
    return found


def _post_init(checks: list[Any]) -> dict[str, Any]:
    """`__post_init__` running the model's after-validators on the Struct (they read
    fields only); msgspec turns their ValueError into a validation error."""
    if not checks:
        return {}

    def __post_init__(self: Any) -> None:
        for check in checks:
            check(self)

    return {"__post_init__": __post_init__}


@cache
def struct_of(model: type[BaseModel]) -> type[msgspec.Struct]:
    """The Struct of a (nested) model: same fields, same constraints."""
    return msgspec.defstruct(model.__name__, _fields(model),
                             namespace=_post_init(_after_validators(model)),
                             **_STRUCT_OPTIONS)


@cache
def envelope_struct(event_type: str) -> type[EventStruct]:
    """The envelope of one event type, tagged by `type` (the model's `Literal`), its
    `payload` the Struct of the payload model. The model's check that `type` names the
    payload holds by construction."""
    model = typed_envelope(event_type)
    cls = msgspec.defstruct(
        f"{event_type}Struct", _fields(model, skip=("type",)), bases=(EventStruct,),
        tag=event_type, namespace={"type": event_type, **_post_init(
            _after_validators(model, skip=("_type_matches_payload",)))},
        **_STRUCT_OPTIONS)
    return cls  # type: ignore[return-value]


REPEATED_LISTS: dict[str, str] = {"WorkerHeartbeat": "loaded"}
"""Payload lists a stream sends again and again unchanged: a worker's heartbeat lists every
version it holds (hundreds once its disk tier fills, 20-30 KB of JSON) and the list
changes only when it loads or evicts one. A record repeating its stream's last list is
parsed with the list cut out (`_spliced`); otherwise the envelope is decoded with that
field left as raw bytes, and the list's new items are decoded and validated on their own
(`_repeated_list`)."""
REMEMBERED_STREAMS = 1_024
"""Streams whose last list is remembered (its bytes, its values and its items' bytes,
roughly 100 KB for a list of 200 versions); past that the memory starts again, and a
larger fleet decodes every list as before."""


def _payload_model(event_type: str) -> type[BaseModel]:
    return typed_envelope(event_type).model_fields["payload"].annotation  # type: ignore[return-value]


@cache
def _deferred_envelope(event_type: str) -> type[EventStruct]:
    """`envelope_struct(event_type)` with its repeated list kept as `msgspec.Raw` (None when
    absent) and no after-validators: `_complete` builds the real Struct from it, which runs
    them on the decoded values."""
    name = REPEATED_LISTS[event_type]
    payload = msgspec.defstruct(
        f"{event_type}DeferredPayload",
        [(name, msgspec.Raw, None) if f[0] == name else f
         for f in _fields(_payload_model(event_type))], **_STRUCT_OPTIONS)
    fields = [("payload", payload) if f[0] == "payload" else f
              for f in _fields(typed_envelope(event_type), skip=("type",))]
    return msgspec.defstruct(  # type: ignore[return-value]
        f"{event_type}Deferred", fields, bases=(EventStruct,), tag=event_type,
        namespace={"type": event_type}, **_STRUCT_OPTIONS)


@cache
def _list_decoder(event_type: str) -> msgspec.json.Decoder[Any]:
    """The repeated list's own type, constraints and all, as the real Struct declares it."""
    return msgspec.json.Decoder(_list_type(event_type), dec_hook=_dec_hook)


def _list_type(event_type: str) -> Any:
    name = REPEATED_LISTS[event_type]
    (tp,) = [f[1] for f in _fields(_payload_model(event_type)) if f[0] == name]
    return tp


@cache
def _item_decoder(event_type: str) -> msgspec.json.Decoder[Any] | None:
    """The decoder of one item of the repeated list, when the list is a plain `list[T]`
    (no constraint on the list itself, so a list is valid exactly when each item is);
    None otherwise (such a list is decoded whole)."""
    tp = _list_type(event_type)
    if get_origin(tp) is not list:
        return None
    (item,) = get_args(tp)
    return msgspec.json.Decoder(item, dec_hook=_dec_hook)


_RAW_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
"""A JSON array as the bytes of each item (a syntax check of the whole, no validation)."""

_remembered: dict[tuple[str, str], tuple[bytes, Any, dict[bytes, Any]]] = {}


def _repeated_list(event_type: str, stream: str, raw: msgspec.Raw) -> Any:
    """The decoded list: the one decoded last for this stream when the bytes are equal
    (decoding is a pure function of them), else decoded and remembered. The bytes are
    compared in full, so a changed list is never served from memory. Events that sent the
    same bytes share one list; readers never change it."""
    data = bytes(raw)
    key = (event_type, stream)
    last = _remembered.get(key)
    if last is not None and last[0] == data:
        return last[1]
    value, items = _decoded_list(event_type, data, last[2] if last is not None else {})
    if len(_remembered) >= REMEMBERED_STREAMS:
        _remembered.clear()
    _remembered[key] = (data, value, items)
    return value


def _decoded_list(event_type: str, data: bytes, known: dict[bytes, Any]
                  ) -> tuple[list[Any], dict[bytes, Any]]:
    """(the list `data` holds, its items by their bytes). A changed list mostly holds the
    items the stream's last list held (a worker loads or evicts one version at a time),
    so it is read as the bytes of each item, and only items whose bytes the last list did
    not hold are decoded and validated (on their own, with the item type: for a plain
    `list[T]` that is what decoding the list whole checks; decoding is a pure function of
    the bytes). `known` grows by the new items (bounded: past twice the list it starts
    again). A list with constraints of its own is decoded whole."""
    item_decoder = _item_decoder(event_type)
    if item_decoder is None:
        return _list_decoder(event_type).decode(data), {}
    pieces = list(map(bytes, _RAW_ITEMS.decode(data)))
    values = list(map(known.get, pieces))
    if None in values:
        decode_item = item_decoder.decode
        values = [decode_item(p) if v is None else v for v, p in zip(values, pieces,
                                                                      strict=True)]
        if len(known) > 2 * len(pieces) + 64:  # items long gone: start again
            known = {}
        known.update(zip(pieces, values, strict=True))  # the stream's own memory
    return values, known


PLACEHOLDER = b"[[[]]]"
"""What `_spliced` puts where a record repeats its stream's last list: a complete JSON
value (so the rest parses as it would around the list) that canonical records never hold,
and that begins and ends with a bracket (so no seven-digit fraction can span it)."""


_PLACEHOLDER_RAW = msgspec.Raw(PLACEHOLDER)


@cache
def _spliced_markers(event_type: str) -> tuple[bytes, bytes]:
    return f'"{REPEATED_LISTS[event_type]}":'.encode(), b'"stream":"'


def _spliced(event_type: str, value: bytes) -> EventStruct | None:
    """The record decoded without scanning its repeated list, when that list's bytes are
    exactly the ones its stream sent last; None where that cannot be shown (the caller
    then decodes the record whole). Raises what decoding the rest raises.

    msgspec scans every byte of the list even into a `Raw` (~2 ns a byte, a 28 KB list
    ~56 µs), so comparing the bytes after parsing still pays for the scan. Here the list is
    found, compared and cut out before parsing: the record's bytes after the first
    `"loaded":` are compared (one memcmp) with the list remembered for the stream the
    record names, and on a match that list is replaced by `PLACEHOLDER` and the rest is
    parsed by the same deferring decoder. It is the same parse: the bytes before the list
    are the same bytes, so the parser reaches the list's offset in the same state; the
    remembered list is a complete JSON value (it was parsed as one), as is the
    placeholder, so both are consumed whole and the bytes after them parse alike. That
    the offset is the list's value (not a string's content, another key's value or an
    unrelated `"loaded":`) is checked after parsing: the decoded field must be the
    placeholder, and the placeholder must occur once in the parsed bytes (a `Raw` is a
    slice of its input, so that slice is the one at the offset). The stream named is only
    a guess of which list to compare; a wrong guess just compares another list's bytes."""
    key_marker, stream_marker = _spliced_markers(event_type)
    at = value.find(key_marker)
    named = value.rfind(stream_marker)
    if at < 0 or named < 0:
        return None
    at += len(key_marker)
    named += len(stream_marker)
    end = value.find(b'"', named)
    stream = value[named:end].decode("utf-8", "replace")
    last = _remembered.get((event_type, stream))
    if last is None or not value.startswith(last[0], at):
        return None
    spliced = value[:at] + PLACEHOLDER + value[at + len(last[0]):]
    if spliced.find(PLACEHOLDER) != at or spliced.find(PLACEHOLDER, at + 1) >= 0 \
            or models_only(spliced):
        return None
    deferred: EventStruct = _deferring_decoder().decode(spliced)
    if deferred.type != event_type or getattr(
            deferred.payload, REPEATED_LISTS[event_type]) != _PLACEHOLDER_RAW:
        return None
    return _complete(deferred, last[1])


def _complete(deferred: EventStruct, repeated: Any = None) -> EventStruct:
    """The real envelope Struct of a deferred one; raises `msgspec.ValidationError` (or an
    after-validator's ValueError) where decoding the record whole would have refused it.
    `repeated`: the list already decoded (`_spliced`), else it is decoded from the raw
    field."""
    event_type = deferred.type
    name, envelope_cls, payload_cls = _completed_types(event_type)
    values = msgspec.structs.asdict(deferred.payload)  # type: ignore[attr-defined]
    raw = values.pop(name)
    if repeated is not None:
        values[name] = repeated
    elif raw is not None:  # absent: the real Struct's default
        values[name] = _repeated_list(event_type, deferred.stream,  # type: ignore[attr-defined]
                                      raw)
    envelope = msgspec.structs.asdict(deferred)
    envelope["payload"] = payload_cls(**values)
    return envelope_cls(**envelope)  # type: ignore[no-any-return]


@cache
def _completed_types(event_type: str) -> tuple[str, type[EventStruct], type[msgspec.Struct]]:
    """(repeated field, real envelope Struct, real payload Struct) of a deferred type."""
    return (REPEATED_LISTS[event_type], envelope_struct(event_type),
            struct_of(_payload_model(event_type)))


@cache
def _decoder() -> msgspec.json.Decoder[Any]:
    """Every envelope Struct, whole."""
    union = Union[tuple(envelope_struct(t) for t in PAYLOAD_TYPES)]  # noqa: UP007
    return msgspec.json.Decoder(union, dec_hook=_dec_hook)


@cache
def _deferring_decoder() -> msgspec.json.Decoder[Any]:
    """`_decoder` with the `REPEATED_LISTS` left raw (what `decode` reads with)."""
    union = Union[tuple(_deferred_envelope(t) if t in REPEATED_LISTS  # noqa: UP007
                        else envelope_struct(t) for t in PAYLOAD_TYPES)]
    return msgspec.json.Decoder(union, dec_hook=_dec_hook)


_LONG_FRACTION = re.compile(rb"\.[0-9]{7}")


SCAN_BY_DOTS = 4096
"""Records at least this long are searched dot by dot (`bytes.find`, a vectorised scan)
instead of by the regex, which steps through every byte: a large record is nearly all a
heartbeat's list of held versions, which has no dot (28 KB: ~0.3 µs against ~10)."""


def models_only(value: bytes) -> bool:
    """Seconds with more than six fractional digits, which pydantic truncates to
    microseconds and msgspec rounds: only pydantic may read such a record (the search
    also hits other long decimals; a false hit costs time only)."""
    if len(value) < SCAN_BY_DOTS:
        return _LONG_FRACTION.search(value) is not None
    find, match = value.find, _LONG_FRACTION.match
    at = find(b".")
    while at >= 0:
        if match(value, at):
            return True
        at = find(b".", at + 1)
    return False


@cache
def _tag_suffix(event_type: str) -> bytes:
    return b'"type":"' + event_type.encode() + b'"}'


def decode(value: bytes | None) -> AnyEnvelope:
    """Parse and validate one record value; raises `codec.EventValidationError`.

    A current-version record the Structs accept comes back as a Struct; anything else is
    decoded by `codec.decode` (upcast, validated, its error naming the field), which
    returns the model or raises exactly what every other reader would.

    A record may hold `type` twice: msgspec takes the first as the tag, pydantic the
    last, and two types share a payload shape (AdapterDisabled, AdapterEnabled). So the
    Struct is kept only when the record ends with `"type":"<its tag>"}`: the tag pydantic
    reads is then the one msgspec read. Canonical JSON (sorted keys, what the platform's
    producers write) always ends so; other layouts take the pydantic path.
    """
    if value is None:
        return decode_model(value)
    for event_type in REPEATED_LISTS:
        if value.endswith(_tag_suffix(event_type)):
            with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError,
                                     ValueError, TypeError):
                spliced = _spliced(event_type, value)
                if spliced is not None:
                    return spliced
    if not models_only(value):
        try:
            envelope: EventStruct = _deferring_decoder().decode(value)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass
        else:
            if value.endswith(_tag_suffix(envelope.type)):
                if envelope.type not in REPEATED_LISTS:
                    return envelope
                with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError,
                                         ValueError, TypeError):
                    return _complete(envelope)
    return decode_model(value)


def plain(value: Any) -> Any:
    """A Struct (or model) as plain Python values, for comparing the two decoders."""
    if isinstance(value, msgspec.Struct):
        out = {f: plain(getattr(value, f)) for f in value.__struct_fields__}
        if isinstance(value, EventStruct):
            out["type"] = value.type
        return out
    if isinstance(value, BaseModel):
        return {f: plain(getattr(value, f)) for f in type(value).model_fields}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value

