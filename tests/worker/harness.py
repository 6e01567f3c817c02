"""A real stack for worker tests: the broker, the registry (in-process uvicorn), worker
PROCESSES (`python -m services.cli serve worker`) and gRPC clients. Nothing is mocked.

One stack per test module keeps the suite lean: the tiny base model is built once per
session, a worker process starts in a few seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import Engine, text

from services.audit.db import make_engine
from services.audit.projector import AuditProjector
from services.config import Settings
from services.contracts.events import Envelope
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.eventlog import EventConsumer
from services.stack.process import ChildProcess, free_port
from services.worker.engine import checkpoint_digest
from tests.conftest import REPO
from tests.registry.artifacts import AdapterFiles, build_adapter
from tests.registry.conftest import TOKENS, RunningRegistry, registry_settings
from tests.waiting import wait_for

CHAT_TEMPLATE = (
    "{{ bos_token }} {% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}w3{% endif %}")
"""A chat template over the tiny WordLevel vocabulary (words w0..w95)."""

BASE_NAME = "tiny-llama"


def add_chat_template(model_dir: Path) -> None:
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "bos_token": "w1", "eos_token": "w2"}))


def worker_env(settings: Settings, **values: object) -> dict[str, str]:
    """The process environment a worker gets: only LORAPLANE_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}
    fields = {"kafka_bootstrap", "adapter_events_topic", "worker_events_topic",
              "dead_letter_topic", "liveness_topic", "topic_partitions", "cache_dir"}
    for name in fields:
        env[f"LORAPLANE_{name.upper()}"] = str(getattr(settings, name))
    for name, value in values.items():
        env[f"LORAPLANE_{name.upper()}"] = str(value)
    return env


