"""`loraplane gate report ADAPTER VERSION`: a gate's outputs side by side, with verdicts.

Reads the registry's `GET /v1/adapters/{id}/versions/{v}/gate` (the fold of the log, so
the report shows exactly what decided the version's traffic) and renders, per case, the
base model's, the previous stable version's and the new version's greedy outputs next to
each check's verdict. Texts are the bounded excerpts the gate result carries; the digests
of the whole outputs are in the JSON (`--json`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

VERDICT_STYLE = {"pass": "green", "fail": "bold red", "skipped": "yellow"}
STATUS_STYLE = {"passed": "green", "failed": "bold red", "expired": "bold red",
                "pending": "yellow", "none": "yellow"}


def _output(outputs: list[dict[str, Any]], role: str) -> str:
    for output in outputs:
        if output["role"] == role:
            cut = "…" if output.get("truncated") else ""
            return f"{output['text']}{cut}\n[{output['tokens']} tok, {output['finish_reason']}]"
    return "—"


def _checks(checks: list[dict[str, Any]]) -> Text:
    text = Text()
    for index, check in enumerate(checks):
        if index:
            text.append("\n")
        text.append(f"{check['verdict'].upper():7} ", style=VERDICT_STYLE[check["verdict"]])
        text.append(check["kind"])
        if check.get("detail"):
            text.append(f": {check['detail']}", style="dim")
    return text


def summary_lines(gate: dict[str, Any]) -> Iterator[Text]:
    name = f"{gate['adapter_id']}@{gate['version']}"
    status = gate["status"]
    line = Text(f"quality gate of {name}: ")
    line.append(status.upper(), style=STATUS_STYLE.get(status, ""))
    if gate.get("gate_id"):
        line.append(f"  (gate {gate['gate_id']}, run by {gate.get('worker_id') or 'no worker'}"
                    f", compared with v{gate.get('baseline_version') or '-'})")
    yield line
    if gate.get("regression_set_sha256"):
        yield Text(f"regression set sha256:{gate['regression_set_sha256']} "
                   f"({gate['cases']} cases), requested {gate['requested_at']} by "
                   f"{gate['requested_by']}")
    if gate.get("completed_at"):
        yield Text(f"completed {gate['completed_at']} in {gate['duration_ms']:.0f} ms on base "
                   f"{gate['base_model_digest'][:16]}…, adapter {gate['adapter_sha256'][:16]}…")
    if gate.get("error"):
        yield Text(f"run error: {gate['error']}", style="red")
    for failure in gate.get("failures", []):
        yield Text(f"  ✗ {failure}", style="red")
    if gate.get("override"):
        o = gate["override"]
        yield Text(f"override by {o['by']} at {o['at']}: {o['reason']}", style="yellow")
    if gate["may_get_traffic"]:
        yield Text("traffic: allowed", style="green")
    else:
        yield Text(f"traffic: refused: {gate['refusal']}", style="red")


def gate_report(gate: dict[str, Any]) -> RenderableType:
    parts: list[RenderableType] = list(summary_lines(gate))
    results = gate.get("results") or []
    if results:
        previous = gate.get("baseline_version")
        table = Table(show_lines=True, expand=True)
        table.add_column("case", no_wrap=True)
        table.add_column("base model", ratio=2)
        table.add_column(f"previous v{previous}" if previous else "previous", ratio=2)
        table.add_column(f"new v{gate['version']}", ratio=2)
        table.add_column("checks", ratio=3)
        for case in results:
            mark = Text("✓ " if case["passed"] else "✗ ",
                        style="green" if case["passed"] else "bold red")
            mark.append(f"{case['case_id']}\nline {case['line']}")
            table.add_row(mark, _output(case["outputs"], "base"),
                          _output(case["outputs"], "previous"), _output(case["outputs"], "new"),
                          _checks(case["checks"]))
        parts.append(table)
    return Group(*parts)
