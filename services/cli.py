"""The `loraplane` command."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import typer
from rich.console import Console

from services.audit.cli import audit_app
from services.config import Settings

app = typer.Typer(help="loraplane: multi-tenant LoRA adapter platform", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)
serve_app = typer.Typer(help="Run one loraplane process in the foreground.",
                        no_args_is_help=True)
app.add_typer(serve_app, name="serve")
app.add_typer(audit_app, name="audit")
gate_app = typer.Typer(help="Quality gates of adapter versions.", no_args_is_help=True)
app.add_typer(gate_app, name="gate")
console = Console()


def _settings() -> Settings:
    return Settings()


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


@app.command()
def up() -> None:
    """Start broker, PostgreSQL, migrations, topics and services; Ctrl-C stops them all."""
    from services.stack.stack import Stack, StackAlreadyRunning

    stop = _stop_on_signals()
    stack = Stack(_settings())
    try:
        stack.start()
    except StackAlreadyRunning as exc:
        console.print(f"[yellow]{exc}[/yellow]")
        raise typer.Exit(1) from None
    try:
        for e in stack.endpoints:
            console.print(f"[bold]{e.name:10}[/bold] {e.where}  [dim]{e.detail}[/dim]")
        console.print("[green]loraplane is up[/green]; Ctrl-C stops everything it started")
        while not stop.wait(0.5):
            problem = stack.check_children()
            if problem:
                console.print(f"[red]{problem}[/red]")
                raise typer.Exit(1)
    finally:
        console.print("stopping…")
        stack.stop()
        console.print("stopped")


@app.command()
def demo() -> None:
    """Run the main job on the embedded default and print what happened."""
    from services.demo import run_demo

    run_demo(_settings())


@app.command()
def migrate(revision: str = typer.Option("head", help="Target revision"),
            down: bool = typer.Option(False, help="Downgrade to REVISION instead")) -> None:
    """Apply (or revert) the Alembic migrations of the audit store."""
    from services.audit import db

    url = _settings().database_url
    if not url:
        console.print("[red]LORAPLANE_DATABASE_URL is not set[/red]")
        raise typer.Exit(2)
    if down:
        db.downgrade(url, revision)
    else:
        db.upgrade(url, revision)
    console.print(f"migrated {'down' if down else 'up'} to {revision}")


@app.command()
def topics() -> None:
    """Create the event topics that do not exist yet."""
    from services.eventlog.topics import ensure_topics

    created = ensure_topics(_settings())
    console.print(f"created: {', '.join(created) or 'nothing (all exist)'}")


@app.command("fetch-kafka")
def fetch_kafka() -> None:
    """Fetch the Apache Kafka jars into the project cache (once)."""
    from services.stack.brokers import kafka_jars

    console.print(f"Kafka jars in {kafka_jars(_settings())}")


@serve_app.command("audit")
def serve_audit() -> None:
    """The audit projector: both topics into PostgreSQL, exactly once; /metrics and
    /checkpoints on LORAPLANE_AUDIT_METRICS_PORT."""
    from services.audit.server import serve

    settings = _settings()
    logging.basicConfig(level=settings.log_level)
    if not settings.database_url or not settings.kafka_bootstrap:
        console.print("[red]set LORAPLANE_DATABASE_URL and LORAPLANE_KAFKA_BOOTSTRAP[/red]")
        raise typer.Exit(2)
    serve(settings, _stop_on_signals())


@serve_app.command("registry")
def serve_registry() -> None:
    """The registry: REST control plane and single writer of the adapter log."""
    from services.registry.server import serve

    serve(_settings())


@serve_app.command("router")
def serve_router() -> None:
    """The router: gRPC Inference and the OpenAI-compatible HTTP API in front of the workers."""
    from services.router.app import serve

    serve(_settings())


@serve_app.command("canary")
def serve_canary() -> None:
    """The canary controller: advances or rolls back rollouts from the request traces."""
    from services.release.canary_app import serve

    settings = _settings()
    if not settings.kafka_bootstrap or not settings.canary_token:
        console.print("[red]set LORAPLANE_KAFKA_BOOTSTRAP and LORAPLANE_CANARY_TOKEN (a token "
                      "of role canary)[/red]")
        raise typer.Exit(2)
    serve(settings)


def _api_token(settings: Settings) -> str | None:
    """LORAPLANE_API_TOKEN, else the admin token a local `loraplane up` wrote."""
    if settings.api_token:
        return settings.api_token
    written = settings.state_dir / "admin.token"
    return written.read_text().strip() if written.exists() else None


@gate_app.command("report")
def gate_report(
    adapter: str = typer.Argument(..., help="Adapter id"),
    version: int = typer.Argument(..., help="Version number"),
    as_json: bool = typer.Option(False, "--json", help="Print the registry's answer as JSON"),
) -> None:
    """Base / previous / new outputs side by side with each check's verdict.

    Exit 0 when the version may get traffic, 1 when it may not, 2 on errors.
    """
    import json

    import httpx

    from services.release.report import gate_report as render

    settings = _settings()
    token = _api_token(settings)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.get(f"{settings.registry_base_url}/v1/adapters/{adapter}/versions/"
                             f"{version}/gate", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        console.print(f"[red]registry at {settings.registry_base_url} unreachable: {exc}[/red]")
        raise typer.Exit(2) from None
    if response.status_code != 200:
        console.print(f"[red]{response.status_code}: {response.text}[/red]")
        raise typer.Exit(2)
    gate = response.json()
    if as_json:
        typer.echo(json.dumps(gate, indent=2))
    else:
        console.print(render(gate))
    raise typer.Exit(0 if gate["may_get_traffic"] else 1)


@serve_app.command("worker")
def serve_worker() -> None:
    """A worker: one base model (LORAPLANE_BASE_MODEL), its adapters, gRPC inference."""
    from services.worker.app import run_worker

    settings = _settings()
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.base_model is None or not settings.kafka_bootstrap:
        console.print("[red]set LORAPLANE_BASE_MODEL (a Hugging Face model directory) and "
                      "LORAPLANE_KAFKA_BOOTSTRAP[/red]")
        raise typer.Exit(2)
    run_worker(settings)


@app.command("base-digest")
def base_digest(
    model_dir: Path = typer.Argument(..., help="A Hugging Face model directory"),
    name: str = typer.Option("", help="Name to register it under (default: the folder)"),
    as_json: bool = typer.Option(False, "--json",
                                 help="Print the body of POST /v1/base-models instead"),
) -> None:
    """The base digest a worker computes for a model directory, to register it."""
    import json

    from services.worker.engine import CheckpointError, checkpoint_digest

    try:
        digest = checkpoint_digest(model_dir)
    except CheckpointError as exc:
        console.print(f"[red]{model_dir}: {exc}[/red]")
        raise typer.Exit(2) from None
    if not as_json:
        typer.echo(digest)
        return
    config = json.loads((model_dir / "config.json").read_text())
    typer.echo(json.dumps({"name": name or model_dir.resolve().name.lower(), "digest": digest,
                           "config": config}))


@app.command()
def status() -> None:
    """Show what a running `loraplane up` started, and whether each part answers."""
    import json

    settings = _settings()
    where = settings.state_dir / "endpoints.json"
    if not where.exists():
        console.print("no loraplane up is running here")
        raise typer.Exit(1)
    for e in json.loads(where.read_text()):
        console.print(f"[bold]{e['name']:10}[/bold] {e['where']}  [dim]{e['detail']}[/dim]")


def main() -> None:  # pragma: no cover - console entry point alias
    app()


if __name__ == "__main__":
    app()
