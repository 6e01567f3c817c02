"""`loraplane demo`: the main job on the embedded default, end to end.

It brings the stack up in a scratch state folder (broker, PostgreSQL, the registry and
the audit projector as real processes), then as an operator would:

1. registers a base model over REST; the registry writes the event to Kafka, a fan-out
   consumer reads it back, and the audit projector's row for it is read from PostgreSQL;
2. publishes two versions of a PEFT adapter (validated, stored by digest), switches to
   v1, then v2, and rolls back without naming a target (the registry picks the previous
   stable version);
3. shows the adapter's lineage and rollback candidates as SQL views, and verifies the
   audit store's hash chains.

Everything it started is stopped at the end. Later capabilities extend this.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid
from typing import Any

import httpx
import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import save
from sqlalchemy import Engine, select, text

from services.audit.db import make_engine
from services.audit.tables import events
from services.audit.verify import verify_store
from services.config import Settings
from services.contracts.codec import canonical_bytes
from services.eventlog import EventConsumer
from services.registry.validation import BaseModelShape
from services.stack.stack import running_stack

console = Console()

BASE_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 256,
}
TENANT = {"org": "acme", "team": "support", "project": "chat"}


def run_demo(settings: Settings) -> None:
    scratch = settings.state_dir.resolve() / "demo" / uuid.uuid4().hex[:8]
    try:
        with running_stack(settings, services=("registry", "audit"), state_dir=scratch) as stack:
            _show_endpoints(stack.endpoints)
            token = (scratch / "admin.token").read_text().strip()
            _operate(stack.settings, token)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    console.print("[green]stack stopped; nothing left running[/green]")


def _show_endpoints(endpoints: list[Any]) -> None:
    table = Table(title="embedded stack")
    for col in ("part", "listens on", "detail"):
        table.add_column(col, overflow="fold")
    for e in endpoints:
        table.add_row(e.name, e.where, e.detail)
    console.print(table)


def demo_adapter(rank: int, seed: int) -> tuple[bytes, bytes]:
    """A PEFT LoRA adapter (config, safetensors) for BASE_CONFIG, q/v projections."""
    shape = BaseModelShape.from_config(BASE_CONFIG)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_hidden_layers):
        for module in ("q_proj", "v_proj"):
            fan_in, fan_out = shape.module_shape(module)
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / 8
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) / 8
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"}
    half = {k: v.to(torch.float16) for k, v in tensors.items()}
    return json.dumps(config).encode(), save(half)


def _check(response: httpx.Response) -> dict[str, Any]:
    if not response.is_success:
        raise RuntimeError(f"{response.request.method} {response.request.url} -> "
                           f"{response.status_code}: {response.text}")
    body: dict[str, Any] = response.json()
    return body


def _operate(settings: Settings, token: str) -> None:
    engine = make_engine(str(settings.database_url))
    client = httpx.Client(base_url=settings.registry_base_url, timeout=30,
                          headers={"Authorization": f"Bearer {token}"})
    try:
        _base_model_round_trip(settings, client, engine)
        _adapter_lifecycle(client)
        _show_audit(engine)
    finally:
        client.close()
        engine.dispose()


def _base_model_round_trip(settings: Settings, client: httpx.Client, engine: Engine) -> None:
    # No weights exist in the demo: the config's digest stands in for the weights digest.
    digest = hashlib.sha256(canonical_bytes(BASE_CONFIG)).hexdigest()
    body = _check(client.post("/v1/base-models", json={
        "name": "demo-llama", "digest": digest, "config": BASE_CONFIG}))
    console.rule("1. one event through Kafka into PostgreSQL")
    console.print(f"[bold]produced[/bold] by the registry: {json.dumps(body)[:300]}")

    seen = []
    with EventConsumer(settings, [settings.adapter_events_topic],
                       reader_id="loraplane-demo-reader") as consumer:
        consumer.catch_up(seen.append)
    record = next(r for r in seen if r.envelope.type == "BaseModelRegistered")
    console.print(f"[bold]consumed[/bold] {record.envelope.type} {record.envelope.event_id} "
                  f"from {record.topic}[{record.partition}]@{record.offset}")
    console.print_json(record.value.decode())

    row = _wait_for(engine, lambda conn: conn.execute(
        select(events).where(events.c.event_id == record.envelope.event_id)).mappings().first())
    table = Table(title="PostgreSQL: audit events row (written by the audit projector)")
    table.add_column("column")
    table.add_column("value", overflow="fold")
    for key in ("id", "topic", "partition", "offset", "event_id", "type", "stream", "seq",
                "actor", "occurred_at", "recorded_at", "prev_hash", "hash"):
        value = row[key]
        table.add_row(key, value.hex() if isinstance(value, bytes) else str(value))
    console.print(table)


def _adapter_lifecycle(client: httpx.Client) -> None:
    console.rule("2. publish, switch, roll back (REST → registry → Kafka)")
    for version, rank in ((1, 8), (2, 16)):
        config, weights = demo_adapter(rank, seed=version)
        body = _check(client.post(
            "/v1/adapters/acme-support/versions",
            data={**TENANT, "owner": "alice@acme", "base_model": "demo-llama",
                  "label": f"support-v{version}", "qos_tier": "gold"},
            files={"adapter_config": ("adapter_config.json", config),
                   "adapter_model": ("adapter_model.safetensors", weights)}))
        console.print(f"published v{body['version']}: rank {body['rank']}, "
                      f"sha256 {body['sha256'][:16]}…, {body['size_bytes']} bytes")
    for version in (1, 2):
        # No worker runs in the demo, so no regression set can run: without an override the
        # registry refuses traffic to a version with no passed gate (LORAPLANE_RELEASE_UNGATED).
        _check(client.post(f"/v1/adapters/acme-support/versions/{version}/override",
                           json={"reason": "demo: no worker here to run a regression set"}))
        console.print(f"v{version} has no quality gate: admin override (ReleaseOverridden)")
        _check(client.put("/v1/adapters/acme-support/active", json={"version": version}))
        console.print(f"switched acme-support to v{version}")
    body = _check(client.post("/v1/adapters/acme-support/rollback",
                              json={"reason": "demo: error rate above canary baseline"}))
    console.print(f"rolled back (no target given): v{body.get('from_version')} → "
                  f"v{body.get('to_version')}")


def _show_audit(engine: Engine) -> None:
    console.rule("3. what an auditor sees (SQL views over the projection)")
    lineage = _wait_for(engine, lambda conn: conn.execute(text(
        "SELECT adapter_id, version, status, published_by, first_activated_at, "
        "rolled_back_by, rollback_reason FROM adapter_lineage "
        "WHERE adapter_id = 'acme-support' ORDER BY version")).mappings().all() or None,
        until=lambda rows: any(r["rolled_back_by"] for r in rows))
    _print_rows("adapter_lineage", lineage)
    candidates = _wait_for(engine, lambda conn: conn.execute(text(
        "SELECT adapter_id, active_version, candidate_version, rollback_target "
        "FROM rollback_candidates")).mappings().all() or None)
    _print_rows("rollback_candidates", candidates)
    report = verify_store(engine)
    verdict = "OK" if not report.problems else f"FAILED: {report.problems[0]}"
    console.print(f"audit verify: {verdict} ({report.rows} rows, {report.partitions} "
                  f"partition chains, {report.checkpoints} signed checkpoints)")


def _print_rows(title: str, rows: Any) -> None:
    table = Table(title=title)
    keys = list(rows[0].keys())
    for key in keys:
        table.add_column(key, overflow="fold")
    for row in rows:
        table.add_row(*("" if row[k] is None else str(row[k]) for k in keys))
    console.print(table)


def _wait_for(engine: Engine, query: Any, until: Any = None, timeout_s: float = 60) -> Any:
    """The projector runs in its own process: poll until its rows show up."""
    deadline = time.monotonic() + timeout_s
    while True:
        with engine.connect() as conn:
            result = query(conn)
        if result is not None and (until is None or until(result)):
            return result
        if time.monotonic() > deadline:
            raise RuntimeError("the audit projection did not catch up within "
                               f"{timeout_s:.0f} s")
        time.sleep(0.2)

