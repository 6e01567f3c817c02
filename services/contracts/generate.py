"""What a `GenerateRequest` may hold: the one rule the router and the worker both check.

The router checks every request of both fronts before it places it (`check_generate`),
and again against the base model's limits once it knows the model (`check_limits`, from
the catalog's registered config). A worker checks the same again with its own limits,
cheaply, for clients that call it directly, then what needs its tokenizer. A refusal is
an `InvalidArgument` naming the proto field (`sampling.max_tokens`,
`chat.messages[2].role`); the fronts answer it as INVALID_ARGUMENT or HTTP 400.

Nothing is silently ignored: a `SamplingParams` field the worker does not implement, an
enum value the proto does not define, or a field number this build does not know (a
newer client's field, kept by protobuf as unknown) is refused by name, and bytes that
do not decode (a string that is not UTF-8) are INVALID_ARGUMENT rather than the
INTERNAL error grpc answers for a request it cannot deserialize.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from services.contracts.grpc import inference_pb2 as pb

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
_FLOAT_MAX = sys.float_info.max
MAX_STOP_STRINGS = 16
MAX_CHAT_MESSAGES = 1024
MAX_CHOICES = 16
"""n and best_of: sequences one request may generate."""
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
MAX_TOKEN_LIST = 256
"""stop_token_ids and bad_words entries."""
MAX_GUIDE_CHARS = 256 * 1024
MAX_TOOLS = 128
TOOL_CHOICES = ("", "auto", "none", "required")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

ROLES = ("system", "user", "assistant", "tool")
"""The chat roles a message may have. A role is a name from this list, never free text:
a role is written into the chat template's control text, so anything else could forge
the template's special tokens."""
ROLE_ALIASES = {"developer": "system"}
"""OpenAI's newer name for the system role."""

SAMPLING_HONOURED = frozenset({
    "max_tokens", "temperature", "top_p", "seed", "stop", "min_tokens", "ignore_eos",
    "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "logit_bias", "stop_token_ids", "bad_words", "logprobs", "top_logprobs",
    "prompt_logprobs", "echo", "n", "best_of", "guide", "tool_choice",
    "parallel_tool_calls"})
"""The `SamplingParams` fields the worker implements; any other field that is set is
refused (`tests/worker/test_intake.py` pins this against the proto)."""

_UNHONOURED = tuple(f for f in pb.SamplingParams.DESCRIPTOR.fields
                    if f.name not in SAMPLING_HONOURED)
_TRACE = re.compile(r"^[0-9a-f]{32}$")
_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")
_QOS_TIERS = frozenset(pb.QosTier.values())


class InvalidArgument(ValueError):
    """A request the caller must fix; `field` is the proto path of the first bad field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ModelLimits:
    """What a base model accepts (None: not known here; the worker still checks)."""

    vocab_size: int | None = None
    context: int | None = None
    """Tokens of prompt and completion together."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelLimits:
        """From a base model's config.json as registered (Hugging Face names)."""
        def positive(key: str) -> int | None:
            value = config.get(key)
            return value if type(value) is int and value > 0 else None

        return cls(positive("vocab_size"), positive("max_position_embeddings"))


def canonical_role(role: str, field: str = "role") -> str:
    """The role a template sees: one of `ROLES` (developer → system)."""
    role = ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        shown = role if len(role) <= 40 else role[:40] + "…"
        raise InvalidArgument(field, f"{shown!r} is not a role; give one of "
                                     f"{', '.join(ROLES)} (or developer)")
    return role


