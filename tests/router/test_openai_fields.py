"""Every field of the OpenAI request schemas (the official `openai` package's own types),
and vLLM's extra sampling fields, sent with a non-default value through the official
client to a running router: each is honoured (the worker receives it) or refused with
400 `unsupported_parameter` naming it, as `services.router.openai_schema.PARAMETERS`
says; none is silently ignored."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest
from openai.types import chat as chat_types
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from services.contracts.grpc import inference_pb2 as pb
from services.router.openai_schema import PARAMETERS, parameter
from tests.conftest import REPO
from tests.router.conftest import TOKENS, CatalogWriter, Fleet

pytestmark = pytest.mark.slow

FUNCTION = {"name": "f", "parameters": {"type": "object", "properties": {}}}
TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
COMPLETION_VALUES: dict[str, Any] = {
    "model": "acme-support@1", "prompt": [5, 6], "best_of": 2, "echo": True,
    "frequency_penalty": 0.5, "logit_bias": {"5": 1.0}, "logprobs": 2, "max_tokens": 5,
    "n": 2, "presence_penalty": 0.5, "seed": 7, "stop": ["zz"], "stream": True,
    "stream_options": {"include_usage": True}, "suffix": "the end", "temperature": 0.5,
    "top_p": 0.5, "user": "bob"}
"""A non-default value for every field of OpenAI's completions request."""
CHAT_VALUES: dict[str, Any] = {
    "model": "acme-support@1", "audio": {"voice": "alloy", "format": "wav"},
    "frequency_penalty": 0.5, "function_call": "auto", "functions": [FUNCTION],
    "logit_bias": {"5": 1.0}, "logprobs": True, "max_completion_tokens": 4, "max_tokens": 5,
    "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
    "metadata": {"k": "v"}, "modalities": ["text", "audio"],
    "moderation": {"model": "omni-moderation-latest"}, "n": 2, "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "x"}, "presence_penalty": 0.5,
    "prompt_cache_key": "k1", "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h", "reasoning_effort": "low",
    "response_format": {"type": "json_object"}, "safety_identifier": "s1", "seed": 7,
    "service_tier": "flex", "stop": ["zz"], "store": True, "stream": True,
    "stream_options": {"include_usage": True}, "temperature": 0.5, "tool_choice": "required",
    "tools": [{"type": "function", "function": FUNCTION}], "top_logprobs": 2, "top_p": 0.5,
    "user": "bob", "verbosity": "low", "web_search_options": {}}
"""A non-default value for every field of OpenAI's chat completions request."""
VLLM_VALUES: dict[str, Any] = {
    "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "length_penalty": 0.5,
    "use_beam_search": True, "stop_token_ids": [7], "include_stop_str_in_output": True,
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "bad_words": ["x"],
    "allowed_token_ids": [1, 2], "truncate_prompt_tokens": 5, "prompt_logprobs": 1,
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a", "b"],
    "guided_grammar": 'root ::= "a"', "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ", "structured_outputs": {"regex": "a+"}, "priority": 1,
    "logits_processors": ["x"], "return_tokens_as_token_ids": True,
    "return_token_ids": True, "cache_salt": "salt", "request_id": "r1",
    "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "min_tokens": 2,
    "ignore_eos": True}
"""vLLM's extra fields of both endpoints, sent in `extra_body`."""
VLLM_COMPLETION_VALUES: dict[str, Any] = {**VLLM_VALUES, "add_special_tokens": False,
                                          "response_format": {"type": "json_object"}}
VLLM_CHAT_VALUES: dict[str, Any] = {
    **VLLM_VALUES, "add_special_tokens": True, "echo": True, "add_generation_prompt": False,
    "continue_final_message": True, "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": True}, "documents": [{"text": "x"}],
    "mm_processor_kwargs": {"a": 1}}
MESSAGE_VALUES: dict[str, tuple[str, Any]] = {
    "role": ("developer", "developer"), "content": ("user", [{"type": "text", "text": "a"},
                                                            {"type": "text", "text": "b"}]),
    "name": ("user", "bob"), "tool_calls": ("assistant", [TOOL_CALL]),
    "tool_call_id": ("tool", "c1"), "function_call": ("assistant", {"name": "f",
                                                                    "arguments": "{}"}),
    "refusal": ("assistant", "no"), "audio": ("assistant", {"id": "a1"})}
