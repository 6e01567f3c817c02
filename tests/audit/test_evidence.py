"""Tamper evidence through the CLI: verify names the edited row, proofs verify and then
fail after tampering, and a replay into an empty broker rebuilds the same projection."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from sqlalchemy import Engine, text

from services.audit.db import make_engine, upgrade
from services.audit.keys import Kek, KeyVault
from services.audit.projector import AuditProjector
from services.audit.sealing import unseal
from services.audit.tables import tenant_keys
from services.audit.verifier import verifier_key
from services.config import Settings
from services.contracts.events import LIVENESS_TOPIC
from tests.audit.conftest import KEK, SIGNING_KEY, cli, drain
from tests.audit.scenario import produce
from tests.conftest import drop_isolation, isolated_settings

pytestmark = pytest.mark.slow


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


def test_event_bytes_over_the_toast_threshold_stay_in_their_row(filled: Engine) -> None:
    """Revision 0008: a sealed trace (~2.5 KB) is one heap tuple, not a second in TOAST."""
    with filled.connect() as conn:
        largest = conn.execute(text("SELECT max(octet_length(canonical)) FROM events")).scalar()
        toasted = conn.execute(text(
            "SELECT pg_relation_size(reltoastrelid) FROM pg_class "
            "WHERE oid = 'events'::regclass")).scalar()
    assert largest > 2100  # past the TOAST threshold (~2 KB): 0004 stored these out of line
    assert toasted == 0


@pytest.mark.parametrize("edit", [
    "UPDATE events SET stream = stream || '-x' WHERE {row}",
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
                              "actor = convert_from(:c, 'UTF8')::jsonb ->> 'actor', "
                              "leaf_hash = sha256('\\x00'::bytea || :c) WHERE id = :id"),
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
    assert document["leaf_index"] == 4 and document["tree_size"] == 8
    assert document["checkpoint"].startswith(f"{audit_settings.audit_origin}/{row['topic']}/"
                                             f"{row['partition']}\n8\n")
    assert "public_key" not in out  # the key is named, never carried
    proof = tmp_path / "proof.json"
    proof.write_text(out)
    code, keys = cli(audit_settings, "public-key")
    assert code == 0
    vkeys = [f"--key={k}" for k in keys.split()]
    code, out = cli(audit_settings, "verify-proof", str(proof), *vkeys)
    assert code == 0, out
    assert out.startswith("OK:")

    tampered = dict(document, leaf=document["leaf"][:-4] + "AAA=")
    proof.write_text(json.dumps(tampered))
    code, out = cli(audit_settings, "verify-proof", str(proof), *vkeys)
    assert code == 1 and "inclusion path" in out

    wrong_key = tmp_path / "k.json"
    wrong_key.write_text(json.dumps(document))
    stranger = verifier_key(document["origin"], Ed25519PrivateKey.generate().public_key()
                            .public_bytes(Encoding.Raw, PublicFormat.Raw))
    code, out = cli(audit_settings, "verify-proof", str(wrong_key), f"--key={stranger}")
    assert code == 1 and "not signed by a trusted key" in out

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
    value = isolated_settings(kafka_bootstrap, database_url, audit_signing_key=SIGNING_KEY,
                              audit_kek=KEK, audit_checkpoint_every=8)
    assert value.database_url
    upgrade(value.database_url)
    yield value
    drop_isolation(value, database_url)


STATE_QUERIES = {
    # Events are compared opened: a personal field a purge erased is replayed as
    # "[erased]" (the data does not come back through the log), so its bytes, and the
    # hashes and roots over them, differ from the old store's exactly there.
    "events": 'SELECT event_id, "partition", chain_index, type, stream, seq, canonical '
              "FROM events",
    "checkpoints": 'SELECT "partition", tree_size FROM checkpoints',
    "chain_heads": 'SELECT "partition", size FROM chain_heads',
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
    vault = KeyVault(engine, Kek(bytes.fromhex(KEK)))
    out = {}
    with engine.connect() as conn:
        for name, query in STATE_QUERIES.items():
            rows = []
            for r in conn.execute(text(query)):
                row = dict(r._mapping)
                if "canonical" in row:
                    row["canonical"] = unseal(row["type"], row["event_id"],
                                              bytes(row["canonical"]), vault)
                rows.append(tuple(sorted((k, repr(v)) for k, v in row.items())))
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
    with filled.connect() as old, engine.begin() as new:  # the same data keys (and KEK):
        keys = [dict(r._mapping) for r in old.execute(text("SELECT * FROM tenant_keys"))]
        new.execute(tenant_keys.insert(), keys)  # sealing gives the same bytes again
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