class Undecodable:
    """What `decode_generate` gives for bytes that are no `GenerateRequest`."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def decode_generate(data: bytes) -> pb.GenerateRequest | Undecodable:
    """grpc's request deserializer for `Generate`: a parse failure becomes a value the
    servicer refuses as INVALID_ARGUMENT (grpc itself would answer INTERNAL)."""
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as exc:
        return Undecodable(str(exc))


def add_inference_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """`add_InferenceServicer_to_server`, with `decode_generate` as the deserializer."""
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=decode_generate,
        response_serializer=pb.GenerateResponse.SerializeToString)}
    for name, request, reply in (("Tokenize", pb.TokenizeRequest, pb.TokenizeReply),
                                 ("Detokenize", pb.DetokenizeRequest, pb.DetokenizeReply),
                                 ("ModelInfo", pb.ModelInfoRequest, pb.ModelInfoReply)):
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=request.FromString,
            response_serializer=reply.SerializeToString)
    name = pb.DESCRIPTOR.services_by_name["Inference"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


@functools.cache
def _message_fields(descriptor: Any) -> tuple[tuple[str, bool], ...]:
    """A message type's fields that hold messages: (name, repeated)."""
    return tuple((f.name, f.is_repeated) for f in descriptor.fields
                 if f.message_type is not None
                 and not f.message_type.GetOptions().map_entry)  # maps of scalars here


def _no_unknown_fields(message: Message, path: str) -> None:
    """Walks every set message field (per request: kept cheap, no ListFields)."""
    unknown = UnknownFieldSet(message)
    if len(unknown):
        numbers = sorted({f.field_number for f in unknown})
        raise InvalidArgument(path or "request",
                              f"field number {numbers[0]} is not in this server's "
                              f"{message.DESCRIPTOR.name}; refused, not ignored")
    for name, repeated in _message_fields(message.DESCRIPTOR):
        if repeated:
            for i, item in enumerate(getattr(message, name)):
                _no_unknown_fields(item, f"{path}.{name}[{i}]" if path else f"{name}[{i}]")
        elif message.HasField(name):
            _no_unknown_fields(getattr(message, name), f"{path}.{name}" if path else name)


def check_generate(request: pb.GenerateRequest | Undecodable) -> None:
    """Every rule that needs no model: raises `InvalidArgument` naming the first bad field.
    Empty `request_id` / `trace_id` are filled in by whoever receives the request."""
    if isinstance(request, Undecodable):
        raise InvalidArgument("request", f"not a loraplane.v1.GenerateRequest: "
                                         f"{request.reason}")
    if len(request.chat.messages) > MAX_CHAT_MESSAGES:  # before walking each of them
        raise InvalidArgument("chat.messages", f"more than {MAX_CHAT_MESSAGES} messages")
    _no_unknown_fields(request, "")
    if request.request_id and not _REQUEST_ID.match(request.request_id):
        raise InvalidArgument("request_id", "1-128 printable ASCII characters")
    if request.trace_id and not _TRACE.match(request.trace_id):
        raise InvalidArgument("trace_id", "32 lowercase hex characters")
    if request.tenant.qos_tier not in _QOS_TIERS:
        raise InvalidArgument("tenant.qos_tier", f"{request.tenant.qos_tier} is not a "
                                                 "QosTier")
    which = request.WhichOneof("prompt")
    if which is None:
        raise InvalidArgument("prompt", "give text, token_ids or chat")
    if which == "text" and not request.text:
        raise InvalidArgument("prompt.text", "is empty")
    if which == "token_ids" and not request.token_ids.ids:
        raise InvalidArgument("prompt.token_ids", "is empty")
    if which == "chat":
        messages = request.chat.messages
        if not messages:
            raise InvalidArgument("chat.messages", "is empty")
        for i, m in enumerate(messages):
            role = canonical_role(m.role, f"chat.messages[{i}].role")
            if m.tool_calls and role != "assistant":
                raise InvalidArgument(f"chat.messages[{i}].tool_calls", "only an assistant "
                                                                       "message calls tools")
            for j, call in enumerate(m.tool_calls):
                where = f"chat.messages[{i}].tool_calls[{j}]"
                _tool_name(call.name, f"{where}.name")
                _json_text(call.arguments or "{}", f"{where}.arguments", dict)
            if m.tool_call_id and role != "tool":
                raise InvalidArgument(f"chat.messages[{i}].tool_call_id", "only a tool message "
                                                                         "answers a call")
        _check_tools(request.chat)
    _check_sampling(request.sampling)
    _check_tool_choice(request)