@dataclass
class WorkerProcess:
    """One `loraplane serve worker` child, its ports, state folder and log."""

    worker_id: str
    port: int
    metrics_port: int
    state_dir: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    child: ChildProcess | None = None
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.state_dir / f"{self.worker_id}.log"

    def start(self) -> WorkerProcess:
        """Start the process; it dies with this one (parent-death signal), even on kill -9."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.child = ChildProcess(self.worker_id,
                                  [sys.executable, "-m", "services.cli", "serve", "worker"],
                                  self.log_path, env=self.env, cwd=REPO)
        self.proc = self.child.proc
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def health(self) -> int | None:
        with grpc.insecure_channel(self.address) as channel:
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            except grpc.RpcError:
                return None
            return int(answer.status)

    def wait_serving(self, timeout_s: float = 90.0) -> None:
        proc = self.proc
        assert proc is not None

        def serving_or_gone() -> bool:
            return proc.poll() is not None or \
                self.health() == health_pb2.HealthCheckResponse.SERVING

        wait_for(serving_or_gone, timeout_s, interval_s=0.2,
                 message=lambda: f"worker {self.worker_id} to serve:\n{self.log_tail()}")
        assert proc.poll() is None, f"worker {self.worker_id} exited:\n{self.log_tail()}"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.child is not None:
            self.child.stop(sig, timeout=30)

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text


class EventTail:
    """Every event of both topics, read by a background fan-out consumer."""

    def __init__(self, settings: Settings) -> None:
        self.events: list[Envelope] = []
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._consumer = EventConsumer(settings, list(settings.topics),
                                       reader_id=f"tail-{uuid.uuid4().hex[:6]}",
                                       on_rejected=lambda r: None)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            records = self._consumer.poll(timeout=0.1)
            if records:
                with self._lock:
                    self.events.extend(r.envelope for r in records)
                    self._lock.notify_all()
        self._consumer.close()

    def of(self, event_type: str, **match: Any) -> list[Envelope]:
        with self._lock:
            found = [e for e in self.events if e.type == event_type]
        return [e for e in found
                if all(getattr(e.payload, k) == v for k, v in match.items())]

    def wait(self, event_type: str, timeout_s: float = 30.0, count: int = 1,
             where: Callable[[Envelope], bool] | None = None, **match: Any) -> list[Envelope]:
        deadline = time.monotonic() + timeout_s
        while True:
            found = [e for e in self.of(event_type, **match) if where is None or where(e)]
            if len(found) >= count:
                return found
            left = deadline - time.monotonic()
            assert left > 0, f"no {count} x {event_type} {match} in {timeout_s} s; saw " + \
                str([e.type for e in self.events][-30:])
            with self._lock:
                self._lock.wait(min(left, 0.2))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class Stack:
    """Registry + worker processes on one test module's own topics."""

    def __init__(self, settings: Settings, root: Path, model_dir: Path, *, tail: bool = True,
                 **registry_overrides: Any) -> None:
        self.settings = registry_settings(settings, root / "blobs", **{
            "lease_interval_s": 0.5, "lease_ttl_s": 2.0, **registry_overrides})
        self.root = root
        self.model_dir = model_dir
        self.registry = RunningRegistry(self.settings).start()
        self.tail = EventTail(self.settings) if tail else None
        self.workers: dict[str, WorkerProcess] = {}
        self.base_digest = checkpoint_digest(model_dir)

    def admin(self) -> httpx.Client:
        return self.registry.client("admin")

    def publisher(self) -> httpx.Client:
        return self.registry.client("publisher")

    def register_base(self) -> None:
        config = json.loads((self.model_dir / "config.json").read_text())
        with self.admin() as admin:
            response = admin.post("/v1/base-models", json={
                "name": BASE_NAME, "digest": self.base_digest, "config": config})
            assert response.status_code == 201, response.text

    def worker(self, worker_id: str, **overrides: object) -> WorkerProcess:
        """A worker process (not started) with small, fast settings, serving in float32:
        tests compare tokens across workers and forms (merged against unmerged, for one),
        which agree exactly only in fp32, and `dtype=auto` would serve bf16 on a host with
        AVX512-BF16 (the dtype rule has its own tests)."""
        state = self.root / worker_id
        values: dict[str, object] = {
            "base_model": self.model_dir, "worker_id": worker_id,
            "worker_port": free_port(), "worker_metrics_port": free_port(),
            "state_dir": state, "registry_url": self.registry.url,
            "worker_token": TOKENS["worker"][0], "worker_block_size": 4,
            "worker_kv_blocks": 512, "worker_adapter_slots": 4,
            "worker_max_lora_rank": 16, "heartbeat_interval_s": 0.5,
            "worker_trace_flush_s": 0.2, "worker_dtype": "float32", "log_level": "INFO",
            **overrides}
        process = WorkerProcess(worker_id, int(values["worker_port"]),  # type: ignore[arg-type]
                                int(values["worker_metrics_port"]),  # type: ignore[arg-type]
                                state, worker_env(self.settings, **values))
        self.workers[worker_id] = process
        return process

    def wait_live(self, worker_id: str, timeout_s: float = 30.0) -> None:
        """Until the registry has folded a heartbeat of the worker (purges and quality
        gates are decided on the workers the registry sees live)."""
        wait_for(lambda: worker_id in self.registry.node.state.heartbeats, timeout_s,
                 message=f"the registry to see {worker_id} live")

    def close(self) -> None:
        for process in self.workers.values():
            process.kill(signal.SIGTERM)
        if self.tail is not None:
            self.tail.close()
        self.registry.stop()


def publish_files(client: httpx.Client, adapter_id: str, files: Any, label: str,
                  tenant: dict[str, str], qos_tier: str = "silver") -> dict[str, Any]:
    """Publish adapter files (`.config`, `.weights` bytes) over REST, as multipart."""
    data = {**tenant, "owner": "alice@example", "base_model": BASE_NAME, "label": label,
            "qos_tier": qos_tier}
    response = client.post(f"/v1/adapters/{adapter_id}/versions", data=data, files={
        "adapter_config": ("adapter_config.json", files.config),
        "adapter_model": ("adapter_model.safetensors", files.weights)})
    assert response.status_code == 201, response.text
    return dict(response.json())


def peft_files(adapter_dir: Path) -> AdapterFiles:
    """The two files PEFT's save_pretrained wrote."""
    return AdapterFiles((adapter_dir / "adapter_config.json").read_bytes(),
                        (adapter_dir / "adapter_model.safetensors").read_bytes())


def fresh_adapter(seed: int, **kw: Any) -> AdapterFiles:
    """An adapter with bytes no other test publishes (content-addressed: no sharing)."""
    return build_adapter(seed=seed, **kw)


def switch(client: httpx.Client, adapter_id: str, version: int) -> None:
    response = client.put(f"/v1/adapters/{adapter_id}/active", json={"version": version})
    assert response.status_code == 200, response.text