"""A chat message's fields: (the message's role, a non-default value)."""

Seen = Callable[[], pb.GenerateRequest]
Probe = Callable[[pb.GenerateRequest, Any], bool]
PROBES: dict[tuple[str, str], Probe] = {
    **{(endpoint, name): probe for endpoint in ("completions", "chat") for name, probe in {
        "model": lambda seen, _: seen.adapter.pinned.adapter_id == "acme-support",
        "max_tokens": lambda seen, _: seen.sampling.max_tokens == 5,
        "temperature": lambda seen, _: abs(seen.sampling.temperature - 0.5) < 1e-6,
        "top_p": lambda seen, _: abs(seen.sampling.top_p - 0.5) < 1e-6,
        "seed": lambda seen, _: seen.sampling.HasField("seed") and seen.sampling.seed == 7,
        "stop": lambda seen, _: list(seen.sampling.stop) == ["zz"],
        "stream": lambda _, answer: isinstance(answer, list) and len(answer) > 1,
        "stream_options": lambda _, answer: answer[-1].usage is not None,
        "user": lambda seen, _: seen.tenant.user_id == "bob",
        "min_tokens": lambda seen, _: seen.sampling.min_tokens == 2,
        "ignore_eos": lambda seen, _: seen.sampling.ignore_eos,
    }.items()},
    ("completions", "prompt"): lambda seen, _: list(seen.token_ids.ids) == [5, 6],
    ("chat", "messages"): lambda seen, _: [(m.role, m.content) for m in seen.chat.messages]
    == [("system", "be brief"), ("user", "hi")],
    ("chat", "max_completion_tokens"): lambda seen, _: seen.sampling.max_tokens == 4,
    ("chat", "messages[].role"): lambda seen, _: seen.chat.messages[0].role == "system",
    ("chat", "messages[].content"): lambda seen, _: seen.chat.messages[0].content == "ab",
    **{(endpoint, name): probe for endpoint in ("completions", "chat") for name, probe in {
        "n": lambda seen, _: seen.sampling.n == 2,
        "presence_penalty": lambda seen, _: abs(seen.sampling.presence_penalty - 0.5) < 1e-6,
        "frequency_penalty": lambda seen, _: abs(seen.sampling.frequency_penalty - 0.5) < 1e-6,
        "logit_bias": lambda seen, _: dict(seen.sampling.logit_bias) == {5: 1.0},
        "response_format": lambda seen, _: seen.sampling.guide.json_object,
        "top_k": lambda seen, _: seen.sampling.top_k == 5,
        "min_p": lambda seen, _: abs(seen.sampling.min_p - 0.1) < 1e-6,
        "repetition_penalty": lambda seen, _: abs(seen.sampling.repetition_penalty - 1.2) < 1e-6,
        "stop_token_ids": lambda seen, _: list(seen.sampling.stop_token_ids) == [7],
        "bad_words": lambda seen, _: list(seen.sampling.bad_words) == ["x"],
        "prompt_logprobs": lambda seen, _: seen.sampling.prompt_logprobs == 1,
        "guided_json": lambda seen, _: seen.sampling.guide.json_schema == '{"type": "object"}',
        "guided_regex": lambda seen, _: seen.sampling.guide.regex == "a+",
        "guided_choice": lambda seen, _: list(seen.sampling.guide.choice.choices) == ["a", "b"],
        "guided_grammar": lambda seen, _: seen.sampling.guide.grammar == 'root ::= "a"',
        "structured_outputs": lambda seen, _: seen.sampling.guide.regex == "a+",
    }.items()},
    ("completions", "best_of"): lambda seen, _: seen.sampling.best_of == 2,
    ("completions", "echo"): lambda seen, _: seen.sampling.echo,
    ("completions", "logprobs"): lambda seen, _: seen.sampling.logprobs
    and seen.sampling.top_logprobs == 2,
    ("chat", "logprobs"): lambda seen, _: seen.sampling.logprobs,
    ("chat", "top_logprobs"): lambda seen, _: seen.sampling.top_logprobs == 2,
    ("chat", "tools"): lambda seen, _: [t.name for t in seen.chat.tools] == ["f"]
    and seen.sampling.tool_choice == "auto",
    ("chat", "tool_choice"): lambda seen, _: seen.sampling.tool_choice == "required",
    ("chat", "parallel_tool_calls"): lambda seen, _: not seen.sampling.parallel_tool_calls,
    ("chat", "messages[].tool_calls"): lambda seen, _: seen.chat.messages[0].tool_calls[0].name
    == "f",
    ("chat", "messages[].tool_call_id"): lambda seen, _: seen.chat.messages[0].tool_call_id
    == "c1",
}
COMPANIONS: dict[str, dict[str, Any]] = {
    "top_logprobs": {"logprobs": True},
    "tool_choice": {"tools": [{"type": "function", "function": FUNCTION}]},
    "parallel_tool_calls": {"tools": [{"type": "function", "function": FUNCTION}]},
}
"""Fields that mean something only beside another: sent together."""
"""How the test sees that each honoured field was honoured: the stand-in worker received
it (or, for streaming, the answer streamed)."""


