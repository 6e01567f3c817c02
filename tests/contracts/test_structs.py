"""Agreement of the two decoders of the event contracts.

`services.contracts.structs` (msgspec Structs generated from the models) must accept
exactly what the pydantic models accept, with the same values, and refuse what they
refuse, naming the same field. Documents are generated from the published schema files
in `schemas/events/` (not from either decoder), every event type; invalid ones are made
from valid ones by one mutation each: a wrong JSON type, a number out of range, a missing
required field, an extra field, a value outside an enum, a string breaking its pattern or
its length.
"""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from services.contracts import structs
from services.contracts.codec import (
    EventValidationError,
    _current_events,
    canonical_bytes,
    schema_for,
)
from services.contracts.codec import decode as decode_model
from services.contracts.events import PAYLOAD_TYPES
from tests.audit.scenario import mixed, story

EVENT_TYPES = sorted(PAYLOAD_TYPES)
Json = Any

# --- documents from the schema files --------------------------------------------------------

_ZONES = st.sampled_from([UTC, timezone(timedelta(hours=5, minutes=30)),
                          timezone(timedelta(hours=-8))])
_TIMES = st.datetimes(min_value=datetime(1970, 1, 2), max_value=datetime(2200, 1, 1),
                      timezones=_ZONES).map(lambda t: t.isoformat().replace("+00:00", "Z"))
_JSON: st.SearchStrategy[Json] = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=6)


def _resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def documents(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Json]:
    """Valid instances of the subset of JSON Schema the event schemas use."""
    schema = _resolve(schema, root)
    if "anyOf" in schema:
        return st.one_of([documents(s, root) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low = schema.get("minimum")
        if "exclusiveMinimum" in schema:
            low = schema["exclusiveMinimum"] + 1
        return st.integers(low, schema.get("maximum", (low or 0) + 10**6))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(low, schema.get("maximum", 1e9), allow_nan=False,
                         allow_infinity=False, exclude_min="exclusiveMinimum" in schema)
    if kind == "string":
        if schema.get("format") == "date-time":
            return _TIMES
        if schema.get("format") == "uuid":
            return st.uuids().map(str)
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True).filter(
                lambda s: schema.get("minLength", 0) <= len(s) <= schema.get("maxLength", 1e9))
        return st.text(min_size=schema.get("minLength", 0),
                       max_size=min(schema.get("maxLength", 12), 12))
    if kind == "array":
        return st.lists(documents(schema.get("items", {}), root),
                        min_size=schema.get("minItems", 0),
                        max_size=max(schema.get("minItems", 0), min(schema.get("maxItems", 3), 3)))
    if kind == "object":
        if "properties" not in schema:
            return st.dictionaries(st.text(max_size=6), _JSON, max_size=3)
        required = set(schema.get("required", ()))
        props = schema["properties"]
        return st.fixed_dictionaries(
            {k: documents(v, root) for k, v in props.items() if k in required},
            optional={k: documents(v, root) for k, v in props.items() if k not in required})
    raise AssertionError(f"schema construct not covered: {schema}")


def _event_documents(event_type: str) -> st.SearchStrategy[Json]:
    schema = schema_for(event_type)
    return documents(schema, schema)


# --- the two decoders ----------------------------------------------------------------------


def by_models(value: bytes) -> tuple[Any, str | None]:
    """(plain values, None) or (None, the error) from the pydantic fast path."""
    try:
        return structs.plain(_current_events().validate_json(value, strict=True)), None
    except ValidationError as exc:
        return None, str(exc)


def by_structs(value: bytes) -> tuple[Any, str | None]:
    """The same from the generated Structs alone (no fallback)."""
    try:
        return structs.plain(structs._decoder().decode(value)), None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return None, str(exc)


def _encode(document: Json) -> bytes:
    return json.dumps(document, ensure_ascii=False, allow_nan=False).encode()


COMMON = settings(max_examples=15, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                         HealthCheck.data_too_large])


@pytest.mark.parametrize("event_type", EVENT_TYPES)
@COMMON
@given(data=st.data())
def test_generated_documents_decode_alike(event_type: str, data: st.DataObject) -> None:
    document = data.draw(_event_documents(event_type))
    value = _encode(document)
    models, models_error = by_models(value)
    fast, fast_error = by_structs(value)
    assert (models_error is None) == (fast_error is None), (models_error, fast_error)
    assert models == fast
    # and the decoder the projector calls gives the same values either way
    if models_error is None:
        assert structs.plain(structs.decode(value)) == models


