"""Faults a cluster of namespaces can suffer, each with its undo.

- `partition(a, b)`: packets between two groups of hosts are dropped silently, in both
  directions (iptables DROP in each host's own tables), as a cut cable or a failed
  switch port would: connections time out, nothing is refused.
- `degrade(a, b, delay, jitter, loss)`: the link between two hosts delays and loses
  packets like `tc netem delay 100ms 50ms loss 5%`, by NFQUEUE and `linkem` (the kernel
  here has no netem), on both sides.
- `pause` / `resume` (SIGSTOP / SIGCONT of a process group) and `kill` (SIGKILL).

Rules live in chains of their own per host (`LPCUT` for partitions, `LPLINK` for
degraded links), hooked into INPUT and OUTPUT, so healing one flushes exactly what it
added and nothing else. `iptables-legacy` is used
where it exists (Debian's `iptables` package installs it): the rules stay in the
namespace's own xtables, independent of any nftables ruleset.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from services.cluster.netns import Host, NetworkError, run_in
from services.stack.process import ChildProcess

CUT, LINK = "LPCUT", "LPLINK"


def iptables_binary() -> str:
    for name in ("iptables-legacy", "iptables"):
        found = shutil.which(name)
        if found:
            return found
    raise NetworkError("iptables is not installed (Debian: apt-get install iptables)")


@dataclass
class Faults:
    """Faults on the hosts of one network; `heal_all()` undoes every one still in place."""

    log_dir: Path
    partitions: list[tuple[frozenset[str], frozenset[str]]] = field(default_factory=list)
    _chains: set[tuple[str, str]] = field(default_factory=set)
    _links: dict[tuple[str, str], list[ChildProcess]] = field(default_factory=dict)
    _queues: int = 0

    def _iptables(self, host: Host, *args: str, check: bool = True) -> None:
        run_in(host.netns, iptables_binary(), "-w", *args, check=check)

    def _chain(self, host: Host, chain: str) -> None:
        if (host.netns, chain) in self._chains:
            return
        self._iptables(host, "-N", chain)
        for hook in ("INPUT", "OUTPUT"):
            self._iptables(host, "-I", hook, "1", "-j", chain)
        self._chains.add((host.netns, chain))

    def _flush(self, host: Host, chain: str) -> None:
        if (host.netns, chain) in self._chains:
            self._iptables(host, "-F", chain)

    # --- partitions ----------------------------------------------------------------------

    def partition(self, side_a: Iterable[Host], side_b: Iterable[Host]) -> None:
        """No packet between any host of `side_a` and any of `side_b`, either way."""
        a, b = list(side_a), list(side_b)
        for host in a + b:
            self._chain(host, CUT)
        for here, there in [(x, y) for x in a for y in b] + [(y, x) for x in a for y in b]:
            self._iptables(here, "-A", CUT, "-s", there.address, "-j", "DROP")
            self._iptables(here, "-A", CUT, "-d", there.address, "-j", "DROP")
        self.partitions.append((frozenset(h.name for h in a), frozenset(h.name for h in b)))

    def heal_partitions(self, hosts: Iterable[Host]) -> None:
        for host in hosts:
            self._flush(host, CUT)
        self.partitions.clear()

    # --- degraded links ------------------------------------------------------------------

    def degrade(self, a: Host, b: Host, *, delay_ms: float = 100.0, jitter_ms: float = 50.0,
                loss: float = 0.05, seed: int = 0) -> None:
        """Delay and loss on the link a↔b, on both sides (each side's egress)."""
        emulators = []
        for index, (here, there) in enumerate(((a, b), (b, a))):
            self._chain(here, LINK)
            self._queues += 1
            queue = self._queues
            self._iptables(here, "-A", LINK, "-d", there.address, "-j", "NFQUEUE",
                           "--queue-num", str(queue), "--queue-bypass")
            emulators.append(ChildProcess(
                f"linkem-{here.name}-{there.name}",
                [sys.executable, "-m", "services.cluster.linkem", "--queue", str(queue),
                 "--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms), "--loss",
                 str(loss), "--seed", str(seed * 2 + index)],
                self.log_dir / f"linkem-{here.name}-{there.name}.log", netns=here.netns,
                env={**os.environ}))
        self._links[(a.name, b.name)] = emulators

    def restore(self, a: Host, b: Host) -> None:
        """The link a↔b as it was: rules flushed on both sides, emulators stopped."""
        for host in (a, b):
            self._flush(host, LINK)
        for emulator in self._links.pop((a.name, b.name), []):
            emulator.stop(timeout=5)

    def heal_all(self, hosts: Iterable[Host]) -> None:
        hosts = list(hosts)
        for host in hosts:
            self._flush(host, LINK)
        for key in list(self._links):
            for emulator in self._links.pop(key):
                emulator.stop(timeout=5)
        self.heal_partitions(hosts)


# --- processes ---------------------------------------------------------------------------


def pause(pid: int) -> None:
    """SIGSTOP the process group (a PostgreSQL server is its postmaster and backends)."""
    os.killpg(os.getpgid(pid), signal.SIGSTOP)


def resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(os.getpgid(pid), signal.SIGCONT)


def kill(pid: int) -> None:
    """SIGKILL the process group: the host's process dies at once, as in a power cut."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(os.getpgid(pid), signal.SIGKILL)
