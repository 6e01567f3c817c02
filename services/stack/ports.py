"""The fixed ports `loraplane up` listens on, checked before anything starts, or all
replaced by free ones (`up --ports auto`).

A port another program (or another stack) holds would otherwise surface as a service
that exits during start with a traceback in its log; checked first, it is one line that
names the port, the service and the setting that moves it.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

from services.config import Settings
from services.stack.process import free_port


@dataclass(frozen=True)
class FixedPort:
    service: str
    setting: str
    """The Settings field holding the port."""
    host_setting: str
    """The Settings field holding the address it binds."""
    what: str


PORTS = (
    FixedPort("registry", "registry_port", "registry_host", "REST"),
    FixedPort("router", "router_port", "router_host", "gRPC"),
    FixedPort("router", "router_http_port", "router_host", "OpenAI HTTP"),
    FixedPort("audit", "audit_metrics_port", "audit_http_host", "metrics and checkpoints"),
    FixedPort("canary", "canary_metrics_port", "canary_metrics_host", "metrics"),
    FixedPort("worker-1", "worker_port", "worker_host", "gRPC"),
    FixedPort("worker-1", "worker_metrics_port", "worker_host", "metrics"),
)


class PortInUse(RuntimeError):
    """A port `up` needs is taken: the message is the one line to show."""


def _wanted(services: Sequence[str], workers: int) -> list[FixedPort]:
    return [p for p in PORTS if p.service in services or (p.service == "worker-1" and workers)]


def taken(host: str, port: int) -> bool:
    """Whether a listener holds (host, port); a port in TIME_WAIT is free, as it is to
    the servers, which bind with SO_REUSEADDR."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def check_ports(settings: Settings, services: Sequence[str], workers: int) -> None:
    """Raise `PortInUse` for the first fixed port (0 = any, never checked) that is taken."""
    for p in _wanted(services, workers):
        port = int(getattr(settings, p.setting))
        host = str(getattr(settings, p.host_setting)) or "0.0.0.0"
        if port and taken(host, port):
            raise PortInUse(
                f"port {port} ({p.service} {p.what}) is in use by another program or stack: "
                f"set LORAPLANE_{p.setting.upper()} to a free port, or run "
                "`loraplane up --ports auto`")


def auto_ports(settings: Settings, services: Sequence[str], workers: int) -> dict[str, int]:
    """A free port for every fixed port this stack would listen on (settings updates);
    0 (any port, or a worker's metrics off) stays as it is."""
    return {p.setting: free_port() for p in _wanted(services, workers)
            if getattr(settings, p.setting)}
