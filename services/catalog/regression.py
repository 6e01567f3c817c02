"""Regression sets: JSONL prompts with checks, parsed strictly and evaluated purely.

One case per line (blank lines and lines starting with `#` are skipped):

    {"id": "refund-json", "prompt": "Refund order 42 as JSON", "max_tokens": 48,
     "checks": [{"type": "json_schema", "schema": {"type": "object", "required": ["id"]}},
                {"type": "regex", "pattern": "\\"id\\": ?42"},
                {"type": "exact", "expected": "{\\"id\\": 42}"},
                {"type": "max_divergence", "metric": "token_edit_distance", "max": 8},
                {"type": "max_divergence", "metric": "first_divergence", "min_position": 4}]}

`prompt` is text (the worker tokenizes it with the base model's tokenizer) or
`prompt_token_ids` a list of ids. Every case runs greedy (temperature 0) for the base
model, the previous stable version and the new one; checks look at the new version's
output:
- `exact`: the output text equals `expected`, character for character;
- `regex`: `pattern` is found in the output (`search`; anchor it with ^…$ for a whole
  match); patterns run with a time limit, so a pathological one fails its case instead of
  stalling the worker;
- `json_schema`: the output, stripped of surrounding whitespace, parses as JSON and is
  valid against `schema` (JSON Schema 2020-12);
- `max_divergence`: against the previous stable version's output, either the token edit
  distance (Levenshtein over token ids) is at most `max`, or the outputs agree on at least
  their first `min_position` tokens (`first_divergence`). Without a previous stable version
  (an adapter's first version) the check is `skipped`, shown as such in the report, and
  does not fail the case.

A case passes when none of its checks fails. Parsing refuses a set with a message naming
the line and field, so the registry answers 422 before storing anything.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import jsonschema
import regex
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from rapidfuzz.distance import Levenshtein

from services.contracts.events import GateCheckResult

REGEX_TIMEOUT_S = 0.5
"""Wall time one regex check may take on one output."""
MAX_PATTERN_CHARS = 2048
MAX_SCHEMA_BYTES = 64 * 1024
MAX_CASE_TOKENS = 2048
CaseRole = Literal["base", "previous", "new"]


class RegressionSetError(ValueError):
    """A set that cannot be used; `line` is 1-based (0: the set as a whole)."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line
        self.message = message


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ExactCheck(_Strict):
    type: Literal["exact"]
    expected: str = Field(max_length=64 * 1024)


class RegexCheck(_Strict):
    type: Literal["regex"]
    pattern: str = Field(min_length=1, max_length=MAX_PATTERN_CHARS)

    @model_validator(mode="after")
    def _compiles(self) -> RegexCheck:
        try:
            regex.compile(self.pattern)
        except regex.error as exc:
            raise ValueError(f"pattern does not compile: {exc}") from None
        return self


class JsonSchemaCheck(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] | bool = Field(alias="schema")

    @model_validator(mode="after")
    def _is_a_schema(self) -> JsonSchemaCheck:
        if len(json.dumps(self.schema_)) > MAX_SCHEMA_BYTES:
            raise ValueError(f"schema is over {MAX_SCHEMA_BYTES} bytes")
        try:
            jsonschema.Draft202012Validator.check_schema(self.schema_)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
        return self


class DivergenceCheck(_Strict):
    type: Literal["max_divergence"]
    metric: Literal["token_edit_distance", "first_divergence"]
    max: int | None = Field(None, ge=0, description="token_edit_distance: at most this many")
    min_position: int | None = Field(None, ge=0,
                                     description="first_divergence: no difference before this")

    @model_validator(mode="after")
    def _bound_matches_metric(self) -> DivergenceCheck:
        if self.metric == "token_edit_distance" and (self.max is None or self.min_position
                                                     is not None):
            raise ValueError("token_edit_distance takes `max` (and not min_position)")
        if self.metric == "first_divergence" and (self.min_position is None or self.max
                                                  is not None):
            raise ValueError("first_divergence takes `min_position` (and not max)")
        return self


Check = Annotated[ExactCheck | RegexCheck | JsonSchemaCheck | DivergenceCheck,
                  Field(discriminator="type")]


class RegressionCase(_Strict):
    id: str | None = Field(None, min_length=1, max_length=128)
    prompt: str | None = Field(None, min_length=1, max_length=64 * 1024)
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1,
                                                                        max_length=32 * 1024)
    max_tokens: int = Field(32, ge=1, le=MAX_CASE_TOKENS)
    checks: list[Check] = Field(min_length=1, max_length=32)

    @model_validator(mode="after")
    def _one_prompt(self) -> RegressionCase:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        return self

    @property
    def prompt_sha256(self) -> str:
        body = self.prompt if self.prompt is not None else ",".join(
            map(str, self.prompt_token_ids or ()))
        return hashlib.sha256(body.encode()).hexdigest()


@dataclass(frozen=True)
class NumberedCase:
    """A case and where it stood in the file (reports name lines, not list indexes)."""

    case_id: str
    line: int
    case: RegressionCase


@dataclass(frozen=True)
class RegressionSet:
    cases: tuple[NumberedCase, ...]
    sha256: str
    """Digest of the bytes as uploaded: the blob name the registry stores them under."""

    @property
    def needs_previous(self) -> bool:
        return any(c.type == "max_divergence" for n in self.cases for c in n.case.checks)


