"""Checkpoints on time: a partition with a few events, far fewer than the count interval,
is signed within `audit_checkpoint_every_s`, and an event in it is proven included by the
stand-alone verifier against that checkpoint; with the period off, nothing is signed
until the count is reached."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from services.audit.projector import AuditProjector
from services.config import Settings
from tests.audit.conftest import cli, drain
from tests.audit.scenario import produce, recorded, story
from tests.conftest import REPO
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


def signed_sizes(engine: Engine) -> dict[tuple[str, int], int]:
    with engine.connect() as conn:
        return {(r.topic, r.partition): r.size for r in conn.execute(text(
            'SELECT topic, "partition", max(tree_size) AS size FROM checkpoints '
            'GROUP BY topic, "partition"'))}


def heads(engine: Engine) -> dict[tuple[str, int], int]:
    with engine.connect() as conn:
        return {(r.topic, r.partition): r.size for r in conn.execute(text(
            'SELECT topic, "partition", size FROM chain_heads'))}


def test_a_quiet_log_is_signed_on_a_period(audit_settings: Settings, db_engine: Engine,
                                           tmp_path: Path) -> None:
    settings = audit_settings.model_copy(update={"audit_checkpoint_every": 1000,
                                                 "audit_checkpoint_every_s": 1.0,
                                                 "state_dir": tmp_path})
    projector = AuditProjector(settings, db_engine)
    try:
        events = story()[:5]
        produce(settings, events)
        drain(projector, len(recorded(events)))
        assert heads(db_engine) and not signed_sizes(db_engine)  # 5 events, not 1000

        def all_signed() -> bool:
            if signed_sizes(db_engine) == heads(db_engine):
                return True
            projector.project_batch(timeout=0.2)  # empty batches: only the period is due
            return False

        wait_for(all_signed, 20, interval_s=0, message="every head signed on time")
        # nothing new: nothing signed again
        count = len(signed_sizes(db_engine))
        for _ in range(8):
            projector.project_batch(timeout=0.2)
        with db_engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM checkpoints")).scalar() == count
    finally:
        projector.close()

    # the note is published, and one event is proven in it by the stand-alone verifier
    with db_engine.connect() as conn:
        event_id, topic, partition = conn.execute(text(
            'SELECT event_id, topic, "partition" FROM events ORDER BY topic, "partition", '
            "chain_index LIMIT 1")).one()
    size = signed_sizes(db_engine)[(topic, partition)]
    assert (tmp_path / "checkpoints" / topic / str(partition) / str(size)).exists()
    code, out = cli(settings, "proof", str(event_id))
    assert code == 0, out
    (tmp_path / "proof.json").write_text(out)
    assert json.loads(out)["leaf_index"] == 0
    code, key = cli(settings, "public-key")
    assert code == 0, key
    vkey = next(line for line in key.split() if f"/{topic}/{partition}+" in line)
    answer = subprocess.run([sys.executable, str(REPO / "services" / "audit" / "verifier.py"),
                             "inclusion", str(tmp_path / "proof.json"), "--key", vkey],
                            capture_output=True, text=True, timeout=60)
    assert answer.returncode == 0 and answer.stdout.startswith("OK"), answer


def test_with_the_period_off_only_the_count_signs(audit_settings: Settings,
                                                  db_engine: Engine) -> None:
    settings = audit_settings.model_copy(update={"audit_checkpoint_every": 1000,
                                                 "audit_checkpoint_every_s": 0.0})
    projector = AuditProjector(settings, db_engine)
    try:
        events = story()[:5]
        produce(settings, events)
        drain(projector, len(recorded(events)))
        until = time.monotonic() + 1.5
        while time.monotonic() < until:
            projector.project_batch(timeout=0.2)
        assert heads(db_engine) and not signed_sizes(db_engine)
    finally:
        projector.close()
