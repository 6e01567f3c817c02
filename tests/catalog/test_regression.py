"""Regression sets: strict parsing with the line named, and every check on every outcome."""

from __future__ import annotations

import json

import pytest

from services.catalog.regression import (
    CaseOutput,
    RegressionSetError,
    case_passed,
    evaluate,
    first_divergence,
    parse_regression_set,
)


def jsonl(*cases: object) -> bytes:
    return "\n".join(json.dumps(c) for c in cases).encode()


def case(*checks: dict[str, object], **fields: object) -> dict[str, object]:
    return {"prompt": "hello", "checks": list(checks), **fields}


EXACT = {"type": "exact", "expected": "ok"}


def test_parses_cases_with_ids_lines_and_digest() -> None:
    data = b"# comment\n\n" + jsonl(case(EXACT, id="a"), case(EXACT, max_tokens=4))
    parsed = parse_regression_set(data)
    assert [(c.case_id, c.line) for c in parsed.cases] == [("a", 3), ("line-4", 4)]
    assert parsed.cases[1].case.max_tokens == 4
    assert len(parsed.sha256) == 64
    assert not parsed.needs_previous


@pytest.mark.parametrize(("data", "line", "message"), [
    (b"", 0, "no cases"),
    (b"\xff\xfe", 0, "not UTF-8"),
    (b'{"prompt": "x", "checks": [' + b"\n", 1, "not JSON"),
    (b"[1, 2]", 1, "a case is a JSON object"),
    (jsonl(case(EXACT), {"checks": [EXACT]}), 2, "exactly one of prompt"),
    (jsonl({"prompt": "x", "prompt_token_ids": [1], "checks": [EXACT]}), 1, "exactly one"),
    (jsonl(case()), 1, "checks"),
    (jsonl(case({"type": "fuzzy"})), 1, "checks.0"),
    (jsonl(case({"type": "regex", "pattern": "("})), 1, "does not compile"),
    (jsonl(case({"type": "json_schema", "schema": {"type": "nonsense"}})), 1,
     "not a valid JSON Schema"),
    (jsonl(case({"type": "max_divergence", "metric": "token_edit_distance"})), 1, "takes `max`"),
    (jsonl(case({"type": "max_divergence", "metric": "first_divergence", "max": 2})), 1,
     "min_position"),
    (jsonl(case(EXACT, max_tokens=0)), 1, "max_tokens"),
    (jsonl(case(EXACT, id="a"), case(EXACT, id="a")), 2, "repeats line 1"),
    (jsonl(case(EXACT, surprise=True)), 1, "surprise"),
])
def test_refuses_a_bad_set_naming_the_line(data: bytes, line: int, message: str) -> None:
    with pytest.raises(RegressionSetError) as raised:
        parse_regression_set(data)
    assert raised.value.line == line
    assert message in str(raised.value)


def test_refuses_more_cases_than_allowed() -> None:
    with pytest.raises(RegressionSetError, match="more than 2 cases"):
        parse_regression_set(jsonl(*[case(EXACT)] * 3), max_cases=2)


def run(check: dict[str, object], new: str = "", new_ids: tuple[int, ...] = (),
        previous: tuple[int, ...] | None = None) -> tuple[str, float | None, str]:
    parsed = parse_regression_set(jsonl(case(check)))
    outputs = {"new": CaseOutput(new, new_ids)}
    if previous is not None:
        outputs["previous"] = CaseOutput("", previous)
    [result] = evaluate(parsed.cases[0].case, outputs)  # type: ignore[arg-type]
    return result.verdict, result.measured, result.detail


def test_exact_passes_only_on_identical_text() -> None:
    assert run(EXACT, "ok")[0] == "pass"
    verdict, at, detail = run(EXACT, "ok ")
    assert (verdict, at) == ("fail", 2.0)
    assert "character 2" in detail
    assert run(EXACT, "OK")[0] == "fail"


def test_regex_searches_and_anchors_when_asked() -> None:
    assert run({"type": "regex", "pattern": r"\d+"}, "order 42")[0] == "pass"
    assert run({"type": "regex", "pattern": r"^\d+$"}, "order 42")[0] == "fail"
    assert run({"type": "regex", "pattern": r"^\d+$"}, "42")[0] == "pass"


def test_a_pathological_regex_fails_its_case_instead_of_hanging() -> None:
    verdict, _, detail = run({"type": "regex", "pattern": r"^(a|aa)+$"}, "a" * 60 + "!")
    assert verdict == "fail"
    assert "ran over" in detail


SCHEMA = {"type": "object", "required": ["id"], "properties": {"id": {"type": "integer"}}}


def test_json_schema_needs_json_and_a_valid_instance() -> None:
    check = {"type": "json_schema", "schema": SCHEMA}
    assert run(check, ' {"id": 4} \n')[0] == "pass"
    verdict, _, detail = run(check, '{"id": "four"}')
    assert verdict == "fail" and "schema violated at id" in detail
    verdict, _, detail = run(check, "{}")
    assert verdict == "fail" and "'id' is a required property" in detail
    verdict, _, detail = run(check, "id: 4")
    assert verdict == "fail" and "not JSON" in detail


def test_token_edit_distance_against_the_previous_version() -> None:
    check = {"type": "max_divergence", "metric": "token_edit_distance", "max": 1}
    assert run(check, new_ids=(1, 2, 3), previous=(1, 2, 3))[:2] == ("pass", 0.0)
    assert run(check, new_ids=(1, 2, 4), previous=(1, 2, 3))[:2] == ("pass", 1.0)
    assert run(check, new_ids=(1, 5, 4), previous=(1, 2, 3))[:2] == ("fail", 2.0)
    assert run(check, new_ids=(1, 2, 3))[0] == "skipped"  # an adapter's first version


def test_first_divergence_position() -> None:
    check = {"type": "max_divergence", "metric": "first_divergence", "min_position": 2}
    assert run(check, new_ids=(1, 2, 9), previous=(1, 2, 3))[:2] == ("pass", 2.0)
    assert run(check, new_ids=(1, 9, 3), previous=(1, 2, 3))[:2] == ("fail", 1.0)
    assert run(check, new_ids=(1,), previous=(1,))[0] == "pass"  # identical, if short
    assert first_divergence((1, 2), (1, 2, 3)) == 2
    assert first_divergence((), (1,)) == 0


def test_a_case_passes_when_no_check_fails() -> None:
    parsed = parse_regression_set(jsonl(case(
        EXACT, {"type": "max_divergence", "metric": "first_divergence", "min_position": 1})))
    checks = evaluate(parsed.cases[0].case, {"new": CaseOutput("ok", (1,))})
    assert [c.verdict for c in checks] == ["pass", "skipped"]
    assert case_passed(checks)
    checks = evaluate(parsed.cases[0].case, {"new": CaseOutput("no", (1,))})
    assert not case_passed(checks)
