"""The OpenAI request bodies the HTTP front accepts, and what it does with every field.

`PARAMETERS` is the table, and docs/router.md lists it. Each field of
`/v1/completions` and `/v1/chat/completions` (OpenAI's, and the vLLM extras clients send
in `extra_body`) is

- `honoured`: it does what OpenAI (or vLLM) says it does;
- `no_effect`: accepted though it does nothing here, because it cannot change the output
  (a tag or a hint for OpenAI's own services) — each row says why;
- `refused`: 400 with code `unsupported_parameter` naming it, unless it holds a neutral
  value, one that asks for what the server does anyway (`n: 1`, `logprobs: false`,
  `presence_penalty: 0`, `top_k: -1`).

A field in no row is refused by name whatever its value, so nothing is silently ignored.
A null is the same as leaving the field out, as in OpenAI's API.

Bodies are read here too (`read_body`), before any model sees them, so that every way a
body can be wrong is a 400 (413 when too large) in OpenAI's error shape naming the field
where there is one: bytes that are not UTF-8, numbers JSON cannot hold (NaN, a
thousand-digit integer), nesting deeper than `MAX_DEPTH`, lone surrogate escapes
(`"\\ud800"`, not Unicode text, so not storable in a proto string). Ranges are checked on
every honoured field here (the proto's uint32/uint64 among them), and the rules both
fronts share (context, vocabulary, roles, stop strings) by the router on the
`GenerateRequest` built from the body (`services.contracts.generate`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from starlette.requests import Request

from services.contracts.generate import (
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_LIST,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    ROLE_ALIASES,
    ROLES,
    UINT32_MAX,
    UINT64_MAX,
    InvalidArgument,
    canonical_role,
)
from services.contracts.grpc import inference_pb2 as pb

MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 32
"""JSON nesting a body may have (a chat message's content part is at depth 4)."""
MAX_INT_DIGITS = 100
MAX_PROMPTS = 128
"""Prompts in one `/v1/completions` request (each is a request to a worker)."""

Kind = Literal["honoured", "no_effect", "refused"]
Endpoint = Literal["completions", "chat"]
COMPLETIONS: tuple[Endpoint, ...] = ("completions",)
CHAT: tuple[Endpoint, ...] = ("chat",)
BOTH: tuple[Endpoint, ...] = ("completions", "chat")


@dataclass(frozen=True)
class Parameter:
    """One field of a request body and what the server does with it."""

    name: str
    """Top-level field, or `messages[].x` for a field of a chat message."""
    kind: Kind
    endpoints: tuple[Endpoint, ...]
    note: str
    neutral: tuple[Any, ...] = ()
    """For `refused`: the values that ask for nothing (accepted)."""
    vllm: bool = False
    """A vLLM extra, not in OpenAI's schema (clients send it in `extra_body`)."""


def _honoured(name: str, endpoints: tuple[Endpoint, ...], note: str, *,
              vllm: bool = False) -> Parameter:
    return Parameter(name, "honoured", endpoints, note, vllm=vllm)


def _refused(name: str, endpoints: tuple[Endpoint, ...], *neutral: Any, note: str = "",
             vllm: bool = False) -> Parameter:
    return Parameter(name, "refused", endpoints, note, neutral, vllm)


PARAMETERS: tuple[Parameter, ...] = (
    _honoured("model", BOTH, "`base:adapter_or_alias`, `adapter@version`, a base model, "
                             "or an adapter id / alias"),
    _honoured("prompt", COMPLETIONS, f"a string, strings, token ids or lists of token ids "
                                     f"(at most {MAX_PROMPTS} prompts)"),
    _honoured("messages", CHAT, "rendered with the base model's chat template by the "
                                "worker"),
    _honoured("messages[].role", CHAT, "system, user, assistant, tool; developer is system"),
    _honoured("messages[].content", CHAT, "a string or a list of text parts "
                                          "(`{\"type\": \"text\", \"text\": …}`)"),
    _honoured("max_tokens", BOTH, "1 up to the model's context (0 is refused); "
                                  "completions default 16, chat the worker's default"),
    _honoured("max_completion_tokens", CHAT, "as max_tokens, and wins over it"),
    _honoured("temperature", BOTH, "0 to 2; 0 is greedy"),
    _honoured("top_p", BOTH, "0 to 1"),
    _honoured("seed", BOTH, "0 to 2^64-1: the same seed and request give the same "
                            "tokens"),
    _honoured("stop", BOTH, f"up to {MAX_STOP_STRINGS} non-empty strings, never part "
                            "of the output"),
    _honoured("stream", BOTH, "server-sent events ending in `data: [DONE]`"),
    _honoured("stream_options", BOTH, "`include_usage`: a last chunk with usage; only "
                                      "with `stream`"),
    _honoured("user", BOTH, "the user id that keeps a user on one side of a canary"),
    _honoured("min_tokens", BOTH, "end-of-sequence masked until this many tokens",
              vllm=True),
    _honoured("ignore_eos", BOTH, "decode past end-of-sequence, to max_tokens", vllm=True),
    Parameter("metadata", "no_effect", CHAT, "tags for OpenAI's stored completions; "
                                             "nothing is stored here"),
    Parameter("safety_identifier", "no_effect", CHAT, "an id for OpenAI's abuse "
                                                      "monitoring"),
    Parameter("prompt_cache_key", "no_effect", CHAT, "a hint for OpenAI's cache routing; "
                                                     "the prefix cache here is keyed by "
                                                     "content within a compliance scope"),
    _honoured("n", BOTH, f"1 to {MAX_CHOICES} choices, sharing the prompt's KV blocks"),
    _honoured("best_of", COMPLETIONS, f"n to {MAX_CHOICES}: the n with the highest "
                                      "cumulative logprob (not with stream unless equal to n)"),
    _honoured("echo", COMPLETIONS, "the prompt's text (and its tokens' logprobs) first"),
    _honoured("logprobs", COMPLETIONS, f"0 to {MAX_TOP_LOGPROBS} alternatives per token"),
    _honoured("logprobs", CHAT, "each token's logprob"),
    _honoured("top_logprobs", CHAT, f"0 to {MAX_TOP_LOGPROBS} alternatives (with logprobs)"),
    _honoured("presence_penalty", BOTH, "-2 to 2"),
    _honoured("frequency_penalty", BOTH, "-2 to 2"),
    _honoured("logit_bias", BOTH, f"token id -> -100 to 100, at most {MAX_LOGIT_BIAS}"),
    _honoured("response_format", BOTH, "text, json_object, json_schema (strict, by xgrammar)"),
    _honoured("tools", CHAT, f"at most {MAX_TOOLS} functions, rendered by the chat template"),
    _honoured("tool_choice", CHAT, "none, auto, required or a named function (the last two "
                                   "enforced by the grammar)"),
    _honoured("parallel_tool_calls", CHAT, "with required or named: one call, or several"),
    _honoured("messages[].tool_calls", CHAT, "an assistant's earlier calls"),
    _honoured("messages[].tool_call_id", CHAT, "the call a tool message answers"),
    *(_honoured(name, BOTH, note, vllm=True) for name, note in (
        ("top_k", "-1 or 0 (off), or a count"), ("min_p", "0 to 1"),
        ("repetition_penalty", "above 0 to 100 (transformers' rule; 1 = off)"),
        ("stop_token_ids", f"at most {MAX_TOKEN_LIST} token ids ending a choice"),
        ("bad_words", f"at most {MAX_TOKEN_LIST} words never generated"),
        ("prompt_logprobs", f"0 to {MAX_TOP_LOGPROBS}: the prompt tokens' logprobs"),
        ("guided_json", "a JSON schema"), ("guided_regex", "a regular expression"),
        ("guided_choice", "one of these strings"), ("guided_grammar", "an EBNF grammar"),
        ("structured_outputs", "json, regex, choice, grammar or json_object"))),
    _refused("store", CHAT, False, note="nothing is stored"),
    _refused("service_tier", CHAT, "auto", "default", note="one processing tier"),
    _refused("suffix", COMPLETIONS, ""),
    _refused("functions", CHAT, [], note="deprecated by OpenAI: use tools"),
    _refused("function_call", CHAT, "none", note="deprecated by OpenAI: use tool_choice"),
    _refused("modalities", CHAT, ["text"]),
    _refused("audio", CHAT),
    _refused("prediction", CHAT),
    _refused("reasoning_effort", CHAT),
    _refused("verbosity", CHAT),
    _refused("web_search_options", CHAT),
    _refused("moderation", CHAT),
    _refused("prompt_cache_options", CHAT),
    _refused("prompt_cache_retention", CHAT),
    _refused("messages[].name", CHAT, note="a name would be written into the template"),
    _refused("messages[].function_call", CHAT),
    _refused("messages[].refusal", CHAT),
    _refused("messages[].audio", CHAT),
    *(_refused(name, BOTH, *neutral, vllm=True) for name, neutral in (
        ("length_penalty", (1,)), ("use_beam_search", (False,)),
        ("include_stop_str_in_output", (False,)), ("skip_special_tokens", (True,)),
        ("spaces_between_special_tokens", (True,)),
        ("allowed_token_ids", ()), ("truncate_prompt_tokens", ()),
        ("guided_decoding_backend", ("xgrammar", "auto")),
        ("guided_whitespace_pattern", ()), ("priority", (0,)),
        ("logits_processors", ()), ("return_tokens_as_token_ids", (False,)),
        ("return_token_ids", (False,)), ("cache_salt", ()), ("request_id", ()),
        ("kv_transfer_params", ()), ("vllm_xargs", ()))),
    _refused("echo", CHAT, False, vllm=True),
    _refused("add_special_tokens", COMPLETIONS, True, vllm=True),
    _refused("add_special_tokens", CHAT, False, vllm=True),
    *(_refused(name, CHAT, *neutral, vllm=True) for name, neutral in (
        ("add_generation_prompt", (True,)), ("continue_final_message", (False,)),
        ("chat_template", ()), ("chat_template_kwargs", ()), ("documents", ()),
        ("mm_processor_kwargs", ()))),
)

_TABLE: dict[tuple[Endpoint, str], Parameter] = {
    (endpoint, p.name): p for p in PARAMETERS for endpoint in p.endpoints}


def parameter(endpoint: Endpoint, name: str) -> Parameter | None:
    return _TABLE.get((endpoint, name))


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality that keeps booleans apart from numbers (`n: true` is not `n: 1`)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return bool(value == neutral)


def _sifted(endpoint: Endpoint, data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The honoured fields of `data`; the rest accepted as neutral or no effect, or
    refused by name."""
    kept = {}
    for name, value in data.items():
        if value is None:
            continue
        row = parameter(endpoint, f"{prefix}{name}")
        if row is None:
            raise PydanticCustomError("unsupported_parameter",
                                      "unknown parameter; refused, not ignored",
                                      {"param": name})
        if row.kind == "honoured":
            kept[name] = value
        elif row.kind == "refused" and not any(_same(value, n) for n in row.neutral):
            why = f" ({row.note})" if row.note else ""
            accepted = (" (accepted: " + ", ".join(json.dumps(n) for n in row.neutral) + ")"
                        if row.neutral else "")
            raise PydanticCustomError("unsupported_parameter",
                                      f"not supported by this server{why}{accepted}",
                                      {"param": name})
    return kept


# --- bodies ----------------------------------------------------------------------------------


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise _invalid("json_schema is given with, and only with, type json_schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (one of its members)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    arguments: str = Field(max_length=256 * 1024)


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(max_length=256)
    type: Literal["function"]
    function: CalledFunction


class OpenAIBody(BaseModel):
    """What both endpoints share; only honoured fields are declared (see `_sifted`)."""

    model_config = ConfigDict(extra="forbid")
    ENDPOINT: ClassVar[Endpoint]

    model: str = Field(min_length=1, max_length=512)
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=UINT64_MAX)
    user: str | None = Field(None, max_length=256)
    min_tokens: int = Field(0, ge=0, le=UINT32_MAX)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    response_format: ResponseFormat | None = None
    top_k: int = Field(-1, ge=-1, le=2**31 - 1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=100)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_TOKEN_LIST)
    bad_words: list[str] | None = Field(None, max_length=MAX_TOKEN_LIST)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_TOKEN_LIST)
    guided_grammar: str | None = Field(None, min_length=1)
    structured_outputs: StructuredOutputs | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit() or int(key) > UINT32_MAX:
                raise _invalid(f"{key[:40]!r} is not a token id")
            if not -100 <= bias <= 100:
                raise _invalid(f"token {key}: {bias} must be in [-100, 100]")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _ids(cls, value: list[int] | None) -> list[int] | None:
        if value and any(not 0 <= t <= UINT32_MAX for t in value):
            raise _invalid(f"token ids are 0 to {UINT32_MAX}")
        return value

    @field_validator("bad_words")
    @classmethod
    def _words(cls, value: list[str] | None) -> list[str] | None:
        if value and not all(value):
            raise _invalid("bad words must be non-empty")
        return value

    def guide(self) -> tuple[str, pb.Guide] | None:
        """The one structured-output ask of the body (BodyError for two)."""
        asks: list[tuple[str, pb.Guide]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asks.append(("response_format", pb.Guide(json_object=True)))
        elif fmt is not None and fmt.json_schema is not None:
            asks.append(("response_format", pb.Guide(
                json_schema=json.dumps(fmt.json_schema.schema_))))
        so = self.structured_outputs
        for name, value in (("guided_json", self.guided_json),
                            ("guided_regex", self.guided_regex),
                            ("guided_choice", self.guided_choice),
                            ("guided_grammar", self.guided_grammar),
                            ("structured_outputs.json", so.json_ if so else None),
                            ("structured_outputs.regex", so.regex if so else None),
                            ("structured_outputs.choice", so.choice if so else None),
                            ("structured_outputs.grammar", so.grammar if so else None),
                            ("structured_outputs.json_object",
                             True if so and so.json_object else None)):
            if value is None:
                continue
            kind = name.rpartition("_")[2] if name.startswith("guided") else name.rpartition(
                ".")[2]
            if kind == "json":
                text = value if isinstance(value, str) else json.dumps(value)
                asks.append((name, pb.Guide(json_schema=text)))
            elif kind == "choice":
                asks.append((name, pb.Guide(choice=pb.ChoiceList(choices=value))))
            elif kind == "json_object":
                asks.append((name, pb.Guide(json_object=True)))
            else:
                asks.append((name, pb.Guide(**{kind: value})))
        if len(asks) > 1:
            raise BodyError(f"{asks[1][0]}: only one structured output at a time (also "
                            f"{asks[0][0]})", param=asks[1][0])
        return asks[0] if asks else None

    @model_validator(mode="before")
    @classmethod
    def _table(cls, data: Any) -> Any:
        return _sifted(cls.ENDPOINT, data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> OpenAIBody:
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("stream_options", "only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, default_max: int | None) -> pb.SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max
        params = pb.SamplingParams(
            max_tokens=max_tokens or 0,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, stop=stops,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, n=self.n,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            top_k=max(self.top_k, 0), min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            stop_token_ids=self.stop_token_ids or [], bad_words=self.bad_words or [])
        for key, bias in (self.logit_bias or {}).items():
            params.logit_bias[int(key)] = bias
        if self.seed is not None:
            params.seed = self.seed
        if self.prompt_logprobs is not None:
            params.prompt_logprobs = self.prompt_logprobs
        guide = self.guide()
        if guide is not None:
            params.guide.CopyFrom(guide[1])
        self.sampling_extra(params)
        return params

    def sampling_extra(self, params: pb.SamplingParams) -> None:
        """The endpoint's own fields."""


class CompletionBody(OpenAIBody):
    ENDPOINT: ClassVar[Endpoint] = "completions"

    prompt: str | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=UINT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

    @model_validator(mode="after")
    def _best_of(self) -> CompletionBody:
        if self.best_of is not None and self.best_of < self.n:
            raise PydanticCustomError("best_of", "must be at least n")
        if self.stream and self.best_of is not None and self.best_of != self.n:
            raise PydanticCustomError("best_of", "cannot stream with best_of above n (the "
                                      "best are known only at the end)")
        return self

    def sampling_extra(self, params: pb.SamplingParams) -> None:
        if self.logprobs is not None:
            params.logprobs = True
            params.top_logprobs = self.logprobs
        if self.best_of is not None:
            params.best_of = self.best_of
        params.echo = self.echo
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            params.prompt_logprobs = self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        """One or more prompts, a list of token ids counting as one (checked here, with
        messages a person can act on, rather than by a union's four error lists)."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise _invalid("a string, a list of strings, a list of token ids or a list of "
                           "lists of token ids")
        if all(type(x) is int for x in value):
            value = [value]
        if len(value) > MAX_PROMPTS:
            raise _invalid(f"{len(value)} prompts; at most {MAX_PROMPTS}")
        for i, one in enumerate(value):
            if isinstance(one, str):
                continue
            if not isinstance(one, list) or not one or any(type(x) is not int for x in one):
                raise _invalid(f"prompt {i} is neither a string nor a non-empty list of "
                               "integer token ids")
            bad = next((x for x in one if not 0 <= x <= UINT32_MAX), None)
            if bad is not None:
                raise _invalid(f"token id {str(bad)[:40]} is outside 0..{UINT32_MAX}")
        if not all(isinstance(x, str) for x in value) and any(isinstance(x, str)
                                                              for x in value):
            raise _invalid("mixes strings and token ids")
        return value

    def prompts(self) -> list[str | list[int]]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    text: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":
            raise PydanticCustomError("unsupported_parameter", "only text content parts are "
                                      f"supported, not {value[:40]!r}")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _table(cls, data: Any) -> Any:
        return _sifted("chat", data, "messages[].") if isinstance(data, dict) else data

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        try:
            return canonical_role(value)
        except InvalidArgument as exc:
            raise _invalid(str(exc)) from None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatBody(OpenAIBody):
    ENDPOINT: ClassVar[Endpoint] = "chat"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tool_rules(self) -> ChatBody:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("top_logprobs", "needs logprobs: true")
        names = [t.function.name for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in names:
                raise PydanticCustomError("tool_choice", "names no tool of tools")
        elif self.tool_choice == "required" and not names:
            raise PydanticCustomError("tool_choice", "required needs tools")
        return self

    def sampling_extra(self, params: pb.SamplingParams) -> None:
        params.logprobs = self.logprobs
        params.top_logprobs = self.top_logprobs or 0
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            params.tool_choice = choice.function.name
        elif self.tools:
            params.tool_choice = choice or "auto"
        params.parallel_tool_calls = self.parallel_tool_calls is not False

    def tools_pb(self) -> list[pb.Tool]:
        return [pb.Tool(name=t.function.name, description=t.function.description or "",
                        parameters=json.dumps(t.function.parameters or {"type": "object"}))
                for t in self.tools or []]


class TokenizeBody(BaseModel):
    """vLLM's `/tokenize`: a prompt, or chat messages (rendered by the template)."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=512)
    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    add_generation_prompt: Literal[True] = True
    add_special_tokens: Literal[True] = True

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise _invalid("give prompt or messages")
        return self


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=512)
    tokens: list[int] = Field(max_length=1_000_000)

    @field_validator("tokens")
    @classmethod
    def _ids(cls, value: list[int]) -> list[int]:
        if any(not 0 <= t <= UINT32_MAX for t in value):
            raise _invalid(f"token ids are 0 to {UINT32_MAX}")
        return value


assert set(ROLES) | set(ROLE_ALIASES) >= {"system", "developer", "user", "assistant", "tool"}


# --- reading a body ------------------------------------------------------------------------


class BodyError(ValueError):
    """A body the front refuses: answered in OpenAI's error shape."""

    def __init__(self, message: str, *, param: str | None = None,
                 code: str = "invalid_request", status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


_SURROGATE = re.compile("[\ud800-\udfff]")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BodyError(f"body: an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BodyError(f"body: the number {text[:24]} is out of range")
    return value


def _constant(text: str) -> float:
    raise BodyError(f"body: {text} is not a JSON number")


def _path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def _checked_tree(data: Any) -> None:
    """No string (or key) with a lone surrogate, no nesting deeper than MAX_DEPTH
    (iterative: the walk itself must not recurse into a hostile depth)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found:
                raise BodyError(f"{path or 'body'}: a lone surrogate (\\u{ord(found[0]):04x}) "
                                "is not Unicode text", param=path or None)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth >= MAX_DEPTH:
            raise BodyError(f"{path}: nested deeper than {MAX_DEPTH} levels",
                            param=path.split(".")[0].split("[")[0] or None)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and _SURROGATE.search(key):
                raise BodyError(f"{path or 'body'}: a key with a lone surrogate is not "
                                "Unicode text", param=path or None)
            stack.append((item, _path(path, key), depth + 1))


async def read_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object, or a BodyError saying what is wrong with it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyError(f"body: {declared} bytes, over the {MAX_BODY_BYTES}-byte limit",
                        code="request_too_large", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyError(f"body: over the {MAX_BODY_BYTES}-byte limit",
                            code="request_too_large", status=413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"body: not UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise BodyError(f"body: not JSON ({exc.msg} at line {exc.lineno} column "
                        f"{exc.colno})") from None
    except RecursionError:
        raise BodyError(f"body: nested deeper than {MAX_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise BodyError("body: a JSON object is required")
    _checked_tree(data)
    return data


_TAGS = re.compile(r"^(str|int|float|bool|none|dict|list|[a-z-]+\[.*\])$")


def _param(loc: tuple[int | str, ...]) -> str | None:
    """`messages[0].content[1].text` from pydantic's location (union tags dropped)."""
    path = ""
    for part in loc:
        if isinstance(part, str) and _TAGS.match(part):
            continue
        path = _path(path, part)
    return path or None


def parse(model: type[OpenAIBody], data: dict[str, Any]) -> Any:
    """`data` as `model`, or a BodyError naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    # a refused field first; else the deepest error (of a union's branches, the one that
    # got furthest says what is wrong)
    error = next((e for e in errors if e["type"] in ("unsupported_parameter", "extra_forbidden")),
                 None) or max(errors, key=lambda e: len(e["loc"]))
    kind = error["type"]
    param = _param(error["loc"])
    inner = (error.get("ctx") or {}).get("param")
    if inner:
        param = _path(param or "", inner)
    if kind in ("stream_options", "best_of", "top_logprobs", "tool_choice"):
        param = kind
    code = "invalid_request"
    message = error["msg"]
    if kind in ("unsupported_parameter", "extra_forbidden"):
        code = "unsupported_parameter"
        if kind == "extra_forbidden":
            message = "unknown parameter; refused, not ignored"
    raise BodyError(f"{param or 'body'}: {message}", param=param, code=code)


_HTTP_PARAMS = {**{f"sampling.{name}": name for name in (
    "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "logit_bias", "stop_token_ids", "bad_words", "prompt_logprobs", "n", "best_of",
    "tool_choice")},
                "sampling.guide": "response_format", "sampling.top_logprobs": "top_logprobs",
                "sampling.max_tokens": "max_tokens", "sampling.min_tokens": "min_tokens",
                "sampling.temperature": "temperature", "sampling.top_p": "top_p",
                "sampling.stop": "stop", "sampling.seed": "seed", "prompt.text": "prompt",
                "prompt.token_ids": "prompt", "chat": "messages", "prompt.chat": "messages"}


def http_param(field: str | None) -> str | None:
    """The body field a `GenerateRequest` field (a refusal's proto path) came from."""
    if field is None:
        return None
    if field.startswith("chat."):
        return field.removeprefix("chat.")
    return _HTTP_PARAMS.get(field, field)