# --- invalid documents ------------------------------------------------------------------


def mutations(document: Json, schema: dict[str, Any], root: dict[str, Any],
              path: tuple[Any, ...] = ()) -> list[tuple[str, tuple[Any, ...], str, Any]]:
    """(kind, path, field name, new value or a marker) of one-field breakages."""
    schema = _resolve(schema, root)
    out: list[tuple[str, tuple[Any, ...], str, Any]] = []
    if "anyOf" in schema:
        branches = [_resolve(s, root) for s in schema["anyOf"]]
        if document is None:
            return out
        schema = next((b for b in branches if b.get("type") != "null"), branches[0])
    name = str(path[-1]) if path else ""
    kind = schema.get("type")
    wrong = {"string": 12345, "integer": "1", "number": "1.5", "boolean": 1, "array": {},
             "object": []}
    if kind in wrong and path:
        out.append(("wrong type", path, name, wrong[kind]))
    if kind == "integer" and isinstance(document, int):
        if "minimum" in schema:
            out.append(("below minimum", path, name, schema["minimum"] - 1))
        if "exclusiveMinimum" in schema:
            out.append(("at exclusive minimum", path, name, schema["exclusiveMinimum"]))
        if "maximum" in schema:
            out.append(("above maximum", path, name, schema["maximum"] + 1))
        # a float that is not integral (past 2**52 adding 0.5 rounds back to a whole number)
        fraction = float(document) + 0.5 if abs(document) < 2**52 else 0.5
        out.append(("a float for an integer", path, name, fraction))
        out.append(("a boolean for an integer", path, name, True))
    if kind == "number" and "maximum" in schema:
        out.append(("above maximum", path, name, schema["maximum"] * 2 + 1))
    if kind == "number" and "exclusiveMinimum" in schema:
        out.append(("at exclusive minimum", path, name, schema["exclusiveMinimum"]))
    if "enum" in schema or ("const" in schema and path and path[-1] != "type"):
        out.append(("bad enum", path, name, "not-a-member"))
    if kind == "string" and isinstance(document, str):
        if "pattern" in schema:
            out.append(("pattern and a trailing newline", path, name, document + "\n"))
            out.append(("pattern", path, name, "UPPER CASE"))
        if "maxLength" in schema:
            out.append(("too long", path, name, "a" * (schema["maxLength"] + 1)))
        if schema.get("minLength", 0) > 0:
            out.append(("too short", path, name, ""))
        if schema.get("format") == "date-time":
            out.append(("not a time", path, name, "yesterday"))
        if schema.get("format") == "uuid":
            out.append(("not a uuid", path, name, "not-a-uuid"))
    if kind == "array" and isinstance(document, list):
        if schema.get("minItems", 0) > 0:
            out.append(("too few items", path, name, []))
        for i, item in enumerate(document[:2]):
            out += mutations(item, schema.get("items", {}), root, (*path, i))
    if kind == "object" and isinstance(document, dict) and "properties" in schema:
        out.append(("extra field", (*path, "zz_unknown"), "zz_unknown", 1))
        for key in schema.get("required", ()):
            if key != "type":
                out.append(("missing", (*path, key), key, MISSING))
        for key, sub in schema["properties"].items():
            if key in document and key != "type":
                out += mutations(document[key], sub, root, (*path, key))
    return out


MISSING = object()


def _mutated(document: Json, path: tuple[Any, ...], value: Any) -> Json:
    out = copy.deepcopy(document)
    target = out
    for step in path[:-1]:
        target = target[step]
    if value is MISSING:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return out


@pytest.mark.parametrize("event_type", EVENT_TYPES)
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_invalid_documents_refused_alike(event_type: str, data: st.DataObject) -> None:
    document = data.draw(_event_documents(event_type))
    if by_models(_encode(document))[1] is not None:
        return  # the schema file allows what a model validator refuses (rollout stages)
    schema = schema_for(event_type)
    for kind, path, name, value in mutations(document, schema, schema):
        bad = _encode(_mutated(document, path, value))
        models, models_error = by_models(bad)
        fast, fast_error = by_structs(bad)
        where = f"{event_type} {kind} at {path}"
        if models_error is None:
            # Still valid for the models (another branch of a union allows it; or pydantic
            # reads `true` as the literal 1): the Structs may only be stricter, and what
            # they refuse the projector's decoder hands to the models.
            assert fast_error is not None or fast == models, where
            assert structs.plain(structs.decode(bad)) == models, where
            continue
        assert fast_error is not None, (where, models_error)
        assert name in fast_error, (where, fast_error)
        assert name in models_error, (where, models_error)  # type: ignore[operator]
        # what the projector dead-letters: the very error every other reader raises
        with pytest.raises(EventValidationError) as fast_exc:
            structs.decode(bad)
        with pytest.raises(EventValidationError) as model_exc:
            decode_model(bad)
        assert str(fast_exc.value) == str(model_exc.value)


