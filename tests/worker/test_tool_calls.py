"""Tool calls parsed from streamed text, per model family, however the text is split."""

from __future__ import annotations

import json

import pytest

from services.worker.tool_calls import ToolCallStream

HERMES = ('I will check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
          '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n'
          '</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; ' \
        '{"name": "get_time", "parameters": {"zone": "cet"}}'


def _run(fmt: str, text: str, step: int) -> tuple[str, list]:
    stream = ToolCallStream(fmt)
    shown, calls = [], []
    for i in range(0, len(text), step):
        out, found = stream.feed(text[i:i + step])
        shown.append(out)
        calls += found
    out, found = stream.finish()
    return "".join(shown) + out, calls + found


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_hermes_calls_and_text_around_them(step: int) -> None:
    text, calls = _run("hermes", HERMES, step)
    assert text == "I will check. "
    assert [(c.name, json.loads(c.arguments), c.index) for c in calls] == [
        ("get_weather", {"city": "Paris"}, 0), ("get_time", {"zone": "utc"}, 1)]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_llama3_json_calls(step: int) -> None:
    text, calls = _run("llama3_json", LLAMA, step)
    assert text == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "cet"})]


@pytest.mark.parametrize("fmt, text", [
    ("hermes", "a <tool_call>\n{not json}\n</tool_call> b"),
    ("hermes", "unclosed <tool_call>\n{\"name\": \"f\""),
    ("hermes", "a < b <tool but no call"),
    ("llama3_json", "Plain answer, no call."),
    ("llama3_json", '{"just": "json"}'),
])
def test_what_is_not_a_call_is_given_back_as_text(fmt: str, text: str) -> None:
    for step in (1, 4, 1000):
        shown, calls = _run(fmt, text, step)
        assert calls == [] and shown == text, (step, shown)
