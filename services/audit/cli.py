"""`loraplane audit …`: questions answered from the audit store."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy import select

from services.config import Settings

audit_app = typer.Typer(help="Audit store: events, proofs, verification.", no_args_is_help=True)
console = Console()


def _engine():
    from services.audit.db import make_engine

    url = Settings().database_url
    if not url:
        console.print("[red]LORAPLANE_DATABASE_URL is not set[/red]")
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
