"""An int8 worker on real processes: a registry, Kafka, a worker PROCESS started with
LORAPLANE_WORKER_WEIGHTS=int8, the audit projector on PostgreSQL; gRPC all the way.

The worker serves the base and an adapter, and says what it computes with everywhere it
announces itself: its heartbeats, the registry's view of the base model, every request
trace and `served_by`. Merged mode over int8 weights stops the process at start, by name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from services.audit.db import upgrade
from services.audit.projector import AuditProjector
from tests.conftest import isolated_settings
from tests.registry.conftest import TENANT
from tests.worker.conftest import ServedModel
from tests.worker.harness import (
    BASE_NAME,
    REPO,
    Stack,
    alias,
    channel,
    fresh_adapter,
    generate,
    project_until,
    publish_files,
    running_stack,
    signature,
    switch,
)

pytestmark = pytest.mark.slow

ACME = signature(**{"org": "acme", "team": "search", "project": "prod"})


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, database_url: str, served_model: ServedModel,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings(kafka_bootstrap, database_url, audit_signing_key="23" * 32)
    assert settings.database_url
    upgrade(settings.database_url)
    with running_stack(settings, tmp_path_factory.mktemp("int8"), served_model.path,
                       database_url, worker_weights="int8") as running:
        yield running


def test_an_int8_worker_names_its_weights_in_heartbeats_registry_and_traces(
        stack: Stack, audit_db: tuple[AuditProjector, Engine]) -> None:
    beat = stack.tail.wait("WorkerHeartbeat", worker_id="w1")[-1]
    assert beat.payload.base_weights == "int8"
    assert beat.payload.base_model_digest == stack.base_digest  # the checkpoint's digest
    with stack.admin() as admin:
        view = admin.get(f"/v1/base-models/{BASE_NAME}")
        assert view.status_code == 200, view.text
        assert view.json()["workers"] == [{"worker_id": "w1", "base_weights": "int8"}]
        listed = admin.get("/v1/base-models").json()
        assert listed[0]["workers"] == [{"worker_id": "w1", "base_weights": "int8"}]
    with stack.publisher() as pub:
        publish_files(pub, "int8-support", fresh_adapter(31), "v1", TENANT)
        switch(pub, "int8-support", 1)
    with channel(stack.workers["w1"].address) as stub:
        for adapter, rid in ((None, "req-int8-base"), ("int8-support", "req-int8-lora")):
            deadline = time.monotonic() + 30
            while True:  # the worker folds the switch on its own schedule
                try:
                    tokens, final = generate(
                        stub, ACME, adapter=alias(adapter) if adapter else None,
                        ids=[5, 6, 7, 8], max_tokens=6, request_id=rid)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert len(tokens) == 6 and final.base_model_digest == stack.base_digest
    traces = stack.tail.wait("RequestServed", where=lambda e: any(
        r.request_id == "req-int8-lora" for r in e.payload.requests))
    assert all(r.base_weights == "int8" for e in traces for r in e.payload.requests)
    rows = project_until(audit_db, "SELECT request_id, adapter_id, base_weights FROM served_by "
                         "WHERE request_id LIKE 'req-int8-%' ORDER BY request_id", at_least=2)
    assert rows == [
        {"request_id": "req-int8-base", "adapter_id": None, "base_weights": "int8"},
        {"request_id": "req-int8-lora", "adapter_id": "int8-support", "base_weights": "int8"}]
    workers = project_until(audit_db, "SELECT base_weights FROM workers WHERE worker_id = 'w1' "
                            "AND last_heartbeat_at IS NOT NULL")
    assert workers == [{"base_weights": "int8"}]


@pytest.mark.parametrize(("values", "says"), [
    ({"worker_weights": "int8", "worker_merge": "bot"},
     "LORAPLANE_WORKER_MERGE needs dense base weights, not LORAPLANE_WORKER_WEIGHTS=int8"),
    ({"worker_weights": "int4"}, "worker_weights: Input should be 'dense' or 'int8'"),
])
def test_a_worker_refuses_merged_int8_or_an_unknown_format_at_start(
        served_model: ServedModel, values: dict[str, str], says: str) -> None:
    """Before loading anything: one line naming the setting, exit status 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}
    env["LORAPLANE_BASE_MODEL"] = str(served_model.path)
    env.update({f"LORAPLANE_{k.upper()}": v for k, v in values.items()})
    done = subprocess.run([sys.executable, "-m", "services.cli", "serve", "worker"], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stdout and "Traceback" not in done.stdout + done.stderr
