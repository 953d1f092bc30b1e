"""One writer per run directory (issue 20): a second train or resume on a live run is refused with
the holder's PID (exit 6) and changes nothing there; a lock left by a killed process is taken over."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowctl.engine.errors import CheckpointError
from flowctl.training.rundir import RunLock
from test_train_runs import SPEC, run_cli, spec_file  # noqa: F401  (spec_file is a fixture)


def snapshot(run: Path) -> dict[str, tuple[str, int]]:
    """Every file under the run directory: its sha256 and its mtime in ns."""
    return {str(p.relative_to(run)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file()}


def start_train(spec_file: Path, run: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flowctl.cli.main", "train", str(spec_file), "--run-dir",
                             str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop(proc: subprocess.Popen) -> None:
    """SIGSTOP, then wait until the kernel reports it stopped (kill returns before it is)."""
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.time() + 30
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
        assert time.time() < deadline, "the holder never stopped"
        time.sleep(0.01)


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 90) -> None:
    deadline = time.time() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_a_second_lock_is_refused_naming_the_holder_and_a_stale_file_does_not_block(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").write_text("999999999\n")  # a dead holder's PID: flock is free, so it is taken over
    with RunLock(run):
        assert (run / ".lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(CheckpointError, match=rf"PID {os.getpid()}\b") as e:
            RunLock(run).acquire()
        assert e.value.exit_code == 6
        assert (run / ".lock").read_text() == f"{os.getpid()}\n"
    with RunLock(run):  # released on exit, so taken again
        pass


def test_two_trains_on_one_run_dir(spec_file, tmp_path):  # noqa: F811
    spec_file.write_text(spec_file.read_text().replace("steps: 12", "steps: 2000000"))
    run = tmp_path / "run"
    first = start_train(spec_file, run)
    try:
        wait_for(run / "metrics.jsonl", first)
        stop(first)  # frozen, so the directory holds still while we compare
        before = snapshot(run)
        for args in (["train", str(spec_file), "--run-dir", str(run), "--steps", "2"], ["resume", str(run)]):
            second = run_cli(*args)
            assert second.returncode == 6, second.stderr
            assert f"PID {first.pid}" in second.stderr and "one writer per run directory" in second.stderr
            assert "Traceback" not in second.stderr
            assert snapshot(run) == before
        os.kill(first.pid, signal.SIGCONT)
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=60)
        assert first.returncode == 130, err  # the holder itself went on undisturbed
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGCONT)
            first.kill()
            first.communicate()


def test_resume_after_the_holder_was_sigkilled(spec_file, tmp_path):  # noqa: F811
    spec_file.write_text(spec_file.read_text().replace("steps: 12", "steps: 2000000")
                         .replace("every_steps: 100", "every_steps: 3"))
    run = tmp_path / "run"
    holder = start_train(spec_file, run)
    try:
        wait_for(run / "checkpoints" / "latest", holder)
    finally:
        holder.kill()
        holder.communicate()
    assert (run / ".lock").read_text().strip() == str(holder.pid)  # the dead holder's PID is still there
    # the kill may land between a checkpoint's rename and the `latest` pointer: go past every one
    newest = max(int(p.name.rsplit("-", 1)[1]) for p in (run / "checkpoints").glob("ckpt-*"))
    resumed = run_cli("resume", str(run), "--steps", str(newest + 3))
    assert resumed.returncode == 0, resumed.stderr
    assert "restored" in resumed.stderr and f"-{newest + 3} in" in resumed.stdout  # progress; the result
    assert json.loads((run / "run.json").read_text())["step"] == newest + 3
    assert (run / ".lock").read_text().strip() != str(holder.pid)