def _tool_name(name: str, field: str) -> None:
    if not _TOOL_NAME.match(name):
        shown = name if len(name) <= 40 else name[:40] + "…"
        raise InvalidArgument(field, f"{shown!r}: 1-64 letters, digits, _ . or -")


def _json_text(text: str, field: str, kind: type | None = None) -> Any:
    if len(text) > MAX_GUIDE_CHARS:
        raise InvalidArgument(field, f"over {MAX_GUIDE_CHARS} characters")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(field, f"not JSON: {exc}") from None
    if kind is not None and not isinstance(value, kind):
        raise InvalidArgument(field, f"a JSON {'object' if kind is dict else kind.__name__} "
                                     "is required")
    return value


def _check_tools(chat: pb.ChatMessages) -> None:
    if len(chat.tools) > MAX_TOOLS:
        raise InvalidArgument("chat.tools", f"at most {MAX_TOOLS} tools")
    seen: set[str] = set()
    for i, tool in enumerate(chat.tools):
        _tool_name(tool.name, f"chat.tools[{i}].name")
        if tool.name in seen:
            raise InvalidArgument(f"chat.tools[{i}].name", f"{tool.name!r} is named twice")
        seen.add(tool.name)
        if tool.parameters:
            _json_text(tool.parameters, f"chat.tools[{i}].parameters", dict)


def _check_tool_choice(request: pb.GenerateRequest) -> None:
    s = request.sampling
    choice = s.tool_choice
    tools = {t.name for t in request.chat.tools} if request.WhichOneof("prompt") == "chat" \
        else set()
    if choice not in TOOL_CHOICES and choice not in tools:
        raise InvalidArgument("sampling.tool_choice", f"{choice[:64]!r} is none of auto, none, "
                                                      "required or a tool's name")
    if choice == "required" and not tools:
        raise InvalidArgument("sampling.tool_choice", "required needs chat.tools")
    forced = choice not in ("", "auto", "none")
    if forced and s.HasField("guide"):
        raise InvalidArgument("sampling.guide", "a guide and a required or named tool "
                                                "choice cannot both shape the output")


def _check_sampling(s: pb.SamplingParams) -> None:
    for fd in _UNHONOURED:
        if (len(getattr(s, fd.name)) if fd.is_repeated else
                s.HasField(fd.name) if fd.has_presence else getattr(s, fd.name)):
            raise InvalidArgument(f"sampling.{fd.name}", "not supported by this server; "
                                                         "refused, not ignored")
    max_tokens = s.max_tokens
    if max_tokens and s.min_tokens > max_tokens:
        raise InvalidArgument("sampling.min_tokens", f"{s.min_tokens} exceeds max_tokens "
                                                     f"{max_tokens}")
    temperature, top_p = s.temperature, s.top_p
    if not 0 <= temperature <= _FLOAT_MAX:  # NaN fails every comparison
        raise InvalidArgument("sampling.temperature", f"{temperature} must be finite and >= 0")
    if not 0 <= top_p <= 1:
        raise InvalidArgument("sampling.top_p", f"{top_p} must be in [0, 1] (0 or 1 = off)")
    stop = s.stop
    if stop:
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidArgument("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings")
        if not all(stop):
            raise InvalidArgument("sampling.stop", "stop strings must be non-empty")
    if s.top_k < -1:
        raise InvalidArgument("sampling.top_k", f"{s.top_k} must be -1, 0 (off) or a count")
    if not 0 <= s.min_p <= 1:
        raise InvalidArgument("sampling.min_p", f"{s.min_p} must be in [0, 1]")
    if not 0 <= s.repetition_penalty <= 100:
        raise InvalidArgument("sampling.repetition_penalty",
                              f"{s.repetition_penalty} must be in (0, 100] (0 = off)")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not -2 <= value <= 2:
            raise InvalidArgument(f"sampling.{name}", f"{value} must be in [-2, 2]")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS} tokens")
    for token, bias in s.logit_bias.items():
        if not -100 <= bias <= 100:
            raise InvalidArgument("sampling.logit_bias", f"token {token}: {bias} must be in "
                                                         "[-100, 100]")
    if len(s.stop_token_ids) > MAX_TOKEN_LIST:
        raise InvalidArgument("sampling.stop_token_ids", f"at most {MAX_TOKEN_LIST} tokens")
    if len(s.bad_words) > MAX_TOKEN_LIST or not all(s.bad_words):
        raise InvalidArgument("sampling.bad_words", f"at most {MAX_TOKEN_LIST} non-empty words")
    if s.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument("sampling.top_logprobs", f"{s.top_logprobs}: at most "
                                                       f"{MAX_TOP_LOGPROBS}")
    if s.HasField("prompt_logprobs") and s.prompt_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument("sampling.prompt_logprobs", f"{s.prompt_logprobs}: at most "
                                                          f"{MAX_TOP_LOGPROBS}")
    if s.n > MAX_CHOICES:
        raise InvalidArgument("sampling.n", f"{s.n}: at most {MAX_CHOICES}")
    if s.best_of > MAX_CHOICES:
        raise InvalidArgument("sampling.best_of", f"{s.best_of}: at most {MAX_CHOICES}")
    if s.best_of and s.best_of < max(s.n, 1):
        raise InvalidArgument("sampling.best_of", f"{s.best_of} is less than n ({s.n})")
    if s.HasField("guide"):
        _check_guide(s.guide)


