"""`loraplane up`: broker, PostgreSQL, migrations, topics and every service, on one machine.

Start order: broker and PostgreSQL (both keep their data under the state folder), the
migrations, the topics, a refill of an empty broker from the audit store
(`services.stack.refill`), then the audit projector, the registry (ready once it has
replayed the log), the base model's registration (its digest computed as workers compute
it, so they become ready), the router, the canary controller and N workers, each with its
own id, ports and state folder.

It supervises: `supervise()` (called by `up` twice a second) restarts a service that
exited, with the backoff of `RestartPolicy`, and logs it; one child's exit never stops the
stack, so "kill a worker" is a drill, not an outage. A broker or PostgreSQL that died is
started again on the same port with the same data; a broker that lost its log (Tansu) is
refilled and every service restarted, since their positions point into the lost log.

What it starts it stops, in reverse order, on Ctrl-C, SIGTERM or a failed start; every
child also carries a parent-death signal, so nothing outlives `up`. One stack per state
folder: a second `up` finds the lock and says where the first one listens. Where each part
listens is written to STATE_DIR/endpoints.json, which the CLI reads.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from services import tls
from services.client import ENDPOINTS_FILE, grpc_serving, scrape
from services.config import Settings
from services.eventlog.topics import ensure_topics
from services.stack.brokers import EmbeddedBroker, embedded_broker
from services.stack.postgres import LocalPostgres
from services.stack.process import ChildProcess, free_port
from services.stack.supervisor import RestartPolicy

log = logging.getLogger("loraplane.up")

SERVICES: dict[str, str] = {"audit": "audit projector", "registry": "registry (REST)",
                            "router": "router", "canary": "canary controller"}
"""Services `up` starts, by `loraplane serve` name, in start order; workers come last."""

DEFAULT_SERVICES = tuple(SERVICES)
TOKEN_ROLES = ("admin", "worker", "canary")
"""Dev tokens `up` generates when no LORAPLANE_AUTH_TOKENS is given: STATE_DIR/ROLE.token."""

CLIENT_SETTINGS = ("kafka_bootstrap", "database_url", "registry_url", "router_host",
                   "router_port", "router_http_port", "audit_metrics_port", "canary_metrics_port",
                   "state_dir", "adapter_events_topic", "worker_events_topic", "liveness_topic",
                   "dead_letter_topic", "topic_partitions")
"""What a client needs to find the running stack: written to endpoints.json as LORAPLANE_*
variables, which the CLI takes where the environment does not name them."""


class StackAlreadyRunning(RuntimeError):
    pass


class StackError(RuntimeError):
    """The stack could not start: one line that says what and where to look."""


@dataclass
class Endpoint:
    name: str
    where: str
    started_here: bool
    detail: str = ""


@dataclass
class Service:
    """One supervised `loraplane serve …` process."""

    name: str
    kind: str
    env: dict[str, str]
    log_path: Path
    ready: Callable[[], bool]
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    child: ChildProcess | None = None
    restarts: int = 0
    netns: str | None = None
    """The network namespace it runs in (a host of `services.cluster`); None: this one."""

    def start(self) -> None:
        self.child = ChildProcess(self.name,
                                  [sys.executable, "-m", "services.cli", "serve", self.kind],
                                  self.log_path, env=self.env, netns=self.netns)
        self.policy.started(time.monotonic())

    def alive(self) -> bool:
        return self.child is not None and self.child.alive()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM and wait: as long as the process's drain may take (its `*_drain_s`)
        and a little more, then SIGKILL."""
        if self.child is not None:
            self.child.stop(timeout=grace_s)

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child is not None else None


@dataclass
class WorkerPlace:
    worker_id: str
    port: int
    metrics_port: int
    state_dir: Path


