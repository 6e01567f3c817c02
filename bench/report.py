"""Render bench/BENCHMARKS.md from bench/results/*.json, re-running nothing.

    python bench/report.py [--results bench/results] [--out bench/BENCHMARKS.md]

Every figure is printed with the baseline measured in the same run, their ratio, the
settings, the load average it ran under and the command that produced it; each bench's
machine (CPU model, cores, memory, GPU) heads its section, because a figure measured on
another machine is another figure. A result written before benches recorded their run
(no `run` or `figures` key) is listed as such, not guessed at.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.record import RESULTS  # noqa: E402

ORDER = ("multi_lora", "peer", "profile", "int8", "families", "serve", "serve_tls",
         "structured", "merged", "hotswap", "router", "fanout", "registry", "release",
         "replay", "audit", "audit_inline", "audit_server", "chaos")
"""Sections in reading order: the model and engine first, the control plane after."""


def number(value: float | None) -> str:
    """Four significant digits below 10, so a value next to its target (1.104 against
    at most 1.10) does not print as the target itself beside a "not met"."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value).lower()
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.1f}"
    if magnitude >= 10:
        return f"{value:.2f}"
    return f"{value:.4g}"


def verdict(figure: dict[str, Any]) -> str:
    if figure.get("target") is None:
        return ""
    met = figure.get("meets_target")
    mark = "met" if met else ("**not met**" if met is False else "?")
    return f"{figure['target']}: {mark}"


def load(values: list[float] | None) -> str:
    return " / ".join(f"{x:.2f}" for x in values) if values else "n/a"


def machine_line(run: dict[str, Any]) -> str:
    m = run.get("machine") or {}
    cpu = m.get("cpu_model") or "unknown CPU"
    if m.get("cpu_family"):
        cpu += (f" (family {m['cpu_family']} model {m.get('cpu_model_number')}; "
                f"{' '.join(m.get('cpu_flags_of_note') or []) or 'no flags of note'})")
    parts = [cpu, f"{m.get('usable_cores') or m.get('cores')} usable of {m.get('cores')} cores"]
    if m.get("memory_gib"):
        parts.append(f"{m['memory_gib']} GiB")
    parts.append(f"GPU: {m['gpu']}" if m.get("gpu") else "no GPU")
    parts.append(f"Python {m.get('python')}")
    if m.get("torch"):
        parts.append(f"torch {m['torch']} ({m.get('torch_threads')} threads)")
    return ", ".join(parts)


def section(name: str, doc: dict[str, Any]) -> list[str]:
    run, figures = doc.get("run"), doc.get("figures")
    lines = [f"## {name}", ""]
    if not run or figures is None:
        lines += ["Written before benches recorded their run and figures; re-run "
                  f"`python bench/{name}.py` to get them here.", ""]
        return lines
    took = f", {run['seconds']} s" if run.get("seconds") is not None else ""
    lines += [f"- command: `{run['command']}` ({run['mode']} mode{took}, "
              f"started {run['started_at']})",
              f"- machine: {machine_line(run)}",
              f"- load average (1/5/15 min) at start {load(run.get('load_average_start'))}, "
              f"at end {load(run.get('load_average_end'))}"]
    earlier = doc.get("full_run")
    if earlier:  # a run of some sections: the others' figures are older
        lines.append(f"- the sections this command did not run keep their figures from "
                     f"earlier runs, the last full one `{earlier['command']}` (started "
                     f"{earlier['started_at']}, {machine_line(earlier)}); "
                     f"{len(doc.get('partial_runs', []))} partial runs since")
    lines.append("")
    lines += ["| figure | value | baseline (same run) | baseline value | ratio | target | "
              "load avg | settings |",
              "|---|---|---|---|---|---|---|---|"]
    for f in figures:
        better = "lower is better" if f.get("better") == "lower" else "higher is better"
        model = f" ({f['model']})" if f.get("model") and f["model"] not in f["name"] else ""
        base = f.get("baseline_value")
        base_text = "-" if base is None else f"{number(base)} {f['unit']}"
        ratio = "-" if f.get("ratio") is None else f"{number(f['ratio'])} ({better})"
        lines.append(
            f"| {f['name']}{model} | {number(f['value'])} {f['unit']} | "
            f"{f.get('baseline') or '-'} | "
            f"{base_text} | {ratio} | "
            f"{verdict(f) or '-'} | {load(f.get('load_average'))} | {f.get('settings') or '-'} |")
    if run.get("note"):
        lines.append(f"Note: {run['note']}.")
    lines.append("")
    if doc.get("scenarios"):
        lines += chaos_table(doc)
    for table in doc.get("tables") or ():
        lines += tabulate(table)
    return lines