def signature(org: str, team: str, project: str, user: str = "u1") -> pb.TenantSignature:
    return pb.TenantSignature(org_id=org, team_id=team, project_id=project, user_id=user)


def generate(stub: pb_grpc.InferenceStub, tenant: pb.TenantSignature, *,
             adapter: pb.AdapterRef | None = None, ids: list[int] | None = None,
             text: str | None = None, max_tokens: int = 8, ignore_eos: bool = True,
             min_tokens: int = 0, timeout: float = 60.0, **kw: Any
             ) -> tuple[list[int], pb.FinalUsage]:
    """One Generate call to the end: the tokens and the FinalUsage."""
    request = pb.GenerateRequest(
        tenant=tenant, adapter=adapter,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos,
                                   min_tokens=min_tokens), **kw)
    if ids is not None:
        request.token_ids.ids.extend(ids)
    elif text is not None:
        request.text = text
    tokens: list[int] = []
    final = None
    for response in stub.Generate(request, timeout=timeout):
        if response.HasField("token"):
            tokens.append(response.token.token_id)
        else:
            final = response.final
    assert final is not None
    return tokens, final


def pinned(adapter_id: str, version: int) -> pb.AdapterRef:
    return pb.AdapterRef(pinned=pb.PinnedVersion(adapter_id=adapter_id, version=version))


def alias(name: str) -> pb.AdapterRef:
    return pb.AdapterRef(alias=name)


@contextlib.contextmanager
def channel(address: str) -> Iterator[pb_grpc.InferenceStub]:
    with grpc.insecure_channel(address) as ch:
        yield pb_grpc.InferenceStub(ch)


@contextlib.contextmanager
def running_stack(settings: Settings, root: Path, model_dir: Path, database_url: str | None,
                  **worker: object) -> Iterator[Stack]:
    """A module's stack: its topics (and schema) already made; the base model registered
    and worker "w1" serving (with `worker` settings); all of it removed afterwards."""
    from tests.conftest import drop_isolation

    stack = Stack(settings, root, model_dir)
    try:
        stack.register_base()
        stack.worker("w1", **worker).start().wait_serving()
        stack.wait_live("w1")
        yield stack
    finally:
        stack.close()
        drop_isolation(settings, database_url)


@contextlib.contextmanager
def bench_stack(prefix: str, model: Callable[[Path], object], **stack_kw: Any
                ) -> Iterator[tuple[Path, Stack]]:
    """For the benches: an embedded Apache Kafka in a scratch folder, topics of its own, a
    base model written by `model(dir)`, a registry with it registered; all stopped after."""
    import shutil
    import tempfile

    from services.stack.brokers import ApacheKafka
    from tests.conftest import CACHE, isolated_settings

    root = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    broker = ApacheKafka(Settings(cache_dir=CACHE, topic_partitions=3), root / "kafka")
    broker.start()
    stack = None
    try:
        settings = isolated_settings(broker.bootstrap, None, state_dir=root / "state")
        model(root / "base")
        stack = Stack(settings, root, root / "base", **stack_kw)
        stack.register_base()
        yield root, stack
    finally:
        if stack is not None:
            stack.close()
        broker.stop()
        shutil.rmtree(root, ignore_errors=True)


def save_report(out: str | Path, report: dict[str, Any]) -> None:
    """A bench's figures: written as JSON and printed."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))



@contextlib.contextmanager
def audit_projection(stack: Stack) -> Iterator[tuple[AuditProjector, Engine]]:
    """A projector on the stack's database, driven by the test (`project_until`), and an
    engine to query what it wrote."""
    assert stack.settings.database_url
    engine = make_engine(stack.settings.database_url)
    projector = AuditProjector(stack.settings, engine)
    try:
        yield projector, engine
    finally:
        projector.close()
        engine.dispose()


def project_until(audit: tuple[AuditProjector, Engine], sql: str, timeout_s: float = 30.0,
                  at_least: int = 1, **params: object) -> list[dict]:
    """Project batches until `sql` returns `at_least` rows; those rows."""
    projector, engine = audit

    def projected() -> list[dict]:
        projector.project_batch(timeout=0.2)
        with engine.connect() as conn:
            rows = [dict(r._mapping) for r in conn.execute(text(sql), params)]
        return rows if len(rows) >= at_least else []

    return wait_for(projected, timeout_s, interval_s=0, message=f"rows of {sql}")
