"""Release safety end to end on real services: Apache Kafka, the registry over HTTP, a
worker running gates through the real engine, request traces, the canary controller
(in-process and as a killed and restarted `loraplane serve canary`), and the audit
store's `release_decisions` view in PostgreSQL."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from services.audit.db import make_engine
from services.audit.projector import AuditProjector
from services.cli import app
from services.config import Settings
from services.release.canary_app import CanaryController
from services.worker.engine import Engine
from tests.registry.conftest import TENANT, RunningRegistry, registry_settings
from tests.release.harness import (
    CANARY_TOKEN,
    GateWorker,
    Traffic,
    WorkerStream,
    auth_setting,
    controller_process,
)
from tests.release.model import PROMPT, NumberModel, first_tokens
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

ALIAS = "bot-prod"
FAST_PLAN = {"stages": [5, 25, 50, 100], "min_stage_s": 1.5, "window_s": 1.5,
             "min_requests": 10, "max_p95_ms": 2000}


@pytest.fixture
def stack(settings: Settings, tmp_path: Path, engine: Engine,
          numbers: NumberModel) -> Iterator[Stack]:
    built = Stack(settings, tmp_path, engine, numbers)
    try:
        yield built
    finally:
        built.close()


class Stack:
    """The registry (release rule at its default: block), a gate worker, and helpers."""

    def __init__(self, settings: Settings, tmp_path: Path, engine: Engine,
                 numbers: NumberModel) -> None:
        base = registry_settings(settings, tmp_path / "blobs", release_ungated="block",
                                 auth_tokens=auth_setting(), stale_lease_threshold_s=4.0,
                                 gate_sweep_interval_s=0.3, canary_interval_s=0.25,
                                 canary_settle_s=0.3, canary_token=CANARY_TOKEN,
                                 canary_id="canary-test", canary_metrics_port=0)
        self.registry = RunningRegistry(base)
        self.settings = base.model_copy(update={"registry_url": self.registry.url})
        self.registry.start()
        self.engine, self.numbers = engine, numbers
        self.admin = self.registry.client("admin")
        self.publisher = self.registry.client("publisher")
        self.closers: list[Any] = [self.registry.stop, self.admin.close, self.publisher.close]
        response = self.admin.post("/v1/base-models", json={
            "name": "numbers", "digest": engine.base_digest, "config": numbers.config})
        assert response.status_code == 201, response.text
        self.label_set = self._label_set()

    def close(self) -> None:
        for close in reversed(self.closers):
            close()

    def _label_set(self) -> bytes:
        """Case `label` allows the outputs of v1 and `good`, not `bad`'s (JSON Schema)."""
        tokens = {name: first_tokens(self.engine, files)[0]
                  for name, files in self.numbers.adapters.items()}
        assert tokens["bad"] not in (tokens["good"], tokens["v1"])
        cases = [
            {"id": "label", "prompt": PROMPT, "max_tokens": 1, "checks": [
                {"type": "json_schema", "schema": {"type": "integer",
                                                   "enum": [tokens["v1"], tokens["good"]]}}]},
            {"id": "shape", "prompt": "5 5 5", "max_tokens": 3, "checks": [
                {"type": "regex", "pattern": r"^\d+( \d+){2}$"},
                {"type": "max_divergence", "metric": "token_edit_distance", "max": 3}]},
        ]
        return "\n".join(json.dumps(c) for c in cases).encode()

    def gate_worker(self, **kwargs: Any) -> GateWorker:
        worker = GateWorker(self.settings, self.engine, self.registry.url, **kwargs).start()
        self.closers.append(worker.close)
        wait_for(lambda: worker.worker_id in self.registry.node.state.heartbeats, 30,
                 interval_s=0.2, message="the registry to see the gate worker")
        return worker

    def publish(self, name: str, label: str, regression_set: bytes | None = None,
                client: httpx.Client | None = None) -> httpx.Response:
        files = self.numbers.adapters[name]
        parts: dict[str, Any] = {
            "adapter_config": ("adapter_config.json", files.config_json),
            "adapter_model": ("adapter_model.safetensors", files.weights)}
        if regression_set is not None:
            parts["regression_set"] = ("set.jsonl", regression_set)
        return (client or self.publisher).post(
            "/v1/adapters/bot/versions", files=parts,
            data={**TENANT, "owner": "alice@acme", "base_model": "numbers", "label": label})

    def gate(self, version: int) -> dict[str, Any]:
        response = self.publisher.get(f"/v1/adapters/bot/versions/{version}/gate")
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def gate_settled(self, version: int, timeout_s: float = 60) -> dict[str, Any]:
        return wait_for(lambda: (g := self.gate(version))["status"] != "pending" and g,
                        timeout_s, interval_s=0.2, message=f"the gate of bot@{version}")

    def rollout(self) -> dict[str, Any]:
        response = self.publisher.get(f"/v1/aliases/{ALIAS}/rollout")
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def v1_active(self) -> None:
        assert self.publish("v1", "v1", self.label_set).status_code == 201
        assert self.gate_settled(1)["status"] == "passed"
        response = self.publisher.put("/v1/adapters/bot/active", json={"version": 1})
        assert response.status_code == 200, response.text

    def controller(self) -> CanaryController:
        controller = CanaryController(self.settings)
        stop = threading.Event()
        thread = threading.Thread(target=controller.run, args=(stop,), daemon=True)
        thread.start()

        def close() -> None:
            stop.set()
            thread.join(timeout=30)
            controller.close()
        self.closers.append(close)
        return controller

    def traffic(self, **kwargs: Any) -> Traffic:
        traffic = Traffic(self.settings, ALIAS, **kwargs).start()
        self.closers.append(traffic.close)
        return traffic