# --- the records the platform writes ----------------------------------------------------


def test_the_platforms_events_decode_alike() -> None:
    events = [*story(), *mixed(600)]
    assert {e.type for e in events} >= {"RequestServed", "WorkerHeartbeat",
                                         "AdapterVersionPublished", "TenantPurgeRequested"}
    for envelope in events:
        value = canonical_bytes(envelope.to_json())
        fast = structs.decode(value)
        assert isinstance(fast, structs.EventStruct)  # the fast path, no model built
        assert structs.plain(fast) == structs.plain(decode_model(value))
        assert fast.type == envelope.type and not fast.is_barrier


@pytest.mark.parametrize("change", [
    # pydantic truncates a seventh fractional digit, msgspec would round: the models decide
    lambda v: v.replace(b'.000000Z"', b'.9999999Z"', 1),
    # pydantic reads `true` as the literal 1
    lambda v: v.replace(b'"schema_version":1', b'"schema_version":true', 1),
    # msgspec would take the first of two tags, pydantic takes the last
    lambda v: v.replace(b'{"actor"', b'{"type":"AdapterLoaded","actor"', 1),
    # a key spelled with an escape
    lambda v: v.replace(b'"type":', b'"typ\\u0065":', 1),
])
def test_what_only_the_models_read_takes_their_path(change: Any) -> None:
    envelope = next(e for e in mixed(200) if e.type == "RequestServed")
    document = envelope.to_json()
    document["occurred_at"] = "2026-01-01T00:00:00.000000Z"
    value = change(canonical_bytes(document))
    try:
        expected: Any = structs.plain(decode_model(value))
    except EventValidationError as exc:
        expected = str(exc)
    try:
        got: Any = structs.plain(structs.decode(value))
    except EventValidationError as exc:
        got = str(exc)
    assert got == expected


def test_two_tags_read_as_the_models_read_them() -> None:
    """AdapterDisabled and AdapterEnabled share a payload shape: with two `type` keys the
    record must be the type pydantic (and so every other reader) says."""
    envelope = next(e for e in story() if e.type == "AdapterDisabled")
    value = canonical_bytes(envelope.to_json()).replace(
        b'"type":"AdapterDisabled"', b'"type":"AdapterDisabled","type":"AdapterEnabled"')
    assert structs.decode(value).type == decode_model(value).type == "AdapterEnabled"


def test_an_unknown_constraint_is_refused_at_generation() -> None:
    from typing import Annotated

    from pydantic import BaseModel, ConfigDict, Field

    class Odd(BaseModel):
        model_config = ConfigDict(extra="forbid")
        n: Annotated[int, Field(multiple_of=3)]

    with pytest.raises(structs.UnsupportedConstraint, match="multiple_of"):
        structs.struct_of(Odd)

    class Lax(BaseModel):
        n: int

    with pytest.raises(structs.UnsupportedConstraint, match="extra"):
        structs.struct_of(Lax)


def test_a_pattern_value_is_checked_once_and_shared() -> None:
    envelope = next(e for e in mixed(200) if e.type == "RequestServed")
    value = canonical_bytes(envelope.to_json())
    first, second = structs.decode(value), structs.decode(value)
    org = first.tenant.org if first.tenant else first.payload.requests[0].tenant.org  # type: ignore[union-attr]
    again = second.tenant.org if second.tenant else second.payload.requests[0].tenant.org  # type: ignore[union-attr]
    assert org is again and isinstance(org, str)


def test_the_pattern_cache_is_bounded_and_refuses_what_the_pattern_refuses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slug = structs.pattern_str(structs.struct_pattern(r"^[a-z]{1,3}$"))
    monkeypatch.setattr(structs, "KNOWN_VALUES", 2)
    for value in ("a", "b", "c"):
        assert structs._dec_hook(slug, value) == value
    assert len(slug.known) <= 2
    for bad in ("abcd", "a\n", "A", 5, None, ["a"], {"a": 1}):
        with pytest.raises(ValueError):
            structs._dec_hook(slug, bad)


