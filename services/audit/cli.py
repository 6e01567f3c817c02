"""`loraplane audit …`: questions answered from the audit store.

Exit codes: 0 fine, 1 the evidence does not hold (tampering, bad proof), 2 usage or
configuration, 3 the thing asked for does not exist (yet).
"""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from sqlalchemy import Engine, select

from services.config import Settings
from services.rows import print_rows

if TYPE_CHECKING:
    from services.audit.verifier import NoteKey

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
def tail(limit: int = typer.Option(20, min=1, max=10_000),
         as_json: bool = typer.Option(False, "--json", help="Rows as JSON lines")) -> None:
    """The most recently recorded events."""
    from services.audit.tables import events

    engine = _engine()
    with engine.connect() as conn:
        rows = conn.execute(select(events.c.id, events.c.type, events.c.stream, events.c.seq,
                                   events.c.actor, events.c.occurred_at, events.c.topic,
                                   events.c.partition, events.c.offset)
                            .order_by(events.c.id.desc()).limit(limit)).all()
    print_rows(console, ("id", "type", "stream", "seq", "actor", "occurred_at", "position"),
               [(r.id, r.type, r.stream, r.seq, r.actor, r.occurred_at,
                 f"{r.topic}[{r.partition}]@{r.offset}") for r in reversed(rows)],
               as_json=as_json)


def _trusted(keys: list[str] | None, settings: Settings) -> list[NoteKey]:
    """The verifier keys given, else those of this store's own signing key (an operator
    checking their own store; an auditor passes the keys they pinned)."""
    from services.audit.signing import SigningKeyError, load_signer, log_origin
    from services.audit.verifier import EvidenceError, parse_verifier_key

    try:
        if keys:
            return [parse_verifier_key(k) for k in keys]
        signer = load_signer(settings, create=False)
    except (EvidenceError, SigningKeyError) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    return [signer.note_key(log_origin(settings, topic, p)) for topic, p in _logs(settings)]


def _logs(settings: Settings) -> list[tuple[str, int]]:
    """Partition logs: the configured partitions of the chained topics, and any in the
    store."""
    from services.audit.chain import chained_topics

    logs = {(t, p) for t in chained_topics(settings) for p in range(settings.topic_partitions)}
    if settings.database_url:
        from sqlalchemy.exc import SQLAlchemyError

        from services.audit.tables import chain_heads

        try:
            with _engine().connect() as conn:
                logs |= {(r.topic, r.partition) for r in conn.execute(
                    select(chain_heads.c.topic, chain_heads.c.partition))}
        except SQLAlchemyError:
            pass  # keys do not need the database
    return sorted(logs)


KeyOption = typer.Option(None, "--key", help="Trusted verifier key (name+hash+base64), "
                                             "repeatable. Default: this store's own keys.")


@audit_app.command()
def verify(
    key: list[str] = KeyOption,
    checkpoint: list[Path] = typer.Option(
        None, "--checkpoint", exists=True, dir_okay=False,
        help="A checkpoint note kept outside the store; repeatable."),
    against_kafka: bool = typer.Option(
        False, "--against-kafka", help="Also compare the store with the Kafka log, partition "
                                       "by partition, naming every event missing on a side."),
) -> None:
    """Recompute every hash chain and signed checkpoint; name the first bad row."""
    from services.audit.verifier import EvidenceError
    from services.audit.verify import open_external, read_notes, verify_store

    settings = Settings()
    # without --key, stored checkpoints are checked against the key stored with each (a
    # consistency check of the store); checkpoints kept outside need a trusted key
    trusted = _trusted(key, settings) if key or checkpoint else []
    try:
        external = open_external(read_notes(str(p) for p in checkpoint or ()), trusted)
    except (EvidenceError, ValueError) as exc:
        print(f"BAD CHECKPOINT: {exc}")
        raise typer.Exit(1) from None
    engine = _engine()
    report = verify_store(engine, trusted if key else None, external=external,
                          origin_prefix=settings.audit_origin)
    for problem in report.problems:
        print(f"BAD ROW topic={problem.topic} partition={problem.partition} "
              f"offset={problem.offset} event_id={problem.event_id} "
              f"chain_index={problem.chain_index}: {problem.reason}")
    summary = (f"{report.rows} rows, {report.checkpoints} checkpoints, "
               f"{report.partitions} partitions")
    if external:
        summary += f", {len(external)} external checkpoint(s)"
    failed = bool(report.problems)
    if against_kafka:
        failed |= not _against_kafka(settings, engine)
    if failed:
        print(f"FAILED: {len(report.problems)} partition(s) with a bad row ({summary})")
        raise typer.Exit(1)
    print(f"OK: {summary} verified")


def _against_kafka(settings: Settings, engine: Engine) -> bool:
    from services.audit.keys import KeyVault, load_kek
    from services.audit.reconcile import reconcile
    from services.eventlog.errors import EventLogError

    if not settings.kafka_bootstrap:
        err.print("[red]LORAPLANE_KAFKA_BOOTSTRAP is not set[/red]")
        raise typer.Exit(2)
    try:
        report = reconcile(settings, engine, KeyVault(engine, load_kek(settings)))
    except EventLogError as exc:
        err.print(f"[red]cannot read the log: {exc}[/red]")
        raise typer.Exit(2) from None
    for problem in report.problems:
        print(problem.describe())
    print(f"{'KAFKA OK' if report.ok else 'KAFKA FAILED'}: {report.matched} events match the "
          f"log in {report.partitions} partitions ({len(report.problems)} discrepancies; "
          f"{report.expired} past the log's retention, {report.pending} not projected yet, "
          f"{report.skipped} barriers/dead letters/duplicates, {report.shredded} with erased "
          "personal fields)")
    return report.ok


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
    _emit(document, out)


