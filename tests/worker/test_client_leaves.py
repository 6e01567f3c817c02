"""A client that leaves stops the work: on real router and worker processes, a disconnect on
either front (OpenAI HTTP streamed or not, a gRPC cancel, a gRPC deadline) aborts the
sequence on the worker, frees its KV blocks, and the request's trace says `cancelled`.

One stack for the module: the broker, a registry, one worker process, and a router in
this process (its gRPC and HTTP fronts on loopback). Each request asks for far more tokens
than it gets to see (`MAX_TOKENS`, `ignore_eos`), and the client leaves once the worker is
generating; the worker's own counters and its `RequestServed` trace tell what it did.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import grpc
import httpx
import openai
import pytest

from services.contracts.events import ServedRequest
from services.contracts.grpc import inference_pb2 as pb
from tests.conftest import isolated_settings
from tests.router.conftest import TOKENS, RunningRouter, bearer, router_settings
from tests.waiting import wait_for
from tests.worker.conftest import ServedModel
from tests.worker.harness import BASE_NAME, Stack, running_stack, signature

pytestmark = pytest.mark.slow

ACME = signature("acme", "search", "prod")
MAX_TOKENS = 1000
"""With a 3-token prompt, the model's whole context (1024): a run that is not stopped
takes a few seconds of this worker's time."""
KV_BLOCKS = 512
"""The harness worker's pool (`worker_kv_blocks`)."""


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, served_model: ServedModel,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings(kafka_bootstrap, None)
    with running_stack(settings, tmp_path_factory.mktemp("leaves"), served_model.path,
                       None) as running:
        yield running


@pytest.fixture(scope="module")
def router(stack: Stack) -> Iterator[RunningRouter]:
    running = RunningRouter(router_settings(stack.settings, heartbeat_interval_s=0.5)).start()
    running.wait_ring({"w1"})
    yield running
    running.stop()


def generated(stack: Stack) -> float:
    """The worker's count of tokens generated so far (all requests)."""
    found = re.search(r"^loraplane_worker_generated_tokens_total (\S+)$",
                      stack.workers["w1"].metrics(), re.M)
    return float(found.group(1)) if found else 0.0


def wait_generating(stack: Stack, before: float, timeout_s: float = 30.0) -> None:
    """Until the worker has generated tokens since `before` (the request is running)."""
    wait_for(lambda: generated(stack) > before, timeout_s, interval_s=0.02,
             message="the worker to start generating")


def trace_of(stack: Stack, **match: str) -> ServedRequest:
    """The worker's trace of the one request whose fields equal `match`."""
    def mine(request: ServedRequest) -> bool:
        return all(getattr(request, k) == v for k, v in match.items())

    assert stack.tail is not None
    events = stack.tail.wait("RequestServed", where=lambda e: any(
        mine(r) for r in e.payload.requests))
    [trace] = [r for e in events for r in e.payload.requests if mine(r)]
    return trace