def test_a_good_version_passes_its_gate_and_walks_5_to_100(stack: Stack) -> None:
    stack.gate_worker()
    stack.v1_active()
    assert stack.publish("good", "v2", stack.label_set).status_code == 201
    gate = stack.gate_settled(2)
    assert gate["status"] == "passed" and gate["may_get_traffic"], gate
    assert gate["worker_id"] == "w1" and gate["baseline_version"] == 1
    label = gate["results"][0]
    assert [(o["role"], o["version"]) for o in label["outputs"]] == [
        ("base", None), ("previous", 1), ("new", 2)]
    assert label["checks"][0] == {"kind": "json_schema", "verdict": "pass", "detail": "",
                                  "measured": None, "limit": None}

    response = stack.publisher.post(f"/v1/aliases/{ALIAS}/rollout",
                                    json={"adapter_id": "bot", "version": 2, **FAST_PLAN})
    assert response.status_code == 201, response.text
    assert response.json()["weight"] == 5
    traffic = stack.traffic()
    controller = stack.controller()
    port = controller.metrics.serve(0)
    done = wait_for(lambda: (r := stack.rollout())["status"] == "completed" and r, 90,
                    interval_s=0.2, message="the rollout to complete")
    assert [s["action"] for s in done["steps"]] == ["started", "advanced", "advanced",
                                                    "advanced", "completed"]
    assert all(s["actor"] == "canary:" + _token_id(CANARY_TOKEN) for s in done["steps"][1:])
    assert done["split"] == [{"adapter_id": "bot", "version": 2, "weight": 100}]
    judged = done["last_judgement"]
    assert judged["verdict"] == "advance" and not judged["baseline_from_window"]
    assert judged["canary"]["requests"] >= 10
    adapter = stack.publisher.get("/v1/adapters/bot").json()
    assert adapter["active_version"] == 2 and adapter["rollback_target"] == 1
    assert traffic.served.get(2, 0) > 0 and traffic.served.get(1, 0) > 0

    # what Prometheus scrapes from the controller
    def scraped() -> str:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    done_line = 'loraplane_canary_rollout_steps_total{action="completed"} 1.0'
    metrics = wait_for(lambda: done_line in (m := scraped()) and
                       "loraplane_canary_rollouts_running 0.0" in m and m,
                       10, interval_s=0.2, message="the completed rollout on /metrics")
    for line in ('loraplane_canary_rollout_steps_total{action="advanced"} 3.0',
                 "loraplane_canary_ready 1.0"):
        assert line in metrics, metrics
    assert "loraplane_canary_registry_errors_total{" not in metrics
    sample = controller.metrics.registry.get_sample_value
    assert (sample("loraplane_canary_judgements_total", {"outcome": "advance"}) or 0) >= 4
    assert (sample("loraplane_canary_last_judgement_timestamp_seconds") or 0) > 0


def _token_id(token: str) -> str:
    from services.catalog.auth import token_hash

    return token_hash(token)[:12]


