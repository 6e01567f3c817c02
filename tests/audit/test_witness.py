"""What a third party gets without database access: every checkpoint as a signed note
in a folder and over HTTP (with the projector's metrics), a cut tail caught against a
checkpoint kept outside the store, and consistency proofs between two checkpoints."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from confluent_kafka import Producer
from sqlalchemy import Engine, text

from services.audit import verifier
from services.audit.merkle import CompactRange
from services.audit.projector import AuditProjector
from services.audit.publication import HttpEndpoint, http_app
from services.config import Settings
from tests.audit.conftest import cli, count_events, drain
from tests.audit.scenario import mixed, produce, recorded

pytestmark = pytest.mark.slow


@pytest.fixture
def endpoint(projector: AuditProjector) -> Iterator[str]:
    server = HttpEndpoint("127.0.0.1", 0, http_app(projector.folder, projector.metrics.registry))
    yield f"http://127.0.0.1:{server.port}"
    server.close()


def _latest(engine: Engine) -> dict:
    with engine.connect() as conn:
        return dict(conn.execute(text(
            'SELECT topic, "partition", tree_size, note FROM checkpoints WHERE note IS NOT NULL '
            "ORDER BY tree_size DESC, topic, \"partition\" LIMIT 1")).one()._mapping)


def test_checkpoints_are_published_as_notes_in_a_folder_and_over_http(
        audit_settings: Settings, projector: AuditProjector, filled: Engine,
        endpoint: str) -> None:
    latest = _latest(filled)
    folder = audit_settings.checkpoint_root / latest["topic"] / str(latest["partition"])
    assert (folder / "latest").read_text() == latest["note"]
    assert (folder / "8").exists()
    with filled.connect() as conn:
        stored = conn.execute(text("SELECT count(*) FROM checkpoints")).scalar_one()
    assert stored == len(list(audit_settings.checkpoint_root.glob("*/*/[0-9]*")))

    index = httpx.get(f"{endpoint}/checkpoints").json()["logs"]
    assert {(log["topic"], log["partition"]) for log in index} >= {
        (latest["topic"], latest["partition"])}
    one = httpx.get(f"{endpoint}/checkpoints/{latest['topic']}/{latest['partition']}/latest")
    assert one.status_code == 200 and one.text == latest["note"]
    assert one.headers["content-type"].startswith("text/plain")
    first = httpx.get(f"{endpoint}/checkpoints/{latest['topic']}/{latest['partition']}/8")
    assert first.text == (folder / "8").read_text()
    assert httpx.get(f"{endpoint}/checkpoints/{latest['topic']}/99/8").status_code == 404
    assert httpx.get(f"{endpoint}/checkpoints/..%2F..%2Fetc/0/passwd").status_code == 404
    assert httpx.get(f"{endpoint}/etc/passwd").status_code == 404
    everything = httpx.get(f"{endpoint}/checkpoints/latest").json()
    origin = f"{audit_settings.audit_origin}/{latest['topic']}/{latest['partition']}"
    assert everything[origin] == latest["note"]

    # a witness needs only the note and the published key
    _, keys = cli(audit_settings, "public-key")
    trusted = [verifier.parse_verifier_key(k) for k in keys.split()]
    assert verifier.open_checkpoint(one.text, trusted).size == latest["tree_size"]

    # the folder is refilled from the database if it is lost
    shutil.rmtree(audit_settings.checkpoint_root)
    assert projector.publish_checkpoints() == stored


def test_metrics_report_events_batches_checkpoints_dead_letters_and_lag(
        audit_settings: Settings, projector: AuditProjector, filled: Engine,
        endpoint: str) -> None:
    producer = Producer({"bootstrap.servers": audit_settings.kafka_bootstrap})
    producer.produce(audit_settings.worker_events_topic, value=b"{not json", key=b"w9")
    producer.flush(10)
    projector.project_batch(timeout=1.0)
    projector.project_batch(timeout=0.2)
    body = httpx.get(f"{endpoint}/metrics").text
    stored = count_events(filled)

    def value(line_start: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                   if line.startswith(line_start))

    assert value("loraplane_audit_events_total{") == stored
    assert value("loraplane_audit_dead_letters_total{") == 1
    assert value("loraplane_audit_checkpoints_total{") > 0
    assert value("loraplane_audit_batch_events_count") >= 1
    assert value("loraplane_audit_batch_seconds_sum") > 0
    lag = [line for line in body.splitlines() if line.startswith("loraplane_audit_lag_records{")]
    assert len(lag) == len(audit_settings.topics) * audit_settings.topic_partitions
    assert value("loraplane_audit_lag_records{") == 0


def _cut_tail(engine: Engine, topic: str, partition: int, keep: int) -> None:
    """What an attacker with SQL access does to hide the last events: delete them, and
    make every table in the database agree (checkpoints and chain head included)."""
    with engine.begin() as conn:
        where = {"t": topic, "p": partition, "n": keep}
        conn.execute(text('DELETE FROM events WHERE topic = :t AND "partition" = :p '
                          "AND chain_index >= :n"), where)
        conn.execute(text('DELETE FROM checkpoints WHERE topic = :t AND "partition" = :p '
                          "AND tree_size > :n"), where)
        rows = conn.execute(text('SELECT leaf_hash, hash FROM events WHERE topic = :t AND '
                                 '"partition" = :p ORDER BY chain_index'), where).all()
        tree = CompactRange()
        for r in rows:
            tree.append(bytes(r.leaf_hash))
        conn.execute(text('UPDATE chain_heads SET size = :n, head_hash = :h, frontier = :f '
                          'WHERE topic = :t AND "partition" = :p'),
                     {**where, "h": bytes(rows[-1].hash), "f": tree.to_bytes()})


def test_a_cut_tail_is_caught_by_a_checkpoint_kept_outside_the_store(
        audit_settings: Settings, filled: Engine, tmp_path: Path) -> None:
    latest = _latest(filled)
    kept = tmp_path / "witnessed-checkpoint"
    kept.write_text(latest["note"])
    _cut_tail(filled, latest["topic"], latest["partition"], 8)

    code, out = cli(audit_settings, "verify")
    assert code == 0, out  # the database alone agrees with itself
    code, out = cli(audit_settings, "verify", "--checkpoint", str(kept))
    assert code == 1, out
    assert (f"signs {latest['tree_size']} events" in out and "only 8 rows are stored" in out
            and "removed from the end" in out)

    forged = tmp_path / "forged"
    forged.write_text(latest["note"].replace("\n\n", "\nextra\n\n", 1))
    code, out = cli(audit_settings, "verify", "--checkpoint", str(forged))
    assert code == 1 and "BAD CHECKPOINT" in out and "signature" in out


def test_consistency_proofs_between_checkpoints(
        audit_settings: Settings, projector: AuditProjector, filled: Engine,
        tmp_path: Path) -> None:
    latest = _latest(filled)
    folder = audit_settings.checkpoint_root / latest["topic"] / str(latest["partition"])
    old = tmp_path / "last-month"
    shutil.copy(folder / "8", old)
    more = list(mixed(120, seed=9))
    produce(audit_settings, more)
    drain(projector, count_events(filled) + len(recorded(more)))

    code, out = cli(audit_settings, "consistency", str(old), "-o", str(tmp_path / "c.json"))
    assert code == 0, out
    _, keys = cli(audit_settings, "public-key")
    script = tmp_path / "verifier.py"
    shutil.copy(verifier.__file__, script)
    done = subprocess.run([sys.executable, "-I", str(script), "consistency",
                           str(tmp_path / "c.json"), *(f"--key={k}" for k in keys.split())],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0 and "extends its checkpoint of size 8" in done.stdout, done.stdout
    code, out = cli(audit_settings, "verify-proof", str(tmp_path / "c.json"))
    assert code == 0 and out.startswith("OK:"), out

    # between two given notes, and from a note to itself
    code, out = cli(audit_settings, "consistency", str(old), str(folder / "latest"))
    assert code == 0, out
    code, out = cli(audit_settings, "consistency", str(old), str(old))
    assert code == 0 and '"consistency_path": []' in out

    # a history rewritten after the auditor's checkpoint has no consistency proof
    with filled.begin() as conn:
        conn.execute(text("UPDATE events SET leaf_hash = sha256('\\x00'::bytea || "
                          "canonical || ' '::bytea) WHERE topic = :t AND \"partition\" = :p "
                          "AND chain_index = 3"),
                     {"t": latest["topic"], "p": latest["partition"]})
    code, out = cli(audit_settings, "consistency", str(old))
    assert code == 3 and "rewritten" in out
