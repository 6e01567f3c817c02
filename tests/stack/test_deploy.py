"""The compose stack's monitoring files, checked with their own tools where a package
gives them (promtool), by structure where none does (Grafana provisioning), and against
the code: every metric a dashboard or rule reads exists in a service's metrics registry,
every scrape target is a compose service on the port it is configured to serve."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

DEPLOY = REPO / "services" / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _promtool() -> str:
    """Debian's `prometheus` package (.ci/run installs it); PROMTOOL names another."""
    found = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return found


def _run(*args: str) -> str:
    answer = subprocess.run(args, cwd=PROMETHEUS, capture_output=True, text=True, timeout=60)
    assert answer.returncode == 0, answer.stdout + answer.stderr
    return answer.stdout + answer.stderr


def test_promtool_accepts_the_config_and_rules() -> None:
    promtool = _promtool()
    _run(promtool, "check", "config", "prometheus.yml")
    _run(promtool, "check", "rules", "rules.yml")


def test_kv_hit_rate_alert_fires_under_half() -> None:
    assert "SUCCESS" in _run(_promtool(), "test", "rules", "rules_test.yml")


def _metric_names() -> set[str]:
    """Every sample name the services can expose."""
    from services.audit.metrics import ProjectorMetrics
    from services.registry.metrics import RegistryMetrics
    from services.release.metrics import CanaryMetrics
    from services.router.metrics import RouterMetrics
    from services.worker.metrics import WorkerMetrics

    names: set[str] = set()
    for metrics in (WorkerMetrics(), RouterMetrics(), RegistryMetrics(), ProjectorMetrics(),
                    CanaryMetrics()):
        for family in metrics.registry.collect():
            names.add(family.name)
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                        "gauge": ()}.get(family.type, ())
            names.update(family.name + s for s in suffixes)
    for source in (REPO / "services").rglob("*.py"):  # custom collectors
        names.update(re.findall(r'MetricFamily\(\s*"(loraplane_\w+)"', source.read_text()))
    return names


def _expressions() -> list[str]:
    rules = yaml.safe_load((PROMETHEUS / "rules.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    dashboard = json.loads((GRAFANA / "dashboards" / "loraplane.json").read_text())
    exprs += [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    return exprs


def test_every_metric_read_exists_in_a_service_registry() -> None:
    known = _metric_names()
    rules = yaml.safe_load((PROMETHEUS / "rules.yml").read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    read = set()
    for expr in _expressions():
        read |= set(re.findall(r"\bloraplane_\w+", expr))
        for name in re.findall(r"\b[a-z_]+:[a-z_0-9]+:[a-z_0-9]+\b", expr):
            assert name in recorded, f"{name} is not a recording rule"
    assert read, "no metric read at all"
    assert read <= known, f"not exposed by any service: {sorted(read - known)}"


def test_dashboard_shows_what_operators_asked_for() -> None:
    dashboard = json.loads((GRAFANA / "dashboards" / "loraplane.json").read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    text = json.dumps(dashboard)
    for needle in ("adapter:adapter_load_seconds", "kv_prefix_hit_rate", "time_to_first_token",
                   "inter_token", "loraplane_canary_"):
        assert needle in text, needle
    datasource = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasource["apiVersion"] == 1
    (source,) = datasource["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    for panel in dashboard["panels"]:
        assert {"id", "type", "title", "gridPos", "targets"} <= set(panel), panel["title"]
        assert panel["datasource"]["uid"] == source["uid"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"] and target["refId"]


def _mounts(service: str) -> dict[str, str]:
    """Container path → repository path of a service's bind mounts."""
    mounts = {}
    for volume in COMPOSE["services"][service].get("volumes", []):
        host, container = volume.split(":")[:2]
        if host.startswith("./"):
            mounts[container] = host
    return mounts


def test_compose_mounts_the_files_and_scrapes_every_service() -> None:
    services = COMPOSE["services"]
    assert _mounts("prometheus")["/etc/prometheus"] == "./services/deploy/prometheus"
    grafana = _mounts("grafana")
    assert grafana["/etc/grafana/provisioning"] == "./services/deploy/grafana/provisioning"
    provider = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "loraplane.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert grafana[path] == "./services/deploy/grafana/dashboards"
    assert services["worker-gpu"]["profiles"] == ["gpu"]

    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    port_setting = {"registry": "LORAPLANE_REGISTRY_PORT", "router": "LORAPLANE_ROUTER_HTTP_PORT",
                    "audit": "LORAPLANE_AUDIT_METRICS_PORT",
                    "canary": "LORAPLANE_CANARY_METRICS_PORT",
                    "worker": "LORAPLANE_WORKER_METRICS_PORT",
                    "worker-gpu": "LORAPLANE_WORKER_METRICS_PORT"}
    scraped = set()
    for job in config["scrape_configs"]:
        for target in job["static_configs"][0]["targets"]:
            host, port = target.split(":")
            assert host in services, f"{target}: no compose service {host}"
            assert services[host]["environment"][port_setting[host]] == port, target
            scraped.add(host)
    assert scraped == set(port_setting)


def test_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    """Where the compose client is installed (no engine needed)."""
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True) \
        if shutil.which("docker") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("the docker compose client is not installed")
    answer = subprocess.run(["docker", "compose", "-f", str(REPO / "docker-compose.yml"),
                             "--profile", "gpu", "config", "--quiet"],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert answer.returncode == 0, answer.stderr


def test_error_rate_and_latency_alerts_have_promtool_tests() -> None:
    """The two service-level alerts sit beside the others and each has a firing and a
    quiet case in rules_test.yml (which `promtool test rules` runs above)."""
    rules = yaml.safe_load((PROMETHEUS / "rules.yml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert {"RequestErrorRateHigh", "FirstTokenLatencyHigh", "TenantKVHitRateLow",
            "WorkerNotReady", "CanaryControllerNotJudging", "AuditProjectorStalled"} <= set(alerts)
    assert "router:request_errors:ratio_rate5m" in alerts["RequestErrorRateHigh"]["expr"]
    assert "router:first_token_seconds:p99_5m" in alerts["FirstTokenLatencyHigh"]["expr"]
    tests = yaml.safe_load((PROMETHEUS / "rules_test.yml").read_text())["tests"]
    cases = [case for t in tests for case in t.get("alert_rule_test", [])]
    for name in ("RequestErrorRateHigh", "FirstTokenLatencyHigh"):
        expected = [bool(c["exp_alerts"]) for c in cases if c["alertname"] == name]
        assert True in expected and False in expected, name
