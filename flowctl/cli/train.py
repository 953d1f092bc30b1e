"""`flowctl train` and `flowctl resume`: progress on stderr, a JSON summary on stdout with --json."""
from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from flowctl.engine.errors import CheckpointError, FlowctlError, SpecError

DEFAULT_SPEC = "demo (embedded)"


def _embedded_demo() -> tuple[str, Path]:
    text = resources.files("flowctl.spec").joinpath("builtin/demo.yaml").read_text()
    return text, Path(".")


def _load(spec: str | None, data: str | None) -> tuple[Any, str, str]:
    """(loaded spec, its text, the path recorded for resume) with the --data override applied."""
    from flowctl.spec.loader import load_spec, load_text

    if spec is None:
        text, base = _embedded_demo()
        loaded = load_text(text, filename="<embedded demo.yaml>", base_dir=base)
        path = ""
    else:
        p = Path(spec)
        if not p.exists():
            raise SpecError(f"no spec file {spec}")
        text = p.read_text()
        loaded = load_spec(p)
        path = str(p.resolve())
    if data:
        _override_data(loaded, data)
    return loaded, text, path


def _override_data(loaded: Any, data: str) -> None:
    from flowctl.spec.schema import ArrayData, TextData

    p = Path(data).resolve()
    if not p.exists():
        raise SpecError(f"--data {data}: no such file")
    if p.suffix in (".npy", ".npz"):
        loaded.spec.data = ArrayData.model_validate({"source": "arrays", "path": str(p)})
    else:
        ints = [i for i in loaded.inputs() if i.output.dtype.startswith("int")]
        vocab = getattr(ints[0].layer, "classes", None) if ints else None
        loaded.spec.data = TextData.model_validate({"source": "text", "path": str(p), "vocab_size": vocab})


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
        sys.exit(EXIT_INTERRUPTED)


def _lock_run_dir(path: Path) -> None:
    """One writer per run directory (RunLock), held until this command ends; a directory another
    process is writing is refused naming its PID (CheckpointError, exit 6)."""
    from flowctl.training.rundir import RunLock

    click.get_current_context().call_on_close(RunLock(path).acquire().release)


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

    Ctrl-C finishes the step, writes a checkpoint and exits with code 130."""
    from flowctl.training.trainer import Trainer

    console = Console(stderr=True, soft_wrap=True)
    loaded, text, path = _load(spec, data)
    name = loaded.spec.name or loaded.spec.model.name
    explicit = run_dir is not None
    if run_dir is None:  # runs/<name>, or the first free runs/<name>-N: a new run never reuses one
        run_dir = Path("runs") / name
        n = 1
        while (run_dir / "run.json").exists():
            n += 1
            run_dir = Path("runs") / f"{name}-{n}"
    _lock_run_dir(run_dir)
    if explicit and (run_dir / "run.json").exists():
        raise FlowctlError(f"{run_dir} already holds a run: continue it with `flowctl resume {run_dir}`, "
                           f"or pass another --run-dir")
    trainer = Trainer(loaded, run_dir, steps=steps, histograms_every=histograms, prefetch=prefetch,
                      on_warning=lambda m: console.print(f"warning: {m}"))
    try:
        trainer.start_fresh(text, path)
        info = trainer.run.read_info()
        info["overrides"] = {"data": str(Path(data).resolve())} if data else {}
        trainer.run.write_info(info)
        t, n = trainer.model.params()
        unit = "batch per replica" if trainer.program.async_step is not None else "batch"
        console.print(f"training {name} ({t + n:,} parameters) for {trainer.total_steps} steps, {unit} "
                      f"{trainer.batch}, {trainer.program.describe()}, in {run_dir}")
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
    from flowctl.training.rundir import RunDir, resolved, spec_changes, spec_hash
    from flowctl.training.trainer import Trainer

    console = Console(stderr=True, soft_wrap=True)
    run = RunDir(run_dir)
    if not run.exists():
        raise CheckpointError(f"{run_dir}: no run here (run.json missing)")
    _lock_run_dir(run.path)
    info = run.read_info()
    spec_path = info.get("spec_path") or ""
    if spec_path and Path(spec_path).exists():
        loaded, _, _ = _load(spec_path, info.get("overrides", {}).get("data"))
    else:
        from flowctl.spec.loader import load_text

        loaded = load_text((run.path / "spec.yaml").read_text(), filename=str(run.path / "spec.yaml"))
        if info.get("overrides", {}).get("data"):
            _override_data(loaded, info["overrides"]["data"])
    before = json.loads((run.path / "spec.resolved.json").read_text())
    now = resolved(loaded.spec)
    if spec_hash(now) != before["sha256"]:
        changes = spec_changes(before["spec"], now)
        listing = "; ".join(changes[:12]) + (f"; and {len(changes) - 12} more" if len(changes) > 12 else "")
        if not allow_spec_change:
            raise CheckpointError(f"{spec_path or run.path / 'spec.yaml'} changed since the run started: "
                                  f"{listing}. Pass --allow-spec-change to resume anyway")
        console.print(f"warning: resuming with a changed spec: {listing}")
    trainer = Trainer(loaded, run.path, steps=steps, allow_spec_change=allow_spec_change,
                      on_warning=lambda m: console.print(f"warning: {m}"))
    try:
        restored = trainer.restore()
        cursors = "; ".join(f"replica {k} data epoch {s.epoch} batch {s.position}" for k, s in
                            enumerate(trainer.sources)) if len(trainer.sources) > 1 else \
            f"data epoch {trainer.data.epoch} batch {trainer.data.position}"
        console.print(f"restored {restored}: step {trainer.step}, {cursors}, learning rate schedule at step "
                      f"{trainer.step}, {len(trainer.session.rng)} random stream(s); {trainer.program.describe()}")
        if trainer.step >= trainer.total_steps:
            console.print(f"nothing to do: the run is at step {trainer.step} of {trainer.total_steps} "
                          f"(pass --steps to train further)")
            return
        _run(trainer, console, as_json, restored)
    finally:
        trainer.close()