def _heartbeat(loaded: list[dict[str, Any]] | None, worker: str = "w1") -> bytes:
    document: dict[str, Any] = {
        "actor": worker, "event_id": "01a22de7-18a3-7328-b7e8-c7aa6fe90435",
        "occurred_at": "2026-11-29T19:20:49.672257Z",
        "payload": {"address": f"{worker}:8781", "base_model": "tiny-llama",
                    "base_model_digest": "a" * 64, "worker_id": worker},
        "schema_version": 1, "seq": 1, "stream": f"worker/{worker}", "tenant": None,
        "type": "WorkerHeartbeat"}
    if loaded is not None:
        document["payload"]["loaded"] = loaded
    return canonical_bytes(document)


def test_a_repeated_list_is_decoded_once_per_change_and_still_validated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's heartbeats repeat its list of held versions: equal bytes give the list
    decoded before (the same object), changed or broken bytes are decoded and checked
    again, and every result equals what the models read."""
    monkeypatch.setattr(structs, "_remembered", {})
    one = [{"adapter_id": "a1", "version": 1, "sha256": "b" * 64, "tier": "disk"}]
    two = [*one, {"adapter_id": "a2", "version": 3, "sha256": "c" * 64}]
    first, again = structs.decode(_heartbeat(one)), structs.decode(_heartbeat(one))
    assert again.payload.loaded is first.payload.loaded  # type: ignore[union-attr]
    changed = structs.decode(_heartbeat(two))
    assert [a.adapter_id for a in changed.payload.loaded] == ["a1", "a2"]  # type: ignore[union-attr]
    for value in (_heartbeat(one), _heartbeat(two), _heartbeat(None), _heartbeat([])):
        fast = structs.decode(value)
        assert isinstance(fast, structs.EventStruct)
        assert structs.plain(fast) == structs.plain(decode_model(value))
    broken = [{**one[0], "sha256": "not a digest"}]
    with pytest.raises(EventValidationError) as fast_exc:
        structs.decode(_heartbeat(broken))
    with pytest.raises(EventValidationError) as model_exc:
        decode_model(_heartbeat(broken))
    assert str(fast_exc.value) == str(model_exc.value)
    for bad in (b"null", b'{"a":1}', b"[1]"):  # not a list of versions: refused alike
        value = _heartbeat(one).replace(json.dumps(one, separators=(",", ":"),
                                                   sort_keys=True).encode(), bad)
        with pytest.raises(EventValidationError):
            structs.decode(value)
    monkeypatch.setattr(structs, "REMEMBERED_STREAMS", 2)
    for worker in ("w1", "w2", "w3"):
        structs.decode(_heartbeat(one, worker))
    assert len(structs._remembered) <= 2


def test_long_records_are_searched_for_long_fractions_as_short_ones_are() -> None:
    """`models_only` scans long records dot by dot: the same answer as the regex."""
    many = [{"adapter_id": f"a{i}", "version": i + 1, "sha256": f"{i:064x}"} for i in range(60)]
    long = _heartbeat(many)
    assert len(long) >= structs.SCAN_BY_DOTS
    pattern = structs._LONG_FRACTION
    for value in (long, long.replace(b'.672257Z"', b'.6722571Z"'), long.replace(b".", b"x"),
                  long.replace(b'"a59"', b'"1.1234567"'), long + b"1.", long + b".1234567",
                  *(canonical_bytes(e.to_json()) for e in mixed(300))):
        assert structs.models_only(value) == (pattern.search(value) is not None)


def _outcome(decode: Any, value: bytes) -> Any:
    try:
        return structs.plain(decode(value))
    except EventValidationError as exc:
        return f"refused: {exc}"


_ONE = [{"adapter_id": "a1", "version": 1, "sha256": "b" * 64, "tier": "disk"},
        {"adapter_id": "a2", "version": 3, "sha256": "c" * 64, "tier": "device"}]
_LIST = json.dumps(_ONE, separators=(",", ":"), sort_keys=True).encode()


@pytest.mark.parametrize("change", [
    lambda v: v,  # the same record again
    lambda v: v.replace(b'"seq":1', b'"seq":2'),  # the rest changed, validly
    lambda v: v.replace(b'"worker_id":"w1"', b'"free_slots":-1,"worker_id":"w1"'),
    lambda v: v.replace(b'"worker_id":"w1"', b'"extra":1,"worker_id":"w1"'),
    lambda v: v.replace(b'"seq":1', b'"seq":1,"extra":1'),
    lambda v: v.replace(_LIST, _LIST + b"]"),  # the list followed by a stray bracket
    lambda v: v.replace(_LIST, _LIST[:-1] + b',{}]'),  # the list extended
    lambda v: v.replace(_LIST, _LIST[:-1]),  # the list cut short
    lambda v: v[:-2],  # the record cut short
    lambda v: v.replace(b'"address":"w1:8781"', b'"address":"[[[]]]"'),  # the placeholder
    lambda v: v.replace(b'"worker/w1"', b'"worker/w2"'),  # another stream's record
    lambda v: v.replace(b'"worker_id":"w1"', b'"loaded":[],"worker_id":"w1"'),  # twice
    lambda v: v.replace(b'"address"', b'"loaded":[],"address"'),  # twice, the other way
    lambda v: v.replace(b'"actor"', b'"type":"AdapterLoaded","actor"'),  # two tags
    lambda v: v.replace(b'.672257Z"', b'.6722571Z"'),  # only the models read it
    lambda v: v.replace(b'"loaded":', b'"loaded" :'),  # spaced: not found, decoded whole
    lambda v: b" " + v + b" ",
])
def test_a_repeated_list_cut_out_before_parsing_reads_as_the_whole_record(
        change: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record whose list repeats its stream's last one is parsed with the list cut out
    (`_spliced`): whatever else it holds, it is accepted or refused exactly as decoding it
    whole accepts or refuses it, with the same values or the same reason, and as the
    models read it."""
    value = change(_heartbeat(_ONE))
    outcomes = []
    for splice in (True, False):
        monkeypatch.setattr(structs, "_remembered", {})
        structs.decode(_heartbeat(_ONE))  # the stream's last list
        structs.decode(_heartbeat(_ONE, "w2"))
        if not splice:
            monkeypatch.setattr(structs, "_spliced", lambda *_: None)
        outcomes.append(_outcome(structs.decode, value))
    assert outcomes[0] == outcomes[1] == _outcome(decode_model, value)


