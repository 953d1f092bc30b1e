"""`flowctl train` and `flowctl resume`: progress and per-step lines on stderr, the final summary on
stdout (or a JSON summary with --json, the summary lines then on stderr: consoles.py); an
interrupted run's message, with its exit code 130 or 143, on stderr."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from flowctl.cli import consoles


def _rate(x: float) -> str:
    """Examples per second to three significant figures: a big model's 0.02 is not 0."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"


class _Display:
    """A progress bar (step, loss, examples/s, step time, ETA) while stderr is a terminal; plain
    lines every `training.log_every_steps` either way, so a log file gets them too."""

    def __init__(self, console: Console, log_every: int) -> None:
        self.console = console
        self.log_every = log_every
        self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(bar_width=20),
                                 TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[rate]} ex/s"),
                                 TextColumn("{task.fields[step_time]}/step"), TimeRemainingColumn(),
                                 console=console, transient=True, disable=not console.is_terminal)
        self.task: Any = None

    def __enter__(self) -> "_Display":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def start(self, done: int, total: int) -> None:
        self.task = self.progress.add_task("train", total=total, completed=done, loss=float("nan"), rate="-",
                                           step_time="-")

    def step(self, e: Any) -> None:
        step_s = 1.0 / (e.examples_per_s / max(e.batch, 1)) if e.examples_per_s else 0.0
        self.progress.update(self.task, completed=e.step, loss=e.loss, rate=_rate(e.examples_per_s),
                             step_time=_duration(step_s))
        if self.log_every and e.step % self.log_every == 0:
            evals = "".join(f"  {k} {v:.4f}" for k, v in (e.evaluation or {}).items())
            self.progress.console.print(f"step {e.step:>7}  loss {e.loss:.4f}  lr {e.lr:.4g}  "
                                        f"{_rate(e.examples_per_s)} examples/s  {_duration(step_s)}/step{evals}")


def _worker_line(console: Console) -> Any:
    """A remote worker's state as it changes: starting, running (where), lost, restarting."""
    return lambda task, state, detail: console.print(f"worker {task}: {state}" + (f" ({detail})" if detail else ""))


def _run(trainer: Any, console: Console, as_json: bool, restored: str | None) -> None:
    from flowctl.training.trainer import EXIT_INTERRUPTED

    display = _Display(console, trainer.spec.training.log_every_steps)
    trainer.on_step = display.step
    with display:
        display.start(trainer.step, trainer.total_steps)
        summary = trainer.train()
    summary.restored_from = restored
    out = consoles.result(as_json, soft_wrap=True)
    rate = f", {_rate(summary.mean_examples_per_s)} examples/s" if summary.steps_run else ""
    if summary.staleness is not None:
        out.print(f"staleness: mean {summary.staleness['mean']:.2f}, max {summary.staleness['max']} "
                  f"updates (updates applied by other replicas between a replica's read and its update)")
    if summary.interrupted:  # a non-zero exit: its message beside the errors, on stderr
        console.print(f"interrupted at step {summary.last_step}: checkpoint {summary.checkpoint}; "
                      f"continue with: flowctl resume {summary.run_dir}")
    else:
        stopped = " (stopped early: no improvement)" if summary.early_stopped else ""
        evals = "".join(f"; {k} {v:.4f}" for k, v in (summary.evaluation or {}).items())
        if evals and summary.evaluation_step not in (None, summary.last_step):
            evals += f" (evaluated at step {summary.evaluation_step})"
        out.print(f"trained steps {summary.first_step + 1}-{summary.last_step}{stopped} in {summary.seconds:.1f} s"
                  f"{rate}; final loss {summary.final_loss:.4f}{evals}; checkpoint {summary.checkpoint}")
        if summary.best:
            out.print(f"best {summary.best['metric']} {summary.best['value']:.4f} at step {summary.best['step']}: "
                      f"{summary.best['checkpoint']}")
    if as_json:
        click.echo(json.dumps(summary.to_dict()))
    if summary.interrupted:
        sys.exit(summary.exit_code or EXIT_INTERRUPTED)  # 130 for Ctrl-C, 143 for SIGTERM


