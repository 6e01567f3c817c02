"""Read your writes through the router, on real processes: the registry, a worker PROCESS
on the tiny model and a router PROCESS whose reading of the log is held back (a second for
every batch with a switch in it, as on a loaded machine). A publish and switch the registry
has answered are served at once on both fronts (generated gRPC stubs, the official `openai`
package), not refused because the router's fold has not read them yet; a missing adapter
is still refused as missing."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from services.config import Settings
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.stack.process import ChildProcess, free_port
from tests.conftest import REPO, isolated_settings
from tests.router.conftest import TOKENS, auth_setting
from tests.worker.conftest import ServedModel, served_model
from tests.worker.harness import (
    BASE_NAME,
    Stack,
    fresh_adapter,
    publish_files,
    running_stack,
    signature,
    switch,
    worker_env,
)

__all__ = ["served_model"]

TENANT = {"org": "acme", "team": "search", "project": "prod"}
HIGH = '{"platinum": 1e4, "gold": 1e4, "silver": 1e4, "bronze": 1e4}'

LAGGING_READS = '''
"""Loaded by a test's router process: every read of the log that brings a switch is held
a second before it is handed on (to the fold), as a loaded machine would."""
import time

from services.eventlog.consumer import EventConsumer

_poll = EventConsumer.poll


def _late(self, *args, **kwargs):
    records = _poll(self, *args, **kwargs)
    if any(r.envelope.type == "AdapterVersionSwitched" for r in records):
        time.sleep(1.0)
    return records


EventConsumer.poll = _late
'''


class LateRouter:
    """`loraplane serve router` with the lag hook on its path."""

    def __init__(self, settings: Settings, root: Path) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        hook = root / "lagging-reads"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(LAGGING_READS)
        self.env = worker_env(
            settings, auth_tokens=auth_setting(), router_port=self.grpc_port,
            router_http_port=self.http_port, heartbeat_interval_s=0.5,
            router_tenant_rate=HIGH, router_adapter_rate=HIGH, router_cold_load_rate=HIGH,
            state_dir=root / "router", log_level="INFO")
        self.env["PYTHONPATH"] = f"{hook}:{REPO}"
        self.child = ChildProcess("router", [sys.executable, "-m", "services.cli", "serve",
                                             "router"], root / "router.log", env=self.env,
                                  cwd=REPO)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def wait_ring(self, size: int, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.child.alive(), self.child.log_tail()
            try:
                ready = httpx.get(f"{self.url}/readyz", timeout=1)
                if ready.status_code == 200 and len(ready.json()["ring"]) == size:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the router never served " + self.child.log_tail()
            time.sleep(0.1)


@pytest.fixture(scope="module")
def site(kafka_bootstrap: str, served_model: ServedModel,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, LateRouter]]:
    root = tmp_path_factory.mktemp("router-ryw")
    with running_stack(isolated_settings(kafka_bootstrap, None), root, served_model.path,
                       None) as stack:
        router = LateRouter(stack.settings, root)
        try:
            router.wait_ring(1)
            yield stack, router
        finally:
            router.child.stop(signal.SIGTERM, timeout=30)


def publish_and_switch(stack: Stack, adapter_id: str, seed: int) -> None:
    with stack.publisher() as pub:
        publish_files(pub, adapter_id, fresh_adapter(seed), "v1", TENANT)
        switch(pub, adapter_id, 1)


def client(router: LateRouter) -> openai.OpenAI:
    return openai.OpenAI(api_key=TOKENS["acme"][0], base_url=f"{router.url}/v1",
                         max_retries=0, timeout=90)


def grpc_generate(router: LateRouter, adapter: str) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(tenant=signature(**TENANT),
                                 adapter=pb.AdapterRef(alias=adapter),
                                 sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
    request.token_ids.ids.extend([5, 6, 7])
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        return list(pb_grpc.InferenceStub(channel).Generate(
            request, timeout=90,
            metadata=(("authorization", f"Bearer {TOKENS['acme'][0]}"),)))


def test_a_switch_the_registry_answered_is_served_over_grpc_by_a_router_still_reading_it(
        site: tuple[Stack, LateRouter]) -> None:
    stack, router = site
    publish_and_switch(stack, "ryw-grpc", 91)
    final = grpc_generate(router, "ryw-grpc")[-1].final
    assert (final.served_adapter.adapter_id, final.served_adapter.version) == ("ryw-grpc", 1)


def test_a_switch_the_registry_answered_is_served_over_http_by_a_router_still_reading_it(
        site: tuple[Stack, LateRouter]) -> None:
    stack, router = site
    publish_and_switch(stack, "ryw-http", 92)
    done = client(router).completions.create(model=f"{BASE_NAME}:ryw-http", prompt="w5 w6 w7",
                                       max_tokens=3)
    assert done.choices and done.model_extra is not None
    assert done.model_extra["loraplane"]["served"][0]["adapter"] == "ryw-http@1"


def test_a_missing_adapter_is_still_refused_as_missing(site: tuple[Stack, LateRouter]) -> None:
    _, router = site
    with pytest.raises(grpc.RpcError) as missing:
        grpc_generate(router, "never-published")
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(openai.NotFoundError):
        client(router).completions.create(model=f"{BASE_NAME}:never-published", prompt="w5",
                                          max_tokens=2)
