"""The event models and the JSON Schema files in schemas/ are one contract."""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime

import jsonschema_rs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.contracts import codec
from services.contracts.codec import EventValidationError, decode, encode, register_upcaster
from services.contracts.events import (
    PAYLOAD_TYPES,
    AdapterDisabled,
    AdapterVersionPublished,
    Envelope,
    TenantRef,
    typed_envelope,
    uuid7,
)
from services.contracts.schema_export import rendered

SHA = "ab" * 32


def test_checked_in_schemas_match_the_models() -> None:
    expected = rendered()
    on_disk = {p.name: p.read_text() for p in codec.EVENT_SCHEMAS_DIR.glob("*.json")}
    assert set(on_disk) == set(expected), "run python -m services.contracts.schema_export"
    for name, text in expected.items():
        assert on_disk[name] == text, f"{name} is stale: rerun services.contracts.schema_export"


def test_every_architecture_event_type_has_a_schema() -> None:
    required = {"AdapterVersionPublished", "TrafficSplitChanged", "AdapterVersionSwitched",
                "AdapterRolledBack", "AdapterDisabled", "AdapterEnabled", "TenantPurgeRequested",
                "RegistryLease", "WorkerHeartbeat", "AdapterLoaded", "AdapterLoadFailed",
                "AdapterUnloaded", "KVInvalidated", "TenantPurged", "RequestServed"}
    assert required <= set(PAYLOAD_TYPES)
    for name in PAYLOAD_TYPES:
        schema = json.loads((codec.EVENT_SCHEMAS_DIR / f"{name}.json").read_text())
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert schema["properties"]["type"]["const"] == name


def published(**changes: object) -> Envelope:
    payload = dict(adapter_id="acme-support", version=1, label="v1", base_model="llama-tiny",
                   base_model_digest=SHA, sha256=SHA, config_sha256=SHA, size_bytes=10, rank=8,
                   lora_alpha=16, target_modules=["q_proj"], dtype="float16", owner="alice")
    payload.update(changes)
    return Envelope.new(AdapterVersionPublished(**payload), stream="adapter/acme-support", seq=1,
                        actor="alice", tenant=TenantRef(org="acme", team="ml", project="bot"))


def test_encode_decode_round_trip_is_exact() -> None:
    event = published()
    envelope, value = encode(event)
    assert envelope == event
    assert decode(value) == event
    assert encode(decode(value))[1] == value, "canonical bytes are stable"


@pytest.mark.parametrize(("path", "bad", "field"), [
    (("payload", "rank"), 0, "payload.rank"),
    (("payload", "sha256"), "xyz", "payload.sha256"),
    (("tenant", "org"), "Not A Slug", "tenant.org"),
    (("seq",), 0, "seq"),
    (("payload", "unexpected"), 1, "payload.unexpected"),
])
def test_invalid_event_error_names_the_field(path: tuple[str, ...], bad: object,
                                             field: str) -> None:
    document = published().to_json()
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = bad
    with pytest.raises(EventValidationError) as err:
        encode(document)
    assert err.value.field == field
    assert field in str(err.value)


def test_unknown_type_and_future_version_are_refused() -> None:
    document = published().to_json()
    with pytest.raises(EventValidationError, match="unknown event type"):
        encode({**document, "type": "AdapterTeleported"})
    with pytest.raises(EventValidationError, match="newer than this reader"):
        decode(json.dumps({**document, "schema_version": 99}).encode())


def test_old_versions_are_upcast_before_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A breaking change bumps schema_version; readers upcast what is already on the log."""
    monkeypatch.setattr(AdapterDisabled, "schema_version", 2)
    monkeypatch.setattr(codec, "UPCASTERS", {})
    v2_schema = json.loads(json.dumps(codec.schema_for("AdapterDisabled")))
    v2_schema["properties"]["schema_version"]["const"] = 2
    monkeypatch.setattr(codec, "_validator", lambda _t: jsonschema_rs.validator_for(v2_schema))

    @register_upcaster("AdapterDisabled", 1)
    def _v1_to_v2(doc: dict) -> dict:
        doc["payload"]["reason"] = doc["payload"].pop("why")
        return doc

    v1 = {"event_id": str(uuid7()), "type": "AdapterDisabled", "schema_version": 1,
          "stream": "adapter/a", "seq": 1, "occurred_at": datetime.now(UTC).isoformat(),
          "actor": "x", "payload": {"adapter_id": "a", "version": 1, "why": "broken"}}
    typed_envelope.cache_clear()  # the typed models pin the current schema_version
    codec._current_events.cache_clear()
    try:
        event = codec.decode(json.dumps(v1).encode())
    finally:
        monkeypatch.undo()
        typed_envelope.cache_clear()
        codec._current_events.cache_clear()
    assert event.payload.reason == "broken"
    assert event.schema_version == 2


def test_uuid7_is_time_ordered_and_version_7() -> None:
    ids = [uuid7() for _ in range(5000)]
    assert all(i.version == 7 for i in ids)
    assert ids == sorted(ids, key=lambda u: u.int)
    assert len(set(ids)) == len(ids)


@settings(deadline=None)  # the first example builds the decoder for every event type once
@given(st.binary(max_size=300))
def test_decode_never_crashes_on_garbage(value: bytes) -> None:
    with contextlib.suppress(EventValidationError):
        decode(value)
