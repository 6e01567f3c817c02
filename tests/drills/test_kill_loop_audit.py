"""Every answered request is in the audit, even when the worker that answered it is killed.

Several clients stream through a real router to a worker process; the worker is killed
with SIGKILL while it serves them, restarted, and killed again, `LORAPLANE_TEST_KILL_ROUNDS`
times (3 here; more for a soak: `LORAPLANE_TEST_KILL_ROUNDS=20 pytest ...`). Then the
audit projector is run until it has caught up with the log, and PostgreSQL's `served_by`
must answer every request whose client received its FinalUsage, and every request cut
mid-stream (with its outcome), one row each.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from sqlalchemy import Engine, text

from services.audit.db import make_engine, upgrade
from services.audit.projector import AuditProjector
from services.contracts.grpc import inference_pb2 as pb
from tests.conftest import isolated_settings
from tests.router.conftest import RunningRouter, bearer, router_settings
from tests.waiting import wait_for
from tests.worker.conftest import ServedModel
from tests.worker.harness import Stack, running_stack, signature

pytestmark = pytest.mark.slow

ROUNDS = int(os.environ.get("LORAPLANE_TEST_KILL_ROUNDS", "3"))
CLIENTS = 4
ACME = signature("acme", "search", "prod")


@dataclass
class Load:
    """What the clients saw, by request id."""

    completed: dict[str, pb.FinalUsage] = field(default_factory=dict)
    """The client received every token and the FinalUsage."""
    cut: dict[str, int] = field(default_factory=dict)
    """The stream broke after this many tokens (the worker died under it)."""
    refused: int = 0
    """Failed before any token (no worker up): nothing was answered."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def count(self) -> int:
        with self.lock:
            return len(self.completed)


def client(router: RunningRouter, load: Load, name: str, seed: int) -> None:
    """Short streamed requests back to back, each with its own request and trace id."""
    rng = random.Random(seed)
    stub = router.stub()
    n = 0
    while not load.stop.is_set():
        n += 1
        request_id = f"{name}-{n}"
        request = pb.GenerateRequest(
            request_id=request_id, trace_id=uuid.uuid4().hex, tenant=ACME,
            sampling=pb.SamplingParams(max_tokens=rng.randint(4, 24), ignore_eos=True))
        request.token_ids.ids.extend([rng.randint(4, 90) for _ in range(rng.randint(2, 8))])
        tokens, final = 0, None
        try:
            for response in stub.Generate(request, metadata=bearer("acme"), timeout=30):
                if response.HasField("token"):
                    tokens += 1
                else:
                    final = response.final
        except grpc.RpcError:
            with load.lock:
                if tokens:
                    load.cut[request_id] = tokens
                else:
                    load.refused += 1
            time.sleep(0.05 if tokens else 0.25)
            continue
        if final is not None:  # (the test checks its counts against the store's)
            with load.lock:
                load.completed[request_id] = final


def wait_answers(load: Load, more: int, timeout_s: float = 60.0) -> None:
    start = load.count()
    wait_for(lambda: load.count() >= start + more, timeout_s, interval_s=0.02,
             message=f"{more} more answers")


def kill_loop(stack: Stack, router: RunningRouter, rounds: int) -> Load:
    """Clients stream while the worker is killed (SIGKILL) and restarted `rounds` times."""
    load = Load()
    threads = [threading.Thread(target=client, args=(router, load, f"c{i}", i), daemon=True)
               for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    worker = stack.workers["w1"]
    try:
        for _ in range(rounds):
            wait_answers(load, 20)  # the worker is busy with every client's streams
            worker.kill(signal.SIGKILL)
            worker.start().wait_serving()
        wait_answers(load, 20)
    finally:
        load.stop.set()
        for thread in threads:
            thread.join(timeout=60)
    return load


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, database_url: str, served_model: ServedModel,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings(kafka_bootstrap, database_url)
    assert settings.database_url
    upgrade(settings.database_url)
    with running_stack(settings, tmp_path_factory.mktemp("kill-loop"), served_model.path,
                       database_url) as running:
        yield running


def project_to_the_end(stack: Stack, engine: Engine) -> None:
    """Run the projector until three polls in a row find nothing new."""
    projector = AuditProjector(stack.settings, engine)
    try:
        idle = 0
        while idle < 3:
            idle = idle + 1 if projector.project_batch(timeout=0.5) == 0 else 0
    finally:
        projector.close()


def test_kill_loop_leaves_no_answered_request_out_of_served_by(stack: Stack) -> None:
    router = RunningRouter(router_settings(stack.settings, heartbeat_interval_s=0.5)).start()
    try:
        router.wait_ring({"w1"})
        load = kill_loop(stack, router, ROUNDS)
        witness = getattr(router.app, "witness", None)  # (None: the code before it)
        wait_for(lambda: witness is None or not witness.unwritten, 30,
                 message="the router's witness to write its traces")
    finally:
        router.stop()
    # the last traces, the live worker's and the router's, are on the log before projecting
    assert stack.tail is not None
    tail = stack.tail

    def untraced() -> list[str]:
        traced = {r.request_id for e in tail.of("RequestServed") for r in e.payload.requests}
        return sorted(set(load.completed) - traced | set(load.cut) - traced)

    wait_for(lambda: not untraced(), 30,
             message=lambda: f"a trace of every answered or cut request; none of {untraced()[:10]}")
    assert stack.settings.database_url
    engine = make_engine(stack.settings.database_url)
    try:
        project_to_the_end(stack, engine)
        with engine.connect() as conn:
            rows = [r._mapping for r in conn.execute(text(
                "SELECT request_id, trace_id, status, completion_tokens, worker_id, "
                "base_model_digest FROM served_by WHERE request_id LIKE 'c%'"))]
    finally:
        engine.dispose()
    served: dict[str, list[dict]] = {}
    for row in rows:
        served.setdefault(row["request_id"], []).append(dict(row))
    missing = sorted(set(load.completed) - set(served))
    print(f"kill -9 x {ROUNDS}: {len(load.completed)} completed, {len(missing)} missing from "
          f"served_by; {len(load.cut)} cut mid-stream, "
          f"{len(set(load.cut) - set(served))} of them missing; {load.refused} refused")
    assert load.cut, "no stream was cut: the kills missed the load"
    assert not missing, f"{len(missing)} of {len(load.completed)} answered requests are not " \
                        f"in served_by: {missing[:10]}"
    for request_id, final in load.completed.items():
        [row] = served[request_id]
        assert row["status"] == "ok", row
        assert row["trace_id"] == final.trace_id
        assert row["completion_tokens"] == final.completion_tokens, row
    lost_cuts = sorted(set(load.cut) - set(served))
    assert not lost_cuts, f"cut requests not traced: {lost_cuts[:10]}"
    for request_id, tokens in load.cut.items():
        [row] = served[request_id]  # one row, even where worker and router both traced it
        assert row["status"] in ("cut", "ok"), row
        assert row["worker_id"] == "w1" and row["base_model_digest"] == stack.base_digest
        if row["status"] == "cut":
            assert row["completion_tokens"] == tokens, (row, tokens)
