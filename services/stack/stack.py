"""`loraplane up`: broker, PostgreSQL, migrations, topics and the services, on one machine.

What it starts it stops, in reverse order, on Ctrl-C, SIGTERM or any failure; every
child also carries a parent-death signal, so nothing outlives the stack. One stack per
state directory: a second `up` finds the lock and says where the first one listens.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from services.config import Settings
from services.eventlog.topics import ensure_topics
from services.stack.brokers import EmbeddedBroker, embedded_broker
from services.stack.postgres import LocalPostgres
from services.stack.process import ChildProcess

SERVICES: dict[str, str] = {"audit": "audit projector", "registry": "registry (REST)"}
"""Services `up` starts, by `loraplane serve` name; more join as they are built."""


class StackAlreadyRunning(RuntimeError):
    pass


@dataclass
class Endpoint:
    name: str
    where: str
    started_here: bool
    detail: str = ""


@dataclass
class Stack:
    settings: Settings
    services: Sequence[str] = ("audit", "registry")
    state_dir: Path | None = None
    endpoints: list[Endpoint] = field(default_factory=list)
    _broker: EmbeddedBroker | None = None
    _postgres: LocalPostgres | None = None
    _children: list[ChildProcess] = field(default_factory=list)
    _lock: IO[str] | None = None

    @property
    def root(self) -> Path:
        return (self.state_dir or self.settings.state_dir).resolve()

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
            where = self.root / "endpoints.json"
            detail = where.read_text() if where.exists() else ""
            raise StackAlreadyRunning(
                f"loraplane up is already running for {self.root} ({info}); "
                f"stop it with Ctrl-C there first.\n{detail}") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        self._lock = handle

    # --- start / stop --------------------------------------------------------------------

    def start(self) -> Settings:
        """Start everything; returns the settings the services were given."""
        self._acquire_lock()
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Settings:
        settings = self.settings
        updates: dict[str, object] = {}
        if settings.kafka_bootstrap:
            self.endpoints.append(Endpoint("kafka", settings.kafka_bootstrap, False, "given"))
        else:
            self._broker = embedded_broker(settings, self.root)
            self._broker.start()
            updates["kafka_bootstrap"] = self._broker.bootstrap
            self.endpoints.append(Endpoint("kafka", self._broker.bootstrap, True,
                                           f"{self._broker.kind} broker"))
        if settings.database_url:
            self.endpoints.append(Endpoint("postgres", _redact(settings.database_url), False,
                                           "given"))
        else:
            self._postgres = LocalPostgres(self.root / "postgres")
            self._postgres.start()
            updates["database_url"] = self._postgres.url
            self.endpoints.append(Endpoint("postgres", self._postgres.url, True,
                                           self._postgres.version))
        updates["state_dir"] = self.root
        if "registry" in self.services and not settings.auth_tokens:
            updates["auth_tokens"] = self._dev_admin_token()
        settings = self.settings = settings.model_copy(update=updates)
        from services.audit.db import upgrade

        assert settings.database_url is not None
        upgrade(settings.database_url)
        created = ensure_topics(settings)
        self.endpoints.append(Endpoint("topics", ", ".join(settings.topics), True,
                                       f"{len(created)} created"))
        env = {**os.environ, **_env_of(settings)}
        for name in self.services:
            child = ChildProcess(name, [sys.executable, "-m", "services.cli", "serve", name],
                                 self.root / "logs" / f"{name}.log", env=env)
            self._children.append(child)
            where, detail = f"pid {child.pid}", SERVICES[name]
            if name == "registry":
                where, detail = settings.registry_base_url, f"{detail}, pid {child.pid}"
            self.endpoints.append(Endpoint(name, where, True, detail))
        self._wait_ready(settings)
        (self.root / "endpoints.json").write_text(json.dumps(
            [e.__dict__ for e in self.endpoints], indent=2))
        return settings

    def _dev_admin_token(self) -> str:
        """A local stack gets one admin token, kept in STATE_DIR/admin.token (mode 0600).

        Without it the registry would answer 401 to everything; production configures
        LORAPLANE_AUTH_TOKENS explicitly and `up` then generates nothing.
        """
        path = self.root / "admin.token"
        if not path.exists():
            path.touch(mode=0o600)
            path.write_text(secrets.token_urlsafe(32))
        token = path.read_text().strip()
        self.endpoints.append(Endpoint("admin token", str(path), True,
                                       "Authorization: Bearer $(cat …)"))
        return json.dumps([{"sha256": hashlib.sha256(token.encode()).hexdigest(),
                            "role": "admin"}])

    def _wait_ready(self, settings: Settings, timeout_s: float = 90.0) -> None:
        """Services are up when they say so (the registry once it replayed the log)."""
        deadline = time.monotonic() + timeout_s
        pending = {child.name for child in self._children}
        while pending:
            problem = self.check_children()
            if problem:
                raise RuntimeError(problem)
            if "registry" in pending:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{settings.registry_base_url}/readyz", timeout=1).is_success:
                        pending.discard("registry")
            pending.discard("audit")  # ready once running: it seeks to stored offsets
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout_s:.0f}s: {', '.join(pending)}")
            if pending:
                time.sleep(0.3)

    def check_children(self) -> str | None:
        for child in self._children:
            if not child.alive():
                return f"service {child.name} exited:\n{child.log_tail()}"
        return None

    def stop(self) -> None:
        for child in reversed(self._children):
            child.stop()
        self._children.clear()
        if self._postgres is not None:
            self._postgres.stop()
            self._postgres = None
        if self._broker is not None:
            self._broker.stop()
            self._broker = None
        if self._lock is not None:
            with contextlib.suppress(OSError):
                (self.root / "endpoints.json").unlink()
            self._lock.close()
            self._lock = None


def _redact(url: str) -> str:
    if "@" in url and ":" in url.split("@", 1)[0].split("//", 1)[-1]:
        scheme, rest = url.split("//", 1)
        user = rest.split(":", 1)[0]
        return f"{scheme}//{user}:***@{rest.split('@', 1)[1]}"
    return url


def _env_of(settings: Settings) -> dict[str, str]:
    """The settings as LORAPLANE_* variables, for the service subprocesses."""
    env = {}
    for name, value in settings.model_dump(mode="json", exclude_none=True).items():
        text = value if isinstance(value, str) else json.dumps(value)
        env[f"LORAPLANE_{name.upper()}"] = text
    return env


@contextlib.contextmanager
def running_stack(settings: Settings, **kwargs: object) -> Iterator[Stack]:
    stack = Stack(settings, **kwargs)  # type: ignore[arg-type]
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()
