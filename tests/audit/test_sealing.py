"""Sealing personal fields: what is stored, that it opens again to the log's bytes, that
it is deterministic, and that a destroyed key leaves `[erased]`."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCMSIV

import services.audit.sealing as sealing_module
from services.audit.keys import Kek, KeyRing
from services.audit.sealing import (
    ERASED,
    Sealed,
    SealingError,
    _seal_requests,
    masked,
    personal_literals,
    seal,
    token_key_id,
    unseal,
)
from services.contracts.codec import canonical_bytes, decode
from services.contracts.events import AdapterDisabled, Envelope
from tests.audit.scenario import ACME, GLOBEX, Log

NOW = datetime(2026, 6, 1, tzinfo=UTC)


def _record(envelope: Envelope) -> tuple[Envelope, bytes]:
    value = canonical_bytes(envelope.to_json())
    return decode(value), value


def _served(users: list[str], tenant: object = ACME, at: datetime = NOW
            ) -> tuple[Envelope, bytes]:
    log = Log(at)
    served = log.served("w1", "acme-support", 1, tenant, len(users), "r")  # type: ignore[arg-type]
    document = served.to_json()
    for request, user in zip(document["payload"]["requests"], users, strict=True):
        request["user_id"] = user
    value = canonical_bytes(document)
    return decode(value), value


def _ring() -> KeyRing:
    return KeyRing(Kek(bytes(32)))


def _opener(ring: KeyRing):  # type: ignore[no-untyped-def]
    keys = {k.key_id: k.aead for k in ring.live.values()}
    return lambda key_id: keys.get(key_id)


def test_user_ids_are_sealed_and_open_to_the_exact_log_bytes() -> None:
    envelope, value = _served(["alice@x.example", 'quote " and \\ backslash', "", "é"])
    ring = _ring()
    sealed = seal(envelope, value, ring.key_for)
    assert b"alice@x.example" not in sealed.stored and b"backslash" not in sealed.stored
    tokens = [sealed.values[("user_id", i)] for i in range(4)]
    assert all(token_key_id(t) for t in (tokens[0], tokens[1], tokens[3]))
    assert tokens[2] == ""  # nothing personal in an empty id
    assert unseal("RequestServed", envelope.event_id, sealed.stored, _opener(ring)) == value
    assert json.loads(sealed.stored)["payload"]["requests"][1]["user_id"] == tokens[1]
    again = seal(envelope, value, ring.key_for)
    assert again.stored == sealed.stored  # deterministic: the same record, the same bytes


def _by_general_path(envelope: Envelope, value: bytes, ring: KeyRing,
                     monkeypatch: pytest.MonkeyPatch) -> Sealed:
    with monkeypatch.context() as patched:
        patched.setattr(sealing_module, "_seal_requests", lambda *args: None)
        return seal(envelope, value, ring.key_for)


@pytest.mark.parametrize(("users", "split"), [
    (["alice", "bob", "carol", "dave"], True), (["", ERASED, "x", ""], True),
    (["é", "tab\tand\nnewline"], False), (['quote " inside', "plain"], False),
    (["back\\slash", "ends with \\"], False), (['"user_id":"fake"', "after"], False),
    (["", ""], True), (["a"], True)])
def test_the_split_seal_of_a_trace_is_the_general_paths_edit(
        users: list[str], split: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path makes the same bytes and values as the general path, and leaves to
    it what it cannot read as plain text (escapes, text that looks like a key)."""
    envelope, value = _served(users)
    ring = _ring()
    general = _by_general_path(envelope, value, ring, monkeypatch)
    fast = _seal_requests(envelope, value, ring.key_for)
    assert (fast is not None) == split
    assert seal(envelope, value, ring.key_for) == general
    if fast is not None:
        assert fast == general
    assert unseal("RequestServed", envelope.event_id, general.stored, _opener(ring)) == value


def test_the_split_seal_erases_what_a_purge_destroyed(monkeypatch: pytest.MonkeyPatch) -> None:
    envelope, value = _served(["alice", "bob"])
    ring = _ring()
    ring.destroy(ACME, "p1", NOW + timedelta(hours=1))
    fast = _seal_requests(envelope, value, ring.key_for)
    assert fast is not None and fast.values == {("user_id", 0): ERASED, ("user_id", 1): ERASED}
    assert fast == _by_general_path(envelope, value, ring, monkeypatch)


