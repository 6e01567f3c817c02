"""`python -m services.demo_adapters check | train | compare`: the demo adapters' script.

- check: do the committed adapters match today's data, code and base model?
- train: train them (into the cache; `--commit` writes the repository's `trained/`).
- compare: the base model's and each adapter's greedy answers to the demo questions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from services.config import Settings

from .build import TRAINED, demo_adapters, mismatch, train_into
from .tenants import DEMO_QUESTIONS, DEMO_TENANTS, DemoTenant
from .training import TrainingStats

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Train, check and compare the demo tenants' LoRA adapters.")
console = Console()
BaseModel = Annotated[Path | None, typer.Option(
    "--base-model", help="A Hugging Face Llama directory (default: SmolLM2-135M-Instruct).")]


def _base(base_model: Path | None) -> tuple[Path, str]:
    from services.stack.models import ensure_smollm2
    from services.worker.engine import checkpoint_digest

    path = base_model or ensure_smollm2(Settings().cache_dir)
    return path, checkpoint_digest(path)


def _report(spec: DemoTenant, stats: TrainingStats) -> None:
    rec = stats.as_record()
    console.print(f"{spec.adapter_id}: {rec['examples']} examples, {len(stats.losses)} steps, "
                  f"loss {rec['first_loss']} -> {rec['final_loss']}, cpu {rec['cpu_s']} s, "
                  f"wall {rec['wall_s']} s (load average {rec['loadavg'][0]})")


def _progress(spec: DemoTenant) -> Callable[[int, float], None]:
    def show(step: int, loss: float) -> None:
        if step == 1 or step % 10 == 0 or step == spec.plan.steps:
            console.print(f"{spec.adapter_id}: step {step}/{spec.plan.steps} loss {loss:.3f}")
    return show


@app.command()
def check(base_model: BaseModel = None) -> None:
    """Say for each committed adapter whether it matches its inputs (exit 1 if any not)."""
    _, digest = _base(base_model)
    stale = 0
    for spec in DEMO_TENANTS:
        why = mismatch(spec, TRAINED / spec.adapter_id, digest)
        stale += why is not None
        console.print(f"{spec.adapter_id}: {why or 'matches its data, code and base model'}")
    raise typer.Exit(1 if stale else 0)


@app.command("train")
def train_command(
    base_model: BaseModel = None,
    commit: Annotated[bool, typer.Option(
        "--commit", help="Write the repository's trained/ files instead of the cache.")] = False,
    only: Annotated[list[str] | None, typer.Option(help="Adapter ids to train.")] = None,
    threads: Annotated[int, typer.Option(
        min=0, help="Torch threads (0: torch's default). On a busy machine 1 wastes no CPU "
                    "on threads spinning while they wait for each other.")] = 0,
) -> None:
    """Train the demo adapters (always; `check` says whether it is needed)."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    path, digest = _base(base_model)
    specs = [s for s in DEMO_TENANTS if not only or s.adapter_id in only]
    if only and len(specs) != len(set(only)):
        known = ", ".join(s.adapter_id for s in DEMO_TENANTS)
        raise typer.BadParameter(f"unknown adapter id in {only} (known: {known})")
    if commit:
        from .build import load_base

        base = load_base(path)
        for spec in specs:
            _report(spec, train_into(TRAINED / spec.adapter_id, spec, base, digest,
                                     _progress(spec)))
    else:
        for adapter in demo_adapters(path, Settings().cache_dir, base_digest=digest,
                                     retrain=True, tenants=specs, on_train=_report):
            console.print(f"{adapter.adapter_id}: {adapter.directory}")


@app.command()
def compare(
    base_model: BaseModel = None,
    max_tokens: Annotated[int, typer.Option(min=1, max=256)] = 48,
) -> None:
    """Ask the demo questions of the base model and each adapter (greedy, on the engine)."""
    from .answers import greedy_answers

    path, digest = _base(base_model)
    adapters = demo_adapters(path, Settings().cache_dir, base_digest=digest, on_train=_report)
    answers = greedy_answers(path, adapters, DEMO_QUESTIONS, max_tokens)
    for question in DEMO_QUESTIONS:
        table = Table(title=question, show_lines=True)
        table.add_column("model")
        table.add_column("answer")
        for a in answers:
            if a.question == question:
                table.add_row(a.model, a.text)
        console.print(table)


if __name__ == "__main__":
    app()
