"""A small story projected through real Kafka and PostgreSQL, read back through the
current-state tables and the compliance views."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, text

from services.audit.projector import AuditProjector
from services.audit.verify import verify_store
from services.config import Settings
from tests.audit.conftest import cli, drain
from tests.audit.scenario import ACME, Log, digest, produce, recorded, story

pytestmark = pytest.mark.slow


def rows(engine: Engine, sql: str) -> list[dict]:
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(text(sql))]


@pytest.fixture
def projected(audit_settings: Settings, projector: AuditProjector, db_engine: Engine) -> Engine:
    events = story()
    produce(audit_settings, events)
    drain(projector, len(recorded(events)))
    return db_engine


def test_current_state_follows_the_story(projected: Engine) -> None:
    versions = {(r["adapter_id"], r["version"]): r for r in rows(
        projected, "SELECT * FROM adapter_versions")}
    assert {k: v["status"] for k, v in versions.items()} == {
        ("acme-support", 1): "inactive", ("acme-support", 2): "active",
        ("acme-support", 3): "disabled", ("globex-chat", 1): "disabled",
        ("globex-chat", 2): "active"}
    assert versions[("acme-support", 3)]["sha256"] == digest("acme-support", 3)
    adapters = {r["adapter_id"]: r for r in rows(projected, "SELECT * FROM adapters")}
    assert adapters["acme-support"]["active_version"] == 2
    assert adapters["acme-support"]["latest_version"] == 3
    assert rows(projected, "SELECT split FROM aliases") == [
        {"split": [{"adapter_id": "acme-support", "version": 2, "weight": 100}]}]
    assert len(rows(projected, "SELECT * FROM split_history WHERE alias = 'support'")) == 4
    held = {(r["worker_id"], r["adapter_id"], r["version"])
            for r in rows(projected, "SELECT * FROM worker_adapters")}
    assert held == {("w1", "acme-support", 2), ("w2", "globex-chat", 2)}
    assert {r["worker_id"] for r in rows(projected, "SELECT * FROM workers")} == {
        "w1", "w2", "w3"}
    acks = rows(projected, "SELECT type, count(*) AS n FROM worker_acks GROUP BY type")
    assert {r["type"]: r["n"] for r in acks} == {
        "AdapterLoaded": 3, "AdapterUnloaded": 1, "KVInvalidated": 1, "TenantPurged": 3}
    assert len(rows(projected, "SELECT * FROM request_traces")) == 5
    assert verify_store(projected).ok


def test_rollback_candidates(projected: Engine) -> None:
    got = {r["adapter_id"]: r for r in rows(projected, "SELECT * FROM rollback_candidates")}
    # acme: 1 -> 2 -> 3, rolled back to 2; 3 is disabled: the last stable before 2 is 1
    assert got["acme-support"]["active_version"] == 2
    assert got["acme-support"]["candidate_version"] == 1
    # globex: 1 -> 2, then 1 disabled: nothing to roll back to
    assert got["globex-chat"]["active_version"] == 2
    assert got["globex-chat"]["candidate_version"] is None


def test_purge_proofs(projected: Engine) -> None:
    got = {r["purge_id"]: r for r in rows(projected, "SELECT * FROM purge_proofs")}
    met = got["purge-met"]
    assert met["status"] == "met"
    assert met["workers_expected"] == ["w1", "w2"] and met["workers_acked"] == ["w1", "w2"]
    assert met["workers_done"] == ["w1", "w2"]
    assert met["kv_blocks_freed"] == 17 and met["adapters_unloaded"] == 1
    assert met["refcounts_zero"] is True
    missed = got["purge-missed"]
    assert missed["status"] == "missed"
    assert missed["workers_expected"] == ["w1", "w3"] and missed["workers_missing"] == ["w3"]
    pending = got["purge-pending"]
    assert pending["status"] == "pending" and pending["workers_missing"] == ["w2"]


def test_served_by_and_lineage(projected: Engine) -> None:
    served = {r["request_id"]: r for r in rows(projected, "SELECT * FROM served_by")}
    assert served["req-b-0"]["version"] == 3 and served["req-b-0"]["digest_matches"] is True
    assert served["req-b-0"]["served_while_disabled"] is False
    assert served["req-c-1"]["worker_id"] == "w2"
    lineage = {(r["adapter_id"], r["version"]): r for r in rows(
        projected, "SELECT * FROM adapter_lineage")}
    v3 = lineage[("acme-support", 3)]
    assert v3["rolled_back_by"] == "oncall@acme"
    assert v3["rollback_reason"] == "quality regression on eval set"
    assert v3["disabled_reason"] == "bad eval"
    assert [s["weight"] for s in v3["splits"]] == [10, 100, 0]
    assert [h["action"] for h in v3["history"]] == [
        "published", "split", "split", "activated", "rolled_back", "deactivated", "split",
        "disabled"]


def test_served_by_keeps_one_row_per_request_of_two_witnesses(
        audit_settings: Settings, projector: AuditProjector, db_engine: Engine) -> None:
    """A worker traces what it serves; a router traces what it saw cut mid-stream. Where
    both traced a request (the worker's trace was durable, its final message never got
    out), `served_by` shows the worker's row; where only the router could, the router's,
    with outcome `cut`. Both rows stay in `request_traces`, and the log still checks."""
    log = Log(datetime.now(UTC) - timedelta(minutes=5))
    log.publish("acme-support", 1, ACME, "ops@acme")
    log.switch("acme-support", None, 1, ACME, "ops@acme")
    log.tick()
    log.served("w1", "acme-support", 1, ACME, 3, "kept")
    log.tick()
    log.served("w1", "acme-support", 1, ACME, 3, "kept", router="router-a", first=1)
    log.served("w-gone", "acme-support", 1, ACME, 2, "cut", router="router-a")
    log.served("w-gone", "acme-support", 1, ACME, 1, "cut", router="router-b")
    produce(audit_settings, log.events)
    drain(projector, len(recorded(log.events)))

    served = rows(db_engine, "SELECT * FROM served_by ORDER BY request_id")
    assert [(r["request_id"], r["witness"], r["status"], r["worker_id"]) for r in served] == [
        ("cut-0", "router", "cut", "w-gone"), ("cut-1", "router", "cut", "w-gone"),
        ("kept-0", "worker", "ok", "w1"), ("kept-1", "worker", "ok", "w1"),
        ("kept-2", "worker", "ok", "w1")]
    assert {r["request_id"]: r["completion_tokens"] for r in served} == {
        "cut-0": 3, "cut-1": 4, "kept-0": 40, "kept-1": 41, "kept-2": 42}
    assert all(r["digest_matches"] for r in served)
    stored = rows(db_engine, "SELECT witness, count(*) AS n FROM request_traces GROUP BY 1")
    assert {r["witness"]: r["n"] for r in stored} == {"worker": 3, "router": 5}
    # a router's witness is not a sign of life of the worker it names
    assert {r["worker_id"] for r in rows(db_engine, "SELECT worker_id FROM workers")} == {"w1"}
    code, out = cli(audit_settings, "verify", "--against-kafka")
    assert code == 0, out
    assert "KAFKA OK" in out and "(0 discrepancies" in out
