"""OpenAI's answer shapes built from a worker's `GenerateResponse` stream.

One prompt's responses (`PromptAnswer`) hold its n choices: their text, tool calls,
logprobs and ends (`ChoiceEnd`: finish reason, the stop string or token, as vLLM's
`stop_reason`). Choice `c` of prompt `p` is OpenAI's choice `p * n + c`. Completions give
logprobs in the legacy shape (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`),
chat in the newer one (`content: [{token, logprob, bytes, top_logprobs}]`); a streamed
chat choice's tool calls arrive as `delta.tool_calls` entries, each whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.contracts.grpc import inference_pb2 as pb

FINISH = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop",
          pb.FINISH_REASON_ABORTED: "abort", pb.FINISH_REASON_ERROR: "error",
          pb.FINISH_REASON_TOOL_CALLS: "tool_calls", pb.FINISH_REASON_UNSPECIFIED: "stop"}


def finish_of(end: pb.ChoiceEnd | None, final: pb.FinalUsage | None) -> str:
    if end is not None:
        return FINISH.get(end.finish_reason, "stop")
    return FINISH.get(final.finish_reason, "stop") if final is not None else "error"


def stop_reason(end: pb.ChoiceEnd | None) -> str | int | None:
    if end is None:
        return None
    if end.stop_reason:
        return end.stop_reason
    return end.stop_token_id if end.HasField("stop_token_id") else None


@dataclass
class ChoiceAnswer:
    text: list[str] = field(default_factory=list)
    calls: list[pb.ToolCall] = field(default_factory=list)
    logprobs: list[pb.Logprobs] = field(default_factory=list)
    end: pb.ChoiceEnd | None = None


@dataclass
class PromptAnswer:
    """One prompt's gathered responses."""

    index: int
    echo: pb.PromptEcho | None = None
    choices: dict[int, ChoiceAnswer] = field(default_factory=dict)
    final: pb.FinalUsage | None = None

    def choice(self, index: int) -> ChoiceAnswer:
        return self.choices.setdefault(index, ChoiceAnswer())

    def add(self, response: pb.GenerateResponse) -> None:
        kind = response.WhichOneof("kind")
        if kind == "token":
            t = response.token
            c = self.choice(t.choice)
            c.text.append(t.text)
            c.calls.extend(t.tool_calls)
            if t.HasField("logprobs"):
                c.logprobs.append(t.logprobs)
        elif kind == "prompt":
            self.echo = response.prompt
        elif kind == "choice_end":
            self.choice(response.choice_end.choice).end = response.choice_end
        elif kind == "final":
            self.final = response.final
            for end in response.final.choices:
                self.choice(end.choice).end = end

    def ordered(self, n: int) -> list[tuple[int, ChoiceAnswer]]:
        for c in range(n):
            self.choice(c)
        return sorted(self.choices.items())


def _entry(lp: pb.TokenLogprob) -> dict[str, Any]:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token_bytes)}


def chat_logprobs(items: list[pb.Logprobs]) -> dict[str, Any]:
    return {"content": [{**_entry(i.chosen), "top_logprobs": [_entry(t) for t in i.top]}
                        for i in items], "refusal": None}


