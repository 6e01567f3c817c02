"""One cluster of network namespaces for the fault tests of this folder: the topology of
`services.cluster.topology` on a tiny random Llama (it starts in seconds on 2 cores),
with PEFT adapters for the clients to publish, and an inference token for every tenant.
Torn down at the end, whatever happened (`Cluster.stop`: processes, then namespaces)."""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.cluster.topology import Cluster, ClusterSpec
from tests.conftest import CACHE, _settings, service_dir
from tests.worker.engine.tiny_llama import ADAPTERS, build_adapter, build_model
from tests.worker.harness import add_chat_template


@dataclass
class ClusterRig:
    cluster: Cluster
    files: list[Path]
    """PEFT adapter folders the writers publish (versions cycle through them)."""
    inference_token: str
    out_dir: Path


def cluster_available() -> str | None:
    """Why the cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not (shutil.which("iptables-legacy") or shutil.which("iptables")):
        return "iptables is not installed (.ci/run installs Debian's iptables)"
    return None


def build_rig_files(where: Path) -> tuple[Path, list[Path]]:
    model = where / "base"
    hf = build_model(model, max_position_embeddings=1024)
    add_chat_template(model)
    spec = ADAPTERS[0]  # rank 4 on q/v: small uploads, quick loads
    files = []
    for seed in range(3):
        path = where / f"adapter-{seed}"
        build_adapter(hf, spec, path, seed=300 + seed)
        files.append(path)
    return model, files


def start_rig(where: Path, out_dir: Path) -> ClusterRig:
    model, files = build_rig_files(where / "model")
    token = secrets.token_urlsafe(24)
    spec = ClusterSpec(base_model=model, extra_tokens=(
        {"sha256": hashlib.sha256(token.encode()).hexdigest(), "role": "inference",
         "tenant": "*/*/*"},))
    cluster = Cluster(spec, where / "cluster", _settings())
    cluster.start()
    return ClusterRig(cluster, files, token, out_dir)


@pytest.fixture(scope="package")
def rig() -> Iterator[ClusterRig]:
    why = cluster_available()
    if why is not None:
        pytest.skip(why)
    with service_dir("cluster") as where:
        rig = start_rig(where, CACHE.parent / "test-state" / "chaos")
        try:
            yield rig
        finally:
            rig.cluster.stop()