def test_a_version_that_breaks_a_json_schema_check_gets_no_traffic(stack: Stack) -> None:
    stack.gate_worker()
    stack.v1_active()
    assert stack.publish("bad", "v2", stack.label_set).status_code == 201
    gate = stack.gate_settled(2)
    assert gate["status"] == "failed" and not gate["may_get_traffic"]
    [failure] = gate["failures"]
    assert failure.startswith("case label (line 1): json_schema: schema violated at (root):")
    expected = f"bot@2: quality gate {gate['gate_id']} failed: case label (line 1): json_schema"

    split = {"split": [{"adapter_id": "bot", "version": 2, "weight": 5},
                       {"adapter_id": "bot", "version": 1, "weight": 95}]}
    for method, path, body in (("PUT", f"/v1/aliases/{ALIAS}", split),
                               ("PUT", "/v1/adapters/bot/active", {"version": 2}),
                               ("POST", f"/v1/aliases/{ALIAS}/rollout",
                                {"adapter_id": "bot", "version": 2})):
        response = stack.publisher.request(method, path, json=body)
        assert response.status_code == 409, response.text
        assert response.json()["detail"].startswith(expected), response.text

    # the report: outputs side by side, each check's verdict, exit 1 (no traffic)
    env = {"LORAPLANE_REGISTRY_URL": stack.registry.url, "LORAPLANE_API_TOKEN": "reader-token",
           "COLUMNS": "160"}
    report = CliRunner().invoke(app, ["gate", "report", "bot", "2"], env=env)
    assert report.exit_code == 1, report.output
    bad_label = gate["results"][0]["outputs"][2]["text"]
    for shown in ("quality gate of bot@2: FAILED", "previous v1", "new v2", "FAIL", "json_schema",
                  f"│ {bad_label} ", "[1 tok, length]", "traffic: refused: bot@2: quality gate"):
        assert shown in report.output, report.output
    report = CliRunner().invoke(app, ["gate", "report", "bot", "1", "--json"], env=env)
    assert report.exit_code == 0 and json.loads(report.output)["status"] == "passed"

    # an override is an admin's, needs a reason, and is an event
    override = "/v1/adapters/bot/versions/2/override"
    assert stack.publisher.post(override, json={"reason": "x"}).status_code == 403
    assert stack.admin.post(override, json={"reason": ""}).status_code == 422
    response = stack.admin.post(override, json={"reason": "label 8 added to the taxonomy"})
    assert response.status_code == 200 and response.json()["may_get_traffic"]
    assert response.json()["override"]["reason"] == "label 8 added to the taxonomy"
    assert stack.publisher.put(f"/v1/aliases/{ALIAS}", json=split).status_code == 200


def test_a_gate_that_cannot_complete_is_failed(stack: Stack) -> None:
    # no worker on the base model at all
    assert stack.publish("v1", "v1", stack.label_set).status_code == 201
    gate = stack.gate_settled(1, timeout_s=20)
    assert gate["status"] == "expired" and gate["worker_id"] is None
    assert "expired (no_worker)" in gate["failures"][0]
    response = stack.publisher.put("/v1/adapters/bot/active", json={"version": 1})
    assert response.status_code == 409 and "expired (no_worker)" in response.json()["detail"]
    # a worker that takes the gate, then stops heartbeating (a crash) before answering
    silent = WorkerStream(stack.settings, "w-crashing")
    stack.closers.append(silent.close)
    from services.contracts.events import WorkerHeartbeat

    silent.emit(WorkerHeartbeat(worker_id="w-crashing", address="x:1", base_model="numbers",
                                base_model_digest=stack.engine.base_digest))
    wait_for(lambda: "w-crashing" in stack.registry.node.state.heartbeats, 10, interval_s=0.2,
             message="heartbeat")
    response = stack.publisher.post("/v1/adapters/bot/versions/1/gate",
                                    data={"reason": "re-run now that a worker is up"})
    assert response.status_code == 202, response.text
    assert response.json()["worker_id"] == "w-crashing"
    gate = wait_for(lambda: (g := stack.gate(1))["status"] == "expired" and
                    g["gate_id"] == response.json()["gate_id"] and g, 30, interval_s=0.2,
                    message="worker_lost")
    assert "expired (worker_lost): w-crashing stopped heartbeating" in gate["failures"][0]
    # a regression set that does not parse is refused before anything is stored
    response = stack.publish("good", "v2", b'{"prompt": "x", "checks": []}\n')
    assert response.status_code == 422 and "regression set line 1: checks" in \
        response.json()["detail"]
    assert stack.publisher.get("/v1/adapters/bot").json()["latest_version"] == 1