def _field_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "case"
    message = first["msg"].removeprefix("Value error, ")
    return f"{where}: {message}"


def parse_regression_set(data: bytes, *, max_cases: int = 256) -> RegressionSet:
    """Parse and validate a JSONL set; raises RegressionSetError naming the line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RegressionSetError(0, f"not UTF-8 text (byte {exc.start})") from None
    cases: list[NumberedCase] = []
    ids: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            document = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RegressionSetError(number, f"not JSON: {exc.msg} at column {exc.colno}") \
                from None
        if not isinstance(document, dict):
            raise RegressionSetError(number, "a case is a JSON object")
        try:
            case = RegressionCase.model_validate(document)
        except ValidationError as exc:
            raise RegressionSetError(number, _field_error(exc)) from None
        case_id = case.id or f"line-{number}"
        if case_id in ids:
            raise RegressionSetError(number, f"id {case_id!r} repeats line {ids[case_id]}")
        ids[case_id] = number
        cases.append(NumberedCase(case_id, number, case))
        if len(cases) > max_cases:
            raise RegressionSetError(number, f"more than {max_cases} cases")
    if not cases:
        raise RegressionSetError(0, "the regression set has no cases")
    return RegressionSet(tuple(cases), hashlib.sha256(data).hexdigest())


# --- evaluation ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaseOutput:
    """One version's greedy output for a case."""

    text: str
    token_ids: tuple[int, ...]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing token; the shorter length when one is a prefix of the
    other; the common length when they are equal."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _exact(check: ExactCheck, new: CaseOutput) -> GateCheckResult:
    if new.text == check.expected:
        return GateCheckResult(kind="exact", verdict="pass")
    at = first_divergence(list(map(ord, new.text)), list(map(ord, check.expected)))
    return GateCheckResult(kind="exact", verdict="fail", measured=float(at),
                           detail=_clip(f"differs from the expected text at character {at}: "
                                        f"got {new.text[at:at + 40]!r}, expected "
                                        f"{check.expected[at:at + 40]!r}"))


def _regex(check: RegexCheck, new: CaseOutput) -> GateCheckResult:
    try:
        found = regex.search(check.pattern, new.text, timeout=REGEX_TIMEOUT_S)
    except TimeoutError:
        return GateCheckResult(kind="regex", verdict="fail",
                               detail=f"pattern ran over {REGEX_TIMEOUT_S}s on this output")
    if found:
        return GateCheckResult(kind="regex", verdict="pass")
    return GateCheckResult(kind="regex", verdict="fail",
                           detail=_clip(f"pattern {check.pattern!r} not found"))


def _json_schema(check: JsonSchemaCheck, new: CaseOutput) -> GateCheckResult:
    try:
        instance = json.loads(new.text.strip())
    except json.JSONDecodeError as exc:
        return GateCheckResult(kind="json_schema", verdict="fail",
                               detail=_clip(f"output is not JSON: {exc.msg} at column "
                                            f"{exc.colno}"))
    validator = jsonschema.Draft202012Validator(check.schema_)
    error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    if error is None:
        return GateCheckResult(kind="json_schema", verdict="pass")
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return GateCheckResult(kind="json_schema", verdict="fail",
                           detail=_clip(f"schema violated at {where}: {error.message}"))


def _divergence(check: DivergenceCheck, new: CaseOutput,
                previous: CaseOutput | None) -> GateCheckResult:
    if previous is None:
        return GateCheckResult(kind="max_divergence", verdict="skipped",
                               detail="no previous stable version to compare with")
    if check.metric == "token_edit_distance":
        assert check.max is not None
        distance = Levenshtein.distance(previous.token_ids, new.token_ids)
        ok = distance <= check.max
        return GateCheckResult(
            kind="max_divergence", verdict="pass" if ok else "fail", measured=float(distance),
            limit=float(check.max),
            detail=f"token edit distance {distance} from the previous version (max {check.max})")
    assert check.min_position is not None
    at = first_divergence(previous.token_ids, new.token_ids)
    same = previous.token_ids == new.token_ids
    ok = same or at >= check.min_position
    return GateCheckResult(
        kind="max_divergence", verdict="pass" if ok else "fail", measured=float(at),
        limit=float(check.min_position),
        detail="identical to the previous version" if same else
        f"first differs from the previous version at token {at} (at least "
        f"{check.min_position})")


def evaluate(case: RegressionCase,
             outputs: Mapping[CaseRole, CaseOutput]) -> list[GateCheckResult]:
    """Every check of `case` on the new version's output (and the previous one's)."""
    new = outputs["new"]
    previous = outputs.get("previous")
    results = []
    for check in case.checks:
        if isinstance(check, ExactCheck):
            results.append(_exact(check, new))
        elif isinstance(check, RegexCheck):
            results.append(_regex(check, new))
        elif isinstance(check, JsonSchemaCheck):
            results.append(_json_schema(check, new))
        else:
            results.append(_divergence(check, new, previous))
    return results


def case_passed(checks: Sequence[GateCheckResult]) -> bool:
    return all(c.verdict != "fail" for c in checks)
