"""Starting and resuming a training run: which spec (the embedded demo by default, `--data`
applied), which run directory (a new run never reuses one), and whether a run may be resumed with
the spec as it is now (§3.3: a resumed run must compute what the interrupted one computed).
`flowctl train` and `flowctl resume` call `start_run` and `resume_run` and only render."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Sequence

from flowctl.engine.errors import CheckpointError, FlowctlError, SpecError
from flowctl.spec.check import LoadedSpec
from flowctl.spec.loader import load_spec, load_text
from flowctl.spec.overrides import device_names
from flowctl.spec.schema import ArrayData, ImageData, ParallelTextData, TableData, TextData
from flowctl.training.rundir import RunDir, RunLock, resolved, spec_changes, spec_hash
from flowctl.training.trainer import Trainer

DEMO = "demo (embedded)"
Warn = Callable[[str], None]
WorkerEvent = Callable[[int, str, str], None]  # (task, state, detail): a remote worker starting or lost


def load_training_spec(spec: str | None, data: str | None = None,
                       overrides: Sequence[str] = ()) -> tuple[LoadedSpec, str, str]:
    """(loaded spec, its text, the path recorded for resume; "" for the embedded demo) with the
    `--set` overrides and the `--data` file applied."""
    if spec is None:
        text = resources.files("flowctl.spec").joinpath("builtin/demo.yaml").read_text()
        loaded = load_text(text, filename="<embedded demo.yaml>", base_dir=Path("."), overrides=overrides)
        path = ""
    else:
        p = Path(spec)
        if not p.exists():
            raise SpecError(f"no spec file {spec}")
        loaded = load_spec(p, overrides)
        text = p.read_text()
        path = str(p.resolve())
    if data:
        override_data(loaded, data)
    return loaded, text, path


def override_data(loaded: LoadedSpec, data: str, held: bool = False) -> str:
    """Point the spec's `data:` at a file: arrays (.npy/.npz), a table like the spec's (the same
    columns; held, encoded as the run learned them), or a text corpus, whose vocabulary is the
    first integer input's class count; or at a folder of images (one sub-folder per class).
    Returns the split that reads the file.

    `held`: the file is data to evaluate or predict on. A model trained on a text corpus then keeps
    reading it the same way (sentences with lengths, its named inputs) and keeps its training corpus
    as `path`, so the new file is encoded with the vocabulary the model learned, not its own."""
    p = Path(data).resolve()
    if not p.exists():
        raise SpecError(f"--data {data}: no such file")
    current = loaded.spec.data
    if isinstance(current, ParallelTextData):
        raise SpecError(f"--data {data}: a model trained on sentence pairs reads two files; give held-out pairs "
                        f"as data.validation and data.validation_target (--set) instead")
    if p.is_dir():  # a folder of images, one sub-folder per class; an images spec keeps its reading
        # A held-out fraction is of whichever folder is read; a validation folder was the old data's.
        keep = current.model_dump(exclude={"validation"}) if isinstance(current, ImageData) else {"source": "images"}
        if held and isinstance(current, ImageData):
            loaded.spec.data = ImageData.model_validate({**keep, "validation": str(p), "validation_fraction": None})
            return "validation"
        loaded.spec.data = ImageData.model_validate({**keep, "path": str(p)})
        return "train"
    if p.suffix in (".npy", ".npz"):
        loaded.spec.data = ArrayData.model_validate({"source": "arrays", "path": str(p)})
        return "train"
    if isinstance(current, TableData):  # the same columns, encoded as the run learned them
        keep = current.model_dump(exclude={"validation", "validation_fraction"})
        if held:
            loaded.spec.data = TableData.model_validate({**keep, "validation": str(p)})
            return "validation"
        loaded.spec.data = TableData.model_validate({**keep, "path": str(p)})
        return "train"
    if isinstance(current, TextData):  # the same reading, another file
        keep = current.model_dump(exclude={"validation", "validation_fraction"})
        if held:
            loaded.spec.data = TextData.model_validate({**keep, "validation": str(p)})
            return "validation"
        loaded.spec.data = TextData.model_validate({**keep, "path": str(p)})
        return "train"
    ints = [i for i in loaded.inputs() if i.output.dtype.startswith(("int", "uint"))]
    vocab = getattr(ints[0].layer, "classes", None) if ints else None
    loaded.spec.data = TextData.model_validate({"source": "text", "path": str(p), "vocab_size": vocab})
    return "train"


def safe_run_name(name: str) -> str:
    """A spec's name as one folder name under runs/: a name is a name, never a path (`../x`, an
    absolute path, a separator) -- each character outside letters, digits, '.', '-' and '_'
    becomes '_', and a name of dots alone becomes 'run'."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    return "run" if not safe.strip(".") else safe


