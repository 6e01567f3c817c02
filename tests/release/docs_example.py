"""One gated canary release on real services, printed step by step (docs/release.md).

    python -m tests.release.docs_example

Apache Kafka and PostgreSQL (started here unless LORAPLANE_KAFKA_BOOTSTRAP /
LORAPLANE_DATABASE_URL name them), the registry over HTTP, a worker running gates through
the engine on a tiny random Llama (`tests/release/model.py`), request traces produced as
a worker would (`tests/release/harness.py`, errors injected per version), the canary
controller, and the audit projector.
"""

from __future__ import annotations

import io
import json
import logging
import tempfile
import threading
from pathlib import Path
from typing import Any

from rich.console import Console
from sqlalchemy import text

from bench.audit import services
from services.audit.db import make_engine, upgrade
from services.audit.projector import AuditProjector
from services.config import Settings
from services.release.canary_app import CanaryController
from services.release.report import gate_report
from tests.audit.docs_example import cell, render
from tests.conftest import isolated_settings
from tests.registry.conftest import TENANT, RunningRegistry, registry_settings
from tests.release.harness import CANARY_TOKEN, GateWorker, Traffic, auth_setting
from tests.release.model import PROMPT, build_number_model, first_tokens
from tests.waiting import wait_for

PLAN = {"stages": [5, 25, 50, 100], "min_stage_s": 4, "min_requests": 50,
        "error_rate_floor": 0.05, "max_p95_ms": 800}


def show(title: str, body: str) -> None:
    print(f"\n#### {title}\n\n```\n{body.rstrip()}\n```")


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp, services(Path(tmp)) as (bootstrap, url, *_):
        root = Path(tmp)
        plain = isolated_settings(bootstrap, url, audit_signing_key="42" * 32,
                                  state_dir=root / "state")
        assert plain.database_url
        upgrade(plain.database_url)
        settings = registry_settings(plain, root / "blobs", release_ungated="block",
                                     auth_tokens=auth_setting(), canary_token=CANARY_TOKEN,
                                     canary_interval_s=0.5, canary_settle_s=0.5,
                                     canary_id="canary-1")
        registry = RunningRegistry(settings)
        settings = settings.model_copy(update={"registry_url": registry.url})
        registry.start()
        numbers = build_number_model(root / "model")
        engine = numbers.engine()
        closers: list[Any] = [registry.stop]
        try:
            run(settings, registry, numbers, engine, closers)
        finally:
            for close in reversed(closers):
                close()


