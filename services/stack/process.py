"""Child processes that cannot outlive the process that started them.

Every broker, database and service the embedded stack starts is a direct child with a
parent-death signal, so even a `kill -9` of `loraplane up` leaves nothing running. A
child may be started inside a named network namespace (`ip netns`, the multi-host
cluster of `services.cluster`) through `ip netns exec` and `setpriv`, which set the
namespace, the parent-death signal and the user and then exec the command in place: its
pid is the service's own, so a signal reaches the service itself. That path runs no
Python between fork and exec, so a parent with gRPC threads (a test's clients) can start
children safely; a `preexec_fn` there makes grpc's fork handlers abort the child.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int) -> Any:
    def preexec() -> None:
        os.setsid()  # Ctrl-C reaches only us; we stop children in order
        with contextlib.suppress(OSError):  # not Linux: explicit stop only
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    return preexec


def in_netns(netns: str, argv: Sequence[str], death_signal: int, user: str | None = None,
             group: str | None = None) -> list[str]:
    """`argv` run inside network namespace `netns`, with a parent-death signal, as `user`
    (and `group`, no supplementary groups) if given: `ip netns exec` enters the namespace
    and `setpriv` the rest, each exec'ing the next in place."""
    who = []
    if user:
        who = [f"--reuid={user}", f"--regid={group or user}", "--clear-groups"]
    return ["ip", "netns", "exec", netns, "setpriv",
            f"--pdeathsig={signal.Signals(death_signal).name.removeprefix('SIG')}", *who,
            "--", *argv]


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIRST_PICKED_PORT = 10000
"""Ports below this are left to services that expect their own (PostgreSQL's 5432,
Kafka's 9092, the stack's defaults)."""
_PORTS = random.Random()
"""Seeded from the OS: a caller's seeding of `random` (a test's) does not reach it."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now, drawn below the kernel's ephemeral range where there is
    room. A port from that range (what binding port 0 gives) can become the source port of
    any outgoing connection, a Kafka client's or a database pool's, in the seconds before
    its service binds it: the purge drill's router failed to start on one."""
    low = _ephemeral_low()
    for _ in range(100 if low > FIRST_PICKED_PORT + 1000 else 0):
        port = _PORTS.randrange(FIRST_PICKED_PORT, low)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class ChildProcess:
    """A started command whose output goes to a log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        user: str | None = None,
        group: str | None = None,
        death_signal: int = signal.SIGTERM,
        netns: str | None = None,
    ) -> None:
        """`netns`: the name of a network namespace (`ip netns`) to run in."""
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.netns = netns
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("ab")
        if netns:
            self.proc = subprocess.Popen(
                in_netns(netns, self.argv, death_signal, user, group), stdout=self._log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                start_new_session=True)
            return
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=cwd, user=user, group=group, extra_groups=[] if group else None,
            preexec_fn=_die_with_parent(death_signal))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.alive():
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


class ChildOwner:
    """What `up` asks of a broker or PostgreSQL it supervises: is it running, which pid."""

    _child: ChildProcess | None

    def alive(self) -> bool:
        return self._child is not None and self._child.alive()

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None
