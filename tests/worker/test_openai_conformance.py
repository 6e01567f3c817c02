"""Every inference feature through the official `openai` package (sync and async, stream
and not) and the generated gRPC stubs, against a real router in front of a real worker
PROCESS serving a tiny random Llama with a byte-level BPE tokenizer and a tool-aware chat
template, with an adapter and the base model in the same batches.

Outputs are checked, not only shapes: logprobs equal transformers' log-softmax of the
same model within 1e-4 (fp32), structured outputs parse and validate with `jsonschema`,
tool calls name the forced tool and their arguments validate against its parameters.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.contracts.grpc import inference_pb2 as pb
from tests.conftest import isolated_settings
from tests.registry.conftest import TENANT
from tests.router.conftest import TOKENS, RunningRouter, bearer, router_settings
from tests.worker.engine.tiny_bpe import build_chat_model
from tests.worker.engine.tiny_llama import ADAPTERS, build_adapter
from tests.worker.harness import Stack, peft_files, publish_files, running_stack, switch

pytestmark = pytest.mark.slow

ACME = pb.TenantSignature(org_id="acme", team_id="search", project_id="prod", user_id="u1")
SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "kind", "n"], "additionalProperties": False}
"""No free strings: every constrained answer of a random model ends within its budget."""
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
             "required": ["zone"], "additionalProperties": False}}}]
MODELS = ("tiny-llama", "tiny-llama:helper")
"""The base model, and the tenant's adapter on it."""


@pytest.fixture(scope="module")
def served(kafka_bootstrap: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Stack, RunningRouter, Any]]:
    root = tmp_path_factory.mktemp("conformance")
    hf = build_chat_model(root / "base", max_position_embeddings=2048)
    build_adapter(hf, ADAPTERS[0], root / "helper", seed=7)
    settings = isolated_settings(kafka_bootstrap, database_url)
    with running_stack(settings, root / "stack", root / "base", database_url) as stack:
        with stack.publisher() as pub:
            publish_files(pub, "helper", peft_files(root / "helper"), "v1", TENANT)
            switch(pub, "helper", 1)
        stack.tail.wait("AdapterVersionSwitched", adapter_id="helper")
        router = RunningRouter(router_settings(stack.settings, heartbeat_interval_s=0.5))
        router.start()
        try:
            router.wait_ring({"w1"}, timeout_s=30)
            yield stack, router, hf
        finally:
            router.stop()


def api(router: RunningRouter) -> openai.OpenAI:
    return openai.OpenAI(api_key=TOKENS["acme"][0], base_url=f"{router.http_url}/v1",
                         max_retries=0, timeout=120)


def async_api(router: RunningRouter) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key=TOKENS["acme"][0], base_url=f"{router.http_url}/v1",
                              max_retries=0, timeout=120)


def _ref_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _tokenize(router: RunningRouter, model: str, **body: Any) -> list[int]:
    reply = httpx.post(f"{router.http_url}/tokenize", json={"model": model, **body},
                       headers={"Authorization": f"Bearer {TOKENS['acme'][0]}"}, timeout=60)
    assert reply.status_code == 200, reply.text
    return list(reply.json()["tokens"])


def test_completions_sampling_logprobs_echo_and_n(served) -> None:
    _, router, hf = served
    client = api(router)
    prompt = "The quick brown fox"
    ids = _tokenize(router, "tiny-llama", prompt=prompt)
    out = client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=4, temperature=0, logprobs=3,
        echo=True, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None  # the first prompt token has nothing before it
    completion_ids = _tokenize(router, "tiny-llama", prompt=choice.text)[len(ids):]
    ref = _ref_logprobs(hf, ids + completion_ids)
    values = lp.token_logprobs[1:]
    targets = (ids + completion_ids)[1:]
    assert max(abs(v - float(ref[i, t])) for i, (v, t) in enumerate(
        zip(values, targets, strict=False))) < 1e-4
    assert len(lp.top_logprobs[-1]) == 3
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 4
    # n: choices share the prompt and draw their own streams; usage counts every token
    many = client.completions.create(
        model="tiny-llama:helper", prompt=prompt, max_tokens=3, n=3, temperature=1.0, seed=5,
        presence_penalty=0.5, frequency_penalty=0.3, logit_bias={str(ids[0]): 2.0},
        extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.01,
                    "repetition_penalty": 1.2, "bad_words": ["zzz"]})
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.usage.prompt_tokens == len(ids) and many.usage.completion_tokens == 9
    again = client.completions.create(
        model="tiny-llama:helper", prompt=prompt, max_tokens=3, n=3, temperature=1.0, seed=5,
        presence_penalty=0.5, frequency_penalty=0.3, logit_bias={str(ids[0]): 2.0},
        extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.01,
                    "repetition_penalty": 1.2, "bad_words": ["zzz"]})
    assert [c.text for c in again.choices] == [c.text for c in many.choices]  # seeded
    best = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=3,
                                     best_of=3, temperature=1.0, seed=1,
                                     extra_body={"ignore_eos": True})
    assert len(best.choices) == 1 and best.usage.completion_tokens == 9


