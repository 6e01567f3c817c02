"""Chat prompts: role/content messages rendered with the base model's own chat template.

Rendered the way transformers' `apply_chat_template(messages, add_generation_prompt=True)`
does it, so the same conversation gives the same tokens here as in the model's reference
stack: the template from the model directory (`chat_template` in `tokenizer_config.json`,
or `chat_template.jinja`), a sandboxed Jinja environment with `trim_blocks` and
`lstrip_blocks` and the loop-controls extension, the `raise_exception` and `strftime_now`
globals and a `tojson` filter that does not escape HTML; the special tokens
(`bos_token`, `eos_token`, …) as template variables; then tokenised without adding
special tokens (the template writes them). A role is one of
`services.contracts.generate.ROLES` (developer is system) and nothing else: templates
write the role into their control text (`<|im_start|>{{ role }}`), so a free-text role
could forge the template's special tokens.

Tools (OpenAI's function list) are passed to the template as `tools`, assistant messages
carry their `tool_calls` (arguments parsed into objects, as transformers' templates
expect) and tool messages their `tool_call_id`. The template tells the tool-call format
the model was taught (`tool_format`): Hermes / Qwen `<tool_call>` JSON, or Llama 3 JSON.
A template that never mentions tools gets the Hermes instructions in its system message,
so the model is told about the tools either way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from services.contracts.generate import InvalidArgument, canonical_role

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


HERMES_TOOLS_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions "
    "are described within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with the function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template refused the conversation."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") \
                from exc
        self.special_tokens = special_tokens
        self._errors = jinja2.exceptions.TemplateError
        self.source = source
        self.renders_tools = "tools" in source
        self.tool_format = ("llama3_json" if "<|python_tag|>" in source or "ipython" in source
                            else "hermes")
        """How this model writes tool calls (`services.worker.tool_calls` parses it)."""

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The directory's template, or None when the model has none."""
        root = Path(model_dir)
        config: dict[str, Any] = {}
        config_file = root / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text())
        specials: dict[str, str] = {}
        legacy = root / "special_tokens_map.json"
        sources = [json.loads(legacy.read_text())] if legacy.is_file() else []
        for source in [*sources, config]:
            for name in SPECIAL_TOKENS:
                text = _token_text(source.get(name))
                if text is not None:
                    specials[name] = text
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the "default" one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str):
            jinja_file = root / "chat_template.jinja"
            template = jinja_file.read_text() if jinja_file.is_file() else None
        if not template:
            return None
        return cls(template, specials)

    def render(self, messages: Sequence[dict[str, Any]],
               tools: Sequence[dict[str, Any]] | None = None) -> str:
        try:
            messages = [{**m, "role": canonical_role(m["role"], f"messages[{i}].role")}
                        for i, m in enumerate(messages)]
        except InvalidArgument as exc:
            raise ChatTemplateError(str(exc)) from None
        if tools and not self.renders_tools:
            listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
            prompt = HERMES_TOOLS_PROMPT.format(tools=listed)
            if messages and messages[0]["role"] == "system":
                messages[0] = {**messages[0],
                               "content": f"{messages[0].get('content') or ''}\n\n{prompt}"}
            else:
                messages.insert(0, {"role": "system", "content": prompt})
            tools = None
        try:
            return self._template.render(messages=messages, tools=list(tools) if tools else None,
                                         documents=None, add_generation_prompt=True,
                                         **self.special_tokens)
        except self._errors as exc:
            raise ChatTemplateError(f"the chat template refused these messages: {exc}") \
                from exc
