"""`flowctl demo`: train the embedded default network, with progress on stderr and the result on
stdout (consoles.py)."""
from __future__ import annotations

import json
import time

import click
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from flowctl.cli import consoles


@click.command()
@click.option("--steps", default=300, show_default=True, help="Training steps.")
@click.option("--seed", default=0, show_default=True, help="Graph and data seed.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def demo(steps: int, seed: int, as_json: bool) -> None:
    """Train a two-layer network on a generated task (the embedded default job)."""
    from flowctl.api_example import train_demo

    err = consoles.progress()
    t0 = time.perf_counter()
    with Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                  TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[rate]:.0f} steps/s"),
                  TimeRemainingColumn(), console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("train", total=steps, loss=float("nan"), rate=0.0)

        def on_step(step: int, loss: float) -> None:
            progress.update(task, completed=step + 1, loss=loss,
                            rate=(step + 1) / max(time.perf_counter() - t0, 1e-9))

        result = train_demo(steps=steps, seed=seed, on_step=on_step)
    elapsed = time.perf_counter() - t0
    first = sum(result.losses[:10]) / min(10, len(result.losses))
    last = sum(result.losses[-10:]) / min(10, len(result.losses))
    consoles.result(as_json).print(f"trained {steps} steps in {elapsed:.1f} s: loss {first:.4f} -> {last:.4f} "
              f"({first / max(last, 1e-12):.0f}x lower), accuracy {result.accuracy:.3f}")
    if as_json:
        click.echo(json.dumps({"steps": steps, "seconds": elapsed, "first_loss": first, "final_loss": last,
                               "accuracy": result.accuracy}))
