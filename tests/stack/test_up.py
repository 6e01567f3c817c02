"""`loraplane up` and `loraplane demo` as a user runs them: real processes, real signals."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from services.stack.process import free_port
from tests.conftest import CACHE, REPO, service_dir
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def scratch() -> Iterator[Path]:
    with service_dir("up") as where:
        yield where


def _env(state: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}
    env.update({"LORAPLANE_STATE_DIR": str(state), "LORAPLANE_CACHE_DIR": str(CACHE),
                "LORAPLANE_TOPIC_PARTITIONS": "2", "COLUMNS": "200",
                "LORAPLANE_REGISTRY_PORT": str(free_port()),
                "LORAPLANE_AUDIT_METRICS_PORT": str(free_port()),
                "LORAPLANE_CANARY_METRICS_PORT": "0", **extra})
    return env


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def _wait_for_line(proc: subprocess.Popen[str], needle: str, timeout: float) -> str:
    """Lines come from a reader thread: select() on a buffered text pipe can miss lines
    that readline() already pulled into Python's buffer."""
    assert proc.stdout is not None
    lines: queue.Queue[str | None] = getattr(proc, "_lines", None) or queue.Queue()
    if not hasattr(proc, "_lines"):
        proc._lines = lines  # type: ignore[attr-defined]
        stream = proc.stdout

        def pump() -> None:
            for line in stream:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
    seen = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"never printed {needle!r}:\n{''.join(seen)}")


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _all_gone(processes: list[psutil.Process], timeout: float = 40.0) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return alive


@dataclass
class Models:
    base: Path
    adapter: Path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """A tiny random Llama (tokenizer and chat template included) and one PEFT adapter."""
    from tests.worker.engine.tiny_llama import ADAPTERS, build_adapter, build_model
    from tests.worker.harness import add_chat_template

    root = tmp_path_factory.mktemp("up-models")
    root.chmod(0o755)
    hf = build_model(root / "base", max_position_embeddings=512)
    add_chat_template(root / "base")
    build_adapter(hf, ADAPTERS[0], root / "support-v1", seed=7)
    return Models(root / "base", root / "support-v1")


def _stack_env(state: Path, broker: str) -> dict[str, str]:
    return _env(state, LORAPLANE_KAFKA_BROKER=broker, LORAPLANE_ROUTER_PORT=str(free_port()),
                LORAPLANE_ROUTER_HTTP_PORT=str(free_port()),
                LORAPLANE_WORKER_PORT=str(free_port()),
                LORAPLANE_WORKER_METRICS_PORT=str(free_port()))


def _run(env: dict[str, str], *args: str, timeout: float = 120,
         stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cli(*args), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, input=stdin)


def _one_line_error(answer: subprocess.CompletedProcess[str], needle: str) -> None:
    assert answer.returncode == 1, answer
    assert "Traceback" not in answer.stderr + answer.stdout
    assert needle in answer.stderr, answer.stderr


def _stop(up: subprocess.Popen[str], children: list[psutil.Process]) -> str:
    up.send_signal(signal.SIGINT)
    out = _wait_for_line(up, "stopped", timeout=120)
    assert up.wait(30) == 0
    assert _all_gone(children) == [], "Ctrl-C left processes running"
    return out


