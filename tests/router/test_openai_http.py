"""The official `openai` client pointed at the router: completes, chats, streams; errors in
OpenAI's shape; the same resolution and limits as gRPC."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.router.conftest import RIVAL, TOKENS, CatalogWriter, Fleet

pytestmark = pytest.mark.slow


def client(router, who: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(api_key=TOKENS[who][0], base_url=f"{router.http_url}/v1",
                         max_retries=0, timeout=20)


@pytest.fixture
def router(catalog: CatalogWriter, fleet: Fleet, make_router):
    catalog.publish("acme-support", 1)
    catalog.publish("acme-support", 2, activate=False)
    catalog.split("support", {("acme-support", 1): 50, ("acme-support", 2): 50})
    catalog.publish("rival-bot", 1, tenant=RIVAL)
    fleet.add("w1")
    running = make_router()
    running.wait_ring({"w1"})
    return running


def test_models_lists_the_callers_adapters_and_aliases(router) -> None:
    ids = [m.id for m in client(router).models.list()]
    assert ids == ["tiny-llama", "tiny-llama:acme-support", "tiny-llama:support"]
    assert [m.id for m in client(router, "rival").models.list()] == [
        "tiny-llama", "tiny-llama:rival-bot"]
    assert client(router).models.retrieve("tiny-llama:support").owned_by == "acme/search/prod"


def test_completion_chat_and_pinned_versions(router, fleet: Fleet) -> None:
    api = client(router)
    done = api.completions.create(model="tiny-llama:support", prompt="hello world",
                                  max_tokens=3, user="alice", temperature=0)
    assert done.choices[0].text == " w1.0 w1.1 w1.2"
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens,
            done.usage.total_tokens) == (2, 3, 5)
    seen = fleet["w1"].seen[-1].request
    assert seen.adapter.WhichOneof("ref") == "pinned" and seen.tenant.user_id == "alice"
    assert seen.sampling.max_tokens == 3 and seen.text == "hello world"
    versions = {api.completions.create(model="tiny-llama:support", prompt="x",
                                       user="alice").model_extra["loraplane"]["served"][0]
                ["adapter"] for _ in range(3)}
    assert len(versions) == 1  # the same user stays on one side of the canary

    chat = api.chat.completions.create(model="tiny-llama:acme-support", messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == " w1.0 w1.1 w1.2"
    assert chat.usage.completion_tokens == 3
    sent = fleet["w1"].seen[-1].request
    assert [(m.role, m.content) for m in sent.chat.messages] == [
        ("system", "be brief"), ("user", "hi")]

    pinned = api.completions.create(model="acme-support@2", prompt="x")
    assert pinned.model_extra["loraplane"]["served"][0]["adapter"] == "acme-support@2"
    base_only = api.completions.create(model="tiny-llama", prompt="x")
    assert "adapter" not in base_only.model_extra["loraplane"]["served"][0]
    batch = api.completions.create(model="tiny-llama:support", prompt=["a", "b"])
    assert [c.index for c in batch.choices] == [0, 1] and batch.usage.completion_tokens == 6


def test_streaming_completions_and_chat(router) -> None:
    api = client(router)
    chunks = list(api.completions.create(model="tiny-llama:support", prompt="hello",
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " w1.0 w1.1 w1.2"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    unasked = list(api.completions.create(model="tiny-llama:support", prompt="hello",
                                          stream=True))
    assert all(c.choices and c.usage is None for c in unasked)  # usage only when asked

    stream = api.chat.completions.create(model="tiny-llama:support", stream=True,
                                         stream_options={"include_usage": True},
                                         messages=[{"role": "user", "content": "hi"}])
    parts = list(stream)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == \
        " w1.0 w1.1 w1.2"
    assert parts[-1].usage.total_tokens == 4


def test_errors_come_in_openais_shape(router, fleet: Fleet) -> None:
    api = client(router)
    with pytest.raises(openai.NotFoundError) as nf:
        api.completions.create(model="tiny-llama:nope", prompt="x")
    assert nf.value.body["code"] == "model_not_found" and "nope" in nf.value.body["message"]
    # another tenant's adapter or alias is answered as a missing one
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="tiny-llama:rival-bot", prompt="x")
    with pytest.raises(openai.NotFoundError):
        client(router, "rival").completions.create(model="tiny-llama:support", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="wrong", base_url=f"{router.http_url}/v1",
                      max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model="tiny-llama:support", prompt="x", n=17)
    assert bad.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model="acme-support@x", prompt="x")
    raw = httpx.post(f"{router.http_url}/v1/completions", json={"prompt": "x"},
                     headers={"Authorization": f"Bearer {TOKENS['acme'][0]}"})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "model"

    fleet["w1"].behaviour.fail_after_tokens = 1  # the worker dies mid-stream
    stream = api.completions.create(model="tiny-llama:support", prompt="x", stream=True)
    with pytest.raises(openai.APIError) as mid:
        for _ in stream:
            pass
    assert "mid-stream" in mid.value.message


def test_rate_limits_answer_429_with_retry_after(catalog: CatalogWriter, fleet: Fleet,
                                                 make_router) -> None:
    catalog.publish("acme-support", 1)
    fleet.add("w1")
    router = make_router(router_rate_overrides={"adapter:acme-support": 0.5},
                         router_burst_s=2.0)
    router.wait_ring({"w1"})
    headers = {"Authorization": f"Bearer {TOKENS['acme'][0]}"}
    body = {"model": "tiny-llama:acme-support", "prompt": "x"}
    assert httpx.post(f"{router.http_url}/v1/completions", json=body,
                      headers=headers).status_code == 200
    limited = httpx.post(f"{router.http_url}/v1/completions", json=body, headers=headers)
    assert limited.status_code == 429
    assert limited.headers["Retry-After"] == "2"
    assert limited.json()["error"]["code"] == "adapter_rate"
    assert limited.json()["error"]["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):
        client(router).completions.create(**body)