def _check_guide(guide: pb.Guide) -> None:
    which = guide.WhichOneof("kind")
    if which is None:
        raise InvalidArgument("sampling.guide", "give json_schema, json_object, regex, choice "
                                                "or grammar")
    field = f"sampling.guide.{which}"
    if which == "json_schema":
        _json_text(guide.json_schema, field, dict)
    elif which == "json_object" and not guide.json_object:
        raise InvalidArgument(field, "false asks for nothing; leave the guide out")
    elif which in ("regex", "grammar"):
        text = getattr(guide, which)
        if not text or len(text) > MAX_GUIDE_CHARS:
            raise InvalidArgument(field, f"1 to {MAX_GUIDE_CHARS} characters")
    elif which == "choice":
        choices = guide.choice.choices
        if not choices or len(choices) > MAX_TOKEN_LIST or not all(choices):
            raise InvalidArgument(field, f"1 to {MAX_TOKEN_LIST} non-empty strings")


def check_limits(request: pb.GenerateRequest, limits: ModelLimits,
                 prompt_len: int | None = None) -> None:
    """The rules that need the base model: token ids in its vocabulary, token counts in
    its context. A text or chat prompt counts `prompt_len` tokens once tokenised (the
    worker knows; the router, which has no tokenizer, counts 0)."""
    s = request.sampling
    context = limits.context
    vocab = limits.vocab_size
    if vocab is not None:
        for name, ids in (("stop_token_ids", s.stop_token_ids), ("logit_bias", s.logit_bias)):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise InvalidArgument(f"sampling.{name}", f"token {bad} is outside the "
                                                          f"vocabulary of {vocab}")
    if request.WhichOneof("prompt") == "token_ids":
        ids = request.token_ids.ids
        prompt_len = len(ids)
        vocab = limits.vocab_size
        if vocab is not None and ids and max(ids) >= vocab:
            bad = next(t for t in ids if t >= vocab)  # only on the way out
            raise InvalidArgument("prompt.token_ids", f"token {bad} is outside the "
                                                      f"vocabulary of {vocab}")
    if context is None:
        return
    prompt_len = prompt_len or 0
    if prompt_len >= context:
        raise InvalidArgument("prompt", f"{prompt_len} tokens leave no room for a completion "
                                        f"in the model's context of {context}")
    for name in ("max_tokens", "min_tokens"):
        asked = getattr(s, name)
        if asked + prompt_len > context:
            counted = f" + {prompt_len} prompt tokens" if prompt_len else ""
            raise InvalidArgument(f"sampling.{name}", f"{asked}{counted} exceed the model's "
                                                      f"context of {context}")
