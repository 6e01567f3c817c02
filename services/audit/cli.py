"""`loraplane audit …`: questions answered from the audit store.

Exit codes: 0 fine, 1 the evidence does not hold (tampering, bad proof), 2 usage or
configuration, 3 the thing asked for does not exist (yet).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy import Engine, select

from services.config import Settings

audit_app = typer.Typer(help="Audit store: events, proofs, verification.", no_args_is_help=True)
console = Console()
err = Console(stderr=True)


def _engine() -> Engine:
    from services.audit.db import make_engine

    url = Settings().database_url
    if not url:
        err.print("[red]LORAPLANE_DATABASE_URL is not set[/red]")
        raise typer.Exit(2)
    return make_engine(url)


@audit_app.command()
def tail(limit: int = typer.Option(20, min=1, max=10_000)) -> None:
    """The most recently recorded events."""
    from services.audit.tables import events

    engine = _engine()
    with engine.connect() as conn:
        rows = conn.execute(select(events.c.id, events.c.type, events.c.stream, events.c.seq,
                                   events.c.actor, events.c.occurred_at, events.c.topic,
                                   events.c.partition, events.c.offset)
                            .order_by(events.c.id.desc()).limit(limit)).all()
    table = Table()
    for col in ("id", "type", "stream", "seq", "actor", "occurred_at", "position"):
        table.add_column(col)
    for r in reversed(rows):
        table.add_row(str(r.id), r.type, r.stream, str(r.seq), r.actor, str(r.occurred_at),
                      f"{r.topic}[{r.partition}]@{r.offset}")
    console.print(table)


@audit_app.command()
def verify(
    public_key: list[str] = typer.Option(
        None, "--public-key", help="Trusted checkpoint key (hex); repeatable. Default: any."),
) -> None:
    """Recompute every hash chain and signed checkpoint; name the first bad row."""
    from services.audit.verify import verify_store

    try:
        trusted = [bytes.fromhex(k) for k in public_key] if public_key else None
    except ValueError:
        err.print("[red]--public-key must be hex[/red]")
        raise typer.Exit(2) from None
    report = verify_store(_engine(), trusted)
    for problem in report.problems:
        print(f"BAD ROW topic={problem.topic} partition={problem.partition} "
              f"offset={problem.offset} event_id={problem.event_id} "
              f"chain_index={problem.chain_index}: {problem.reason}")
    summary = (f"{report.rows} rows, {report.checkpoints} checkpoints, "
               f"{report.partitions} partitions")
    if report.problems:
        print(f"FAILED: {len(report.problems)} partition(s) with a bad row ({summary})")
        raise typer.Exit(1)
    print(f"OK: {summary} verified")


@audit_app.command()
def proof(
    event_id: str = typer.Argument(..., help="The event's id (UUID)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Write here instead of stdout."),
) -> None:
    """Print an inclusion proof of one event in a signed checkpoint (JSON)."""
    from services.audit.proof import ProofUnavailable, build_proof

    try:
        wanted = uuid.UUID(event_id)
    except ValueError:
        err.print(f"[red]not a UUID: {event_id}[/red]")
        raise typer.Exit(2) from None
    try:
        document = build_proof(_engine(), wanted)
    except ProofUnavailable as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(3) from None
    text = json.dumps(document, indent=2)
    if out is None:
        print(text)
    else:
        out.write_text(text + "\n")


@audit_app.command("verify-proof")
def verify_proof_command(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, help="A proof JSON file."),
    public_key: str | None = typer.Option(None, help="The log's published key (hex)."),
) -> None:
    """Check an inclusion proof: leaf → root by the audit path, root by the signature."""
    from services.audit.merkle import verify_proof

    try:
        document = json.loads(file.read_text())
        trusted = bytes.fromhex(public_key) if public_key else None
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    problems = verify_proof(document, trusted)
    for problem in problems:
        print(f"INVALID: {problem}")
    if problems:
        raise typer.Exit(1)
    print(f"OK: event {document.get('event_id')} is entry {document['index']} of "
          f"{document['topic']}[{document['partition']}] in the checkpoint of size "
          f"{document['tree_size']} signed by {document['checkpoint']['public_key']}")


@audit_app.command()
def checkpoint() -> None:
    """Sign the current head of every partition not yet covered by a checkpoint."""
    from services.audit.projector import AuditProjector

    signed = AuditProjector(Settings(), _engine()).checkpoint_now()
    for cp in signed:
        print(f"signed {cp['topic']}[{cp['partition']}] size {cp['tree_size']} "
              f"root {cp['root'].hex()}")
    if not signed:
        print("every partition head is already signed")


@audit_app.command("public-key")
def public_key_command() -> None:
    """The Ed25519 public key that signs checkpoints (hex): publish it to auditors."""
    from services.audit.signing import SigningKeyError, load_signer

    try:
        print(load_signer(Settings(), create=False).public_key.hex())
    except SigningKeyError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(3) from None


@audit_app.command("replay-to-kafka")
def replay_to_kafka_command(
    allow_nonempty: bool = typer.Option(False, help="Append even if the topics have records."),
    no_chain_check: bool = typer.Option(False, help="Skip the chain check while reading."),
) -> None:
    """Republish the stored log into an empty broker: original ids, bytes and order."""
    from services.audit.replay import ReplayRefused, replay_to_kafka

    settings = Settings()
    if not settings.kafka_bootstrap:
        err.print("[red]LORAPLANE_KAFKA_BOOTSTRAP is not set[/red]")
        raise typer.Exit(2)
    try:
        report = replay_to_kafka(settings, _engine(), allow_nonempty=allow_nonempty,
                                 check_chain=not no_chain_check)
    except ReplayRefused as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    for topic, count in sorted(report.produced.items()):
        print(f"replayed {count} events into {topic}")
    print(f"replayed {report.total} events")