def _emit(document: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(document, indent=2)
    if out is None:
        print(text)
    else:
        out.write_text(text + "\n")


@audit_app.command()
def consistency(
    old: Path = typer.Argument(..., exists=True, dir_okay=False,
                               help="A checkpoint note an auditor kept."),
    new: Path | None = typer.Argument(None, exists=True, dir_okay=False,
                                      help="A later note of the same log (default: the "
                                           "newest signed one)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Write here instead of stdout."),
) -> None:
    """Print a consistency proof (RFC 9162): the log at NEW extends the log at OLD."""
    from services.audit.proof import ProofUnavailable, build_consistency

    try:
        document = build_consistency(_engine(), Settings().audit_origin, old.read_text(),
                                     new.read_text() if new else None)
    except ProofUnavailable as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(3) from None
    _emit(document, out)


@audit_app.command("verify-proof")
def verify_proof_command(
    file: Path = typer.Argument(..., exists=True, dir_okay=False,
                                help="An inclusion or consistency proof (JSON)."),
    key: list[str] = KeyOption,
) -> None:
    """Check a proof with no database: the same code as the stand-alone verifier."""
    from services.audit.verifier import (
        CONSISTENCY_FORMAT,
        EvidenceError,
        check_consistency,
        check_inclusion,
    )

    trusted = _trusted(key, Settings())
    try:
        document = json.loads(file.read_text())
        if document.get("format") == CONSISTENCY_FORMAT:
            old, new = check_consistency(document, trusted)
            print(f"OK: {new.origin} at size {new.size} extends its checkpoint of size "
                  f"{old.size}")
            return
        cp = check_inclusion(document, trusted)
    except (EvidenceError, ValueError, AttributeError) as exc:
        print(f"INVALID: {exc}")
        raise typer.Exit(1) from None
    print(f"OK: event {document.get('event_id')} is entry {document['leaf_index']} of "
          f"{cp.origin} in the checkpoint of size {cp.size}")


@audit_app.command()
def checkpoint() -> None:
    """Sign the current head of every partition not yet covered by a checkpoint."""
    from services.audit.projector import AuditProjector

    signed = AuditProjector(Settings(), _engine()).checkpoint_now()
    for cp in signed:
        print(f"signed {cp['origin']} size {cp['tree_size']} "
              f"root {base64.b64encode(cp['root']).decode()}")
    if not signed:
        print("every partition head is already signed")


@audit_app.command("public-key")
def public_key_command() -> None:
    """The verifier key of every partition log (name+hash+base64): publish to auditors."""
    from services.audit.signing import SigningKeyError, load_signer, log_origin

    settings = Settings()
    try:
        signer = load_signer(settings, create=False)
    except SigningKeyError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(3) from None
    for topic, partition in _logs(settings):
        print(signer.note_key(log_origin(settings, topic, partition)).vkey)


@audit_app.command()
def reveal(event_id: str = typer.Argument(..., help="The event's id (UUID).")) -> None:
    """Print a stored event with its personal fields opened (needs the KEK): what the
    tenant's key still unlocks; `[erased]` where a purge destroyed it."""
    from services.audit.keys import KeyUnavailable, KeyVault, load_kek
    from services.audit.sealing import SealingError, unseal
    from services.audit.tables import events

    try:
        wanted = uuid.UUID(event_id)
    except ValueError:
        err.print(f"[red]not a UUID: {event_id}[/red]")
        raise typer.Exit(2) from None
    engine = _engine()
    with engine.connect() as conn:
        row = conn.execute(select(events.c.type, events.c.canonical)
                           .where(events.c.event_id == wanted)).first()
    if row is None:
        err.print(f"[red]event {event_id} is not in the audit store[/red]")
        raise typer.Exit(3)
    try:
        opened = unseal(row.type, wanted, bytes(row.canonical),
                        KeyVault(engine, load_kek(Settings())))
    except (KeyUnavailable, SealingError) as exc:
        print(f"INVALID: {exc}")
        raise typer.Exit(1) from None
    print(json.dumps(json.loads(opened), indent=2, ensure_ascii=False))


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


@audit_app.command()
def sql(
    query: str = typer.Argument(..., help='A query, e.g. "select * from purge_proofs"'),
    limit: int = typer.Option(200, "--limit", min=1, max=100_000, help="Rows shown at most"),
    as_json: bool = typer.Option(False, "--json", help="Rows as JSON lines"),
) -> None:
    """Ask the audit store in SQL, read-only (views: adapter_lineage, served_by,
    purge_proofs, rollback_candidates, release_decisions, events_json)."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError, OperationalError

    engine = _engine()
    try:
        with engine.connect() as conn:
            conn.execute(text("SET TRANSACTION READ ONLY"))
            result = conn.execute(text(query))
            if not result.returns_rows:
                console.print("(no rows)")
                return
            columns = list(result.keys())
            rows = result.fetchmany(limit)
            more = result.fetchone() is not None
    except OperationalError as exc:
        err.print(f"[red]no database: {_first_line(exc)}[/red]")
        raise typer.Exit(2) from None
    except DBAPIError as exc:
        err.print(f"[red]{_first_line(exc)}[/red]")
        raise typer.Exit(2) from None
    finally:
        engine.dispose()
    print_rows(console, columns, rows, as_json=as_json)
    if not as_json:
        console.print(f"{len(rows)} row(s)" + (f", more not shown (--limit {limit})" if more
                                               else ""))


def _first_line(exc: Exception) -> str:
    orig = getattr(exc, "orig", None) or exc
    return str(orig).strip().splitlines()[0] if str(orig).strip() else type(exc).__name__
