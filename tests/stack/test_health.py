"""`loraplane health SERVICE`, the probe compose and the Helm chart run in each container,
against real services: a registry, a worker process and a router on the test's topics;
the projector and canary controller where nothing listens."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from services.stack.process import free_port
from tests.conftest import REPO, isolated_settings
from tests.worker.conftest import ServedModel
from tests.worker.harness import Stack, running_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, served_model: ServedModel,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings(kafka_bootstrap, None)
    with running_stack(settings, tmp_path_factory.mktemp("health"), served_model.path,
                       None) as running:
        yield running


def health(service: str, **env: object) -> subprocess.CompletedProcess[str]:
    values = {"LORAPLANE_STATE_DIR": str(REPO / ".loraplane" / "no-stack-here"),
              **{f"LORAPLANE_{k.upper()}": str(v) for k, v in env.items()}}
    return subprocess.run([sys.executable, "-m", "services.cli", "health", service],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **values})


def test_health_says_ready_for_running_services_and_why_not_otherwise(stack: Stack) -> None:
    from tests.router.conftest import RunningRouter, router_settings

    worker = stack.workers["w1"]
    answer = health("worker", worker_host="0.0.0.0", worker_port=worker.port)
    assert answer.returncode == 0 and answer.stdout.strip() == "worker ready", answer

    port = int(stack.registry.url.rsplit(":", 1)[1])
    answer = health("registry", registry_host="127.0.0.1", registry_port=port)
    assert answer.returncode == 0 and answer.stdout.strip() == "registry ready", answer

    router = RunningRouter(router_settings(stack.settings, heartbeat_interval_s=0.5)).start()
    try:
        router.wait_ring({"w1"})
        answer = health("router", router_host="127.0.0.1",
                        router_http_port=router.app.http_port)
        assert answer.returncode == 0 and answer.stdout.strip() == "router ready", answer
    finally:
        router.stop()

    nobody = free_port()
    for service, setting in (("audit", "audit_metrics_port"),
                             ("canary", "canary_metrics_port"),
                             ("router", "router_http_port"), ("worker", "worker_port")):
        answer = health(service, **{setting: nobody})
        assert answer.returncode == 1, (service, answer)
        assert answer.stderr.startswith(f"{service} not ready: ") and answer.stdout == ""
        assert str(nobody) in answer.stderr and "Traceback" not in answer.stderr
    answer = health("kafka")
    assert answer.returncode == 2 and "registry, router, worker, audit" in answer.stderr
