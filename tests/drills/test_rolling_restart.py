"""Rolling restarts nobody notices: three worker processes behind a router under steady
load from several clients; each worker in turn gets SIGTERM (it leaves the ring, finishes
its streams, exits) and is started again. Every request completes with all its tokens:
0 failed, 0 cut. p99 TTFT during the roll is reported against the p99 before it.

The first worker also serves one long stream when it gets SIGTERM (longer than the 5 s
a worker used to give its streams): it finishes whole.

Then a router process gets SIGTERM while it streams: the stream finishes, the router
answers no new call, and it exits well within its drain window.

`LORAPLANE_TEST_ROLL_CLIENTS` (4) and `LORAPLANE_TEST_ROLL_TOKENS` (24) size the load; the
figures are written to `LORAPLANE_TEST_ROLL_REPORT` when it names a file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.stack.process import free_port
from tests.conftest import REPO, isolated_settings
from tests.registry.conftest import TENANT
from tests.router.conftest import RunningRouter, bearer, router_settings
from tests.waiting import wait_for
from tests.worker.conftest import ServedModel
from tests.worker.harness import (
    Stack,
    WorkerProcess,
    fresh_adapter,
    publish_files,
    running_stack,
    switch,
    worker_env,
)

pytestmark = [pytest.mark.slow, pytest.mark.chaos]  # 50 s: in `make chaos`, not the suite

CLIENTS = int(os.environ.get("LORAPLANE_TEST_ROLL_CLIENTS", "4"))
TOKENS = int(os.environ.get("LORAPLANE_TEST_ROLL_TOKENS", "24"))
WORKERS = ("w1", "w2", "w3")
DRAIN_S = 60
LONG = 600
"""Tokens of the stream the first worker is serving when it gets SIGTERM: longer than the
5 s a worker used to give its streams before it cut them."""


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, served_model: ServedModel,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings(kafka_bootstrap, None)
    with running_stack(settings, tmp_path_factory.mktemp("roll"), served_model.path, None,
                       worker_drain_s=DRAIN_S) as running:
        for worker in WORKERS[1:]:
            running.worker(worker, worker_drain_s=DRAIN_S).start()
        for worker in WORKERS[1:]:
            running.workers[worker].wait_serving()
        with running.publisher() as pub:
            publish_files(pub, "roll", fresh_adapter(5101), "v1", TENANT, qos_tier="gold")
            switch(pub, "roll", 1)
        yield running


@dataclass
class Call:
    phase: str
    ttft_s: float | None
    tokens: int
    finished: bool
    error: str | None


class Load:
    """`CLIENTS` threads streaming through the router, one request after another."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.phase = "warmup"
        self.calls: list[Call] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                        for i in range(CLIENTS)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)

    def _client(self, index: int) -> None:
        with grpc.insecure_channel(self.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            n = 0
            while not self.stop.is_set():
                n += 1
                request = pb.GenerateRequest(
                    tenant=pb.TenantSignature(org_id=TENANT["org"], team_id=TENANT["team"],
                                              project_id=TENANT["project"],
                                              user_id=f"user-{index}-{n}"),
                    adapter=pb.AdapterRef(alias="roll"),
                    sampling=pb.SamplingParams(max_tokens=TOKENS, ignore_eos=True))
                request.token_ids.ids.extend([5, 6, 7, 8 + index % 8])
                phase, began = self.phase, time.monotonic()
                ttft, tokens, finished, error = None, 0, False, None
                try:
                    for answer in stub.Generate(request, metadata=bearer("acme"), timeout=60):
                        if answer.HasField("token"):
                            tokens += 1
                            if ttft is None:
                                ttft = time.monotonic() - began
                        else:
                            finished = True
                except grpc.RpcError as exc:
                    error = f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
                with self.lock:
                    self.calls.append(Call(phase, ttft, tokens, finished, error))

    def of(self, phase: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.phase == phase]


class LongStream:
    """One long stream straight to a worker, read to its end in a thread of its own."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.tokens = 0
        self.finished = False
        self.error: str | None = None
        self.seconds = 0.0
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        request = pb.GenerateRequest(
            tenant=pb.TenantSignature(org_id=TENANT["org"], team_id=TENANT["team"],
                                      project_id=TENANT["project"], user_id="long"),
            adapter=pb.AdapterRef(alias="roll"),
            sampling=pb.SamplingParams(max_tokens=LONG, ignore_eos=True))
        request.token_ids.ids.extend([5, 6, 7])
        began = time.monotonic()
        with grpc.insecure_channel(self.address) as channel:
            try:
                for answer in pb_grpc.InferenceStub(channel).Generate(request, timeout=120):
                    if answer.HasField("token"):
                        self.tokens += 1
                        self.started.set()
                    else:
                        self.finished = True
            except grpc.RpcError as exc:
                self.error = f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
        self.seconds = time.monotonic() - began
        self.started.set()


def restart(worker: WorkerProcess, timeout_s: float = 120.0) -> None:
    worker.start()

    def serving() -> bool:
        code = worker.proc.poll() if worker.proc is not None else None
        assert code is None, f"{worker.worker_id} exited with {code}:\n{worker.log_tail()}"
        return worker.health() == 1  # SERVING

    wait_for(serving, timeout_s, interval_s=0.2, message=f"{worker.worker_id} serving again")


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def test_rolling_restart_of_three_workers_fails_no_request(stack: Stack) -> None:
    router = RunningRouter(router_settings(stack.settings, heartbeat_interval_s=0.5)).start()
    try:
        router.wait_ring(set(WORKERS), timeout_s=30)
        with Load(f"127.0.0.1:{router.app.grpc_port}") as load:
            # warm-up (first batches, kernels compiled), then the steady state before the roll
            wait_for(lambda: len(load.of("warmup")) >= 10 * CLIENTS, 120, interval_s=0.2,
                     message="the warm-up calls")
            load.phase = "before"
            time.sleep(5.0)  # the steady state the roll is compared with: a window of load
            load.phase = "during"
            rolled: list[float] = []
            drains: list[float] = []
            long = LongStream(stack.workers[WORKERS[0]].address)
            for worker_id in WORKERS:
                worker = stack.workers[worker_id]
                if worker_id == WORKERS[0]:
                    long.started.wait(60)
                began = time.monotonic()
                worker.kill(signal.SIGTERM)  # waits for the exit (drained)
                assert worker.proc is not None and worker.proc.returncode == 0, \
                    worker.log_tail()
                rolled.append(time.monotonic() - began)
                drained = [line for line in worker.log_tail(80).splitlines()
                           if "drained in" in line]
                assert drained, worker.log_tail()
                drains.append(float(drained[-1].split("drained in ")[1].split(" s")[0]))
                restart(worker)
                router.wait_ring(set(WORKERS), timeout_s=30)
            load.phase = "after"
            wait_for(lambda: len(load.of("after")) >= CLIENTS, 60, interval_s=0.1,
                     message="calls after the roll")
        calls = load.of("before") + load.of("during")
        failed = [c for c in load.calls if c.error is not None]
        cut = [c for c in load.calls if c.error is None and (c.tokens != TOKENS
                                                              or not c.finished)]
        before = [c.ttft_s for c in load.of("before") if c.ttft_s is not None]
        during = [c.ttft_s for c in load.of("during") if c.ttft_s is not None]
        report = {"clients": CLIENTS, "tokens_per_request": TOKENS,
                  "requests": len(load.calls), "requests_during_roll": len(load.of("during")),
                  "failed": len(failed), "cut_streams": len(cut),
                  "p99_ttft_before_ms": round(p99(before) * 1e3, 1),
                  "p99_ttft_during_ms": round(p99(during) * 1e3, 1),
                  "p50_ttft_before_ms": round(sorted(before)[len(before) // 2] * 1e3, 1),
                  "p50_ttft_during_ms": round(sorted(during)[len(during) // 2] * 1e3, 1),
                  "worker_drain_s": drains, "worker_exit_s": [round(s, 1) for s in rolled]}
        long.thread.join(timeout=120)
        retried = sum(sample.value for family in router.dispatcher.metrics.retries.collect()
                      for sample in family.samples if sample.name.endswith("_total"))
        report["router_retries"] = retried
        report["long_stream"] = {"tokens": long.tokens, "seconds": round(long.seconds, 1),
                                 "finished": long.finished, "error": long.error}
        print("rolling restart:", json.dumps(report))
        if os.environ.get("LORAPLANE_TEST_ROLL_REPORT"):
            Path(os.environ["LORAPLANE_TEST_ROLL_REPORT"]).write_text(json.dumps(report) + "\n")
        assert (long.tokens, long.finished, long.error) == (LONG, True, None), \
            report["long_stream"]
        assert not failed, failed[:5]
        # the router took each worker out of its ring before that worker stopped admitting:
        # no request had to be retried elsewhere
        assert retried == 0, report
        assert not cut, cut[:5]
        assert len(load.of("before")) >= CLIENTS and len(load.of("during")) >= 3 * CLIENTS
        assert calls and all(c.finished for c in calls)
        # the workers' traces say the same: nothing aborted or failed on any of them
        assert stack.tail is not None
        traced = [r for e in stack.tail.of("RequestServed") for r in e.payload.requests]
        assert traced and {r.status for r in traced} == {"ok"}, \
            {r.status for r in traced}
    finally:
        router.stop()


def test_a_router_drains_its_streams_and_refuses_new_calls(stack: Stack) -> None:
    """A `loraplane serve router` process with a long stream in flight gets SIGTERM."""
    settings = router_settings(stack.settings, heartbeat_interval_s=0.5)
    grpc_port, http_port = free_port(), free_port()
    env = worker_env(settings, auth_tokens=settings.auth_tokens, router_port=grpc_port,
                     router_http_port=http_port, heartbeat_interval_s=0.5,
                     router_drain_s=20, router_tenant_rate=json.dumps(
                         settings.router_tenant_rate), router_adapter_rate=json.dumps(
                         settings.router_adapter_rate), log_level="INFO")
    log_path = stack.root / "router.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "router"],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        target = f"127.0.0.1:{grpc_port}"
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            request = pb.GenerateRequest(
                tenant=pb.TenantSignature(org_id=TENANT["org"], team_id=TENANT["team"],
                                          project_id=TENANT["project"], user_id="long"),
                adapter=pb.AdapterRef(alias="roll"),
                sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True))
            request.token_ids.ids.extend([5, 6, 7])

            def streaming() -> tuple[Iterator[pb.GenerateResponse], pb.GenerateResponse]:
                stream = stub.Generate(request, metadata=bearer("acme"), timeout=120)
                return stream, next(stream)

            # until the router is ready and its ring full
            stream, first = wait_for(streaming, 60, interval_s=0.3, ignoring=(grpc.RpcError,),
                                     message=lambda: log_path.read_text()[-3000:])
            assert first.HasField("token")
            proc.send_signal(signal.SIGTERM)
            stopped_at = time.monotonic()
            wait_for(lambda: "draining" in log_path.read_text(), 10,
                     message="the router to say it is draining")
            with pytest.raises(grpc.RpcError) as refused:
                next(iter(stub.Generate(request, metadata=bearer("acme"), timeout=10)))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            # the router's own refusal: gRPC's stop answered a racing call CANCELLED
            assert "draining" in (refused.value.details() or ""), refused.value
            tokens = 1 + sum(1 for answer in stream if answer.HasField("token"))
        assert tokens == 400  # the stream in flight finished whole
        assert proc.wait(30) == 0
        assert time.monotonic() - stopped_at < 20  # left when its streams were done
        assert "draining" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