@pytest.fixture
def router(catalog: CatalogWriter, fleet: Fleet, make_router):
    catalog.publish("acme-support", 1)
    fleet.add("w1")
    running = make_router()
    running.wait_ring({"w1"})
    return running


def _send(api: openai.OpenAI, endpoint: str, fields: dict[str, Any],
          extra: dict[str, Any]) -> Any:
    """One request with `fields` (OpenAI's, as keyword arguments) and `extra` (vLLM's, in
    `extra_body`); a stream is read to its end."""
    if endpoint == "completions":
        kwargs: dict[str, Any] = {"model": "tiny-llama", "prompt": "hello", **fields}
        create: Callable[..., Any] = api.completions.create
    else:
        kwargs = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
                  **fields}
        create = api.chat.completions.create
    if "stream_options" in fields or "stream_options" in extra:
        kwargs["stream"] = True
    answer = create(**kwargs, extra_body=extra or None)
    return list(answer) if kwargs.get("stream") else answer


def _cases() -> list[tuple[str, str, str, dict[str, Any], dict[str, Any]]]:
    """(endpoint, table name, the name the answer gives, fields, extra_body) per field."""
    cases = []
    for endpoint, openai_values, vllm_values in (
            ("completions", COMPLETION_VALUES, VLLM_COMPLETION_VALUES),
            ("chat", CHAT_VALUES, VLLM_CHAT_VALUES)):
        cases += [(endpoint, name, name, {name: value, **(COMPANIONS.get(name, {})
                                                          if endpoint == "chat" else {})}, {})
                  for name, value in openai_values.items()]
        cases += [(endpoint, name, name, {}, {name: value})
                  for name, value in vllm_values.items()]
        cases += [(endpoint, "frobnicate", "frobnicate", {}, {"frobnicate": 1}),
                  (endpoint, "stream_options.include_obfuscation",
                   "stream_options.include_obfuscation", {},
                   {"stream_options": {"include_obfuscation": True}})]
    for name, (role, value) in MESSAGE_VALUES.items():
        message = {"role": role, "content": "hi", name: value}
        cases.append(("chat", f"messages[].{name}", f"messages[0].{name}",
                      {"messages": [message]}, {}))
    cases.append(("chat", "messages[].content[].prompt_cache_breakpoint",
                  "messages[0].content[0].prompt_cache_breakpoint", {"messages": [
                      {"role": "user", "content": [{"type": "text", "text": "hi",
                                                    "prompt_cache_breakpoint": {}}]}]}, {}))
    return cases


