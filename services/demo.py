"""`loraplane demo`: the main job on the embedded default, end to end.

It brings the stack up in a scratch state folder, publishes one event through Kafka,
reads it back with a fan-out consumer, lets the audit projector write it to PostgreSQL,
prints all three, and stops everything it started. Later capabilities extend this.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid

from rich.console import Console
from rich.table import Table
from sqlalchemy import select

from services.audit.db import make_engine
from services.audit.projector import AuditProjector
from services.audit.tables import events
from services.config import Settings
from services.contracts.events import BaseModelRegistered, Envelope
from services.eventlog import EventConsumer, EventProducer
from services.stack.stack import running_stack

console = Console()


def run_demo(settings: Settings) -> None:
    scratch = settings.state_dir.resolve() / "demo" / uuid.uuid4().hex[:8]
    try:
        with running_stack(settings, services=(), state_dir=scratch) as stack:
            _show_endpoints(stack.endpoints)
            _round_trip(stack.settings)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    console.print("[green]stack stopped; nothing left running[/green]")


def _show_endpoints(endpoints: list) -> None:
    table = Table(title="embedded stack")
    for col in ("part", "listens on", "detail"):
        table.add_column(col)
    for e in endpoints:
        table.add_row(e.name, e.where, e.detail)
    console.print(table)


def _round_trip(settings: Settings) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    event = Envelope.new(BaseModelRegistered(name="demo-llama", digest=digest, config=config),
                         stream="base-model/demo-llama", seq=1, actor="demo")
    with EventProducer(settings, client_id="loraplane-demo") as producer:
        position = producer.publish(event)
    console.print(f"[bold]produced[/bold] {event.type} {event.event_id} -> "
                  f"{position.topic}[{position.partition}]@{position.offset}")

    seen = []
    with EventConsumer(settings, [settings.adapter_events_topic],
                       reader_id="loraplane-demo-reader") as consumer:
        consumer.catch_up(seen.append)
    consumed = next(r for r in seen if r.envelope.event_id == event.event_id)
    console.print(f"[bold]consumed[/bold] {consumed.envelope.type} {consumed.envelope.event_id} "
                  f"from {consumed.topic}[{consumed.partition}]@{consumed.offset}")
    console.print_json(consumed.value.decode())

    assert settings.database_url is not None
    engine = make_engine(settings.database_url)
    projector = AuditProjector(settings, engine)
    row = None
    deadline = time.monotonic() + 30
    try:
        while row is None and time.monotonic() < deadline:
            projector.project_batch(timeout=0.2)
            with engine.connect() as conn:
                row = conn.execute(select(events).where(events.c.event_id == event.event_id)
                                   ).mappings().first()
    finally:
        projector.close()
        engine.dispose()
    if row is None:
        raise RuntimeError("the event did not reach PostgreSQL within 30 s")
    table = Table(title="PostgreSQL: audit events row")
    table.add_column("column")
    table.add_column("value", overflow="fold")
    for key in ("id", "topic", "partition", "offset", "event_id", "type", "stream", "seq",
                "actor", "occurred_at", "recorded_at", "prev_hash", "hash"):
        value = row[key]
        table.add_row(key, value.hex() if isinstance(value, bytes) else str(value))
    table.add_row("payload", json.dumps(row["payload"], sort_keys=True))
    console.print(table)