def completion_logprobs(items: list[pb.Logprobs], offset: int = 0) -> dict[str, Any]:
    tokens, values, tops, offsets = [], [], [], []
    at = offset
    for i in items:
        has = i.HasField("chosen")
        tokens.append(i.chosen.token)
        values.append(i.chosen.logprob if has else None)
        tops.append({t.token: t.logprob for t in i.top} if has else None)
        offsets.append(at)
        at += len(i.chosen.token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def _echo_logprobs(echo: pb.PromptEcho) -> list[pb.Logprobs]:
    if echo.logprobs:
        return list(echo.logprobs)
    return []


def completion_choices(answer: PromptAnswer, n: int, echo: bool, logprobs: bool
                       ) -> list[dict[str, Any]]:
    out = []
    for c, choice in answer.ordered(n):
        prefix = answer.echo.text if echo and answer.echo is not None else ""
        entry: dict[str, Any] = {
            "index": answer.index * n + c, "text": prefix + "".join(choice.text),
            "logprobs": None, "finish_reason": finish_of(choice.end, answer.final),
            "stop_reason": stop_reason(choice.end)}
        if logprobs:
            items = (_echo_logprobs(answer.echo) if echo and answer.echo else []) + \
                choice.logprobs
            entry["logprobs"] = completion_logprobs(items)
        if answer.echo is not None and answer.echo.logprobs and not echo:
            entry["prompt_logprobs"] = _prompt_logprobs(answer.echo)
        out.append(entry)
    return out


def _prompt_logprobs(echo: pb.PromptEcho) -> list[Any]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else token id →
    {logprob, decoded_token}."""
    out: list[Any] = []
    for token, lp in zip(echo.token_ids, echo.logprobs, strict=False):
        if not lp.HasField("chosen"):
            out.append(None)
            continue
        entry = {str(token): {"logprob": lp.chosen.logprob, "decoded_token": lp.chosen.token}}
        for t in lp.top:
            entry.setdefault(str(t.token_id), {"logprob": t.logprob, "decoded_token": t.token})
        out.append(entry)
    return out


def tool_calls(calls: list[pb.ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def chat_choices(answer: PromptAnswer, n: int, logprobs: bool) -> list[dict[str, Any]]:
    out = []
    for c, choice in answer.ordered(n):
        text = "".join(choice.text)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": text if text or not choice.calls else None}
        if choice.calls:
            message["tool_calls"] = tool_calls(choice.calls)
        out.append({"index": c, "message": message,
                    "logprobs": chat_logprobs(choice.logprobs) if logprobs else None,
                    "finish_reason": finish_of(choice.end, answer.final),
                    "stop_reason": stop_reason(choice.end)})
        if answer.echo is not None and answer.echo.logprobs:
            out[-1]["prompt_logprobs"] = _prompt_logprobs(answer.echo)
    return out


class ChunkMaker:
    """Streamed chunks' `choices` entries, one response at a time (None: nothing to
    send); each choice's end is sent once, from its `ChoiceEnd` or else the final."""

    def __init__(self, chat: bool, n: int, echo: bool, logprobs: bool) -> None:
        self.chat = chat
        self.n = n
        self.echo = echo
        self.logprobs = logprobs
        self.started: set[int] = set()
        self.ended: set[int] = set()
        self.calls: dict[int, int] = {}

    def entries(self, prompt: int, response: pb.GenerateResponse) -> list[dict[str, Any]]:
        kind = response.WhichOneof("kind")
        if kind == "token":
            return [self._token(prompt, response.token)]
        if kind == "prompt" and self.echo and not self.chat:
            echo = response.prompt
            entry: dict[str, Any] = {"text": echo.text, "logprobs": None, "finish_reason": None}
            if self.logprobs:
                entry["logprobs"] = completion_logprobs(list(echo.logprobs))
            return [{"index": prompt * self.n + c, **entry} for c in range(self.n)]
        if kind == "choice_end":
            return self._end(prompt, response.choice_end.choice, response.choice_end, None)
        if kind == "final":
            out = []
            for c in range(self.n):
                end = next((e for e in response.final.choices if e.choice == c), None)
                out += self._end(prompt, c, end, response.final)
            return out
        return []

    def _index(self, prompt: int, choice: int) -> int:
        return prompt * self.n + choice

    def _token(self, prompt: int, t: pb.TokenChunk) -> dict[str, Any]:
        index = self._index(prompt, t.choice)
        if not self.chat:
            entry: dict[str, Any] = {"index": index, "text": t.text, "logprobs": None,
                                     "finish_reason": None}
            if self.logprobs and t.HasField("logprobs"):
                entry["logprobs"] = completion_logprobs([t.logprobs])
            return entry
        delta: dict[str, Any] = {}
        if index not in self.started:
            self.started.add(index)
            delta["role"] = "assistant"
        if t.text or not t.tool_calls:
            delta["content"] = t.text
        if t.tool_calls:
            delta["tool_calls"] = [{"index": c.index, **call} for c, call in
                                   zip(t.tool_calls, tool_calls(list(t.tool_calls)),
                                       strict=True)]
        return {"index": t.choice, "delta": delta,
                "logprobs": chat_logprobs([t.logprobs]) if self.logprobs
                and t.HasField("logprobs") else None, "finish_reason": None}

    def _end(self, prompt: int, choice: int, end: pb.ChoiceEnd | None,
             final: pb.FinalUsage | None) -> list[dict[str, Any]]:
        index = self._index(prompt, choice)
        if index in self.ended:
            return []
        self.ended.add(index)
        reason = finish_of(end, final)
        if not self.chat:
            return [{"index": index, "text": "", "logprobs": None, "finish_reason": reason,
                     "stop_reason": stop_reason(end)}]
        delta: dict[str, Any] = {}
        if index not in self.started:
            self.started.add(index)
            delta["role"] = "assistant"
        return [{"index": choice, "delta": delta, "logprobs": None, "finish_reason": reason,
                 "stop_reason": stop_reason(end)}]