def assert_stopped(stack: Stack, trace: ServedRequest, left_at: datetime,
                   most: int = MAX_TOKENS // 2) -> None:
    """The worker aborted the sequence: traced `cancelled` short of `most` tokens, soon
    after the client left; it generates nothing more; every KV block is free again."""
    assert trace.status == "cancelled", trace
    assert trace.completion_tokens < most, trace
    assert (trace.finished_at - left_at).total_seconds() < 2.0, (trace.finished_at, left_at)
    settled = generated(stack)
    assert stack.tail is not None
    after = datetime.now(UTC)  # the worker's next heartbeat bounds "nothing more"
    beat = stack.tail.wait("WorkerHeartbeat", where=lambda e: e.occurred_at > after)[-1]
    assert generated(stack) == settled, "the worker went on generating"
    assert beat.payload.free_kv_blocks == KV_BLOCKS, "every KV block is free (or cached) again"


def completion_body(user: str, stream: bool) -> dict[str, object]:
    return {"model": BASE_NAME, "prompt": "w5 w6 w7", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "user": user, "stream": stream}


def test_http_client_that_disconnects_before_a_non_streamed_answer(
        stack: Stack, router: RunningRouter) -> None:
    """The client (httpx) gives up while the worker generates; nothing was streamed to it,
    yet the worker stops within a step, not MAX_TOKENS later."""
    user = f"gone-{uuid.uuid4().hex[:8]}"
    before = generated(stack)

    async def leave() -> datetime:
        async with httpx.AsyncClient(base_url=router.http_url, timeout=60) as client:
            post = asyncio.create_task(client.post(
                "/v1/completions", json=completion_body(user, stream=False),
                headers={"Authorization": f"Bearer {TOKENS['acme'][0]}"}))
            await asyncio.to_thread(wait_generating, stack, before)
            assert not post.done(), "answered before the client could leave"
            post.cancel()  # httpx closes the connection of a response it did not finish
            left_at = datetime.now(UTC)
            with pytest.raises(asyncio.CancelledError):
                await post
            return left_at

    left_at = asyncio.run(leave())
    assert_stopped(stack, trace_of(stack, user_id=user), left_at)


def test_http_client_that_disconnects_from_a_stream(stack: Stack,
                                                    router: RunningRouter) -> None:
    """The official `openai` client reads a few chunks of a streamed completion and
    closes the stream."""
    user = f"gone-{uuid.uuid4().hex[:8]}"
    client = openai.OpenAI(base_url=f"{router.http_url}/v1", api_key=TOKENS["acme"][0],
                           max_retries=0)
    stream = client.completions.create(model=BASE_NAME, prompt="w5 w6 w7",
                                       max_tokens=MAX_TOKENS, user=user, stream=True,
                                       extra_body={"ignore_eos": True})
    for count, _ in enumerate(stream, 1):
        if count == 3:
            break
    stream.close()
    left_at = datetime.now(UTC)
    assert_stopped(stack, trace_of(stack, user_id=user), left_at)


def _grpc_request(request_id: str) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id, tenant=ACME, sampling=pb.SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True))
    request.token_ids.ids.extend([5, 6, 7])
    return request


def test_grpc_cancel(stack: Stack, router: RunningRouter) -> None:
    request_id = f"cancel-{uuid.uuid4().hex[:8]}"
    call = router.stub().Generate(_grpc_request(request_id), metadata=bearer("acme"),
                                  timeout=60)
    for _ in range(3):
        assert next(call).HasField("token")
    call.cancel()
    left_at = datetime.now(UTC)
    with pytest.raises(grpc.RpcError) as caught:
        next(call)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    assert_stopped(stack, trace_of(stack, request_id=request_id), left_at)


def test_grpc_deadline(stack: Stack, router: RunningRouter) -> None:
    """A deadline a fifth of what the whole answer takes here: timed first, the faster of
    two answers (the tiny model's speed follows the machine's load, which varies by
    several times on a busy machine). The stop is checked against the whole answer, not
    a fifth of it, for the same reason."""
    whole_s = []
    for _ in range(2):
        sent_at = time.monotonic()
        answer = list(router.stub().Generate(_grpc_request(f"whole-{uuid.uuid4().hex[:8]}"),
                                             metadata=bearer("acme"), timeout=120))
        assert answer[-1].final.completion_tokens == MAX_TOKENS
        whole_s.append(time.monotonic() - sent_at)
    deadline_s = max(0.2, min(whole_s) / 5)
    request_id = f"deadline-{uuid.uuid4().hex[:8]}"
    sent_at = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        list(router.stub().Generate(_grpc_request(request_id), metadata=bearer("acme"),
                                    timeout=deadline_s))
    left_at = datetime.now(UTC)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - sent_at < deadline_s + 2.0
    assert_stopped(stack, trace_of(stack, request_id=request_id), left_at, most=MAX_TOKENS)