def run(settings: Settings, registry: RunningRegistry, numbers: Any, engine: Any,
        closers: list[Any]) -> None:
    admin, pub = registry.client("admin"), registry.client("publisher")
    closers += [admin.close, pub.close]
    admin.post("/v1/base-models", json={"name": "numbers", "digest": engine.base_digest,
                                        "config": numbers.config}).raise_for_status()
    worker = GateWorker(settings, engine, registry.url).start()
    closers.append(worker.close)
    wait_for(lambda: "w1" in registry.node.state.heartbeats, 30, interval_s=0.2,
             message="worker heartbeat")
    labels = {n: first_tokens(engine, f)[0] for n, f in numbers.adapters.items()}
    allowed = sorted({labels["v1"], labels["good"], labels["other"]})
    cases = [
        {"id": "label", "prompt": PROMPT, "max_tokens": 1, "checks": [
            {"type": "json_schema", "schema": {"type": "integer", "enum": allowed}}]},
        {"id": "shape", "prompt": "5 5 5", "max_tokens": 3, "checks": [
            {"type": "regex", "pattern": r"^\d+( \d+){2}$"},
            {"type": "max_divergence", "metric": "token_edit_distance", "max": 3}]},
    ]
    regression_set = "\n".join(json.dumps(c) for c in cases).encode()
    show("regression.jsonl", regression_set.decode())

    def publish(name: str, label: str) -> dict[str, Any]:
        files = numbers.adapters[name]
        response = pub.post("/v1/adapters/bot/versions", data={
            **TENANT, "owner": "alice@acme", "base_model": "numbers", "label": label}, files={
            "adapter_config": ("adapter_config.json", files.config_json),
            "adapter_model": ("adapter_model.safetensors", files.weights),
            "regression_set": ("regression.jsonl", regression_set)})
        response.raise_for_status()
        version = response.json()["version"]
        return wait_for(lambda: (g := pub.get(f"/v1/adapters/bot/versions/{version}/gate")
                                 .json())["status"] != "pending" and g, 60, interval_s=0.2,
                        message="gate")

    def report(gate: dict[str, Any], name: str) -> None:
        console = Console(file=io.StringIO(), record=True, width=140, color_system=None)
        console.print(gate_report(gate))
        show(f"$ loraplane gate report bot {gate['version']}   # {name}",
             console.export_text())

    publish("v1", "v1")
    pub.put("/v1/adapters/bot/active", json={"version": 1}).raise_for_status()
    report(publish("good", "v2"), "passes")
    report(publish("bad", "v3"), "breaks the JSON Schema check")
    response = pub.put("/v1/aliases/bot-prod", json={"split": [
        {"adapter_id": "bot", "version": 3, "weight": 5},
        {"adapter_id": "bot", "version": 1, "weight": 95}]})
    show("$ curl -X PUT …/v1/aliases/bot-prod -d '{\"split\": [{\"adapter_id\": \"bot\", "
         "\"version\": 3, \"weight\": 5}, …]}'", f"HTTP {response.status_code}\n{response.text}")

    controller = CanaryController(settings)
    stop = threading.Event()
    thread = threading.Thread(target=controller.run, args=(stop,), daemon=True)
    thread.start()
    closers.append(lambda: (stop.set(), thread.join(30), controller.close()))

    body = {"adapter_id": "bot", "version": 2, **PLAN}
    response = pub.post("/v1/aliases/bot-prod/rollout", json=body)
    response.raise_for_status()
    show("$ curl -X POST …/v1/aliases/bot-prod/rollout -d '" + json.dumps(body) + "'",
         json.dumps({k: response.json()[k] for k in ("rollout_id", "stage", "weight", "status",
                                                     "split")}))
    traffic = Traffic(settings, "bot-prod", rate_per_s=400, errors={1: 0.02, 2: 0.02, 4: 0.3})
    traffic.start()
    closers.append(traffic.close)
    wait_for(lambda: pub.get("/v1/aliases/bot-prod/rollout").json()["status"] == "completed",
             120, interval_s=0.2, message="v2's rollout")
    steps = pub.get("/v1/aliases/bot-prod/rollout").json()["steps"]
    show("$ curl …/v1/aliases/bot-prod/rollout   # steps",
         "\n".join(f"{s['at']}  {s['action']:<10} {s['actor']}" for s in steps))

    report(publish("other", "v4"), "passes its gate; errors in production")
    response = pub.post("/v1/aliases/bot-prod/rollout", json={**body, "version": 4})
    response.raise_for_status()
    done = wait_for(lambda: (r := pub.get("/v1/aliases/bot-prod/rollout").json())["status"]
                    == "rolled_back" and r, 120, interval_s=0.2, message="v4's rollback")
    show("$ curl …/v1/aliases/bot-prod/rollout   # v4",
         json.dumps({k: done[k] for k in ("status", "weight", "status_reason", "split")},
                    indent=1))

    assert settings.database_url
    engine_db = make_engine(settings.database_url)
    projector = AuditProjector(settings, engine_db)
    query = """SELECT decided_at, decision, decided_by, version, weight AS w,
       canary_requests AS c_req, canary_errors AS c_err, baseline_requests AS b_req,
       baseline_errors AS b_err, left(reason, 60) AS reason
FROM release_decisions WHERE adapter_id = 'bot' ORDER BY decided_at"""

    def rows() -> list[Any]:
        projector.project_batch(timeout=0.3)
        with engine_db.connect() as conn:
            found = list(conn.execute(text(query)))
        return found if found and found[-1].decision == "rollout_rolled_back" else []

    found = wait_for(rows, 60, interval_s=0.2, message="the projection")
    projector.close()
    engine_db.dispose()
    columns = ["decided_at", "decision", "decided_by", "version", "w", "c_req", "c_err",
               "b_req", "b_err", "reason"]
    show("release_decisions", query + ";\n\n" + render(columns,
                                                       [[cell(v) for v in r] for r in found]))


if __name__ == "__main__":
    main()
