"""Interoperability with the reference implementation: the Go libraries behind the
go.sum checksum database (golang.org/x/mod/sumdb/note and sumdb/tlog) verify our signed
checkpoint notes, inclusion proofs and consistency proofs.

The small Go program in `goverify/` is built once per source version into the project
cache (the Go toolchain fetches golang.org/x/mod from its module proxy the first time).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from services.audit.projector import AuditProjector
from services.audit.proof import build_consistency, build_proof
from services.config import Settings
from tests.audit.conftest import cli, drain
from tests.audit.scenario import mixed, produce, recorded, story
from tests.conftest import CACHE

pytestmark = pytest.mark.slow

SOURCE = Path(__file__).with_name("goverify")


@pytest.fixture(scope="session")
def goverify() -> Path:
    go = shutil.which("go")
    if go is None:
        if os.environ.get("CI"):
            pytest.fail("the Go toolchain is not installed")
        pytest.skip("the Go toolchain is not installed")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(SOURCE.iterdir()))
                            ).hexdigest()[:16]
    binary = CACHE / "goverify" / digest / "goverify"
    if not binary.exists():
        binary.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "GOFLAGS": "-mod=readonly", "GOTOOLCHAIN": "local"}
        built = subprocess.run([go, "build", "-o", str(binary), "."], cwd=SOURCE, env=env,
                               capture_output=True, text=True, timeout=600, check=False)
        if built.returncode != 0:
            pytest.fail(f"building the Go verifier failed:\n{built.stderr}")
    return binary


def run(binary: Path, request: dict) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binary)], input=json.dumps(request), capture_output=True,
                          text=True, timeout=60, check=False)


def test_go_reference_libraries_verify_our_evidence(
        goverify: Path, audit_settings: Settings, projector: AuditProjector,
        db_engine: Engine) -> None:
    events = story() + list(mixed(60, seed=6))
    produce(audit_settings, events)
    drain(projector, len(recorded(events)))
    assert cli(audit_settings, "checkpoint")[0] == 0
    _, keys = cli(audit_settings, "public-key")
    with db_engine.connect() as conn:
        notes = [r.note for r in conn.execute(text(
            "SELECT note FROM checkpoints WHERE note IS NOT NULL"))]
        sample = [r.event_id for r in conn.execute(text(
            "SELECT event_id FROM events ORDER BY chain_index DESC, id LIMIT 12"))]
        first = conn.execute(text(
            'SELECT note FROM checkpoints WHERE tree_size = 8 AND (topic, "partition") = '
            '(SELECT topic, "partition" FROM checkpoints ORDER BY tree_size DESC LIMIT 1)')
        ).one()
    proofs = [build_proof(db_engine, event_id) for event_id in sample]
    consistency = build_consistency(db_engine, audit_settings.audit_origin, first.note)
    request = {
        "vkeys": keys.split(),
        "checkpoints": notes,
        "inclusion": [{"note": p["checkpoint"], "leaf": p["leaf"], "index": p["leaf_index"],
                       "path": p["inclusion_path"]} for p in proofs],
        "consistency": [{"old": consistency["old_checkpoint"],
                         "new": consistency["new_checkpoint"],
                         "path": consistency["consistency_path"]}],
    }
    assert consistency["new_size"] > 8
    done = run(goverify, request)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(": ok") == len(notes) + len(proofs) + 1

    # and the reference rejects what ours rejects
    bad_leaf = dict(request["inclusion"][0],
                    leaf=base64.b64encode(b"{}" + base64.b64decode(proofs[0]["leaf"])).decode())
    bad_note = notes[0].replace("\n\n", "\nextension\n\n", 1)
    refused = run(goverify, {"vkeys": keys.split(), "checkpoints": [bad_note],
                             "inclusion": [bad_leaf], "consistency": []})
    assert refused.returncode == 1
    assert "ok" not in refused.stdout and refused.stdout.count("\n") == 2, refused.stdout
