"""`loraplane up` and `loraplane demo` as a user runs them: real processes, real signals."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from services.stack.process import free_port
from tests.conftest import CACHE, REPO, service_dir

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
                "LORAPLANE_AUDIT_METRICS_PORT": str(free_port()), **extra})
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


@pytest.mark.parametrize("broker", ["apache", "tansu"])
def test_up_runs_refuses_a_second_and_stops_everything(scratch: Path, broker: str) -> None:
    env = _env(scratch / "state", LORAPLANE_KAFKA_BROKER=broker)
    up = subprocess.Popen(_cli("up"), cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        out = _wait_for_line(up, "loraplane is up", timeout=120)
        assert "kafka" in out and "postgres" in out and "audit" in out
        children = _descendants(up.pid)
        names = " ".join(" ".join(p.cmdline()) for p in children)
        assert ("kafka.Kafka" in names) == (broker == "apache")
        assert "postgres" in names

        second = subprocess.run(_cli("up"), cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=60)
        assert second.returncode == 1
        assert "already running" in second.stdout

        status = subprocess.run(_cli("status"), cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0 and "kafka" in status.stdout

        up.send_signal(signal.SIGINT)
        assert up.wait(90) == 0
        assert _all_gone(children) == [], "Ctrl-C left processes running"
    finally:
        if up.poll() is None:
            up.kill()


def test_killed_up_leaves_nothing_running(scratch: Path) -> None:
    env = _env(scratch / "state", LORAPLANE_KAFKA_BROKER="tansu")
    up = subprocess.Popen(_cli("up"), cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_line(up, "loraplane is up", timeout=120)
        children = _descendants(up.pid)
        assert children
    finally:
        up.kill()  # no chance to clean up: the parent-death signal must do it
        up.wait(10)
    assert _all_gone(children) == []


def test_demo_round_trips_an_event_into_postgres(scratch: Path) -> None:
    env = _env(scratch / "state")
    demo = subprocess.Popen(_cli("demo"), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out, _ = demo.communicate(timeout=300)
    assert demo.returncode == 0, out
    for needle in ("produced", "consumed", "PostgreSQL: audit events row", "hash",
                   "nothing left running"):
        assert needle in out
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if str(scratch) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