def choose_run_dir(name: str, run_dir: Path | None) -> Path:
    """`run_dir` if it holds no run yet; by default runs/<name>, or the first free runs/<name>-N
    (the spec's name made a safe folder name: `safe_run_name`)."""
    if run_dir is not None:
        if (run_dir / "run.json").exists():
            raise FlowctlError(f"{run_dir} already holds a run: continue it with `flowctl resume {run_dir}`, "
                               f"or pass another --run-dir")
        return run_dir
    return _free_run_dir(name)


def _free_run_dir(name: str) -> Path:
    name = safe_run_name(name)
    run_dir = Path("runs") / name
    n = 1
    while (run_dir / "run.json").exists():
        n += 1
        run_dir = Path("runs") / f"{name}-{n}"
    return run_dir


def command_line_overrides(overrides: Sequence[str] = (), devices: str | None = None,
                           algorithm: str | None = None) -> list[str]:
    """`--set` overrides, with `--devices cpu:0,cpu:1` and `--algorithm A` as the spec keys they
    set (`train` runs on devices this machine has: profiles are for `place`)."""
    out = list(overrides)
    if devices:
        names = device_names(devices)
        if names is None:
            raise SpecError(f"--devices {devices}: train runs on this machine's devices; give device names such "
                            f"as cpu:0,cpu:1 or gpu:0 (profiles such as 4xgpu:k40 are for `flowctl place`)")
        out.append(f"devices=[{', '.join(names)}]")
    if algorithm:
        out.append(f"placement.algorithm={algorithm}")
    return out


def start_run(spec: str | None, run_dir: Path | None = None, data: str | None = None, steps: int | None = None,
              histograms: int = 0, prefetch: int = 2, on_warning: Warn | None = None,
              overrides: Sequence[str] = (), trace_step: int | None = None,
              on_worker: WorkerEvent | None = None) -> Trainer:
    """A trainer on a new run directory, initialised and recorded (the spec with its overrides, the
    graph, the devices), ready to `train()`. The caller closes it."""
    loaded, text, path = load_training_spec(spec, data, overrides)
    name = loaded.spec.name or loaded.spec.model.name
    # One writer per run directory: the lock first, so a second train on the same directory is
    # told who holds it, then the check that no run is there yet.
    target = run_dir if run_dir is not None else _free_run_dir(name)
    made = not target.exists()  # a start that fails removes the directory it made, and only that
    lock = RunLock(target).acquire()
    try:
        trainer = Trainer(loaded, choose_run_dir(name, run_dir) if run_dir is not None else lock.path, steps=steps,
                          histograms_every=histograms, prefetch=prefetch, on_warning=on_warning, trace_step=trace_step,
                          on_worker=on_worker)
    except BaseException:
        lock.release()
        _unmake(target, made)
        raise
    trainer.lock = lock
    try:
        trainer.start_fresh(text, path)
        info = trainer.run.read_info()
        info["overrides"] = {**({"data": str(Path(data).resolve())} if data else {}),
                             **({"set": list(overrides)} if overrides else {})}
        trainer.run.write_info(info)
    except BaseException:
        trainer.close()
        _unmake(target, made)
        raise
    return trainer


def _unmake(path: Path, made: bool) -> None:
    """Remove a run directory this start made, when the start failed before any step ran (nothing
    in it is worth keeping: no checkpoint can exist yet)."""
    if made and path.is_dir() and not (path / "checkpoints" / "latest").exists():
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class Resumed:
    trainer: Trainer
    checkpoint: str  # the checkpoint restored
    changes: list[str]  # how the spec differs from the run's (resumed anyway with allow_spec_change)


