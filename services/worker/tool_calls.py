"""Tool calls parsed out of a choice's text as it streams, per the model family's format.

- `hermes` (Hermes, Qwen 2/2.5/3 and chatml models told about tools in that form):
  `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`, any number of them, with
  free text around them;
- `llama3_json` (Llama 3.x): the whole answer is `{"name": …, "parameters": {…}}`
  (several separated by `;`), optionally after `<|python_tag|>`.

Text that may be the start of a call is held back (like a stop string) until it is known
to be one or not; a complete call is handed out whole, its arguments as JSON text. What
does not parse as a call is given back as text, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str
    index: int


def _call(obj: Any, index: int, arguments_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"],
                      json.dumps(args, ensure_ascii=False), index)


def _partial_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that starts `marker` (held back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


@dataclass
class ToolCallStream:
    """One choice's text in, (text to show, calls completed) out."""

    format: str
    _buffer: str = ""
    _calls: int = 0
    calls: list[ParsedCall] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buffer += text
        if self.format == "llama3_json":
            return self._llama(final=False)
        return self._hermes(final=False)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        if self.format == "llama3_json":
            return self._llama(final=True)
        return self._hermes(final=True)

    def _found(self, call: ParsedCall) -> ParsedCall:
        self._calls += 1
        self.calls.append(call)
        return call

    def _hermes(self, final: bool) -> tuple[str, list[ParsedCall]]:
        shown: list[str] = []
        found: list[ParsedCall] = []
        while True:
            start = self._buffer.find(OPEN)
            if start == -1:
                keep = 0 if final else _partial_prefix(self._buffer, OPEN)
                tail = self._buffer[:len(self._buffer) - keep]
                if self.calls and not tail.strip():  # blanks after a call: not content
                    if final:
                        self._buffer = ""
                    break  # (held until text that is not blank follows, if any does)
                shown.append(tail)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            if not (self.calls and not self._buffer[:start].strip()):
                shown.append(self._buffer[:start])
            end = self._buffer.find(CLOSE, start)
            if end == -1:
                self._buffer = self._buffer[start:]
                if final:  # an unclosed call: the model's text, as it wrote it
                    shown.append(self._buffer)
                    self._buffer = ""
                break
            body = self._buffer[start + len(OPEN):end]
            try:
                call = _call(json.loads(body), self._calls, "arguments")
            except ValueError:
                call = None
            if call is None:
                shown.append(self._buffer[start:end + len(CLOSE)])
            else:
                found.append(self._found(call))
            self._buffer = self._buffer[end + len(CLOSE):]
        return "".join(shown), found

    def _llama(self, final: bool) -> tuple[str, list[ParsedCall]]:
        stripped = self._buffer.lstrip()
        maybe = (not stripped or stripped.startswith("{") or PYTHON_TAG.startswith(stripped[:14])
                 or stripped.startswith(PYTHON_TAG))
        if not maybe:
            text, self._buffer = self._buffer, ""
            self.format = "text"  # not a call: stream the rest as it comes
            return text, []
        if not final:
            return "", []
        body = stripped.removeprefix(PYTHON_TAG).strip()
        found: list[ParsedCall] = []
        for part in (p for p in body.split(";") if p.strip()):
            try:
                call = _call(json.loads(part), self._calls + len(found), "parameters")
            except ValueError:
                call = None
            if call is None:
                text, self._buffer = self._buffer, ""
                return text, []
            found.append(call)
        self._buffer = ""
        for call in found:
            self._found(call)
        return "", found

    def __post_init__(self) -> None:
        if self.format not in ("hermes", "llama3_json", "text"):
            raise ValueError(f"unknown tool-call format {self.format!r}")


def feed_text(stream: ToolCallStream | None, text: str) -> tuple[str, list[ParsedCall]]:
    """Plain text passes through when the choice offers no tools."""
    if stream is None or stream.format == "text":
        return text, []
    return stream.feed(text)