@dataclass
class Stack:
    settings: Settings
    services: Sequence[str] = DEFAULT_SERVICES
    state_dir: Path | None = None
    workers: int = 0
    base_model: Path | None = None
    """The workers' model directory; default SmolLM2-135M-Instruct (converted once)."""
    endpoints: list[Endpoint] = field(default_factory=list)
    base_model_name: str | None = None
    _broker: EmbeddedBroker | None = None
    _postgres: LocalPostgres | None = None
    _running: list[Service] = field(default_factory=list)
    _places: list[WorkerPlace] = field(default_factory=list)
    _broker_policy: RestartPolicy = field(default_factory=RestartPolicy)
    _postgres_policy: RestartPolicy = field(default_factory=RestartPolicy)
    _lock: IO[str] | None = None
    auto_ports: bool = False
    """Listen on free ports instead of the settings' fixed ones (`up --ports auto`); where
    is written to endpoints.json as always."""

    @property
    def root(self) -> Path:
        return (self.state_dir or self.settings.state_dir).resolve()

    @property
    def children(self) -> list[Service]:
        return list(self._running)

    # --- lock ----------------------------------------------------------------------------

    def _acquire_lock(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        handle = (self.root / "up.lock").open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            info = handle.read().strip() or "unknown pid"
            handle.close()
            raise StackAlreadyRunning(
                f"loraplane up is already running for {self.root} ({info}); stop it with "
                f"Ctrl-C there first, or see `loraplane status`") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        self._lock = handle

    # --- start ---------------------------------------------------------------------------

    def start(self) -> Settings:
        """Start everything; returns the settings the services were given."""
        self._acquire_lock()
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Settings:
        from services.stack.ports import auto_ports, check_ports

        if self.auto_ports:
            self.settings = self.settings.model_copy(
                update=auto_ports(self.settings, self.services, self.workers))
        check_ports(self.settings, self.services, self.workers)
        settings = self.settings
        updates: dict[str, object] = {"state_dir": self.root}
        if settings.kafka_bootstrap:
            self.endpoints.append(Endpoint("kafka", settings.kafka_bootstrap, False, "given"))
        else:
            self._broker = embedded_broker(settings, self.root)
            self._broker.start()
            self._broker_policy.started(time.monotonic())
            updates["kafka_bootstrap"] = self._broker.bootstrap
            self.endpoints.append(Endpoint(
                "kafka", self._broker.bootstrap, True,
                f"{self._broker.kind} broker" + ("" if self._broker.durable else ", in memory")))
        if settings.database_url:
            self.endpoints.append(Endpoint("postgres", _redact(settings.database_url), False,
                                           "given"))
        else:
            self._postgres = LocalPostgres(self.root / "postgres")
            self._postgres.start()
            self._postgres_policy.started(time.monotonic())
            updates["database_url"] = self._postgres.url
            self.endpoints.append(Endpoint("postgres", self._postgres.url, True,
                                           f"{self._postgres.version}, data in "
                                           f"{self.root / 'postgres'}"))
        if "audit" in self.services and settings.audit_metrics_port == 0:
            updates["audit_metrics_port"] = free_port()
        if "canary" in self.services and settings.canary_metrics_port == 0:
            updates["canary_metrics_port"] = free_port()
        if not settings.registry_url:
            updates["registry_url"] = (f"{tls.http_scheme(settings)}://{settings.registry_host}:"
                                       f"{settings.registry_port}")
        updates.update(self._tokens(settings))
        settings = self.settings = settings.model_copy(update=updates)
        from services.audit.db import make_engine, upgrade

        assert settings.database_url is not None
        upgrade(settings.database_url)
        created = ensure_topics(settings)
        self.endpoints.append(Endpoint("topics", ", ".join(settings.topics), True,
                                       f"{len(created)} created"))
        engine = make_engine(settings.database_url)
        try:
            from services.stack.refill import refill_if_empty

            refill = refill_if_empty(settings, engine)
        finally:
            engine.dispose()
        if refill is not None:
            self.endpoints.append(Endpoint("refill", f"{refill.events} events", True,
                                           "the broker was empty: republished from the "
                                           "audit store"))
        self._start_services(settings)
        self.endpoints.append(Endpoint(
            "tls", "on" if tls.serves_tls(settings) else "off", True,
            tls.describe(settings) if tls.serves_tls(settings) else
            "plaintext: every listener binds loopback by default; set LORAPLANE_TLS_CERT_FILE,"
            " _KEY_FILE and _CA_FILE for TLS"))
        self._write_endpoints(settings)
        return settings

    def _tokens(self, settings: Settings) -> dict[str, object]:
        """A local stack gets dev tokens (admin, worker, canary) in STATE_DIR/ROLE.token,
        mode 0600. Without them the registry would answer 401 to everything; production
        configures LORAPLANE_AUTH_TOKENS (and the worker and canary tokens) explicitly and
        `up` then generates nothing."""
        if settings.auth_tokens:
            return {}
        entries, updates = [], {}
        for role in TOKEN_ROLES:
            token = self._dev_token(role)
            entries.append({"sha256": hashlib.sha256(token.encode()).hexdigest(),
                            "role": role})
            if role != "admin":
                updates[f"{role}_token"] = token
        self.endpoints.append(Endpoint(
            "tokens", str(self.root / "admin.token"), True,
            "admin; worker.token and canary.token beside it; "
            "curl -H \"Authorization: Bearer $(cat …)\""))
        return {"auth_tokens": json.dumps(entries), **updates}

    def _dev_token(self, role: str) -> str:
        path = self.root / f"{role}.token"
        if not path.exists():
            path.touch(mode=0o600)
            path.write_text(secrets.token_urlsafe(32))
        return path.read_text().strip()

    def _service_env(self, settings: Settings, **values: object) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}
        env.update(env_of(settings.model_copy(update=values)))
        return env

    def _start_services(self, settings: Settings) -> None:
        logs = self.root / "logs"
        scheme, verify = tls.http_scheme(settings), tls.client_ssl_context(settings)
        ready: dict[str, Callable[[], bool]] = {
            "audit": lambda: _http_ok(f"{scheme}://{_loopback(settings.audit_http_host)}:"
                                      f"{settings.audit_metrics_port}/metrics", verify),
            "registry": lambda: _http_ok(f"{settings.registry_base_url}/readyz", verify),
            "router": lambda: self._router_ready(settings),
            "canary": lambda: _http_ok(f"http://{_loopback(settings.canary_metrics_host)}:"
                                       f"{settings.canary_metrics_port}/metrics"),
        }
        for name in SERVICES:
            if name not in self.services:
                continue
            if name == "canary" and not settings.canary_token:
                log.warning("no canary controller: LORAPLANE_CANARY_TOKEN is not set")
                continue
            service = Service(name, name, self._service_env(settings),
                              logs / f"{name}.log", ready[name])
            service.start()
            self._running.append(service)
            if name == "registry":
                self._wait_ready([service])
                if self.workers or self.base_model:  # workers serve once it is registered
                    self._register_base_model(settings)
        if self.workers:
            self._start_workers(settings, logs)
        self._wait_ready(self._running)
        for service in self._running:
            self.endpoints.append(self._endpoint(service, settings))

    def _router_ready(self, settings: Settings) -> bool:
        """The router has folded the log and, when this stack runs workers, holds them all
        in its ring: "up" then means a request can be served, not only that it was heard."""
        base = (f"{tls.http_scheme(settings)}://{_loopback(settings.router_host)}:"
                f"{settings.router_http_port}")
        verify = tls.client_ssl_context(settings)
        if not _http_ok(f"{base}/readyz", verify):
            return False
        if not self.workers:
            return True
        ring = scrape(f"{base}/metrics", verify).get("loraplane_router_ring_size", 0.0)
        return ring >= self.workers

    def _register_base_model(self, settings: Settings) -> None:
        """Register the workers' base model (idempotent across restarts), as the CLI's
        `register-base` does: the digest the workers compute, under the folder's name."""
        from services.client import RegistryClient, api_token
        from services.stack.models import ensure_smollm2

        model_dir = Path(self.base_model) if self.base_model else \
            ensure_smollm2(settings.cache_dir)
        self.base_model = model_dir.resolve()
        with RegistryClient(settings, token=api_token(settings)) as registry:
            name, digest, _ = registry.register_base_model(self.base_model)
        self.base_model_name = name
        self.endpoints.append(Endpoint("base model", str(self.base_model), True,
                                       f"{name}, digest {digest[:16]}…"))

    def _start_workers(self, settings: Settings, logs: Path) -> None:
        for i in range(1, self.workers + 1):
            first = i == 1
            place = WorkerPlace(
                worker_id=f"worker-{i}",
                port=settings.worker_port if first else free_port(),
                metrics_port=(settings.worker_metrics_port if first or
                              settings.worker_metrics_port == 0 else free_port()),
                state_dir=self.root / "workers" / f"worker-{i}")
            place.state_dir.mkdir(parents=True, exist_ok=True)
            self._places.append(place)
            env = self._service_env(
                settings, worker_id=place.worker_id, worker_port=place.port,
                worker_metrics_port=place.metrics_port, state_dir=place.state_dir,
                base_model=self.base_model,
                worker_address=f"{_loopback(settings.worker_host)}:{place.port}")
            address = f"{_loopback(settings.worker_host)}:{place.port}"
            service = Service(place.worker_id, "worker", env,
                              logs / f"{place.worker_id}.log",
                              lambda address=address: grpc_serving(  # type: ignore[misc]
                                  address, settings))
            service.start()
            self._running.append(service)

    def _wait_ready(self, services: list[Service], timeout_s: float = 240.0) -> None:
        """Services are up when they say so: the registry once it replayed the log, the
        router once it folded it, workers once their gRPC health says SERVING."""
        deadline = time.monotonic() + timeout_s
        pending = {s.name: s for s in services}
        while pending:
            for name, service in list(pending.items()):
                if not service.alive():
                    assert service.child is not None
                    raise StackError(f"service {name} exited during start; its log "
                                     f"({service.log_path}) ends:\n"
                                     f"{service.child.log_tail()}")
                if service.ready():
                    del pending[name]
            if time.monotonic() > deadline:
                raise StackError(f"not ready after {timeout_s:.0f}s: {', '.join(pending)}; "
                                 f"logs in {self.root / 'logs'}")
            if pending:
                time.sleep(0.3)

    def _endpoint(self, service: Service, settings: Settings) -> Endpoint:
        pid = f"pid {service.pid}"
        if service.name == "registry":
            return Endpoint("registry", settings.registry_base_url, True,
                            f"REST, /metrics, /docs; {pid}")
        if service.name == "router":
            host = _loopback(settings.router_host)
            return Endpoint("router", f"{host}:{settings.router_port}", True,
                            f"gRPC loraplane.v1.Inference; OpenAI HTTP "
                            f"http://{host}:{settings.router_http_port}/v1, /metrics; {pid}")
        if service.name == "audit":
            base = f"http://{_loopback(settings.audit_http_host)}:{settings.audit_metrics_port}"
            return Endpoint("audit", f"{base}/metrics", True,
                            f"projector into PostgreSQL; checkpoints {base}/checkpoints; {pid}")
        if service.name == "canary":
            host = _loopback(settings.canary_metrics_host)
            return Endpoint("canary", f"http://{host}:{settings.canary_metrics_port}/metrics",
                            True, f"canary controller; {pid}")
        place = next((p for p in self._places if p.worker_id == service.name), None)
        if place is not None:
            host = _loopback(settings.worker_host)
            return Endpoint(service.name, f"{host}:{place.port}", True,
                            f"worker gRPC; metrics http://{host}:{place.metrics_port}/metrics;"
                            f" state {place.state_dir}; {pid}")
        return Endpoint(service.name, pid, True, SERVICES.get(service.kind, service.kind))

    def _write_endpoints(self, settings: Settings) -> None:
        values = settings.model_dump(mode="json")
        document: dict[str, Any] = {
            "pid": os.getpid(), "state_dir": str(self.root),
            "env": {f"LORAPLANE_{k.upper()}": str(values[k]) for k in CLIENT_SETTINGS
                    if values.get(k) is not None},
            "base_model": {"name": self.base_model_name,
                           "path": str(self.base_model) if self.base_model else None},
            "services": [{"name": s.name, "kind": s.kind, "pid": s.pid} for s in self._running],
            "workers": [{"worker_id": p.worker_id,
                         "address": f"{_loopback(settings.worker_host)}:{p.port}",
                         "metrics": f"http://{_loopback(settings.worker_host)}:"
                                    f"{p.metrics_port}/metrics"} for p in self._places],
            "endpoints": [e.__dict__ for e in self.endpoints],
        }
        path = self.root / ENDPOINTS_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(document, indent=2))
        tmp.replace(path)

    # --- supervision ---------------------------------------------------------------------

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart what died (with backoff); returns what happened, one line each."""
        now = time.monotonic() if now is None else now
        happened: list[str] = []
        if self._postgres is not None and not self._postgres.alive():
            happened += self._revive("postgres", self._postgres_policy, now,
                                     self._postgres.stop, self._postgres.start)
        if self._broker is not None and not self._broker.alive():
            happened += self._revive("kafka", self._broker_policy, now, self._broker.stop,
                                     self._restart_broker)
        for service in self._running:
            if service.alive():
                continue
            happened += self._revive(service.name, service.policy, now, service.stop,
                                     service.start)
            if service.alive():
                service.restarts += 1
        if any(line.startswith("restarted") for line in happened):
            self._write_endpoints(self.settings)
        return happened

    def _revive(self, name: str, policy: RestartPolicy, now: float,
                stop: Callable[[], None], start: Callable[[], None]) -> list[str]:
        if policy.due_at is None:
            delay = policy.exited(now)
            line = f"{name} exited; restarting in {delay:.1f}s (exit #{policy.failures} in a row)"
            log.warning(line)
            return [line]
        if not policy.due(now):
            return []
        stop()
        try:
            start()
        except Exception as exc:  # tried again after the next delay
            policy.started(now)
            delay = policy.exited(now)
            line = f"{name} failed to restart ({exc}); next try in {delay:.1f}s"
            log.error(line)
            return [line]
        policy.started(time.monotonic())
        line = f"restarted {name}"
        log.warning(line)
        return [line]

    def _restart_broker(self) -> None:
        """Same port, same data. A broker that kept nothing (Tansu) is refilled from the
        audit store and every service restarted: their positions point into a lost log."""
        assert self._broker is not None
        self._broker.start()
        if self._broker.durable:
            return
        from services.audit.db import make_engine
        from services.stack.refill import refill_if_empty

        ensure_topics(self.settings)
        assert self.settings.database_url is not None
        engine = make_engine(self.settings.database_url)
        try:
            refill_if_empty(self.settings, engine)
        finally:
            engine.dispose()
        for service in self._running:
            service.stop()
            service.start()

    def status_lines(self) -> list[str]:
        return [f"{s.name}: {'running' if s.alive() else 'down'}, pid {s.pid}, "
                f"{s.restarts} restart(s)" for s in self._running]

    # --- stop ----------------------------------------------------------------------------

    def stop(self) -> None:
        drain = {"worker": self.settings.worker_drain_s, "router": self.settings.router_drain_s}
        for service in self._running:  # workers and routers drain side by side, not in turn
            if service.kind in drain and service.child is not None and service.alive():
                service.child.proc.send_signal(signal.SIGTERM)  # a second one changes nothing
        for service in reversed(self._running):
            service.stop(grace_s=drain.get(service.kind, 0.0) + 20.0)
        self._running.clear()
        if self._postgres is not None:
            self._postgres.stop()
            self._postgres = None
        if self._broker is not None:
            self._broker.stop()
            self._broker = None
        if self._lock is not None:
            with contextlib.suppress(OSError):
                (self.root / ENDPOINTS_FILE).unlink()
            self._lock.close()
            self._lock = None


def _loopback(host: str) -> str:
    """Where a local client dials a service listening on `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _http_ok(url: str, verify: Any = True) -> bool:
    try:
        return httpx.get(url, timeout=1, verify=verify).is_success
    except httpx.HTTPError:
        return False


def _redact(url: str) -> str:
    if "@" in url and ":" in url.split("@", 1)[0].split("//", 1)[-1]:
        scheme, rest = url.split("//", 1)
        user = rest.split(":", 1)[0]
        return f"{scheme}//{user}:***@{rest.split('@', 1)[1]}"
    return url


def env_of(settings: Settings) -> dict[str, str]:
    """The settings as LORAPLANE_* variables, for the service subprocesses (the local stack's
    and the cluster's, which start the same services)."""
    env = {}
    for name, value in settings.model_dump(mode="json", exclude_none=True).items():
        text = value if isinstance(value, str) else json.dumps(value)
        env[f"LORAPLANE_{name.upper()}"] = text
    return env


@contextlib.contextmanager
def running_stack(settings: Settings, **kwargs: Any) -> Iterator[Stack]:
    stack = Stack(settings, **kwargs)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()
