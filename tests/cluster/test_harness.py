"""The cluster harness itself: hosts on their own addresses, every process bound to its
host's address only, a replicated Kafka, and a teardown that leaves nothing behind even
when the start fails or the owner is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from services.cluster.netns import Network, _namespaces, sweep_stale
from services.cluster.topology import Cluster, ClusterSpec
from tests.cluster.conftest import ClusterRig, cluster_available
from tests.conftest import REPO, _settings
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(cluster_available() is not None,
                                 reason=str(cluster_available()))]


def _listeners(netns: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "exec", netns, "ss", "-Hltn"], capture_output=True,
                         text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if line.strip()]


def test_every_process_listens_on_its_own_host_address_only(rig: ClusterRig) -> None:
    cluster = rig.cluster
    print(f"harness start-up: {cluster.timings}")
    assert cluster.timings["total"] > 0
    addresses = {host.address for host in cluster.hosts()}
    assert len(addresses) == len(cluster.hosts()) == len(cluster.nodes) == 13
    for name, node in cluster.nodes.items():
        assert node.alive(), name
        listening = _listeners(node.host.netns)
        assert listening, f"{name} listens nowhere"
        for local in listening:
            host = local.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")
            assert host == node.host.address, f"{name} listens on {local}, not only on " \
                                              f"{node.host.address}"


def test_topics_are_replicated_three_times_with_two_in_sync(rig: ClusterRig) -> None:
    cluster = rig.cluster
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap, "log_level": 0})
    settings = cluster.settings
    topics = [settings.adapter_events_topic, settings.worker_events_topic,
              settings.liveness_topic]
    metadata = admin.list_topics(timeout=10)
    for topic in topics:
        for partition in metadata.topics[topic].partitions.values():
            assert len(partition.replicas) == 3, (topic, partition.id, partition.replicas)
    resources = [ConfigResource(ConfigResource.Type.TOPIC, t) for t in topics]
    for future in admin.describe_configs(resources).values():
        configs = future.result(10)
        assert configs["min.insync.replicas"].value == "2"
    assert len({b.id for b in metadata.brokers.values()}) == 3


def test_a_failed_start_removes_every_namespace(tmp_path, monkeypatch) -> None:
    spec = ClusterSpec(base_model=tmp_path / "no-model")
    cluster = Cluster(spec, tmp_path / "cluster", _settings())

    def broken() -> None:
        raise RuntimeError("injected: the brokers did not start")

    monkeypatch.setattr(cluster, "_start_storage", broken)
    with pytest.raises(RuntimeError, match="injected"):
        cluster.start()
    assert cluster.network is not None
    tag = cluster.network.tag
    assert not [n for n in _namespaces() if f"-{tag}-" in n]
    out = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    assert f"lpb{tag}" not in out


def test_a_network_whose_owner_was_killed_is_swept() -> None:
    code = ("import time\nfrom services.cluster.netns import Network\n"
            "n = Network.create(['a', 'b']); print(n.tag, flush=True); time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=REPO)
    assert owner.stdout is not None
    tag = owner.stdout.readline().strip()
    assert tag and len([n for n in _namespaces() if f"-{tag}-" in n]) == 2
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait(10)
    wait_for(lambda: not os.path.exists(f"/proc/{owner.pid}"), 10, message="the owner gone")
    assert tag in sweep_stale()
    assert not [n for n in _namespaces() if f"-{tag}-" in n]
    # and a network of a live owner is never swept
    network = Network.create(["c"])
    try:
        assert network.tag not in sweep_stale()
        assert len([n for n in _namespaces() if f"-{network.tag}-" in n]) == 1
    finally:
        network.destroy()
