"""Hosts on one machine: a Linux network namespace per host, each with its own address on
one bridge, so processes talk over a real (virtual) network that faults can cut.

    network = Network.create(["kafka-1", "registry-1", ...])
    network.hosts["registry-1"].address    # 10.x.y.11, bound by that host's processes
    network.destroy()                      # namespaces, veths and the bridge

The bridge's own address (.1) is the machine's: the test runner and a person's CLI reach
every host through it. Everything is named after a short tag, and the tag's owner pid is
recorded under /run/loraplane-cluster, so a run killed before its teardown is swept by
the next one (`sweep_stale`). Needs root (`ip netns`, veth, bridge).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

RUN_DIR = Path("/run/loraplane-cluster")
NETNS_PREFIX = "lp-"


class NetworkError(RuntimeError):
    pass


def ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    argv = ["ip", *(("netns", "exec", netns, "ip") if netns else ()), *args]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise NetworkError(f"{' '.join(argv)}: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def run_in(netns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """A command inside a host's namespace (iptables, a probe)."""
    result = subprocess.run(["ip", "netns", "exec", netns, *argv], capture_output=True,
                            text=True, check=False)
    if check and result.returncode != 0:
        raise NetworkError(f"{netns}: {' '.join(argv)}: "
                           f"{result.stderr.strip() or result.stdout.strip()}")
    return result


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    address: str


@dataclass
class Network:
    tag: str
    subnet: ipaddress.IPv4Network
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def bridge(self) -> str:
        return f"lpb{self.tag}"

    @property
    def gateway(self) -> str:
        """The machine's own address on the network (the bridge's)."""
        return str(self.subnet.network_address + 1)

    @classmethod
    def create(cls, names: list[str], *, seed: int | None = None) -> Network:
        """A bridge and one namespace per name; torn down again if any step fails."""
        if os.geteuid() != 0:
            raise NetworkError("a cluster of network namespaces needs root")
        sweep_stale()
        network = cls(tag=secrets.token_hex(3), subnet=_free_subnet(seed))
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        (RUN_DIR / network.tag).write_text(f"{os.getpid()}\n")
        try:
            ip("link", "add", network.bridge, "type", "bridge")
            ip("addr", "add", f"{network.gateway}/{network.subnet.prefixlen}", "dev",
               network.bridge)
            ip("link", "set", network.bridge, "up")
            for index, name in enumerate(names):
                network._add_host(name, index)
        except BaseException:
            network.destroy()
            raise
        return network

    def _add_host(self, name: str, index: int) -> Host:
        netns = f"{NETNS_PREFIX}{self.tag}-{name}"
        address = str(self.subnet.network_address + 10 + index)
        outside, inside = f"lpv{self.tag}{index:02d}", f"lpp{self.tag}{index:02d}"
        ip("netns", "add", netns)
        ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        ip("link", "set", inside, "netns", netns)
        ip("link", "set", outside, "master", self.bridge)
        ip("link", "set", outside, "up")
        ip("link", "set", inside, "name", "eth0", netns=netns)
        ip("addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0", netns=netns)
        ip("link", "set", "eth0", "up", netns=netns)
        ip("link", "set", "lo", "up", netns=netns)
        host = Host(name, netns, address)
        self.hosts[name] = host
        return host

    def destroy(self) -> None:
        """Every namespace (its veth goes with it) and the bridge; safe to call twice."""
        _remove(self.tag)
        self.hosts.clear()


def _remove(tag: str) -> None:
    for netns in _namespaces():
        if netns.startswith(f"{NETNS_PREFIX}{tag}-"):
            _kill_inside(netns)
            ip("netns", "del", netns, check=False)
    ip("link", "del", f"lpb{tag}", check=False)
    with contextlib.suppress(FileNotFoundError):
        (RUN_DIR / tag).unlink()


def _kill_inside(netns: str) -> None:
    """Whatever still runs in a namespace that is going away (a child whose parent was
    killed before it could stop it): a namespace with processes in it outlives `del`."""
    result = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True,
                            check=False)
    for pid in result.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)


def _namespaces() -> list[str]:
    out = ip("netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Remove the networks of runs whose process is gone; returns their tags."""
    swept = []
    if RUN_DIR.is_dir():
        for marker in RUN_DIR.iterdir():
            try:
                pid = int(marker.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pid = -1
            if pid > 0 and Path(f"/proc/{pid}").exists():
                continue
            _remove(marker.name)
            swept.append(marker.name)
    return swept


def _free_subnet(seed: int | None) -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no interface or route of the machine uses."""
    used = []
    for line in ip("-4", "route", "show", "table", "all", check=False).splitlines() + \
            ip("-4", "-o", "addr", "show", check=False).splitlines():
        for word in line.split():
            with contextlib.suppress(ValueError):
                if "/" in word or word.count(".") == 3:
                    used.append(ipaddress.ip_network(word, strict=False))
    chooser = random.Random(seed)
    for _ in range(200):
        subnet = ipaddress.ip_network(f"10.{chooser.randint(100, 250)}."
                                      f"{chooser.randint(0, 255)}.0/24")
        if not any(subnet.overlaps(other) for other in used
                   if other.prefixlen > 0):
            return subnet
    raise NetworkError("no free /24 in 10.0.0.0/8 for the cluster's network")
