"""The Helm chart (services/deploy/helm/loraplane) as `helm lint` and `helm template` see
it, and against the code, as the compose file is checked: every container runs a real
`loraplane` command, every variable is a real setting, every probe a real health probe;
workers get their drain as termination grace and a PodDisruptionBudget, one Deployment
per base model; the dashboard is the one Grafana provisioning ships.

`helm` installs as a Go module (`.ci/run` does it); outside CI a machine without it skips
these tests, in CI they fail."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.config import Settings
from tests.conftest import REPO
from tests.test_layout import _is_group, _resolve

CHART = REPO / "services" / "deploy" / "helm" / "loraplane"
HELPERS = {"POD_IP", "PG_USER", "PG_PASSWORD"}
"""Variables the chart sets only to build a LORAPLANE_* value from them ($(NAME))."""

EVERYTHING = {
    "tls": {"enabled": True, "serverName": "loraplane-worker"},
    "kafka": {"strimzi": {"enabled": True}, "securityProtocol": "SSL"},
    "postgres": {"cloudnativepg": {"enabled": True}, "sslmode": "require"},
    "secretEnv": {"existingSecret": "loraplane-secrets"},
    "monitoring": {"serviceMonitors": True},
    "workers": {"models": [
        {"name": "llama-8b", "replicas": 3, "device": "cuda",
         "modelVolume": {"persistentVolumeClaim": {"claimName": "llama-8b"}},
         "resources": {"limits": {"nvidia.com/gpu": 1}},
         "nodeSelector": {"gpu": "h100"}, "env": {"LORAPLANE_WORKER_ADAPTER_SLOTS": "32"}},
        {"name": "qwen-7b", "replicas": 2, "device": "cuda",
         "modelVolume": {"persistentVolumeClaim": {"claimName": "qwen-7b"}},
         "resources": {"limits": {"nvidia.com/gpu": 1}}}]},
}


def helm() -> str:
    found = os.environ.get("HELM") or shutil.which("helm")
    gopath_bin = Path(os.environ.get("GOPATH", Path.home() / "go")) / "bin" / "helm"
    if found is None and gopath_bin.exists():
        found = str(gopath_bin)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("helm is not installed: .ci/run installs it with `go install`")
        pytest.skip("helm is not installed (go install helm.sh/helm/v3/cmd/helm@v3.21.4)")
    return found


def run(*args: str) -> str:
    answer = subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120)
    assert answer.returncode == 0, answer.stdout + answer.stderr
    return answer.stdout


def render(tmp_path: Path, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    args = ["template", "lp", str(CHART)]
    if values is not None:
        file = tmp_path / "values.yaml"
        file.write_text(yaml.safe_dump(values))
        args += ["-f", str(file)]
    return [d for d in yaml.safe_load_all(run(*args)) if d]


def test_helm_lint_accepts_the_chart_with_defaults_and_with_everything_on(
        tmp_path: Path) -> None:
    run("lint", str(CHART), "--strict")
    file = tmp_path / "everything.yaml"
    file.write_text(yaml.safe_dump(EVERYTHING))
    run("lint", str(CHART), "--strict", "-f", str(file))


def pods(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod spec) of every Deployment, StatefulSet and Job."""
    return [(d, d["spec"]["template"]["spec"]) for d in docs
            if d["kind"] in ("Deployment", "StatefulSet", "Job")]


@pytest.mark.parametrize("values", [None, EVERYTHING], ids=["defaults", "everything"])
def test_every_command_is_real_and_every_variable_a_setting(
        tmp_path: Path, values: dict[str, Any] | None) -> None:
    docs = render(tmp_path, values)
    fields = set(Settings.model_fields)
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"]
                  == "lp-env")
    for key in config["data"]:
        assert key.removeprefix("LORAPLANE_").lower() in fields, f"ConfigMap: unknown {key}"
    commands = set()
    for workload, spec in pods(docs):
        for container in spec["containers"]:
            where = f"{workload['kind']} {workload['metadata']['name']}"
            command = container["command"]
            assert command[0] == "loraplane", where
            assert not _is_group(_resolve(command[1:])), f"{where}: incomplete command"
            commands.add(" ".join(command[1:]))
            for item in container.get("env", []):
                name = item["name"]
                if name in HELPERS:
                    continue
                assert name.startswith("LORAPLANE_"), f"{where}: {name}"
                assert name.removeprefix("LORAPLANE_").lower() in fields, f"{where}: {name}"
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in container:
                    argv = container[probe]["exec"]["command"]
                    assert argv[:2] == ["loraplane", "health"], where
                    assert not _is_group(_resolve(argv[1:-1])), where
                    assert command[:2] != ["loraplane", "serve"] or argv[-1] == command[-1]
    assert {"serve registry", "serve router", "serve worker", "serve audit", "serve canary",
            "migrate", "topics"} <= commands


