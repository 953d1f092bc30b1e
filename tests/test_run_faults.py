"""A run directory survives what real machines do (issue 21): SIGTERM, damaged metrics and
metadata, a kill before the first checkpoint, non-finite values, symlinks out of the run, a
read-only directory, a full disk. Each failure is asserted as an operator sees it (the exit code,
one error line, no traceback, the newest valid checkpoint as it was), and then the run is finished
from what was left and compared, bit for bit, with a run that never failed."""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli
from flowctl.engine.errors import NonFiniteError
from flowctl.spec.loader import load_spec
from flowctl.training.faults import checked_learning_rate
from flowctl.training.runs import start_run
from flowctl.training.trainer import Trainer
from test_train_runs import SPEC, losses, straight

CHILD = Path(__file__).resolve().parent / "crash_child.py"


def write_spec(directory: Path, text: str = SPEC, every: int = 4) -> Path:
    """The exact spec of test_train_runs (12 steps, dropout, Adam, a decaying rate) and its data
    in `directory`, checkpointing every `every` steps."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 6)).astype(np.float32)
    np.savez(directory / "data.npz", x=x, y=(x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32))
    p = directory / "exact.yaml"
    p.write_text(text.replace("every_steps: 100", f"every_steps: {every}"))
    return p


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    return write_spec(tmp_path)


@pytest.fixture
def full(spec: Path, tmp_path: Path) -> Path:
    """The run that never failed: 12 steps, checkpoints at 4, 8 and 12."""
    straight(spec, tmp_path / "full", 12).close()
    return tmp_path / "full"


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


def run_cli(*args: str, preexec_fn: Callable[[], None] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowctl.cli.main", *args], capture_output=True, text=True,
                          timeout=120, preexec_fn=preexec_fn)


def the_error(output: str, *needles: str) -> str:
    """The one error line of a failed command (no traceback), holding every needle."""
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def manifest(run: Path, step: int) -> dict[str, Any]:
    return json.loads((run / "checkpoints" / f"ckpt-{step:08d}" / "manifest.json").read_text())


def assert_same_finish(run: Path, full: Path, step: int = 12) -> None:
    """Bit for bit: every step's loss, and the last checkpoint's tensors (their sha256), random
    streams, data cursor and step."""
    assert losses(run) == losses(full)[:step]
    a, b = manifest(run, step), manifest(full, step)
    assert a["tensors"] == b["tensors"]
    assert a["state"] == b["state"]


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- SIGTERM
def wait_for_metrics(run: Path, size: int) -> None:
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and (not metrics.exists() or metrics.stat().st_size < size):
        time.sleep(0.05)


def test_sigterm_finishes_the_step_checkpoints_and_exits_143(tmp_path):
    spec = write_spec(tmp_path, SPEC.replace("steps: 12", "steps: 2000000"), every=100)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "flowctl.cli.main", "train", str(spec), "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_metrics(run, 2000)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "interrupted at step" in err and "flowctl resume" in err
    info = json.loads((run / "run.json").read_text())
    step = info["step"]
    assert info["status"] == "interrupted" and step > 0
    assert manifest(run, step)["state"]["step"] == step
    # Resumable to the same end as a run that was never stopped.
    straight(spec, tmp_path / "full", step + 3).close()
    r = invoke("resume", str(run), "--steps", str(step + 3))
    assert r.exit_code == 0, r.output
    assert_same_finish(run, tmp_path / "full", step + 3)


def test_sigterm_stops_async_replicas_with_a_checkpoint(tmp_path):
    from test_strategies import _demo_async

    spec = tmp_path / "demo.yaml"
    spec.write_text(_demo_async(2_000_000))
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "flowctl.cli.main", "train", str(spec), "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_metrics(run, 3000)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "interrupted"
    step = info["step"]
    assert len(manifest(run, step)["state"]["data"]) == 2  # a cursor per replica, taken with no update in flight
    r = invoke("resume", str(run), "--steps", str(step + 6))
    assert r.exit_code == 0, r.output
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, step + 7))


# ----------------------------------------------------------------------------- damaged metrics and metadata
DAMAGED_LINES = [b'{"step": 9, "loss": 0.5', b"garbage", b"\x00\x00\x00\x00", b"\xff\xfe\x80binary",
                 b'{"loss": 0.25}', b"[1, 2]", b'{"step": "9"}', b"[" * 100_000 + b"]" * 100_000]


def test_damaged_metrics_lines_are_skipped_and_dropped_on_resume(spec, full, tmp_path):
    run = tmp_path / "run"
    straight(spec, run, 8).close()
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b"\n".join(DAMAGED_LINES))  # the last one torn: no newline
    warnings: list[str] = []
    t = Trainer(load_spec(spec), run, steps=12, on_warning=warnings.append)
    try:
        assert [(m["step"], m["loss"]) for m in t.run.read_metrics()] == list(zip(range(1, 9), losses(full)))
        assert t.restore().endswith("ckpt-00000008")
        t.train()
    finally:
        t.close()
    said = [w for w in warnings if "damaged line" in w]
    assert len(said) == 2 and f"skipped {len(DAMAGED_LINES)} damaged line(s) (line 9: not JSON" in said[1]
    assert_same_finish(run, full)  # the damaged lines are gone, the rest is exact


def _rewrite_manifest(ckpt: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    """Damage a manifest consistently: its commit marker is recomputed, so the file checks pass
    and only what the state means is wrong (a bug of another writer, not a torn write)."""
    m = json.loads((ckpt / "manifest.json").read_text())
    raw = change(m)
    raw = raw if isinstance(raw, bytes) else json.dumps(m, indent=1).encode()
    (ckpt / "manifest.json").write_bytes(raw)
    (ckpt / "COMMIT").write_text(hashlib.sha256(raw).hexdigest() + "\n")


MANIFEST_DAMAGE: dict[str, Callable[[dict[str, Any]], Any]] = {
    "no state.data": lambda m: m["state"].pop("data"),
    "a bad RNG state": lambda m: m["state"]["rng"].update({k: "garbage" for k in m["state"]["rng"]}),
    "a data cursor that is not one": lambda m: m["state"].update(data="garbage"),
    "JSON nested 100k deep": lambda m: b'{"state": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "binary": lambda m: b"\x00\xff\xfe garbage",
}


@pytest.mark.parametrize("damage", list(MANIFEST_DAMAGE))
def test_damaged_checkpoint_metadata_falls_back_to_the_previous(spec, full, tmp_path, damage):
    run = tmp_path / "run"
    straight(spec, run, 8).close()  # checkpoints at 4 and 8
    _rewrite_manifest(run / "checkpoints" / "ckpt-00000008", MANIFEST_DAMAGE[damage])
    before = files(run / "checkpoints" / "ckpt-00000004")
    r = invoke("resume", str(run))
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    assert "skipping damaged checkpoint ckpt-00000008" in r.output and "restored" in r.output
    assert "ckpt-00000004: step 4" in " ".join(r.output.split())
    assert files(run / "checkpoints" / "ckpt-00000004") == before
    assert_same_finish(run, full)


def test_no_valid_checkpoint_left_is_one_clear_error(spec, tmp_path):
    run = tmp_path / "run"
    straight(spec, run, 8).close()
    for step in (4, 8):
        _rewrite_manifest(run / "checkpoints" / f"ckpt-{step:08d}", MANIFEST_DAMAGE["no state.data"])
    before = files(run / "checkpoints")
    r = run_cli("resume", str(run))
    assert r.returncode == 6
    the_error(r.stderr, "no valid checkpoint", "ckpt-00000008", "ckpt-00000004", "KeyError: 'data'")
    assert files(run / "checkpoints") == before


RUN_DAMAGE = {
    "run.json": (b'{"status": "runn\x00\x00', "run.json: damaged"),
    "spec.resolved.json": (b"[" * 100_000, "spec.resolved.json: damaged (JSON nested too deeply)"),
    "checkpoints/latest": (b"\xff\xfe\x00\x01ckpt", None),
}


@pytest.mark.parametrize("name", list(RUN_DAMAGE))
def test_damaged_run_metadata_is_a_warning_and_is_rewritten(spec, full, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)  # without run.json's spec path, the spec's data path is read from here
    run = tmp_path / "run"
    straight(spec, run, 8).close()
    garbage, warning = RUN_DAMAGE[name]
    (run / name).write_bytes(garbage)
    r = invoke("resume", str(run))
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output and "ckpt-00000008: step 8" in " ".join(r.output.split())
    if warning:
        assert warning in " ".join(r.output.split()), r.output
        json.loads((run / name).read_text())  # written again, whole
    assert (run / "checkpoints" / "latest").read_text() == "ckpt-00000012\n"
    assert_same_finish(run, full)


# ----------------------------------------------------------------------------- killed before the first checkpoint
def test_killed_during_the_first_checkpoint_resumes_from_step_0(spec, full, tmp_path):
    run = tmp_path / "run"
    killed = subprocess.run([sys.executable, str(CHILD), "--cli", "mid_tensors", "train", str(spec),
                             "--run-dir", str(run)], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not list((run / "checkpoints").glob("ckpt-*"))
    r = invoke("train", str(spec), "--run-dir", str(run))
    assert r.exit_code == 1 and "already holds a run" in r.output and f"flowctl resume {run}" in r.output
    r = invoke("resume", str(run))
    assert r.exit_code == 0, r.output
    assert "starting it again from step 0" in r.output and "initial state" in r.output
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert_same_finish(run, full)


def test_stopped_before_its_first_step_resumes_from_step_0(spec, full, tmp_path):
    run = tmp_path / "run"
    start_run(str(spec), run).close()  # recorded, initialised, never trained: as if killed right there
    r = invoke("resume", str(run))
    assert r.exit_code == 0, r.output
    assert_same_finish(run, full)


# ----------------------------------------------------------------------------- every checkpoint deleted
def test_a_run_whose_checkpoints_were_all_deleted_is_refused_unless_restart(spec, full, tmp_path):
    """It restarted from step 0 saying the run "stopped before its first checkpoint", while its
    metrics showed 12 steps. Now: what happened, and no change; --restart trains from step 0 with
    the old metrics set aside, so metrics.jsonl holds steps 1-12 once."""
    run = tmp_path / "run"
    r = invoke("train", str(spec), "--run-dir", str(run))
    assert r.exit_code == 0, r.output
    old_metrics = (run / "metrics.jsonl").read_bytes()
    for c in (run / "checkpoints").glob("ckpt-*"):
        shutil.rmtree(c)
    # What says a checkpoint was written: checkpoints/latest and run.json's "finished"; then the
    # latter alone; then (as if killed) the metrics past the first checkpoint due, at step 4.
    for what, evidence in [("the checkpoint directories", "checkpoints/latest names one"),
                           ("the whole checkpoints folder", "run.json says it finished"),
                           ("run.json's status", "a checkpoint was due at step 4")]:
        if what == "run.json's status":
            info = json.loads((run / "run.json").read_text())
            (run / "run.json").write_text(json.dumps({**info, "status": "running"}))
        before = {k: v for k, v in files(run).items() if k != ".lock"}
        r = invoke("resume", str(run))
        assert r.exit_code == 6, (what, r.output)
        the_error(r.output, "metrics.jsonl records 12 step(s)", evidence, "no checkpoint is left", "--restart")
        assert {k: v for k, v in files(run).items() if k != ".lock"} == before, what  # refused: nothing touched
        shutil.rmtree(run / "checkpoints", ignore_errors=True)
    r = invoke("resume", str(run), "--restart")
    assert r.exit_code == 0, r.output
    assert "starting the run again from step 0 (--restart)" in " ".join(r.output.split())
    aside = list(run.glob("metrics.*.jsonl"))
    assert len(aside) == 1 and aside[0].read_bytes() == old_metrics, aside
    assert aside[0].name in " ".join(r.output.split())
    assert_same_finish(run, full)  # steps 1-12, once, as the run that never failed


def test_restart_is_refused_while_a_checkpoint_is_left(spec, full, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(full, run)
    before = {k: v for k, v in files(run).items() if k != ".lock"}
    r = invoke("resume", str(run), "--restart")
    assert r.exit_code == 6, r.output
    the_error(r.output, "--restart", "ckpt-00000012 is left", "resume continues from it")
    assert {k: v for k, v in files(run).items() if k != ".lock"} == before


# ----------------------------------------------------------------------------- non-finite values
def test_a_non_finite_schedule_value_is_refused_before_a_run_starts(tmp_path):
    """A NaN written into the schedule is a spec error at its line, before any run directory is made
    (a schedule that overflows at run time stops the step instead: the test below)."""
    text = SPEC.replace("learning_rate: {schedule: exponential, initial: 0.05, decay_rate: 0.5, decay_steps: 4}",
                        "learning_rate: {schedule: piecewise, boundaries: [6], values: [0.05, .nan]}")
    spec = write_spec(tmp_path, text)
    run = tmp_path / "run"
    r = run_cli("train", str(spec), "--run-dir", str(run))
    assert r.returncode == 2, r.stderr
    assert "exact.yaml:" in r.stderr and "values must be finite and > 0, got nan" in r.stderr
    assert not run.exists()


def test_a_schedule_that_overflows_is_a_non_finite_rate():
    from flowctl.spec.schema import Schedule

    s = Schedule.model_validate({"schedule": "exponential", "initial": 1.0, "decay_rate": 1e10, "decay_steps": 1})
    assert checked_learning_rate(s, 3) == pytest.approx(1e30)
    with pytest.raises(NonFiniteError, match=r"step 41: the learning rate .* cannot be computed"):
        checked_learning_rate(s, 40)


def test_non_finite_variables_are_never_checkpointed(spec, tmp_path):
    run = tmp_path / "run"
    t = straight(spec, run, 4)
    try:
        before = files(run / "checkpoints")
        values = t.session.variable_values()
        # An infinite Adam moment: step 5's loss is finite (computed before the update), the update
        # makes a weight infinite, and the save after it is refused.
        name = next(k for k in sorted(values) if "/Adam/m" in k)
        bad = values[name].copy()
        bad.flat[0] = np.inf
        t.session.load_variables({name: bad})
        t.total_steps = 5
        with pytest.raises(NonFiniteError, match=r"step 5: variable '.+' holds \d+ non-finite value\(s\) of \d+; "
                                                 r"no checkpoint was written"):
            t.train()
    finally:
        t.close()
    assert files(run / "checkpoints") == before


# ----------------------------------------------------------------------------- symlinks out of the run
@pytest.mark.parametrize("name", ["metrics.jsonl", "run.json", "events", "checkpoints"])
def test_a_symlink_out_of_the_run_is_never_written_through(spec, full, tmp_path, name):
    run = tmp_path / "run"
    straight(spec, run, 8).close()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    moved = outside / name
    shutil.move(str(run / name), str(moved))
    (run / name).symlink_to(moved)
    before = files(outside)
    r = invoke("resume", str(run))
    assert r.exit_code == 6, r.output
    msg = the_error(r.output, str(run / name))
    assert "symlink" in msg and "refusing to write" in msg
    assert files(outside) == before  # nothing written there, nothing deleted
    (run / name).unlink()
    shutil.move(str(moved), str(run / name))
    r = invoke("resume", str(run))
    assert r.exit_code == 0, r.output
    assert_same_finish(run, full)


# ----------------------------------------------------------------------------- read-only, disk full
class ReadOnly:
    """Make paths unwritable, and writable again. Permission bits do not bind root, so as root the
    immutable attribute (`chattr +i`, which does) stands in for them."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.root = os.geteuid() == 0
        if self.root and (shutil.which("chattr") is None or
                          subprocess.run(["chattr", "+i", *map(str, paths)], capture_output=True).returncode):
            self.undo()
            pytest.skip("running as root, and this filesystem has no immutable attribute to make a directory "
                        "read-only for root")
        for p in paths if not self.root else []:
            p.chmod(0o555 if p.is_dir() else 0o444)

    def undo(self) -> None:
        if self.root:
            subprocess.run(["chattr", "-i", *map(str, self.paths)], capture_output=True)
        else:
            for p in self.paths:
                p.chmod(0o755 if p.is_dir() else 0o644)