def test_the_walk_covers_openais_schemas_and_the_table(router) -> None:
    """The walk below sends every field of OpenAI's request types (a newer `openai` with a
    new field fails here until the field is classified), every message field, and every
    vLLM row of the table; and every row of OpenAI's schema is in the table."""
    schemas = {"completions": set(completion_create_params.CompletionCreateParamsBase
                                  .__annotations__) | {"stream"},
               "chat": set(chat_create_params.CompletionCreateParamsBase.__annotations__)
               | {"stream"}}
    assert schemas["completions"] <= set(COMPLETION_VALUES)
    assert schemas["chat"] <= set(CHAT_VALUES)
    for endpoint, names in schemas.items():
        assert [n for n in sorted(names) if parameter(endpoint, n) is None] == []  # type: ignore[arg-type]
    message_fields = set().union(*(t.__annotations__ for t in (
        chat_types.ChatCompletionSystemMessageParam, chat_types.ChatCompletionUserMessageParam,
        chat_types.ChatCompletionAssistantMessageParam,
        chat_types.ChatCompletionToolMessageParam,
        chat_types.ChatCompletionDeveloperMessageParam)))
    assert message_fields <= set(MESSAGE_VALUES)
    walked = {(endpoint, name) for endpoint, name, *_ in _cases()}
    assert {(e, p.name) for p in PARAMETERS for e in p.endpoints} <= walked
    honoured = {(e, p.name) for p in PARAMETERS if p.kind == "honoured" for e in p.endpoints}
    assert honoured == set(PROBES)


def test_every_field_is_honoured_or_refused_by_name(router, fleet: Fleet) -> None:
    api = openai.OpenAI(api_key=TOKENS["acme"][0], base_url=f"{router.http_url}/v1",
                        max_retries=0, timeout=20)
    wrong: list[str] = []
    for endpoint, name, shown, fields, extra in _cases():
        row = parameter(endpoint, name)  # type: ignore[arg-type]
        before = len(fleet["w1"].seen)
        try:
            answer = _send(api, endpoint, fields, extra)
        except openai.BadRequestError as refused:
            error = refused.body or {}
            if row is not None and row.kind != "refused":
                wrong.append(f"{endpoint} {name}: {row.kind} in the table, but {error}")
            elif (error.get("code"), error.get("param")) != ("unsupported_parameter", shown):
                wrong.append(f"{endpoint} {name}: refused, but not by name: {error}")
            elif len(fleet["w1"].seen) != before:
                wrong.append(f"{endpoint} {name}: refused, yet a worker got the request")
            continue
        if row is None or row.kind == "refused":
            wrong.append(f"{endpoint} {name}: silently ignored (answered 200)")
        elif row.kind == "honoured":
            seen = fleet["w1"].seen[-1].request
            if not PROBES[(endpoint, name)](seen, answer):
                wrong.append(f"{endpoint} {name}: answered, but not honoured")
    assert not wrong, "\n".join(wrong)


def test_neutral_values_of_refused_fields_ask_for_nothing_and_pass(router) -> None:
    api = openai.OpenAI(api_key=TOKENS["acme"][0], base_url=f"{router.http_url}/v1",
                        max_retries=0, timeout=20)
    for p in PARAMETERS:
        if p.kind != "refused" or "[]" in p.name:
            continue
        for endpoint in p.endpoints:
            known = p.name in (COMPLETION_VALUES if endpoint == "completions"
                               else CHAT_VALUES)
            for value in (*p.neutral, None):
                fields, extra = ({p.name: value}, {}) if known else ({}, {p.name: value})
                _send(api, endpoint, fields, extra)  # raises on a refusal


def test_the_router_page_lists_the_table() -> None:
    """The router page's OpenAI section names every row of the table, in the list of its
    kind."""
    text = (REPO / "docs" / "router.md").read_text()
    section = text[text.index("### OpenAI-compatible HTTP"):text.index("### gRPC")]
    lists = {kind: section[section.index(f"- {heading}"):] for kind, heading in (
        ("honoured", "honoured:"), ("no_effect", "accepted, no effect"),
        ("refused", "refused unless neutral:"))}
    for p in PARAMETERS:
        name = p.name.removeprefix("messages[].")
        if p.kind == "refused" and not p.neutral:
            where = section[section.index("- refused:"):]
        else:
            where = lists[p.kind]
        assert f"`{name}`" in where.split("\n\n")[0], (p.kind, p.name)