def test_up_serves_supervises_and_keeps_everything_across_a_restart(
        scratch: Path, models: Models) -> None:
    """Two workers behind the router on a given base model; the CLI publishes, switches
    and generates through them; a killed worker is restarted; Ctrl-C stops all of it; a
    second `up` on the same state folder still has the adapter and serves it."""
    env = _stack_env(scratch / "state", "apache")
    args = ("up", "--workers", "2", "--base-model", str(models.base))
    up = subprocess.Popen(_cli(*args), cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        out = _wait_for_line(up, "loraplane is up", timeout=240)
        for part in ("kafka", "postgres", "base model", "registry", "router", "canary",
                     "worker-1", "worker-2", "admin.token"):
            assert part in out, out
        children = _descendants(up.pid)

        second = _run(env, "up")
        assert second.returncode == 1 and "already running" in second.stderr

        published = _run(env, "publish", str(models.adapter), "--tenant", "acme/support/chat",
                         "--adapter", "acme-support")
        assert published.returncode == 0, published.stderr
        assert "published acme-support v1" in published.stdout
        assert _run(env, "override", "acme-support", "1", "--reason", "test").returncode == 0
        assert _run(env, "switch", "acme-support", "1").returncode == 0
        _one_line_error(_run(env, "split", "acme-support", "v1=90", "v2=5"),
                        "not 100")
        _one_line_error(_run(env, "switch", "acme-support", "7"), "no version 7")

        answer = _run(env, "generate", "--tenant", "acme/support/chat", "--adapter",
                      "acme-support", "--max-tokens", "4", "w5 w6 w7")
        assert answer.returncode == 0, answer.stderr
        assert "acme-support v1 on worker-" in answer.stderr
        talk = _run(env, "chat", "--tenant", "acme/support/chat", "--adapter", "acme-support",
                    "--max-tokens", "3", stdin="w5 w6\nw7\n\n")
        assert talk.returncode == 0, talk.stderr
        assert talk.stdout.count("model>") == 2 and talk.stderr.count("acme-support v1") == 2

        document = json.loads((scratch / "state" / "endpoints.json").read_text())
        worker = next(s for s in document["services"] if s["name"] == "worker-1")
        os.kill(worker["pid"], signal.SIGKILL)
        _wait_for_line(up, "restarted worker-1", timeout=60)

        status = _run(env, "status")
        assert status.returncode == 0, status.stderr
        assert "worker-2" in status.stdout and "ready" in status.stdout
        assert "serving" in status.stdout
        _stop(up, children + _descendants(up.pid))

        up = subprocess.Popen(_cli("up", "--workers", "1", "--base-model", str(models.base)),
                              cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        _wait_for_line(up, "loraplane is up", timeout=240)
        children = _descendants(up.pid)
        # Known gap: on a busy machine the second `up` has twice said it was up a moment
        # before its router placed a request ("no live worker serves this base model").
        # What this test holds is that the restarted stack keeps the adapter and serves
        # it; the first answer may take until the router has the worker.
        def served() -> subprocess.CompletedProcess[str] | None:
            answer = _run(env, "generate", "--tenant", "acme/support/chat", "--adapter",
                          "acme-support", "--max-tokens", "2", "w5 w6")
            if answer.returncode != 0 and "no live worker" in answer.stderr:
                return None
            return answer

        again = wait_for(served, 20, interval_s=1.0, message="the restarted stack to serve")
        assert again.returncode == 0, again.stderr
        assert "acme-support v1" in again.stderr
        _stop(up, children)
    finally:
        if up.poll() is None:
            up.kill()


@pytest.mark.chaos  # about 20 s: in `make chaos`, not the suite
def test_tansu_restart_is_refilled_from_the_audit_store(scratch: Path, models: Models) -> None:
    """Tansu keeps nothing: the second `up` republishes the audit store before the services
    start, so the registry still knows the adapter and its version. That `up` is then
    killed with SIGKILL: its children die with it (parent-death signal)."""
    env = _stack_env(scratch / "state", "tansu")
    args = ("up", "--workers", "0", "--base-model", str(models.base))
    up = subprocess.Popen(_cli(*args), cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_line(up, "loraplane is up", timeout=180)
        children = _descendants(up.pid)
        published = _run(env, "publish", str(models.adapter), "--tenant", "acme/support/chat",
                         "--adapter", "acme-support", "--label", "first")
        assert published.returncode == 0, published.stderr
        wait_for(lambda: '"first"' in _run(env, "audit", "sql", "select label from "
                                           "adapter_lineage", "--json").stdout,
                 60, interval_s=0.5, message="the projector to store v1")
        _stop(up, children)

        up = subprocess.Popen(_cli(*args), cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        out = _wait_for_line(up, "loraplane is up", timeout=180)
        assert "refill" in out, out
        children = _descendants(up.pid)
        listed = _run(env, "audit", "sql", "select adapter_id, version, label from "
                      "adapter_lineage", "--json")
        assert listed.returncode == 0, listed.stderr
        assert '"first"' in listed.stdout
        second = _run(env, "publish", str(models.adapter), "--tenant", "acme/support/chat",
                      "--adapter", "acme-support", "--label", "second")
        assert second.returncode == 0, second.stderr
        assert "acme-support v2" in second.stdout  # the registry saw v1 in the refilled log
        up.kill()  # no chance to clean up: the parent-death signal must do it
        up.wait(10)
        assert _all_gone(children) == [], "kill -9 of up left processes running"
    finally:
        if up.poll() is None:
            up.kill()


def test_client_commands_without_a_stack_say_so_in_one_line(scratch: Path) -> None:
    env = _env(scratch / "nothing")
    _one_line_error(_run(env, "switch", "acme", "1"), "is `loraplane up` running?")
    _one_line_error(_run(env, "generate", "--tenant", "a/b/c", "hi"),
                    "is `loraplane up` running?")
    _one_line_error(_run(env, "generate", "--tenant", "nope", "hi"), "org/team/project")


def test_demo_runs_every_step_on_two_workers_and_leaves_nothing_running(scratch: Path) -> None:
    """`loraplane demo` on a tiny model (the real one is the default): the tenants' answers,
    the canary, the rollback, the purge and their proofs in SQL; exit 0, nothing left."""
    from tests.worker.engine.tiny_llama import build_model
    from tests.worker.harness import add_chat_template

    model = scratch / "tiny"
    build_model(model, max_position_embeddings=256)
    add_chat_template(model)
    env = _env(scratch / "state")
    demo = subprocess.Popen(
        _cli("demo", "--base-model", str(model), "--answer-tokens", "6", "--stage-s", "3"),
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = demo.communicate(timeout=600)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 0, out
    for needle in ("worker-1", "worker-2", "different answers from 4 requests",
                   "base model, no adapter", "rollout completed", "fault injection",
                   "rolled back at 5 %", "error rate", "purge_proofs", "met",
                   "adapter_lineage", "release_decisions", "rollout_rolled_back", "served_by",
                   "tokens/s, all workers", "TTFT", "adapter load into a device slot",
                   "audit verify: OK", "stand-alone verifier: OK", "nothing left running"):
        assert needle in out, needle
    verdict = next(line for line in out.splitlines() if line.startswith("audit verify: OK"))
    assert " 0 signed checkpoints" not in verdict, verdict  # signed on time, not by count
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if str(scratch) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []


def test_a_taken_port_is_one_line_and_ports_auto_moves_every_port(scratch: Path) -> None:
    """Another program on the registry's port: `up` stops at once with one line naming
    the port, the service and the setting; `up --ports auto` then listens on free ports,
    writes them to endpoints.json, and the CLI finds the stack there."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = _env(scratch / "state", LORAPLANE_KAFKA_BROKER="tansu",
                   LORAPLANE_REGISTRY_PORT=str(port), LORAPLANE_REGISTRY_HOST="127.0.0.1")
        began = time.monotonic()
        answer = _run(env, "up", "--workers", "0", timeout=60)
        assert time.monotonic() - began < 30  # before the broker and PostgreSQL start
        assert answer.returncode == 1, answer
        line = answer.stderr.strip()
        assert len(line.splitlines()) == 1 and "Traceback" not in answer.stderr, line
        assert f"port {port} (registry REST) is in use" in line
        assert "LORAPLANE_REGISTRY_PORT" in line and "--ports auto" in line
        assert not (scratch / "state" / "kafka").exists()

        up = subprocess.Popen(_cli("up", "--workers", "0", "--ports", "auto"), cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        try:
            _wait_for_line(up, "loraplane is up", timeout=180)
            children = _descendants(up.pid)
            document = json.loads((scratch / "state" / "endpoints.json").read_text())
            url = document["env"]["LORAPLANE_REGISTRY_URL"]
            assert not url.endswith(f":{port}") and url.startswith("http://127.0.0.1:")
            assert int(document["env"]["LORAPLANE_ROUTER_PORT"]) != 8782
            found = _run(_env(scratch / "state"), "base-models", "--json")
            assert found.returncode == 0 and found.stdout == "", found  # none registered
            listed = _run(_env(scratch / "state"), "status", "--json")
            assert listed.returncode == 0, listed.stderr
            services = {s["service"]: s["state"] for s in json.loads(listed.stdout)["services"]}
            assert services["registry"] == "ready" and services["router"] == "ready", services
            _stop(up, children)
        finally:
            if up.poll() is None:
                up.kill()
