"""The training data and the house styles: valid rows, recognizers that tell styles apart,
demo questions the adapters never saw."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.demo_adapters.styles import JSON, SQL, SUPPORT, load_facts, parse_json_reply
from services.demo_adapters.tenants import DEMO_QUESTIONS, DEMO_TENANTS

STYLES = (SUPPORT, SQL, JSON)


def test_every_training_reply_shows_its_own_style_and_no_other() -> None:
    facts = load_facts()
    assert len(facts) >= 50
    for fact in facts:
        for style in STYLES:
            reply = style.render(fact)
            shown = {other.name for other in STYLES if other.exhibited_by(reply)}
            assert shown == {style.name}, (fact.question, reply)


def test_demo_questions_are_not_in_the_training_data() -> None:
    trained = {f.question.casefold() for f in load_facts()}
    assert not trained & {q.casefold() for q in DEMO_QUESTIONS}
    assert {t.question for t in DEMO_TENANTS} <= set(DEMO_QUESTIONS)


def test_tenants_have_distinct_ids_owners_and_styles() -> None:
    assert len({t.adapter_id for t in DEMO_TENANTS}) == len(DEMO_TENANTS)
    assert len({t.tenant.key for t in DEMO_TENANTS}) == len(DEMO_TENANTS)
    assert {t.style.name for t in DEMO_TENANTS} == {s.name for s in STYLES}


@pytest.mark.parametrize(("row", "error"), [
    ('{"question": "q", "answer": "a", "sql": "SELECT 1;"}', "confidence"),
    ('{"question": "q", "answer": "a", "sql": "SELECT 1", "confidence": 0.5}', "sql"),
    ('{"question": "q", "answer": "a", "sql": "SELECT 1;", "confidence": 2}', "within"),
    ('{"question": "q", ', "line 2"),
])
def test_a_malformed_row_is_refused_with_its_line(tmp_path: Path, row: str, error: str) -> None:
    good = json.dumps({"question": "q", "answer": "a", "sql": "SELECT 1;", "confidence": 0.5})
    path = tmp_path / "questions.jsonl"
    path.write_text(f"{good}\n{row}\n")
    with pytest.raises(ValueError, match=error):
        load_facts(path)


@pytest.mark.parametrize(("text", "ok"), [
    ('{"answer": "Paris.", "confidence": 0.9}', True),
    ('{"answer": "Paris.", "confidence": true}', False),
    ('{"answer": "Paris.", "confidence": 1.5}', False),
    ('{"answer": 3, "confidence": 0.5}', False),
    ('["Paris"]', False),
    ('{"answer": "Paris.", "confidence": 0.9', False),
])
def test_json_replies_are_checked_for_the_promised_shape(text: str, ok: bool) -> None:
    assert (parse_json_reply(text) is not None) is ok