class RunDir(click.Path):
    """A run directory: a path, never an empty one (click would make '' the current directory)."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("is empty: give a directory, or leave --run-dir out for runs/<spec name>", param, ctx)
        return super().convert(value, param, ctx)


@click.command()
@click.argument("spec", required=False)
@click.option("--steps", type=click.IntRange(min=1), help="Train this many steps in all (default: training.steps).")
@click.option("--run-dir", type=RunDir(file_okay=False, path_type=Path),
              help="Where the run lives (default: runs/<spec name>, or runs/<spec name>-N if taken).")
@click.option("--data", "data", help="Train on this file: a text corpus, .npy/.npz arrays, or a table like the spec's; "
                                        "or a folder of images, one sub-folder per class.")
@click.option("--histograms", type=int, default=0, help="Write weight histograms every N steps.")
@click.option("--prefetch", type=int, default=2, show_default=True,
              help="Batches read ahead on a background thread while the model computes (0: none).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Change one spec key (YAML value), e.g. --set training.batch_size=64. Repeatable.")
@click.option("--devices", help="Train on these devices: the spec's device names, e.g. cpu:0,cpu:1.")
@click.option("--algorithm", "-a", help="Placer for a multi-device single-strategy step (default: the spec's).")
@click.option("--trace", "trace_step", type=int, metavar="STEP",
              help="Write a timeline of step STEP (RUN/trace-STEP.json: chrome://tracing or ui.perfetto.dev).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def train(spec: str | None, steps: int | None, run_dir: Path | None, data: str | None, histograms: int,
          prefetch: int, overrides: tuple[str, ...], devices: str | None, algorithm: str | None,
          trace_step: int | None, as_json: bool) -> None:
    """Train SPEC (default: the embedded demo) with progress, metrics and checkpoints.

    Ctrl-C (or SIGTERM) finishes the step, writes a checkpoint and exits with code 130 (143)."""
    from flowctl.training.runs import command_line_overrides, start_run

    console = consoles.progress(soft_wrap=True)
    trainer = start_run(spec, run_dir, data, steps, histograms, prefetch,
                        on_warning=lambda m: console.print(f"warning: {m}"),
                        overrides=command_line_overrides(overrides, devices, algorithm), trace_step=trace_step,
                        on_worker=_worker_line(console))
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
@click.option("--steps", type=click.IntRange(min=1), help="Train until this many steps in all (default: the spec's).")
@click.option("--allow-spec-change", is_flag=True, help="Resume even though the spec changed.")
@click.option("--restart", is_flag=True,
              help="The run's checkpoints were all lost: train it again from step 0, its metrics.jsonl "
                   "set aside as metrics.<time>.jsonl.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def resume(run_dir: Path, steps: int | None, allow_spec_change: bool, restart: bool, as_json: bool) -> None:
    """Continue the run in RUN_DIR exactly where its last checkpoint left it.

    A run with no checkpoint left though one was written (its metrics, checkpoints/latest or run.json
    say so) is refused unless --restart; a run killed before its first checkpoint starts again from
    step 0."""
    from flowctl.training.runs import resume_run

    console = consoles.progress(soft_wrap=True)
    r = resume_run(run_dir, steps, allow_spec_change, on_warning=lambda m: console.print(f"warning: {m}"),
                   on_worker=_worker_line(console), restart=restart)
    trainer = r.trainer
    try:
        cursors = "; ".join(f"replica {k} data epoch {s.epoch} batch {s.position}" for k, s in
                            enumerate(trainer.sources)) if len(trainer.sources) > 1 else \
            f"data epoch {trainer.data.epoch} batch {trainer.data.position}"
        console.print(f"restored {r.checkpoint}: step {trainer.step}, {cursors}, learning rate schedule at step "
                      f"{trainer.step}, {len(trainer.session.rng)} random stream(s); {trainer.program.describe()}")
        if trainer.step >= trainer.total_steps:
            consoles.result(as_json, soft_wrap=True).print(
                f"nothing to do: the run is at step {trainer.step} of {trainer.total_steps} (pass --steps to train "
                f"further)")
            return
        _run(trainer, console, as_json, r.checkpoint)
    finally:
        trainer.close()
