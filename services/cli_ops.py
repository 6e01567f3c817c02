"""Operator commands of `loraplane` beside the ones in `services.cli`: health probes for
compose and Kubernetes, and the read verbs and workflows the operations checklist names.

`register(app)` adds them to the `loraplane` typer app (`services.cli` calls it), so they
are `loraplane …` commands like the others. This module never imports `services.cli`:
run as `python -m services.cli`, that module is `__main__`, and a second copy would get
the commands instead.
"""

from __future__ import annotations

import typer
from rich.console import Console

from services.config import Settings

err = Console(stderr=True)

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

    from services.client import grpc_serving

    def get(url: str) -> httpx.Response | str:
        try:
            return httpx.get(url, timeout=timeout_s)
        except httpx.HTTPError as exc:
            return f"{url}: {type(exc).__name__}: {exc}"

    if service == "worker":
        address = f"{local(settings.worker_host)}:{settings.worker_port}"
        return None if grpc_serving(address) else f"worker at {address} is not SERVING"
    registry = (settings.registry_url
                or f"http://{local(settings.registry_host)}:{settings.registry_port}")
    url = {
        "registry": f"{registry}/readyz",
        "router": f"http://{local(settings.router_host)}:{settings.router_http_port}/readyz",
        "audit": f"http://{local(settings.audit_http_host)}:{settings.audit_metrics_port}"
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


def register(app: typer.Typer) -> None:
    app.command("health")(health)
