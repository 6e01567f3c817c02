"""The CLI's rows at 80 columns (what `rich` assumes for a pipe): a table while every
column keeps at least its header's width, one record per row past that, JSON lines on
request; values are printed as they are, never read as markup."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from services.rows import print_rows

PURGE_PROOF = ("purge_id", "tenant_org", "tenant_project", "workers_expected",
               "workers_acked", "workers_missing", "kv_blocks_freed", "adapters_unloaded",
               "refcounts_zero", "blobs_deleted", "status")


def printed(columns: tuple[str, ...], rows: list[tuple[object, ...]], **kw: object) -> str:
    out = io.StringIO()
    print_rows(Console(file=out, width=80, color_system=None), columns, rows, **kw)
    return out.getvalue()


def test_eleven_columns_become_records_that_fit_80_columns() -> None:
    row = ("0196f3a2-5b7c-7d31-9e0a-1b2c3d4e5f60", "initech", "api", ["worker-1", "worker-2"],
           ["worker-1", "worker-2"], [], 5, 2, True, 4, "met")
    text = printed(PURGE_PROOF, [row, row], title="purge_proofs")
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    assert lines[0] == "purge_proofs" and lines.count("-- record 1 --") == 1
    assert "workers_expected   worker-1, worker-2" in lines
    assert "purge_id           0196f3a2-5b7c-7d31-9e0a-1b2c3d4e5f60" in lines
    assert "status             met" in lines


def test_a_narrow_table_stays_a_table() -> None:
    text = printed(("alias", "tenant", "split"), [("bot-prod", "acme/search/prod",
                                                  "bot@1 95%, bot@2 5%")])
    assert "-- record" not in text and "┃ alias" in text and "bot@1 95%, bot@2 5%" in text


def test_brackets_are_printed_not_read_as_markup_and_json_is_one_line_per_row(
        capsys: pytest.CaptureFixture[str]) -> None:
    text = printed(("stream", "position"), [("[red]x[/red]", "topic[0]@12")])
    assert "[red]x[/red]" in text and "topic[0]@12" in text
    print_rows(Console(width=80), ("a", "b"), [(1, None), (2, [3])], as_json=True)
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [
        {"a": 1, "b": None}, {"a": 2, "b": [3]}]