def test_stop_reasons_and_usage_only_when_asked(served) -> None:
    _, router, _ = served
    client = api(router)
    free = client.completions.create(model="tiny-llama", prompt="abc", max_tokens=8,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    assert free.choices[0].finish_reason == "length"
    stop = text[3:5] if len(text) >= 5 else text[:1]
    cut = client.completions.create(model="tiny-llama", prompt="abc", max_tokens=8,
                                    temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(model="tiny-llama", prompt="abc", max_tokens=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in chunks)
    chunks = list(client.completions.create(model="tiny-llama", prompt="abc", max_tokens=3,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


@pytest.mark.parametrize("model", MODELS)
def test_json_schema_answers_validate_on_base_and_adapter(served, model: str) -> None:
    _, router, _ = served
    client = api(router)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA,
                                                  "strict": True}}
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "answer"}], max_tokens=48,
        temperature=1.0, seed=3, n=2, response_format=fmt)  # type: ignore[arg-type]
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    obj = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "answer"}], max_tokens=48,
        response_format={"type": "json_object"}, temperature=0)
    assert obj.choices[0].finish_reason in ("stop", "length")
    picked = client.completions.create(model=model, prompt="pick", max_tokens=12,
                                       extra_body={"guided_choice": ["red", "green"]})
    assert picked.choices[0].text in ("red", "green")
    digits = client.completions.create(model=model, prompt="code", max_tokens=12,
                                       extra_body={"guided_regex": "[0-9]{4}"})
    assert len(digits.choices[0].text) == 4 and digits.choices[0].text.isdigit()


def test_json_schema_streams_async(served) -> None:
    _, router, _ = served

    async def run() -> str:
        client = async_api(router)
        stream = await client.chat.completions.create(
            model="tiny-llama:helper", messages=[{"role": "user", "content": "go"}],
            max_tokens=48, stream=True, temperature=0, logprobs=True, top_logprobs=2,
            response_format={"type": "json_schema", "json_schema": {  # type: ignore[arg-type]
                "name": "a", "schema": SCHEMA}})
        parts, reasons, logprobs = [], [], 0
        async for chunk in stream:
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                reasons.append(choice.finish_reason)
                if choice.logprobs is not None:
                    logprobs += len(choice.logprobs.content or [])
                    assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content or [])
        assert reasons[-1] == "stop" and logprobs > 0
        await client.close()
        return "".join(parts)

    jsonschema.validate(json.loads(asyncio.run(run())), SCHEMA)