def test_an_error_spike_is_rolled_back_at_its_stage_and_the_view_shows_why(
        stack: Stack, migrated_settings: Settings) -> None:
    stack.gate_worker()
    stack.v1_active()
    assert stack.publish("good", "v2", stack.label_set).status_code == 201
    assert stack.gate_settled(2)["status"] == "passed"
    plan = {**FAST_PLAN, "min_stage_s": 30}  # judged on errors long before it could advance
    response = stack.publisher.post(f"/v1/aliases/{ALIAS}/rollout",
                                    json={"adapter_id": "bot", "version": 2, **plan})
    assert response.status_code == 201, response.text
    traffic = stack.traffic(errors={1: 0.02, 2: 0.30})
    controller = stack.controller()
    done = wait_for(lambda: (r := stack.rollout())["status"] == "rolled_back" and r, 60,
                    interval_s=0.2, message="the automatic rollback")
    wait_for(lambda: controller.metrics.registry.get_sample_value(
        "loraplane_canary_rollout_steps_total", {"action": "rolled_back"}) == 1.0, 10,
        interval_s=0.2, message="the rollback counted")
    assert done["weight"] == 5 and done["stage"] == 0
    assert done["split"] == [{"adapter_id": "bot", "version": 1, "weight": 100}]
    assert "> 1.5 x baseline" in done["status_reason"], done
    served_after = dict(traffic.served)
    wait_for(lambda: sum(traffic.served.values()) > sum(served_after.values()) + 100, 30,
             interval_s=0.2, message="more traffic")
    assert traffic.served.get(2, 0) == served_after.get(2, 0)  # v2 gets nothing any more
    refusal = stack.gate(2)["refusal"]
    assert refusal.startswith(f"bot@2: canary rollout {done['rollout_id']} rolled it back at 5%")

    engine = make_engine(migrated_settings.database_url or "")
    projector = AuditProjector(migrated_settings.model_copy(
        update={"audit_signing_key": "11" * 32}), engine)
    try:
        def projected() -> list[Any]:
            projector.project_batch(timeout=0.2)
            with engine.connect() as conn:
                return list(conn.execute(text(
                    "SELECT decision, decided_by, automatic, version, stage, weight, reason, "
                    "canary_requests, canary_errors, canary_error_rate, baseline_requests, "
                    "baseline_errors, baseline_error_rate, window_start, window_end, "
                    "gate_cases, gate_failed_cases, gate_worker "
                    "FROM release_decisions ORDER BY decided_at")))
        rows = wait_for(lambda: (r := projected()) and r[-1].decision == "rollout_rolled_back"
                        and r, 60, interval_s=0.2, message="release_decisions to show the rollback")
    finally:
        projector.close()
        engine.dispose()
    assert [r.decision for r in rows] == ["gate_requested", "gate_passed", "gate_requested",
                                          "gate_passed", "rollout_started",
                                          "rollout_rolled_back"]
    assert rows[0].gate_worker == "w1" and rows[1].decided_by == "w1"
    assert rows[1].gate_cases == 2 and rows[1].gate_failed_cases == 0
    rollback = rows[-1]
    assert rollback.decided_by == "canary:" + _token_id(CANARY_TOKEN) and rollback.automatic
    assert (rollback.version, rollback.stage, rollback.weight) == (2, 0, 0)
    assert rollback.canary_requests >= 10
    assert rollback.canary_error_rate > 1.5 * rollback.baseline_error_rate
    assert rollback.baseline_requests >= 10
    assert rollback.window_start < rollback.window_end
    assert "error rate" in rollback.reason and "> 1.5 x baseline" in rollback.reason


def test_a_controller_killed_mid_rollout_resumes_at_the_same_stage(stack: Stack,
                                                                  tmp_path: Path) -> None:
    stack.gate_worker()
    stack.v1_active()
    assert stack.publish("good", "v2", stack.label_set).status_code == 201
    assert stack.gate_settled(2)["status"] == "passed"
    plan = {**FAST_PLAN, "min_stage_s": 2.5, "window_s": 2.0}
    response = stack.publisher.post(f"/v1/aliases/{ALIAS}/rollout",
                                    json={"adapter_id": "bot", "version": 2, **plan})
    assert response.status_code == 201, response.text
    stack.traffic()
    first = controller_process(stack.settings, tmp_path / "canary-1.log")
    try:
        wait_for(lambda: stack.rollout()["stage"] >= 1, 60, interval_s=0.2, message="stage 1 (25%)")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    stage = stack.rollout()["stage"]
    assert stage in (1, 2)
    # no controller: nothing moves
    held = wait_for(lambda: stack.rollout(), 1, interval_s=0.2, message="rollout")
    threading.Event().wait(plan["min_stage_s"] + 1.0)
    assert stack.rollout()["stage"] == held["stage"] == stage
    second = controller_process(stack.settings, tmp_path / "canary-2.log")
    try:
        done = wait_for(lambda: (r := stack.rollout())["status"] == "completed" and r, 90,
                        interval_s=0.2, message="the resumed rollout to complete")
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=30)
    assert [s["action"] for s in done["steps"]] == ["started", "advanced", "advanced",
                                                    "advanced", "completed"]
    log = (tmp_path / "canary-2.log").read_text()
    assert f"resuming {ALIAS} at {plan['stages'][stage]}%" in log, log