def test_workers_router_registry_and_the_rest_as_operators_expect(tmp_path: Path) -> None:
    docs = render(tmp_path, EVERYTHING)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    defaults = Settings()

    workers = [d for d in by_kind["Deployment"] if "-worker-" in d["metadata"]["name"]]
    assert {d["metadata"]["name"] for d in workers} == {"lp-worker-llama-8b", "lp-worker-qwen-7b"}
    for worker in workers:
        spec = worker["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert spec["terminationGracePeriodSeconds"] > float(env["LORAPLANE_WORKER_DRAIN_S"])
        assert float(env["LORAPLANE_WORKER_DRAIN_S"]) == defaults.worker_drain_s
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert env["LORAPLANE_BASE_MODEL"] == "/models/base"
        assert ("PodDisruptionBudget", worker["metadata"]["name"]) in names
    llama = next(w for w in workers if w["metadata"]["name"].endswith("llama-8b"))
    assert llama["spec"]["replicas"] == 3
    assert llama["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h100"}

    registry = next(d for d in by_kind["Deployment"] if d["metadata"]["name"] == "lp-registry")
    assert registry["spec"]["replicas"] == 2
    router = next(d for d in by_kind["Deployment"] if d["metadata"]["name"] == "lp-router")
    assert ("HorizontalPodAutoscaler", "lp-router") in names
    router_spec = router["spec"]["template"]["spec"]
    router_env = {e["name"]: e.get("value") for e in router_spec["containers"][0]["env"]}
    assert router_spec["terminationGracePeriodSeconds"] > \
        float(router_env["LORAPLANE_ROUTER_DRAIN_S"])
    jobs = {d["spec"]["template"]["spec"]["containers"][0]["command"][1] for d in by_kind["Job"]}
    assert jobs == {"migrate", "topics"}
    assert all("pre-install" in d["metadata"]["annotations"]["helm.sh/hook"]
               for d in by_kind["Job"])
    assert {"Kafka", "KafkaNodePool", "Cluster"} <= set(by_kind)
    assert len(by_kind["ServiceMonitor"]) == 5

    # TLS from a Secret, mounted where the settings point
    for _, spec in pods(docs):
        (container,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env["LORAPLANE_TLS_CERT_FILE"] == "/etc/loraplane/tls/tls.crt"
        assert json.loads(env["LORAPLANE_TLS_CLIENT_AUTH"]) == ["worker", "registry"]
        volume = next(v for v in spec["volumes"] if v["name"] == "tls")
        assert volume["secret"]["secretName"] == "loraplane-tls"
        mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")
        assert mount["mountPath"] == "/etc/loraplane/tls"
        with pytest.MonkeyPatch.context() as patch:  # read as the process reads them
            for key, value in env.items():
                if key.startswith("LORAPLANE_TLS_"):
                    patch.setenv(key, value)
            assert Settings().tls_client_auth == ["worker", "registry"]


def test_the_dashboard_configmap_is_the_provisioned_dashboard(tmp_path: Path) -> None:
    shipped = (REPO / "services" / "deploy" / "grafana" / "dashboards" / "loraplane.json")
    assert (CHART / "files" / "loraplane-dashboard.json").read_text() == shipped.read_text()
    docs = render(tmp_path)
    (dashboard,) = [d for d in docs if d["kind"] == "ConfigMap"
                    and d["metadata"]["name"] == "lp-dashboard"]
    assert json.loads(dashboard["data"]["loraplane.json"]) == json.loads(shipped.read_text())
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