def resume_run(run_dir: Path, steps: int | None = None, allow_spec_change: bool = False,
               on_warning: Warn | None = None, on_worker: WorkerEvent | None = None,
               restart: bool = False) -> Resumed:
    """The run in `run_dir` restored from its newest valid checkpoint. The spec is read again from
    where the run found it (else the run's copy); a change to what it computes is refused, listing
    the changes, unless `allow_spec_change`. `restart`: a run whose checkpoints were all lost
    starts again from step 0 (Trainer.restore), instead of being refused."""
    run = RunDir(run_dir, on_warning)
    loaded, spec_path = load_run_spec(run)
    lock = RunLock(run.path).acquire()
    try:
        resumed = _resume(run, loaded, spec_path, steps, allow_spec_change, on_warning, on_worker, restart)
    except BaseException:
        lock.release()
        raise
    resumed.trainer.lock = lock
    return resumed


def _resume(run: RunDir, loaded: LoadedSpec, spec_path: str, steps: int | None, allow_spec_change: bool,
            on_warning: Warn | None, on_worker: WorkerEvent | None, restart: bool = False) -> Resumed:
    changes = _changes(run, loaded)
    if changes and not allow_spec_change:
        raise CheckpointError(f"{spec_path} changed since the run started: "
                              f"{_listing(changes)}. Pass --allow-spec-change to resume anyway")
    if changes and on_warning is not None:
        on_warning(f"resuming with a changed spec: {_listing(changes)}")
    trainer = Trainer(loaded, run.path, steps=steps, allow_spec_change=allow_spec_change, on_warning=on_warning,
                      on_worker=on_worker)
    try:
        restored = trainer.restore(restart)
        if changes is None:  # the checkpoint's own spec hash matched: record the spec again
            run.write_json("spec.resolved.json", {"sha256": trainer.hash, "spec": trainer.resolved})
    except BaseException:
        trainer.close()
        raise
    return Resumed(trainer, restored, changes or [])


def load_run_spec(run: RunDir) -> tuple[LoadedSpec, str]:
    """The spec of the run in `run`, read again from where the run found it (else the run's own
    copy), with the run's `--set` overrides and `--data` file; and the path it was read from. A
    damaged run.json (a warning said so) is rewritten, and the run's own copies stand in for it."""
    if not run.exists():
        raise CheckpointError(f"{run.path}: no run here (run.json missing)")
    info = run.info_or_empty()
    if not info:
        run.write_info({"status": "running", "spec_path": "", "overrides": {}})
    spec_path = str(info.get("spec_path") or "")
    recorded = info.get("overrides")
    recorded = recorded if isinstance(recorded, dict) else {}
    data = recorded.get("data")
    overrides = [str(o) for o in recorded.get("set", []) if isinstance(o, str)]
    if spec_path and Path(spec_path).exists():
        loaded, _, _ = load_training_spec(spec_path, data, overrides)
        return loaded, spec_path
    copy = run.path / "spec.yaml"
    try:
        text = copy.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{copy}: unreadable ({getattr(e, 'strerror', None) or e}), and the spec "
                              f"the run started from is {spec_path or 'not recorded'}") from None
    loaded = load_text(text, filename=str(copy), overrides=overrides)
    if data:
        override_data(loaded, data)
    return loaded, str(copy)


def _changes(run: RunDir, loaded: LoadedSpec) -> list[str] | None:
    """How the spec differs from the run's; None when spec.resolved.json is damaged (a warning:
    the checkpoints' manifests carry the spec hash too, and restoring compares it)."""
    try:
        before: Any = run.read_json("spec.resolved.json")
        if not isinstance(before, dict) or not isinstance(before.get("sha256"), str) or "spec" not in before:
            raise CheckpointError(f"{run.path / 'spec.resolved.json'}: damaged (no sha256 and spec)")
    except CheckpointError as e:
        run.on_warning(f"{e}; comparing the spec with the checkpoint's hash instead")
        return None
    now = resolved(loaded.spec)
    if spec_hash(now) == before["sha256"]:
        return []
    try:
        return spec_changes(before["spec"], now) or ["the resolved spec's hash changed"]
    except RecursionError:  # nested deeper than any spec: damaged, and its hash differs anyway
        return ["spec.resolved.json is damaged (nested too deeply) and its hash differs"]


def _listing(changes: list[str]) -> str:
    return "; ".join(changes[:12]) + (f"; and {len(changes) - 12} more" if len(changes) > 12 else "")


__all__ = ["DEMO", "Resumed", "choose_run_dir", "command_line_overrides", "load_run_spec", "load_training_spec",
           "override_data", "resume_run", "start_run"]