def test_each_field_and_event_is_bound_into_its_token() -> None:
    envelope, value = _served(["same", "same"])
    ring = _ring()
    sealed = seal(envelope, value, ring.key_for)
    first, second = sealed.values[("user_id", 0)], sealed.values[("user_id", 1)]
    assert first != second  # the occurrence is associated data
    swapped = sealed.stored.replace(first.encode(), b"@@").replace(second.encode(),
                                                                   first.encode())
    swapped = swapped.replace(b"@@", second.encode())
    with pytest.raises(SealingError):
        unseal("RequestServed", envelope.event_id, swapped, _opener(ring))


def test_a_destroyed_key_reads_as_erased_and_later_values_get_a_new_key() -> None:
    envelope, value = _served(["alice"])
    ring = _ring()
    sealed = seal(envelope, value, ring.key_for)
    opener = _opener(ring)
    ring.destroy(ACME, "p1", NOW + timedelta(hours=1))
    gone = unseal("RequestServed", envelope.event_id, sealed.stored,
                  lambda key_id: None if key_id == token_key_id(sealed.values[("user_id", 0)])
                  else opener(key_id))
    assert json.loads(gone)["payload"]["requests"][0]["user_id"] == ERASED
    assert seal(envelope, value, ring.key_for).values[("user_id", 0)] == ERASED  # dated before
    later, later_value = _served(["bob"], at=NOW + timedelta(hours=2))
    token = seal(later, later_value, ring.key_for).values[("user_id", 0)]
    assert token_key_id(token) not in (None, token_key_id(sealed.values[("user_id", 0)]))


def test_each_requests_tenant_keys_its_own_user_id() -> None:
    ring = _ring()
    acme, acme_value = _served(["a"], ACME)
    globex, globex_value = _served(["g"], GLOBEX)
    a = seal(acme, acme_value, ring.key_for).values[("user_id", 0)]
    g = seal(globex, globex_value, ring.key_for).values[("user_id", 0)]
    assert token_key_id(a) != token_key_id(g)


def test_free_text_of_the_adapter_log_is_sealed() -> None:
    log = Log(NOW)
    envelope, value = _record(log.publish("acme-support", 1, ACME, "ops", owner="o@acme"))
    ring = _ring()
    sealed = seal(envelope, value, ring.key_for)
    assert b"o@acme" not in sealed.stored and b"acme-support-v1" not in sealed.stored
    assert unseal(envelope.type, envelope.event_id, sealed.stored, _opener(ring)) == value
    disabled, disabled_value = _record(log.add(
        AdapterDisabled(adapter_id="acme-support", version=1, reason="r"),
        "adapter/acme-support", "ops", ACME))
    assert token_key_id(seal(disabled, disabled_value, ring.key_for).values[("reason", 0)])
    operator, operator_value = _record(log.add(  # no tenant: an operator's text, kept
        AdapterDisabled(adapter_id="acme-support", version=1, reason="ops note"),
        "adapter/acme-support", "ops", None))
    assert seal(operator, operator_value, ring.key_for).stored == operator_value


def test_a_record_not_written_canonically_is_sealed_in_canonical_form() -> None:
    _, value = _served(["alice", "bob"])
    document = json.loads(value)
    del document["payload"]["requests"][1]["user_id"]  # a producer that omits the default
    spaced = json.dumps(document, indent=1).encode()
    decoded = decode(spaced)
    ring = _ring()
    sealed = seal(decoded, spaced, ring.key_for)
    assert b"alice" not in sealed.stored
    opened = unseal("RequestServed", decoded.event_id, sealed.stored, _opener(ring))
    assert json.loads(opened)["payload"]["requests"][1]["user_id"] == ""
    assert masked("RequestServed", opened) == masked("RequestServed", sealed.stored)
    assert [f for f, _, _ in personal_literals("RequestServed", opened)] == ["user_id"] * 2


def test_tokens_are_aes_gcm_siv_under_the_data_key() -> None:
    envelope, value = _served(["alice"])
    ring = _ring()
    token = seal(envelope, value, ring.key_for).values[("user_id", 0)]
    key = next(iter(ring.live.values()))
    assert isinstance(key.aead, AESGCMSIV) and token.startswith(f"sealed:{key.key_id}:")
    created, destroyed = ring.take_changes()
    assert len(created) == 1 and destroyed == [] and created[0]["wrapped_key"] != b""
