"""`flowctl train` and `flowctl resume`: progress on stderr, a JSON summary on stdout with --json."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn


class _Display:
    def __init__(self, console: Console, quiet: bool) -> None:
        self.console = console
        self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                 TextColumn("loss {task.fields[loss]:.4f}"),
                                 TextColumn("{task.fields[eps]:,.0f} ex/s"), TimeRemainingColumn(),
                                 console=console, transient=True, disable=quiet)
        self.task: Any = None

    def __enter__(self) -> "_Display":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def start(self, done: int, total: int) -> None:
        self.task = self.progress.add_task("train", total=total, completed=done, loss=float("nan"), eps=0.0)

    def step(self, e: Any) -> None:
        self.progress.update(self.task, completed=e.step, loss=e.loss, eps=e.examples_per_s)
        log_every = getattr(self, "log_every", 0)
        if log_every and e.step % log_every == 0:
            self.progress.console.print(f"step {e.step:>7}  loss {e.loss:.4f}  lr {e.lr:.4g}  "
                                        f"{e.examples_per_s:,.0f} examples/s")


def _run(trainer: Any, console: Console, as_json: bool, restored: str | None) -> None:
    from flowctl.training.trainer import EXIT_INTERRUPTED

    display = _Display(console, quiet=False)
    display.log_every = trainer.spec.training.log_every_steps  # type: ignore[attr-defined]
    trainer.on_step = display.step
    with display:
        display.start(trainer.step, trainer.total_steps)
        summary = trainer.train()
    summary.restored_from = restored
    rate = f", {summary.mean_examples_per_s:,.0f} examples/s" if summary.steps_run else ""
    if summary.staleness is not None:
        console.print(f"staleness: mean {summary.staleness['mean']:.2f}, max {summary.staleness['max']} "
                      f"updates (updates applied by other replicas between a replica's read and its update)")
    if summary.interrupted:
        console.print(f"interrupted at step {summary.last_step}: checkpoint {summary.checkpoint}; "
                      f"continue with: flowctl resume {summary.run_dir}")
    else:
        console.print(f"trained steps {summary.first_step + 1}-{summary.last_step} in {summary.seconds:.1f} s"
                      f"{rate}; final loss {summary.final_loss:.4f}; checkpoint {summary.checkpoint}")
    if as_json:
        click.echo(json.dumps(summary.to_dict()))
    if summary.interrupted:
        sys.exit(summary.exit_code or EXIT_INTERRUPTED)  # 130 for Ctrl-C, 143 for SIGTERM


@click.command()
@click.argument("spec", required=False)
@click.option("--steps", type=int, help="Train this many steps in all (default: training.steps).")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the run lives (default: runs/<spec name>, or runs/<spec name>-N if taken).")
@click.option("--data", "data", help="Train on this file: a text corpus, or .npy/.npz arrays.")
@click.option("--histograms", type=int, default=0, help="Write weight histograms every N steps.")
@click.option("--prefetch", type=int, default=2, show_default=True,
              help="Batches read ahead on a background thread while the model computes (0: none).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def train(spec: str | None, steps: int | None, run_dir: Path | None, data: str | None, histograms: int,
          prefetch: int, as_json: bool) -> None:
    """Train SPEC (default: the embedded demo) with progress, metrics and checkpoints.

    Ctrl-C (or SIGTERM) finishes the step, writes a checkpoint and exits with code 130 (143)."""
    from flowctl.training.runs import start_run

    console = Console(stderr=True, soft_wrap=True)
    trainer = start_run(spec, run_dir, data, steps, histograms, prefetch,
                        on_warning=lambda m: console.print(f"warning: {m}"))
    try:
        t, n = trainer.model.params()
        unit = "batch per replica" if trainer.program.step.async_step is not None else "batch"
        console.print(f"training {trainer.spec.name or trainer.spec.model.name} ({t + n:,} parameters) for {trainer.total_steps} steps, "
                      f"{unit} {trainer.batch}, {trainer.program.describe()}, in {trainer.run.path}")
        _run(trainer, console, as_json, None)
    finally:
        trainer.close()  # the device threads of a multi-device session


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--steps", type=int, help="Train until this many steps in all (default: the spec's).")
@click.option("--allow-spec-change", is_flag=True, help="Resume even though the spec changed.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def resume(run_dir: Path, steps: int | None, allow_spec_change: bool, as_json: bool) -> None:
    """Continue the run in RUN_DIR exactly where its last checkpoint left it."""
    from flowctl.training.runs import resume_run

    console = Console(stderr=True, soft_wrap=True)
    r = resume_run(run_dir, steps, allow_spec_change, on_warning=lambda m: console.print(f"warning: {m}"))
    trainer = r.trainer
    try:
        cursors = "; ".join(f"replica {k} data epoch {s.epoch} batch {s.position}" for k, s in
                            enumerate(trainer.sources)) if len(trainer.sources) > 1 else \
            f"data epoch {trainer.data.epoch} batch {trainer.data.position}"
        console.print(f"restored {r.checkpoint}: step {trainer.step}, {cursors}, learning rate schedule at step "
                      f"{trainer.step}, {len(trainer.session.rng)} random stream(s); {trainer.program.describe()}")
        if trainer.step >= trainer.total_steps:
            console.print(f"nothing to do: the run is at step {trainer.step} of {trainer.total_steps} "
                          f"(pass --steps to train further)")
            return
        _run(trainer, console, as_json, r.checkpoint)
    finally:
        trainer.close()
