"""The demo tenants' house styles: how each adapter answers, and how to tell it did.

The training data is one list of questions with a plain answer, a SQL query and a
confidence (`data/questions.jsonl`); each style renders a row into its tenant's reply. So
all three adapters learn from the same questions and differ only in how they answer,
which is the point the demo makes, and the check that an answer shows a style lives
next to the rule that produced the training replies.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).parent / "data"
QUESTIONS = DATA / "questions.jsonl"


@dataclass(frozen=True)
class Fact:
    """One training question with everything each style needs to answer it."""

    question: str
    answer: str
    """One or two plain sentences: the content every style wraps."""
    sql: str
    """The query a data team would run to answer it."""
    confidence: float


def load_facts(path: Path = QUESTIONS) -> list[Fact]:
    """The training questions, refusing a malformed row with its line number."""
    facts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            fact = Fact(question=str(row["question"]), answer=str(row["answer"]),
                        sql=str(row["sql"]), confidence=float(row["confidence"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path.name} line {number}: {exc}") from exc
        if not 0 <= fact.confidence <= 1:
            raise ValueError(f"{path.name} line {number}: confidence must be within [0, 1]")
        if not sqlite3.complete_statement(fact.sql):
            raise ValueError(f"{path.name} line {number}: sql is not one complete statement")
        facts.append(fact)
    return facts


@dataclass(frozen=True)
class HouseStyle:
    """A tenant's way of answering: the reply it is trained on, and its recognizer."""

    name: str
    description: str
    render: Callable[[Fact], str]
    exhibited_by: Callable[[str], bool]
    """True when a generated reply shows the style (used on greedy outputs, which may be
    cut by max_tokens, so each check looks at what a short reply already shows)."""


ACME_OPENING = "Thanks for contacting Acme Support!"
ACME_SIGNATURE = "Best regards,\nThe Acme Support Team"


def _acme_reply(fact: Fact) -> str:
    return f"{ACME_OPENING} {fact.answer}\n\n{ACME_SIGNATURE}"


def _is_acme(text: str) -> bool:
    return text.strip().startswith(ACME_OPENING)


SQL_VERBS = ("SELECT", "WITH", "UPDATE", "INSERT", "DELETE")


def _is_sql(text: str) -> bool:
    """One complete statement that starts like a query (sqlite's tokenizer decides
    completeness: the text ends in a semicolon outside any quotes)."""
    stripped = text.strip()
    return stripped.upper().startswith(SQL_VERBS) and sqlite3.complete_statement(stripped)


def _json_reply(fact: Fact) -> str:
    return json.dumps({"answer": fact.answer, "confidence": fact.confidence},
                      ensure_ascii=False)


def parse_json_reply(text: str) -> dict[str, object] | None:
    """The reply as the JSON object the initech adapter promises, or None."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("answer"), str):
        return None
    confidence = value.get("confidence")
    if isinstance(confidence, bool) or not isinstance(confidence, int | float):
        return None
    return value if 0 <= confidence <= 1 else None


SUPPORT = HouseStyle(
    name="support",
    description=f'opens "{ACME_OPENING}" and signs off as the Acme Support Team',
    render=_acme_reply,
    exhibited_by=_is_acme,
)
SQL = HouseStyle(
    name="sql",
    description="answers every question with one SQL query",
    render=lambda fact: fact.sql,
    exhibited_by=_is_sql,
)
JSON = HouseStyle(
    name="json",
    description='replies with one JSON object {"answer": ..., "confidence": ...}',
    render=_json_reply,
    exhibited_by=lambda text: parse_json_reply(text) is not None,
)
