"""The engine's events for one request turned into `GenerateResponse` messages.

Per choice: logprobs as `TokenLogprob`s (token text and bytes from the tokenizer, once
per id), tool calls parsed from the text (`tool_calls.ToolCallStream`), a `ChoiceEnd`
naming the stop string or token that ended it. The prompt's echo (text, ids, logprobs)
comes first when asked for. With best_of above n every sequence is held until the
request ends, and the n with the highest cumulative logprob are answered, renumbered
from 0 (vLLM's and OpenAI's rule; a stream cannot do that, so the fronts refuse it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from services.contracts.grpc import inference_pb2 as pb
from services.worker.engine import TokenEvent
from services.worker.intake import WorkItem
from services.worker.tool_calls import ParsedCall, ToolCallStream, feed_text

FINISH = {"length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP,
          "abort": pb.FINISH_REASON_ABORTED, "error": pb.FINISH_REASON_ERROR}


@functools.lru_cache(maxsize=4)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: a byte-level BPE token's chars → bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenTexts:
    """A token id's own text and bytes (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, pb.TokenLogprob] = {}

    def entry(self, token: int, logprob: float) -> pb.TokenLogprob:
        known = self._cache.get(token)
        if known is None:
            text, raw = str(token), str(token).encode()
            if self.tokenizer is not None:
                piece = self.tokenizer.id_to_token(token) or ""
                table = _byte_decoder()
                if piece and all(ch in table for ch in piece):
                    raw = bytes(table[ch] for ch in piece)
                else:
                    raw = piece.replace("▁", " ").encode()
                text = raw.decode("utf-8", errors="replace")
            known = self._cache[token] = pb.TokenLogprob(token_id=token, token=text,
                                                         token_bytes=raw)
            if len(self._cache) > 200_000:
                self._cache.clear()
        out = pb.TokenLogprob()
        out.CopyFrom(known)
        out.logprob = logprob
        return out


@dataclass
class _Choice:
    tools: ToolCallStream | None
    index: int = 0
    held: list[pb.GenerateResponse] = field(default_factory=list)
    calls: int = 0
    end: pb.ChoiceEnd | None = None


class ResponseBuilder:
    """One request's responses, built from its engine events."""

    def __init__(self, work: WorkItem, texts: TokenTexts) -> None:
        self.work = work
        self.texts = texts
        self.hold_all = work.sampling.n > work.returned
        self.choices: dict[int, _Choice] = {}
        self.prompt_sent = False

    def _choice(self, index: int) -> _Choice:
        found = self.choices.get(index)
        if found is None:
            stream = ToolCallStream(self.work.tool_format) if self.work.tool_format else None
            found = self.choices[index] = _Choice(stream)
        return found

    def _logprobs(self, event: TokenEvent) -> pb.Logprobs | None:
        params = self.work.sampling
        if event.logprob is None or not (params.logprobs or params.top_logprobs):
            return None
        return pb.Logprobs(chosen=self.texts.entry(event.token_id or 0, event.logprob),
                           top=[self.texts.entry(t, lp) for t, lp in event.top_logprobs])

    def _echo(self, event: TokenEvent | None) -> pb.GenerateResponse | None:
        params = self.work.sampling
        if self.prompt_sent or not (self.work.echo or params.prompt_logprobs is not None):
            return None
        self.prompt_sent = True
        ids = self.work.prompt_ids
        echo = pb.PromptEcho(token_ids=ids)
        tok = self.texts.tokenizer
        if tok is not None:
            echo.text = tok.decode(ids, skip_special_tokens=False)
        if params.prompt_logprobs is not None and event is not None and event.prompt_logprobs:
            echo.logprobs.append(pb.Logprobs())
            for token, (lp, alts) in zip(ids[1:], event.prompt_logprobs, strict=False):
                echo.logprobs.append(pb.Logprobs(
                    chosen=self.texts.entry(token, lp),
                    top=[self.texts.entry(t, v) for t, v in alts]))
        return pb.GenerateResponse(prompt=echo)

    def on_event(self, event: TokenEvent) -> list[pb.GenerateResponse]:
        out: list[pb.GenerateResponse] = []
        echo = self._echo(event)
        if echo is not None:
            out.append(echo)
        choice = self._choice(event.choice)
        if event.token_id is not None:
            text, calls = feed_text(choice.tools, event.text)
            if event.finish_reason is not None and choice.tools is not None:
                more, late = choice.tools.finish()
                text, calls = text + more, calls + late
            chunk = pb.TokenChunk(index=event.index, token_id=event.token_id, text=text,
                                  choice=event.choice, tool_calls=self._calls(calls))
            choice.calls += len(calls)
            lp = self._logprobs(event)
            if lp is not None:
                chunk.logprobs.CopyFrom(lp)
            response = pb.GenerateResponse(token=chunk)
            (choice.held if self.hold_all else out).append(response)
        if event.finish_reason is not None:
            choice.end = self._end(event.choice, event.finish_reason.value, event.stop_reason,
                                   choice.calls)
        return out

    @staticmethod
    def _calls(calls: list[ParsedCall]) -> list[pb.ToolCall]:
        return [pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments, index=c.index)
                for c in calls]

    @staticmethod
    def _end(index: int, reason: str, stop: str | int | None, calls: int) -> pb.ChoiceEnd:
        end = pb.ChoiceEnd(choice=index, finish_reason=FINISH.get(reason,
                                                                  pb.FINISH_REASON_ERROR))
        if calls and reason == "stop":
            end.finish_reason = pb.FINISH_REASON_TOOL_CALLS
        if isinstance(stop, str):
            end.stop_reason = stop
        elif isinstance(stop, int):
            end.stop_token_id = stop
        return end

    def on_finished(self, reason: str, results: Any) -> tuple[list[pb.GenerateResponse],
                                                               list[pb.ChoiceEnd]]:
        """The held responses (best_of) and every answered choice's end, in order."""
        out: list[pb.GenerateResponse] = []
        echo = self._echo(None)
        if echo is not None:
            out.append(echo)
        ends: dict[int, pb.ChoiceEnd] = {}
        for result in results:
            choice = self._choice(result.choice)
            end = choice.end or self._end(result.choice, result.finish_reason.value,
                                          result.stop_reason, choice.calls)
            end.completion_tokens = len(result.token_ids)
            end.cumulative_logprob = result.cumulative_logprob
            ends[result.choice] = end
        if not ends:  # aborted before any choice was known
            ends[0] = self._end(0, reason, None, 0)
        order = sorted(ends)
        if self.hold_all:
            order = sorted(ends, key=lambda i: -ends[i].cumulative_logprob)[:self.work.returned]
        answered = []
        for new, old in enumerate(order):
            for response in self._choice(old).held:
                response.token.choice = new
                out.append(response)
            ends[old].choice = new
            answered.append(ends[old])
        return out, answered
