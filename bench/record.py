"""What every benchmark writes next to its own figures: the run and its headline figures.

A result file `bench/results/NAME.json` keeps the bench's own keys and adds two:

- `run`: the command as typed, quick or full mode, when, how long, the load average at the
  start and the end, and the machine (CPU model, family/model/stepping and flags of note, cores,
  memory, GPU, Python, torch);
- `figures`: the headline figures, each with the baseline measured in the same run, the
  ratio, the target where there is one, the settings and the load average it ran under.

`bench/report.py` renders BENCHMARKS.md from these files alone, so the report can be
regenerated without re-running anything, and a figure never travels without the settings
and the machine it was measured on.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from services.hostcpu import cpu_flags, cpuinfo

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@dataclass
class Figure:
    """One headline figure. `ratio` is value / baseline value: both were measured in the
    same run, on the same machine, so the ratio is what carries over to another machine."""

    name: str
    value: float | None
    unit: str
    baseline: str | None = None
    """What the baseline is (e.g. "the bare engine on the same requests")."""
    baseline_value: float | None = None
    better: Literal["higher", "lower"] = "higher"
    target: str | None = None
    """The goal as written in its issue, e.g. "ratio >= 0.90" or "p99 < 250 ms"."""
    meets_target: bool | None = None
    settings: str = ""
    load_average: list[float] | None = None
    model: str | None = None
    """The base model the figure was measured on, where one is involved."""
    ratio: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.value is not None and self.baseline_value:
            self.ratio = round(self.value / self.baseline_value, 4)
        if self.load_average is None:
            self.load_average = load_average()


def cpu_model() -> str:
    return cpuinfo().get("model name") or platform.processor() or platform.machine()


FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""CPU flags that change what a figure means: hosts of one machine kind differ in them
(with and without AVX512-BF16, for one), and the bf16 serving default follows them."""


def cpu_identity() -> dict[str, Any]:
    """Family, model and stepping, and the flags of note: "AMD EPYC" alone names several
    generations, whose figures differ by tens of percent."""
    info = cpuinfo()
    flags = cpu_flags()
    return {"cpu_family": info.get("cpu family"), "cpu_model_number": info.get("model"),
            "cpu_stepping": info.get("stepping"),
            "cpu_flags_of_note": [f for f in FLAGS_OF_NOTE if f in flags]}


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    """This machine, as a reader of a figure needs it: what ran it and how big it is."""
    info: dict[str, Any] = {
        "cpu_model": cpu_model(), **cpu_identity(), "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "memory_gib": memory_gib(), "platform": platform.platform(),
        "python": platform.python_version(), "gpu": None,
    }
    torch = sys.modules.get("torch")  # only when the bench uses it: never imported here
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    return info


TIMING_ENV = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Environment variables that change what a CPU bench measures (whether torch's idle
threads spin, how many there are): the recorded command starts with those that are set,
so that running it again measures the same thing."""


class BenchRun:
    """Started when a bench starts; `save` writes the result with its run and figures."""

    def __init__(self, name: str, *, quick: bool, argv: Sequence[str] | None = None) -> None:
        self.name = name
        self.quick = quick
        args = list(sys.argv[1:] if argv is None else argv)
        env = [f"{key}={os.environ[key]}" for key in TIMING_ENV if key in os.environ]
        script = Path(sys.argv[0])  # a bench may write several results (serve.py --tls)
        where = (f"bench/{script.name}" if script.suffix == ".py" and script.parent.name ==
                 "bench" else f"bench/{name}.py")
        self.command = " ".join([*env, "python", where, *args])
        self.started = datetime.now(UTC)
        self._t0 = time.perf_counter()
        self.load_at_start = load_average()

    @property
    def mode(self) -> str:
        return "quick" if self.quick else "full"

    def header(self) -> dict[str, Any]:
        return {"bench": self.name, "command": self.command, "mode": self.mode,
                "started_at": self.started.isoformat(timespec="seconds"),
                "seconds": round(time.perf_counter() - self._t0, 1),
                "load_average_start": self.load_at_start,
                "load_average_end": load_average(), "machine": machine()}

    def save(self, out: str | Path, result: dict[str, Any], figures: Sequence[Figure],
             *, echo: bool = True) -> dict[str, Any]:
        document = {**result, "run": self.header(), "figures": [asdict(f) for f in figures]}
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(document, indent=2, default=str) + "\n")
        tmp.replace(path)
        if echo:
            for figure in figures:
                ratio = f"  ratio {figure.ratio:.3g}" if figure.ratio is not None else ""
                print(f"[{self.name}] {figure.name}: {figure.value} {figure.unit}{ratio}",
                      flush=True)
            print(f"[{self.name}] wrote {path}", flush=True)
        return document