def test_a_read_only_run_dir_is_one_line_and_exit_6(spec, full, tmp_path):
    run = tmp_path / "run"
    straight(spec, run, 8).close()
    parent = tmp_path / "ro"
    parent.mkdir()
    before = files(run)
    ro = ReadOnly([parent, run, *run.rglob("*")])
    try:
        r = run_cli("resume", str(run))
        assert r.returncode == 6, r.stderr
        # The first file a resume writes is the run's lock (one writer per run directory).
        the_error(r.stderr, f"{run / '.lock'}: write failed (", "free there")
        r = run_cli("train", str(spec), "--run-dir", str(parent / "new"))
        assert r.returncode == 6, r.stderr
        the_error(r.stderr, f"{parent / 'new'}: write failed (")
    finally:
        ro.undo()
    assert {k: v for k, v in files(run).items() if k != ".lock"} == before
    r = invoke("resume", str(run))
    assert r.exit_code == 0, r.output
    assert_same_finish(run, full)


def _file_size_limit(limit: int) -> Callable[[], None]:
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("where", ["metrics", "checkpoint"])
def test_a_full_disk_is_one_line_and_exit_6_and_the_run_resumes(spec, full, tmp_path, where):
    """RLIMIT_FSIZE: no file of the child may grow past the limit (a disk that fills up, as one
    process sees it). `metrics`: metrics.jsonl fills at the flush before the save at step 12 and is
    left with a torn line; `checkpoint`: the tensor file of checkpoint 8 cannot be written."""
    run = tmp_path / "run"
    straight(spec, run, 8 if where == "metrics" else 4).close()
    metrics = run / "metrics.jsonl"
    tensors = len((run / "checkpoints" / "ckpt-00000004" / "tensors.safetensors").read_bytes())
    limit = metrics.stat().st_size + 200 if where == "metrics" else tensors - 100
    before = files(run / "checkpoints")
    r = run_cli("resume", str(run), "--steps", "400", preexec_fn=_file_size_limit(limit))
    assert r.returncode == 6, r.stderr
    if where == "metrics":
        the_error(r.stderr, f"{metrics}: write failed (file too large;", "free there)", "checkpoints are untouched")
        assert not metrics.read_bytes().endswith(b"\n")  # torn mid-line
    else:
        the_error(r.stderr, "ckpt-00000008", "write failed (file too large)",
                  "the last good checkpoint ckpt-00000004 is untouched", "free there")
    assert files(run / "checkpoints") == before
    r = invoke("resume", str(run))
    assert r.exit_code == 0, r.output
    assert_same_finish(run, full)