def test_forced_tool_calls_validate_and_stream(served) -> None:
    _, router, _ = served
    client = api(router)
    messages = [{"role": "user", "content": "weather?"}]
    out = client.chat.completions.create(
        model="tiny-llama:helper", messages=messages, tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    required = client.chat.completions.create(
        model="tiny-llama", messages=messages, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
        parallel_tool_calls=False, max_tokens=64, temperature=1.0, seed=2)
    assert required.choices[0].message.tool_calls[0].function.name in ("get_weather",
                                                                       "get_time")
    # the conversation goes on: the call and its result rendered by the chat template
    follow = client.chat.completions.create(
        model="tiny-llama:helper", max_tokens=3, tools=TOOLS, tool_choice="none",  # type: ignore[arg-type]
        messages=[*messages, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.choices[0].message.tool_calls is None

    async def streamed() -> list[Any]:
        aclient = async_api(router)
        stream = await aclient.chat.completions.create(
            model="tiny-llama:helper", messages=messages, tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=64, temperature=0, stream=True)
        deltas, reasons = [], []
        async for chunk in stream:
            for c in chunk.choices:
                deltas += c.delta.tool_calls or []
                reasons.append(c.finish_reason)
        await aclient.close()
        assert reasons[-1] == "tool_calls"
        return deltas

    deltas = asyncio.run(streamed())
    assert deltas and deltas[0].function.name == "get_time" and deltas[0].id
    assert json.loads(deltas[0].function.arguments)["zone"] in ("utc", "cet")


def test_discovery_and_tokenize_are_tenant_scoped(served) -> None:
    _, router, _ = served
    models = {m.id: m for m in api(router).models.list().data}
    assert models["tiny-llama:helper"].model_extra["parent"] == "tiny-llama"
    assert models["tiny-llama"].model_extra["parent"] is None
    ids = _tokenize(router, "tiny-llama:helper", prompt="hello")
    back = httpx.post(f"{router.http_url}/detokenize", json={
        "model": "tiny-llama", "tokens": ids},
        headers={"Authorization": f"Bearer {TOKENS['acme'][0]}"}, timeout=60)
    assert back.json() == {"prompt": "hello"}
    chat_ids = _tokenize(router, "tiny-llama", messages=[{"role": "user", "content": "hi"}])
    assert len(chat_ids) > 3
    rival = httpx.post(f"{router.http_url}/tokenize", json={
        "model": "tiny-llama:helper", "prompt": "x"},
        headers={"Authorization": f"Bearer {TOKENS['rival'][0]}"}, timeout=60)
    assert rival.status_code in (403, 404), rival.text


def test_the_same_over_grpc(served) -> None:
    _, router, _ = served
    stub = router.stub()
    request = pb.GenerateRequest(tenant=ACME, adapter=pb.AdapterRef(alias="helper"),
                                 text="The quick", sampling=pb.SamplingParams(
                                     max_tokens=4, ignore_eos=True, logprobs=True,
                                     top_logprobs=2, n=2, seed=3, temperature=1.0,
                                     prompt_logprobs=1))
    answers = list(stub.Generate(request, metadata=bearer("acme"), timeout=120))
    kinds = [a.WhichOneof("kind") for a in answers]
    assert kinds[0] == "prompt" and kinds[-1] == "final"
    assert kinds.count("choice_end") == 2 and kinds.count("token") == 8
    tokens = [a.token for a in answers if a.HasField("token")]
    assert all(t.HasField("logprobs") and len(t.logprobs.top) == 2 for t in tokens)
    assert {t.choice for t in tokens} == {0, 1}
    final = answers[-1].final
    assert final.completion_tokens == 8 and len(final.choices) == 2
    assert list(answers[0].prompt.token_ids) and len(answers[0].prompt.logprobs) > 1
    guided = pb.GenerateRequest(tenant=ACME, text="x", sampling=pb.SamplingParams(
        max_tokens=48, guide=pb.Guide(json_schema=json.dumps(SCHEMA))))
    text = "".join(a.token.text for a in stub.Generate(guided, metadata=bearer("acme"),
                                                       timeout=120) if a.HasField("token"))
    jsonschema.validate(json.loads(text), SCHEMA)
    tokenized = stub.Tokenize(pb.TokenizeRequest(tenant=ACME, base_model="tiny-llama",
                                                 text="hello"), metadata=bearer("acme"))
    assert tokenized.count == len(tokenized.token_ids) > 0
    info = stub.ModelInfo(pb.ModelInfoRequest(tenant=ACME), metadata=bearer("acme"))
    entries = {m.id: m for m in info.models}
    assert entries["tiny-llama:helper"].parent == "tiny-llama"
    assert entries["tiny-llama"].max_model_len > 0
    with pytest.raises(grpc.RpcError) as bad:
        list(stub.Generate(pb.GenerateRequest(tenant=ACME, text="x", sampling=pb.SamplingParams(
            guide=pb.Guide(regex="(unclosed"))), metadata=bearer("acme"), timeout=60))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.guide" in (bad.value.details() or "")
    reflection = reflection_pb2_grpc.ServerReflectionStub(router.channel)
    answer = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="loraplane.v1.Inference")])))
    proto = answer.file_descriptor_response.file_descriptor_proto[0]
    from google.protobuf import descriptor_pb2

    described = descriptor_pb2.FileDescriptorProto.FromString(proto)
    methods = {m.name for s in described.service if s.name == "Inference" for m in s.method}
    assert {"Generate", "Tokenize", "Detokenize", "ModelInfo"} <= methods
