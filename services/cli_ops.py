"""Operator commands of `loraplane` beside the ones in `services.cli`: health probes for
compose and Kubernetes, and the read verbs and workflows the operations checklist names.

`register(app)` adds them to the `loraplane` typer app (`services.cli` calls it), so they
are `loraplane …` commands like the others. This module never imports `services.cli`:
run as `python -m services.cli`, that module is `__main__`, and a second copy would get
the commands instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from services.config import Settings
from services.rows import print_rows

err = Console(stderr=True, soft_wrap=True)  # an error is one line, whatever the width

HEALTH_SERVICES = ("registry", "router", "worker", "audit", "canary")


def local(host: str) -> str:
    """Where a probe beside the process reaches a listener bound to `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def probe(service: str, settings: Settings, timeout_s: float = 3.0) -> str | None:
    """Why SERVICE, where these settings put it, is not ready (None: it is).

    The registry and the router by their `/readyz`, the worker by gRPC health SERVING,
    the projector and the canary controller by their `/metrics` (the controller's
    `loraplane_canary_ready` at 1)."""
    import httpx

    from services import tls
    from services.client import grpc_serving

    def get(url: str) -> httpx.Response | str:
        try:
            return httpx.get(url, timeout=timeout_s, verify=tls.client_ssl_context(settings))
        except httpx.HTTPError as exc:
            return f"{url}: {type(exc).__name__}: {exc}"

    if service == "worker":
        address = f"{local(settings.worker_host)}:{settings.worker_port}"
        return None if grpc_serving(address, settings) else \
            f"worker at {address} is not SERVING"
    scheme = tls.http_scheme(settings)
    registry = (settings.registry_url
                or f"{scheme}://{local(settings.registry_host)}:{settings.registry_port}")
    url = {
        "registry": f"{registry}/readyz",
        "router": f"{scheme}://{local(settings.router_host)}:{settings.router_http_port}"
                  "/readyz",
        "audit": f"{scheme}://{local(settings.audit_http_host)}:{settings.audit_metrics_port}"
                 "/metrics",
        "canary": f"http://{local(settings.canary_metrics_host)}:"
                  f"{settings.canary_metrics_port}/metrics",
    }[service]
    answer = get(url)
    if isinstance(answer, str):
        return answer
    if answer.status_code != 200:
        return f"{url}: {answer.status_code} {answer.text.strip()[:200]}"
    if service == "canary" and "loraplane_canary_ready 1.0" not in answer.text:
        return "canary controller is replaying the log"
    return None


def health(
    service: str = typer.Argument(..., help="registry, router, worker, audit or canary"),
    timeout: float = typer.Option(3.0, "--timeout", min=0.1, help="Seconds per probe"),
) -> None:
    """Exit 0 when SERVICE, where this environment's LORAPLANE_* settings put it, is ready;
    else 1 with the reason on stderr: the health probe of compose and Kubernetes."""
    if service not in HEALTH_SERVICES:
        err.print(f"error: no service {service!r} (one of {', '.join(HEALTH_SERVICES)})")
        raise typer.Exit(2)
    reason = probe(service, Settings(), timeout)
    if reason is not None:
        err.print(f"{service} not ready: {reason}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    typer.echo(f"{service} ready")


# --- read verbs over the registry's GET routes ---------------------------------------------

JsonOption = typer.Option(False, "--json", help="JSON lines, one object per row")
out = Console()


def _registry():  # -> RegistryClient
    from services.client import RegistryClient

    return RegistryClient(Settings(), timeout_s=30)


def _pages(registry: Any, path: str) -> list[dict[str, Any]]:
    """Every item of a paginated GET route."""
    items: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        page = registry.request("GET", path,
                                params={"limit": 200, **({"cursor": cursor} if cursor else {})})
        items += page.get("items", [])
        cursor = page.get("next_cursor")
        if not cursor:
            return items


def _tenant(item: dict[str, Any]) -> str:
    t = item.get("tenant") or {}
    return "/".join(t.get(k, "") for k in ("org", "team", "project")) if t else ""


def _split(split: list[dict[str, Any]]) -> str:
    return ", ".join(f"{e['adapter_id']}@{e['version']} {e['weight']}%" for e in split)


VERSION_COLUMNS = ("version", "label", "active", "qos_tier", "rank", "dtype", "size_bytes",
                   "sha256", "published_at", "disabled", "purged", "owner")


def adapters_list(as_json: bool = JsonOption) -> None:
    """Adapters the token may read: tenant, active and latest version, disabled and purged
    versions."""
    with _registry() as registry:
        items = _pages(registry, "/v1/adapters")
    if as_json:
        for item in items:
            print(json.dumps(item))
        return
    print_rows(out, ("adapter", "tenant", "active", "latest", "versions", "disabled", "purged"),
               [(a["adapter_id"], _tenant(a), a.get("active_version"), a["latest_version"],
                 a["versions"], a.get("disabled_versions"), a.get("purged_versions"))
                for a in items], title=f"{len(items)} adapter(s)")


def adapters_show(adapter: str = typer.Argument(..., help="Adapter id"),
                  as_json: bool = JsonOption) -> None:
    """One adapter and its versions."""
    with _registry() as registry:
        item = registry.request("GET", f"/v1/adapters/{adapter}")
        versions = _pages(registry, f"/v1/adapters/{adapter}/versions")
    if as_json:
        print(json.dumps({**item, "version_list": versions}))
        return
    print_rows(out, ("field", "value"), [
        ("adapter", item["adapter_id"]), ("tenant", _tenant(item)),
        ("active version", item.get("active_version")),
        ("latest version", item["latest_version"]),
        ("rollback target", item.get("rollback_target")),
        ("disabled versions", item.get("disabled_versions")),
        ("purged versions", item.get("purged_versions"))], title=adapter)
    _print_versions(versions)


def _print_versions(versions: list[dict[str, Any]]) -> None:
    print_rows(out, VERSION_COLUMNS, [
        (v["version"], v["label"], "yes" if v.get("active") else "", v["qos_tier"], v["rank"],
         v["dtype"], v["size_bytes"], v["sha256"][:16], v["published_at"],
         v.get("disabled_reason") or ("yes" if v.get("disabled") else ""),
         v.get("purged_by") or ("yes" if v.get("purged") else ""), v["owner"])
        for v in versions], title=f"{len(versions)} version(s)")


def versions(adapter: str = typer.Argument(..., help="Adapter id"),
             as_json: bool = JsonOption) -> None:
    """Every version of an adapter: label, state, rank, digest, when and by whom."""
    with _registry() as registry:
        items = _pages(registry, f"/v1/adapters/{adapter}/versions")
    if as_json:
        for item in items:
            print(json.dumps(item))
        return
    _print_versions(items)


def aliases(as_json: bool = JsonOption) -> None:
    """Aliases and their traffic splits."""
    with _registry() as registry:
        items = _pages(registry, "/v1/aliases")
    if as_json:
        for item in items:
            print(json.dumps(item))
        return
    print_rows(out, ("alias", "tenant", "split", "changed_at"),
               [(a["alias"], _tenant(a), _split(a["split"]), a["changed_at"]) for a in items],
               title=f"{len(items)} alias(es)")


def base_models(as_json: bool = JsonOption) -> None:
    """Registered base models: name, digest, architecture."""
    with _registry() as registry:
        items = list(registry.request("GET", "/v1/base-models"))
    if as_json:
        for item in items:
            print(json.dumps(item))
        return
    print_rows(out, ("name", "digest", "architecture", "layers", "registered_at"), [
        (m["name"], m["digest"], ", ".join(m.get("config", {}).get("architectures", [])),
         m.get("config", {}).get("num_hidden_layers"), m["registered_at"]) for m in items],
        title=f"{len(items)} base model(s)")


def deploy(
    adapter_dir: Path = typer.Argument(..., help="A PEFT adapter folder (adapter_config.json "
                                                 "+ adapter_model.safetensors)"),
    tenant: str = typer.Option(..., "--tenant", help="org/team/project"),
    adapter: str | None = typer.Option(None, "--adapter",
                                       help="Adapter id (default: the folder's name)"),
    alias: str | None = typer.Option(None, "--alias",
                                     help="Alias the canary runs on (default: the adapter id)"),
    label: str = typer.Option("", "--label", help="Version label (default: the folder name)"),
    regression_set: Path | None = typer.Option(
        None, "--regression-set", exists=True, dir_okay=False,
        help="JSONL regression set for the quality gate"),
    stages: str | None = typer.Option(
        None, "--stages", help="Canary percentages, e.g. 5,25,50,100 (default: the "
                               "registry's LORAPLANE_CANARY_STAGES)"),
    min_stage_s: float | None = typer.Option(
        None, "--min-stage-s", min=0.001, help="Least seconds at each stage (default: the "
                                               "registry's, 15 minutes)"),
    qos_tier: str = typer.Option("silver", "--qos-tier"),
    owner: str = typer.Option("cli", "--owner"),
    base_model: str | None = typer.Option(None, "--base-model"),
    timeout: float = typer.Option(24 * 3600.0, "--timeout", min=1.0,
                                  help="Give up waiting after this many seconds"),
) -> None:
    """Publish a version, wait for its quality gate, then walk the canary through its
    stages with live progress. Exit 0 when it completed (or a first version was made
    active), 1 with the controller's figures when it was rolled back, the gate failed or
    the rollout was halted."""
    from rich.status import Status

    from services.client import ClientError, tenant_parts
    from services.release.deploy import Deployment, DeployPlan, arm, split_line

    tenant_parts(tenant)
    try:
        stage_list = [int(x) for x in stages.split(",")] if stages else None
    except ValueError:
        raise ClientError(f"--stages {stages!r} is not a list of percentages like "
                          "5,25,50,100") from None
    adapter_id = adapter or adapter_dir.resolve().name
    plan = DeployPlan(adapter_dir=adapter_dir, tenant=tenant, adapter_id=adapter_id,
                      alias=alias or adapter_id, label=label or adapter_dir.resolve().name,
                      owner=owner, qos_tier=qos_tier, base_model=base_model,
                      regression_set=regression_set, stages=stage_list,
                      min_stage_s=min_stage_s, timeout_s=timeout)
    with _registry() as registry, Status("", console=err) as status:
        outcome = Deployment(registry, plan, lambda line: out.print(line, highlight=False,
                                                                    markup=False),
                             progress=status.update).run()
    if outcome.ok:
        if outcome.status == "completed":
            out.print(f"[green]deployed[/green] {adapter_id} v{outcome.version}: the rollout "
                      f"completed; {split_line(outcome.rollout['split'])}")  # type: ignore[index]
        return
    err.print(f"[red]deploy of {adapter_id} v{outcome.version} {outcome.status.replace('_', ' ')}"
              f"[/red]: {outcome.reason}", highlight=False)
    judged = (outcome.rollout or {}).get("last_judgement")
    if judged:
        err.print(f"controller's figures: verdict {judged['verdict']}; canary v"
                  f"{judged['canary']['version']} {arm(judged['canary'])}; baseline v"
                  f"{judged['baseline']['version']} {arm(judged['baseline'])}; window "
                  f"{judged['window_start'][11:19]} to {judged['window_end'][11:19]}"
                  + (f"; {'; '.join(judged['reasons'])}" if judged.get("reasons") else ""),
                  highlight=False)
    raise typer.Exit(1)


def show_version(value: bool) -> None:
    """`loraplane --version`: the installed package's version, then exit."""
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"loraplane {version('loraplane')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            typer.echo("loraplane (not installed)")
        raise typer.Exit()


def register(app: typer.Typer, clear_errors: Callable[[Callable[..., Any]], Any]) -> None:
    """Add the commands to the `loraplane` app; `clear_errors` is its one-line error
    handling (a failed request: one red line on stderr and exit 1)."""
    app.command("health")(health)
    adapters_app = typer.Typer(help="Adapters in the registry.", no_args_is_help=True)
    adapters_app.command("list")(clear_errors(adapters_list))
    adapters_app.command("show")(clear_errors(adapters_show))
    app.add_typer(adapters_app, name="adapters")
    app.command("versions")(clear_errors(versions))
    app.command("aliases")(clear_errors(aliases))
    app.command("base-models")(clear_errors(base_models))
    app.command("deploy")(clear_errors(deploy))
