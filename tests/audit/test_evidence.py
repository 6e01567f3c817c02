"""Tamper evidence through the CLI: verify names the edited row, proofs verify and then
fail after tampering, and a replay into an empty broker rebuilds the same projection."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from typer.testing import CliRunner

from services.audit.db import make_engine, upgrade
from services.audit.projector import AuditProjector
from services.cli import app
from services.config import Settings
from services.contracts.events import LIVENESS_TOPIC
from tests.audit.conftest import drain
from tests.audit.scenario import mixed, produce, recorded, story
from tests.conftest import drop_isolation, isolated_settings

pytestmark = pytest.mark.slow


def cli(settings: Settings, *args: str) -> tuple[int, str]:
    env = {f"LORAPLANE_{k.upper()}": str(getattr(settings, k)) for k in (
        "database_url", "kafka_bootstrap", "adapter_events_topic", "worker_events_topic",
        "liveness_topic", "dead_letter_topic", "state_dir", "audit_signing_key",
        "topic_partitions")}
    result = CliRunner().invoke(app, ["audit", *args], env=env)
    return result.exit_code, result.output


@pytest.fixture
def filled_events() -> list:
    return story() + list(mixed(300, seed=2))


@pytest.fixture
def filled(audit_settings: Settings, projector: AuditProjector, db_engine: Engine,
           filled_events: list) -> Engine:
    produce(audit_settings, filled_events)
    drain(projector, len(recorded(filled_events)))
    return db_engine


def one_row(engine: Engine, where: str = "chain_index = 5") -> dict:
    with engine.connect() as conn:
        return dict(conn.execute(text(
            f'SELECT topic, "partition", "offset", event_id, chain_index FROM events '
            f"WHERE {where} ORDER BY topic, \"partition\" LIMIT 1")).one()._mapping)


def sql(engine: Engine, statement: str) -> None:
    with engine.begin() as conn:
        conn.execute(text(statement))


def named(output: str, row: dict) -> bool:
    return (f"topic={row['topic']} partition={row['partition']} offset={row['offset']} "
            f"event_id={row['event_id']}") in output


def test_verify_passes_on_an_untouched_store(audit_settings: Settings, filled: Engine) -> None:
    code, out = cli(audit_settings, "verify")
    assert code == 0, out
    assert out.startswith("OK:") and "checkpoints" in out


@pytest.mark.parametrize("edit", [
    "UPDATE events SET payload = jsonb_set(payload, '{{actor_note}}', '\"x\"') WHERE {row}",
    "UPDATE events SET type = 'AdapterDisabled' WHERE {row}",
    "UPDATE events SET canonical = canonical || ' '::bytea WHERE {row}",
    "UPDATE events SET occurred_at = occurred_at + interval '1 second' WHERE {row}",
    "DELETE FROM events WHERE {row}",
])
def test_verify_names_the_row_changed_with_sql(audit_settings: Settings, filled: Engine,
                                               edit: str) -> None:
    row = one_row(filled)
    sql(filled, edit.format(row=f"event_id = '{row['event_id']}'"))
    code, out = cli(audit_settings, "verify")
    assert code == 1, out
    if edit.startswith("DELETE"):  # the first row after the hole is named
        after = one_row(filled, f"topic = '{row['topic']}' AND \"partition\" = "
                                f"{row['partition']} AND chain_index = 6")
        assert named(out, after), out
    else:
        assert named(out, row), out
    assert "FAILED" in out


def test_a_consistent_rewrite_is_caught_by_the_signed_checkpoint(
        audit_settings: Settings, filled: Engine) -> None:
    """Rewrite one event and recompute every later hash: only the checkpoint can tell."""
    row = one_row(filled, "chain_index = 3")
    with filled.begin() as conn:
        rows = conn.execute(text(
            'SELECT id, canonical, prev_hash FROM events WHERE topic = :t AND "partition" = :p '
            "ORDER BY chain_index"), {"t": row["topic"], "p": row["partition"]}).all()
        from services.audit.chain import link

        prev = bytes(rows[0].prev_hash)
        for r in rows:
            canonical = bytes(r.canonical)
            if r.id == rows[3].id:
                canonical = canonical.replace(b'"actor":"', b'"actor":"mallory-', 1)
            digest = link(prev, canonical)
            conn.execute(text("UPDATE events SET canonical = :c, prev_hash = :p, hash = :h, "
                              "actor = convert_from(:c, 'UTF8')::jsonb ->> 'actor' "
                              "WHERE id = :id"),
                         {"c": canonical, "p": prev, "h": digest, "id": r.id})
            prev = digest
    code, out = cli(audit_settings, "verify")
    assert code == 1, out
    assert "Merkle root" in out
    assert f"partition={row['partition']}" in out and "chain_index=0" in out


def test_inclusion_proof_verifies_and_fails_after_tampering(
        audit_settings: Settings, filled: Engine, tmp_path: Path) -> None:
    row = one_row(filled, "chain_index = 4")
    code, out = cli(audit_settings, "proof", str(row["event_id"]))
    assert code == 0, out
    document = json.loads(out)
    assert document["index"] == 4 and document["tree_size"] == 8
    proof = tmp_path / "proof.json"
    proof.write_text(out)
    code, public_key = cli(audit_settings, "public-key")
    assert code == 0
    code, out = cli(audit_settings, "verify-proof", str(proof), "--public-key",
                    public_key.strip())
    assert code == 0, out
    assert out.startswith("OK:")

    tampered = dict(document, leaf=document["leaf"][:-4] + "AAA=")
    tampered.pop("leaf_hash")
    proof.write_text(json.dumps(tampered))
    code, out = cli(audit_settings, "verify-proof", str(proof))
    assert code == 1 and "audit path" in out

    wrong_key = tmp_path / "k.json"
    wrong_key.write_text(json.dumps(document))
    code, out = cli(audit_settings, "verify-proof", str(wrong_key), "--public-key", "ab" * 32)
    assert code == 1 and "trusted" in out

    # once the stored row is edited, the server refuses to issue a proof for it
    sql(filled, f"UPDATE events SET canonical = canonical || ' '::bytea "
                f"WHERE event_id = '{row['event_id']}'")
    code, out = cli(audit_settings, "proof", str(row["event_id"]))
    assert code == 3 and "no longer match" in out


def test_proof_of_the_unsigned_tail_needs_a_checkpoint(
        audit_settings: Settings, filled: Engine) -> None:
    with filled.connect() as conn:
        tail = conn.execute(text(
            'SELECT e.event_id FROM events e JOIN chain_heads h USING (topic, "partition") '
            "WHERE e.chain_index >= (h.size / 8) * 8 LIMIT 1")).scalar_one()
    code, out = cli(audit_settings, "proof", str(tail))
    assert code == 3 and "audit checkpoint" in out
    code, out = cli(audit_settings, "checkpoint")
    assert code == 0 and "signed" in out
    code, out = cli(audit_settings, "proof", str(tail))
    assert code == 0, out
    code, out = cli(audit_settings, "verify")
    assert code == 0, out


@pytest.fixture
def fresh_site(kafka_bootstrap: str, database_url: str) -> Iterator[Settings]:
    """Empty topics and an empty schema: the broker and database after a disaster."""
    value = isolated_settings(kafka_bootstrap, database_url, audit_signing_key="11" * 32,
                              audit_checkpoint_every=8)
    assert value.database_url
    upgrade(value.database_url)
    yield value
    drop_isolation(value, database_url)


STATE_QUERIES = {
    "events": 'SELECT event_id, "partition", chain_index, type, stream, seq, payload, '
              "canonical, prev_hash, hash FROM events",
    # the signature also covers the topic name, which differs here (fresh topics on the
    # same broker); with the same names, as after a real disaster, it is identical too
    "checkpoints": 'SELECT "partition", tree_size, root, chain_head, public_key FROM checkpoints',
    "chain_heads": 'SELECT "partition", size, head_hash, frontier FROM chain_heads',
    "adapters": "SELECT * FROM adapters",
    "adapter_versions": "SELECT * FROM adapter_versions",
    "version_history": "SELECT event_id, adapter_id, version, action, at, actor, alias, "
                       "weight, reason FROM version_history",
    "aliases": "SELECT * FROM aliases",
    "workers": "SELECT * FROM workers",
    "worker_adapters": "SELECT * FROM worker_adapters",
    "worker_acks": "SELECT * FROM worker_acks",
    "purges": "SELECT * FROM purges",
    "request_traces": "SELECT event_id, ordinal, request_id, worker_id, adapter_id, version, "
                      "adapter_sha256, started_at FROM request_traces",
    "rollback_candidates": "SELECT * FROM rollback_candidates",
    "purge_proofs": "SELECT * FROM purge_proofs",
}


def snapshot(engine: Engine) -> dict[str, list]:
    out = {}
    with engine.connect() as conn:
        for name, query in STATE_QUERIES.items():
            rows = [tuple(sorted((k, repr(v)) for k, v in r._mapping.items()))
                    for r in conn.execute(text(query))]
            out[name] = sorted(rows)
    return out


def test_replay_into_an_empty_broker_rebuilds_an_identical_projection(
        audit_settings: Settings, filled: Engine, fresh_site: Settings,
        filled_events: list) -> None:
    before = snapshot(filled)
    # the old database is the source; the new site's empty topics are the target
    source = fresh_site.model_copy(update={"database_url": audit_settings.database_url})
    code, out = cli(source, "replay-to-kafka")
    assert code == 0, out
    assert f"replayed {len(before['events'])} events" in out
    code, out = cli(source, "replay-to-kafka")
    assert code == 1 and "not empty" in out  # a second replay is refused
    # leases and heartbeats are not part of the record: the workers send them again
    produce(fresh_site, [e for e in filled_events if type(e.payload).topic == LIVENESS_TOPIC])

    assert fresh_site.database_url
    engine = make_engine(fresh_site.database_url)
    rebuilt = AuditProjector(fresh_site, engine, name="audit")
    try:
        drain(rebuilt, len(before["events"]))
    finally:
        rebuilt.close()
    after = snapshot(engine)
    engine.dispose()
    for name in STATE_QUERIES:
        assert after[name] == before[name], name
    code, out = cli(fresh_site, "verify")
    assert code == 0 and out.startswith("OK:"), out
