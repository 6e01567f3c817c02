"""SRE drills on `loraplane up` itself: real processes, killed for real. One stack for
the module: Apache Kafka, PostgreSQL, every service and two workers on a tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import psutil
import pytest

from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from tests.conftest import REPO, service_dir
from tests.stack.test_up import _cli, _run, _stack_env, _stop, _wait_for_line
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


@dataclass
class Up:
    proc: subprocess.Popen[str]
    env: dict[str, str]
    state: Path

    def document(self) -> dict:
        return json.loads((self.state / "endpoints.json").read_text())

    def admin_token(self) -> str:
        return (self.state / "admin.token").read_text().strip()


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    from tests.worker.engine.tiny_llama import ADAPTERS, build_adapter, build_model
    from tests.worker.harness import add_chat_template

    with service_dir("drills") as scratch:
        models = scratch / "models"
        hf = build_model(models / "base", max_position_embeddings=1024)
        add_chat_template(models / "base")
        build_adapter(hf, ADAPTERS[0], models / "v1", seed=3)
        build_adapter(hf, ADAPTERS[1], models / "v2", seed=4)
        env = _stack_env(scratch / "state", "apache")
        proc = subprocess.Popen(
            _cli("up", "--workers", "2", "--base-model", str(models / "base")), cwd=REPO,
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            _wait_for_line(proc, "loraplane is up", timeout=240)
            children = psutil.Process(proc.pid).children(recursive=True)
            for args in (("publish", str(models / "v1"), "--tenant", "acme/support/chat",
                          "--adapter", "acme-support"),
                         ("override", "acme-support", "1", "--reason", "drill"),
                         ("switch", "acme-support", "1")):
                answer = _run(env, *args)
                assert answer.returncode == 0, answer.stderr
            yield Up(proc, env | {"MODELS": str(models)}, scratch / "state")
            _stop(proc, children + psutil.Process(proc.pid).children(recursive=True))
        finally:
            if proc.poll() is None:
                proc.kill()


def _request(max_tokens: int, trace_id: str = "") -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        tenant=pb.TenantSignature(org_id="acme", team_id="support", project_id="chat",
                                  user_id="drill"),
        adapter=pb.AdapterRef(alias="acme-support"), trace_id=trace_id,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    request.text = "w5 w6"
    return request


def test_a_worker_killed_mid_stream(up: Up) -> None:
    """The stream it was serving ends with UNAVAILABLE (tokens already sent are not
    replayed elsewhere); the router's trace records the attempt; the next request fails
    over to the other worker before its first token; `up` restarts the killed one."""
    document = up.document()
    pids = {s["name"]: s["pid"] for s in document["services"]}
    router = document["env"]
    address = f"127.0.0.1:{router['LORAPLANE_ROUTER_PORT']}"
    http = f"http://127.0.0.1:{router['LORAPLANE_ROUTER_HTTP_PORT']}"
    metadata = (("authorization", f"Bearer {up.admin_token()}"),)
    trace_id = uuid.uuid4().hex
    received = 0
    killed = None
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as lost:
            for _ in stub.Generate(_request(900, trace_id), timeout=120, metadata=metadata):
                received += 1
                if killed is None:
                    busy = [line for line in httpx.get(f"{http}/metrics").text.splitlines()
                            if line.startswith("loraplane_router_in_flight{")
                            and not line.endswith(" 0.0")]
                    assert len(busy) == 1, busy
                    killed = busy[0].split('worker="')[1].split('"')[0]
                    os.kill(pids[killed], signal.SIGKILL)
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        assert 0 < received < 900
        answers = list(stub.Generate(_request(4), timeout=60, metadata=metadata))
    final = answers[-1].final
    assert final.completion_tokens == 4 and final.worker_id != killed
    traces = httpx.get(f"{http}/debug/traces", params={"trace_id": trace_id},
                       headers={"Authorization": f"Bearer {up.admin_token()}",
                                "X-Loraplane-Tenant": "acme/support/chat"}).json()
    assert "traces" in traces, traces
    [trace] = traces["traces"]
    assert [a["outcome"] for a in trace["attempts"]] == ["failed_after_first_token"]
    assert trace["attempts"][0]["worker"] == killed
    _wait_for_line(up.proc, f"restarted {killed}", timeout=60)


def test_the_broker_restarted(up: Up) -> None:
    """Kafka killed with SIGKILL: `up` starts it again on the same port and log; the
    registry, the projector and the workers reconnect; nothing published is lost."""
    (kafka,) = [p for p in psutil.Process(up.proc.pid).children(recursive=True)
                if "kafka.Kafka" in " ".join(p.cmdline())]
    kafka.kill()
    _wait_for_line(up.proc, "restarted kafka", timeout=90)
    published = _run(up.env, "publish", str(Path(up.env["MODELS"]) / "v2"), "--tenant",
                     "acme/support/chat", "--adapter", "acme-support")
    assert published.returncode == 0, published.stderr
    assert "acme-support v2" in published.stdout  # v1 survived in the registry's fold
    answer = _run(up.env, "generate", "--tenant", "acme/support/chat", "--adapter",
                  "acme-support", "--max-tokens", "3", "w5")
    assert answer.returncode == 0 and "acme-support v1" in answer.stderr, answer.stderr
    listed = wait_for(  # the projector stored v2 after the restart
        lambda: (r := _run(up.env, "audit", "sql", "select version from adapter_lineage where "
                           "adapter_id = 'acme-support' order by version", "--json")
                 ).stdout.count('"version"') == 2 and r, 60, interval_s=1.0,
        message="v2 in the audit store")
    assert listed.stdout.split() == ['{"version":', '1}', '{"version":', '2}'], listed.stdout


def test_a_tenants_contract_ending(up: Up) -> None:
    """`loraplane purge` on the running stack: every worker acks within the deadline (KV
    and adapters freed, refcounts zero), and the proof is in SQL, all within 60 s."""
    started = time.monotonic()
    purged = _run(up.env, "purge", "acme/support/chat", "--deadline", "60")
    assert purged.returncode == 0, purged.stdout + purged.stderr
    assert ": met" in purged.stdout and "worker-1" in purged.stdout \
        and "worker-2" in purged.stdout, purged.stdout
    purge_id = purged.stdout.split("purge ", 1)[1].split()[0]
    proof = wait_for(
        lambda: '"met"' in (r := _run(
            up.env, "audit", "sql", "select status, refcounts_zero, workers_missing "
            f"from purge_proofs where purge_id = '{purge_id}'", "--json")).stdout and r,
        max(0.0, 60 - (time.monotonic() - started)), interval_s=1.0,
        message="the purge's proof in SQL")
    assert json.loads(proof.stdout) == {"status": "met", "refcounts_zero": True,
                                        "workers_missing": []}
    assert time.monotonic() - started < 60
