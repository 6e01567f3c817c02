"""Children started while other threads stream over gRPC all reach exec: `services` turns
gRPC's fork support off before grpc is imported (with it on, ~3% of such children died of
SIGABRT before exec, which showed up as workers that never restarted in drills); and the
ports `free_port` hands out."""

from __future__ import annotations

import socket
import subprocess
import sys

from services.stack import process
from tests.conftest import REPO

SPAWN_WHILE_STREAMING = """
import services  # first, as in every loraplane process
import os, sys, threading
from concurrent import futures
from pathlib import Path
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from services.stack.process import ChildProcess

server = grpc.server(futures.ThreadPoolExecutor(4))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
stop = threading.Event()

def call() -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            stub.Check(health_pb2.HealthCheckRequest())

for _ in range(4):
    threading.Thread(target=call, daemon=True).start()
codes = []
for _ in range(int(sys.argv[1])):
    child = ChildProcess("true", ["/bin/true"], Path(sys.argv[2]))
    codes.append(child.proc.wait(30))
    child.stop()
stop.set()
server.stop(0)
print(sum(1 for c in codes if c != 0), flush=True)
os._exit(0)  # the callers' threads may still be inside gRPC: what exit does then is not the point
"""


def spawned_and_failed(tmp: str, children: int, **env: str) -> int:
    answer = subprocess.run([sys.executable, "-c", SPAWN_WHILE_STREAMING, str(children),
                             f"{tmp}/child.log"], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env={"PATH": "/usr/bin:/bin", **env})
    assert answer.returncode == 0, answer.stderr[-2000:]
    return int(answer.stdout.strip().splitlines()[-1])


def test_no_child_dies_before_exec_while_grpc_is_busy(tmp_path: object) -> None:
    assert spawned_and_failed(str(tmp_path), 300) == 0


def test_free_ports_come_from_below_the_ephemeral_range_and_bind(tmp_path, monkeypatch) -> None:
    """A picked port is never one the kernel may hand an outgoing connection as its source
    port meanwhile; with no room below the range, the kernel's own pick."""
    low = process._ephemeral_low()
    ports = {process.free_port() for _ in range(200)}
    assert all(process.FIRST_PICKED_PORT <= p < low for p in ports)
    assert len(ports) > 150  # drawn at random, not the same few
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", next(iter(ports))))  # free when handed out
    narrow = tmp_path / "range"
    narrow.write_text("1024\t60999\n")
    monkeypatch.setattr(process, "EPHEMERAL_RANGE", narrow)
    assert process.free_port() >= low  # bound to port 0: the kernel's (real) range
    monkeypatch.setattr(process, "EPHEMERAL_RANGE", tmp_path / "absent")
    assert process._ephemeral_low() == 32768