def tabulate(table: dict[str, Any]) -> list[str]:
    """A bench's own table (`tables` in its result: title, header, rows), for what one
    figure per line does not show well: a ratio per workload and dtype, a profile."""
    header = table["header"]
    lines = [f"**{table['title']}**", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in table["rows"]]
    lines.append("")
    return lines


def chaos_table(doc: dict[str, Any]) -> list[str]:
    """bench/chaos.py: one row per fault scenario (operations attempted / acknowledged /
    failed / unknown, the fault, anomalies), then each anomaly the checker found."""
    lines = ["| scenario | seed | fault | writes (att/ok/fail/unk) | generations "
             "(att/ok/fail) | generate p99 before / during | takeover | anomalies |",
             "|---|---|---|---|---|---|---|---|"]
    found = []
    for s in doc["scenarios"]:
        counts = s["counts"]
        writes = [counts.get(k, {}) for k in ("publish", "switch", "purge")]
        w = [sum(c.get(x, 0) for c in writes) for x in ("attempted", "ok", "fail", "unknown")]
        g = counts.get("generate", {})
        gen = s["latency"]["generate"]
        takeover = s["notes"].get("takeover_s")
        lines.append(
            f"| {s['scenario']} | {s['seed']} | {s['description']} | {'/'.join(map(str, w))} | "
            f"{g.get('attempted', 0)}/{g.get('ok', 0)}/{g.get('fail', 0)} | "
            f"{number(gen['p99_before_ms'])} / {number(gen['p99_fault_ms'])} ms | "
            f"{'-' if takeover is None else f'{number(takeover)} s'} | {s['anomalies']} |")
        found += [f"- {s['scenario']}: {a['check']}: {a['detail']}"
                  for a in s["check"]["anomalies"]]
    start = doc.get("startup") or {}
    lines += ["", f"Harness start-up: {number(start.get('total'))} s ("
              + ", ".join(f"{k} {number(v)} s" for k, v in start.items() if k != "total")
              + "). Anomalies found: " + (str(len(found)) if found else "none") + ".", ""]
    return lines + found + ([""] if found else [])


def render(results: Path) -> str:
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted(results.glob("*.json")):
        try:
            docs[path.stem] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            docs[path.stem] = {"error": f"unreadable: {exc}"}
    names = [n for n in ORDER if n in docs] + sorted(set(docs) - set(ORDER))
    lines = ["# Benchmarks", "",
             "Generated by `python bench/report.py` from `bench/results/*.json` (`make "
             "bench` runs every bench, then this; `make bench-report` regenerates it alone). "
             "Each ratio is value / baseline, both measured in the same run on the same "
             "machine: the ratio is what carries over to another machine, the raw figures do "
             "not. Quick-mode figures use reduced sizes (said in each command and setting); "
             "run a bench without `--quick` for the full figures. How each bench measures: "
             "[METHOD.md](METHOD.md).", ""]
    lines += ["| bench | mode | figures | targets met | seconds |", "|---|---|---|---|---|"]
    for name in names:
        doc = docs[name]
        run, figures = doc.get("run") or {}, doc.get("figures")
        if figures is None:
            lines.append(f"| [{name}](#{name}) | - | not recorded | - | - |")
            continue
        targeted = [f for f in figures if f.get("target")]
        met = sum(1 for f in targeted if f.get("meets_target"))
        lines.append(f"| [{name}](#{name}) | {run.get('mode', '-')} | "
                     f"{len(figures)} | {met} of {len(targeted)} | {run.get('seconds') or '-'} |")
    lines.append("")
    for name in names:
        if "error" in docs[name]:
            lines += [f"## {name}", "", docs[name]["error"], ""]
        else:
            lines += section(name, docs[name])
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "BENCHMARKS.md")
    args = parser.parse_args()
    args.out.write_text(render(args.results))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
