"""A purge that erases: personal fields are stored sealed under the tenant's data key, the
purge destroys the key, and the evidence still verifies, against itself and against Kafka."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, text

from services.audit.projector import AuditProjector
from services.audit.sealing import ERASED, token_key_id
from services.config import Settings
from services.contracts.events import AdapterDisabled, Envelope, TenantPurgeRequested
from tests.audit.conftest import cli, drain
from tests.audit.scenario import ACME, GLOBEX, Log, produce

pytestmark = pytest.mark.slow

SECRETS = ("alice@customer.example", "owner-alice@acme", "mentions a customer",
           "bob@customer.example", "carol@customer.example", "dave@customer.example")


def history() -> tuple[list[Envelope], list[Envelope], dict[str, Envelope]]:
    """(events stored before the purge is read, the purge and what follows, by name)."""
    log = Log(datetime.now(UTC) - timedelta(minutes=10))
    named: dict[str, Envelope] = {}
    log.publish("acme-support", 1, ACME, "ops@acme", owner="owner-alice@acme")
    log.add(AdapterDisabled(adapter_id="acme-support", version=1, reason="mentions a customer"),
            "adapter/acme-support", "ops@acme", ACME)
    named["before"] = log.served("w1", "acme-support", 1, ACME, 1, "early",
                                 user="alice@customer.example")
    named["other"] = log.served("w1", None, None, GLOBEX, 1, "globex",
                                user="bob@customer.example")
    before = list(log.events)
    log.tick(5)
    named["purge"] = log.add(TenantPurgeRequested(purge_id="purge-acme", deadline_s=60),
                             "tenant/acme/ml/support", "privacy@acme", ACME)
    log.tick(5)
    named["after"] = log.served("w1", "acme-support", 1, ACME, 1, "later",
                                user="carol@customer.example")
    # a trace of a request that started before the purge, reported after it
    log.now -= timedelta(seconds=30)
    named["late"] = log.served("w2", "acme-support", 1, ACME, 1, "straggler",
                               user="dave@customer.example")
    return before, log.events[len(before):], named


def _rows(engine: Engine, sql: str, **params: object) -> list[dict]:
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(text(sql), params)]


def test_a_purge_destroys_the_key_and_the_evidence_still_holds(
        audit_settings: Settings, projector: AuditProjector, db_engine: Engine) -> None:
    before, after, named = history()
    produce(audit_settings, before)
    drain(projector, len(before))
    produce(audit_settings, after)
    drain(projector, len(before) + len(after))

    # nothing personal is stored in the clear, anywhere in the hash-chained store
    for secret in SECRETS:
        assert _rows(db_engine, "SELECT event_id FROM events WHERE position(:s IN "
                                "convert_from(canonical, 'UTF8')) > 0", s=secret) == [], secret
        assert _rows(db_engine, "SELECT 1 FROM request_traces WHERE user_id = :s", s=secret) == []

    keys = _rows(db_engine, "SELECT * FROM tenant_keys ORDER BY created_at, key_id")
    acme = [k for k in keys if k["tenant_org"] == "acme"]
    destroyed = [k for k in acme if k["destroyed_at"] is not None]
    assert len(destroyed) == 1 and destroyed[0]["wrapped_key"] is None
    assert destroyed[0]["destroyed_by_purge"] == "purge-acme"
    assert [k["wrapped_key"] is not None for k in acme if k not in destroyed] == [True]
    proof = _rows(db_engine, "SELECT * FROM purge_proofs WHERE purge_id = 'purge-acme'")[0]
    assert proof["keys_destroyed"] == [destroyed[0]["key_id"]]
    assert proof["keys_destroyed_at"] == destroyed[0]["destroyed_at"]

    traces = {r["request_id"]: r["user_id"] for r in _rows(
        db_engine, "SELECT request_id, user_id FROM request_traces")}
    assert token_key_id(traces["early-0"]) == destroyed[0]["key_id"]
    assert token_key_id(traces["later-0"]) not in (None, destroyed[0]["key_id"])
    assert traces["straggler-0"] == ERASED  # dated before the purge, stored after it
    version = _rows(db_engine, "SELECT label, owner, disabled_reason FROM adapter_versions")[0]
    assert version == {"label": ERASED, "owner": ERASED, "disabled_reason": ERASED}
    reasons = _rows(db_engine, "SELECT reason FROM version_history WHERE action = 'disabled'")
    assert reasons == [{"reason": ERASED}]

    def revealed(name: str) -> dict:
        code, out = cli(audit_settings, "reveal", str(named[name].event_id))
        assert code == 0, out
        return json.loads(out)["payload"]["requests"][0]

    assert revealed("before")["user_id"] == ERASED
    assert revealed("after")["user_id"] == "carol@customer.example"
    assert revealed("other")["user_id"] == "bob@customer.example"

    assert cli(audit_settings, "checkpoint")[0] == 0  # sign the shredded history too
    code, out = cli(audit_settings, "verify", "--against-kafka")
    assert code == 0, out
    assert "KAFKA OK" in out and "(0 discrepancies" in out and "2 checkpoints" in out
    # publish (label, owner), disable (reason), the early trace, the straggler: erased
    assert "4 with erased personal fields" in out