def test_a_repeated_list_is_not_scanned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The repeat of a stream's list is parsed without its list and shares the list
    decoded before; a changed list is parsed whole."""
    monkeypatch.setattr(structs, "_remembered", {})
    parsed: list[int] = []
    decoder = structs._deferring_decoder()

    class Counting:
        def decode(self, value: bytes) -> Any:
            parsed.append(len(value))
            return decoder.decode(value)

    monkeypatch.setattr(structs, "_deferring_decoder", Counting)
    many = [{"adapter_id": f"a{i}", "version": i + 1, "sha256": f"{i:064x}"} for i in range(60)]
    first = structs.decode(_heartbeat(many))
    again = structs.decode(_heartbeat(many))
    assert again.payload.loaded is first.payload.loaded  # type: ignore[union-attr]
    assert parsed[0] == len(_heartbeat(many)) and parsed[1] < 600
    structs.decode(_heartbeat(many[:-1]))
    assert parsed[2] == len(_heartbeat(many[:-1]))


@pytest.mark.parametrize("whole", [False, True])
def test_a_changed_list_decodes_only_its_new_items(whole: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed list is read item by item: the items the stream's last list held are
    taken as decoded then, only the others are decoded and validated, and every list
    reads as the models read it, a broken item refused with the same reason (`whole`:
    a list type with constraints of its own, decoded whole)."""
    monkeypatch.setattr(structs, "_remembered", {})
    if whole:
        monkeypatch.setattr(structs, "_item_decoder", lambda _: None)
    decoded: list[bytes] = []
    item_decoder = structs._item_decoder("WorkerHeartbeat")

    class Counting:
        def decode(self, value: bytes) -> Any:
            decoded.append(value)
            return item_decoder.decode(value)  # type: ignore[union-attr]

    if not whole:
        monkeypatch.setattr(structs, "_item_decoder", lambda _: Counting())
    many = [{"adapter_id": f"a{i}", "version": i + 1, "sha256": f"{i:064x}"} for i in range(8)]
    extra = {"adapter_id": "b1", "version": 2, "sha256": "d" * 64, "tier": "host"}
    lists = [many, [*many, extra], many[1:], [*many[1:], extra, extra], many[::-1], [], many,
             [*many, {**extra, "sha256": "not a digest"}], [*many, {**extra, "x": 1}],
             [*many, 5], [*many, None], many]
    for loaded in lists:
        value = _heartbeat(loaded)
        before = len(decoded)
        assert _outcome(structs.decode, value) == _outcome(decode_model, value)
        if not whole and loaded and loaded is not many:
            assert len(decoded) - before <= 2  # the new item (twice in one list), no other
