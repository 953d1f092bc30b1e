"""Training runs end to end: exact resume, crash safety, corruption, Ctrl-C, the NaN guard,
TensorBoard files, and the README's demo (issue 4)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli
from flowctl.spec.loader import load_spec
from flowctl.training.trainer import Trainer

SPEC = """\
version: 1
name: exact
model:
  layers:
    - {name: x, type: input, shape: [6]}
    - {name: h, type: dense, units: 16, activation: relu}
    - {name: drop, type: dropout, rate: 0.3}
    - {name: logits, type: dense, units: 3}
    - {name: y, type: input, shape: [], dtype: int32, classes: 3}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, y]}
data: {source: arrays, path: data.npz, shuffle: true, seed: 5}
training:
  optimizer: {type: adam}
  learning_rate: {schedule: exponential, initial: 0.05, decay_rate: 0.5, decay_steps: 4}
  batch_size: 10
  steps: 12
  seed: 3
checkpoint: {every_steps: 100, keep: 3}
"""


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 6)).astype(np.float32)  # 4 batches per epoch
    np.savez(tmp_path / "data.npz", x=x, y=(x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32))
    p = tmp_path / "exact.yaml"
    p.write_text(SPEC)
    return p


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowctl.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


def straight(spec_file: Path, run_dir: Path, steps: int) -> Trainer:
    t = Trainer(load_spec(spec_file), run_dir, steps=steps)
    t.start_fresh(spec_file.read_text(), str(spec_file))
    t.train()
    return t


def resumed(spec_file: Path, run_dir: Path, steps: int) -> Trainer:
    t = Trainer(load_spec(spec_file), run_dir, steps=steps)
    t.restore()
    t.train()
    return t


def losses(run_dir: Path) -> list[float]:
    """The training loss of every step the run logged (evaluation records carry none)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def assert_same_state(a: Trainer, b: Trainer) -> None:
    va, vb = a.session.variable_values(), b.session.variable_values()
    assert sorted(va) == sorted(vb)
    assert any("/Adam/" in k for k in va)  # optimizer slots are compared too
    for k in va:
        np.testing.assert_array_equal(va[k], vb[k], err_msg=k)
    assert a.session.rng_states().keys() == b.session.rng_states().keys()


@pytest.mark.parametrize("k", [5, 4])  # mid-epoch, and exactly at the epoch boundary
def test_k_steps_then_resume_equals_n_steps_straight(spec_file, tmp_path, k):
    full = straight(spec_file, tmp_path / "full", 12)
    straight(spec_file, tmp_path / "split", k)
    again = resumed(spec_file, tmp_path / "split", 12)
    assert losses(tmp_path / "full") == losses(tmp_path / "split")  # bitwise, step by step
    assert len(losses(tmp_path / "split")) == 12
    assert_same_state(full, again)


@pytest.mark.parametrize("phase", ["after_tensors", "after_manifest", "before_commit_marker", "before_rename",
                                   "before_latest", "before_prune"])
def test_sigkill_during_a_save_leaves_a_resumable_run(spec_file, tmp_path, phase):
    full = straight(spec_file, tmp_path / "full", 9)
    run = tmp_path / "crash"
    spec = spec_file.read_text().replace("every_steps: 100", "every_steps: 3")
    spec_file.write_text(spec)
    assert run_cli("train", str(spec_file), "--run-dir", str(run), "--steps", "3").returncode == 0
    child = Path(__file__).resolve().parent / "crash_child.py"
    killed = subprocess.run([sys.executable, str(child), "--cli", phase, "resume", str(run), "--steps", "9"],
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    again = resumed(spec_file, run, 9)  # finds checkpoint 3 or 6, whichever is whole
    assert losses(run) == losses(tmp_path / "full")
    assert_same_state(full, again)
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_corrupted_newest_checkpoint_falls_back_to_the_previous(spec_file, tmp_path):
    spec_file.write_text(spec_file.read_text().replace("every_steps: 100", "every_steps: 4"))
    full = straight(spec_file, tmp_path / "full", 12)
    run = tmp_path / "run"
    straight(spec_file, run, 8)  # checkpoints at 4 and 8
    tensor_file = next((run / "checkpoints" / "ckpt-00000008").glob("*.safetensors"))
    data = bytearray(tensor_file.read_bytes())
    data[-3] ^= 0xFF
    tensor_file.write_bytes(bytes(data))
    warnings: list[str] = []
    t = Trainer(load_spec(spec_file), run, steps=12, on_warning=warnings.append)
    assert t.restore().endswith("ckpt-00000004")
    assert any("ckpt-00000008" in w and "checksum" in w for w in warnings), warnings
    t.train()
    assert losses(run) == losses(tmp_path / "full")
    assert_same_state(full, t)


def test_ctrl_c_writes_a_checkpoint_and_exits_130(spec_file, tmp_path):
    spec_file.write_text(spec_file.read_text().replace("steps: 12", "steps: 2000000"))
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "flowctl.cli.main", "train", str(spec_file), "--run-dir",
                             str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and (not metrics.exists() or metrics.stat().st_size < 2000):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted at step" in err and "flowctl resume" in err
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "interrupted"
    assert (run / "checkpoints" / f"ckpt-{info['step']:08d}").is_dir()


def test_nan_guard_names_the_node(spec_file, tmp_path):
    spec_file.write_text(spec_file.read_text().replace("initial: 0.05", "initial: 1.0e+30"))
    r = CliRunner().invoke(cli, ["train", str(spec_file), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 5, r.output
    assert "the loss is not finite" in r.output and "node '" in r.output
    assert "Traceback" not in r.output


def test_tensorboard_can_read_the_event_files(spec_file, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = CliRunner().invoke(cli, ["train", str(spec_file), "--run-dir", str(tmp_path / "run"), "--histograms", "4"])
    assert r.exit_code == 0, r.output
    acc = EventAccumulator(str(tmp_path / "run" / "events"))
    acc.Reload()
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == list(range(1, 13))
    np.testing.assert_allclose([e.value for e in loss], losses(tmp_path / "run"), rtol=1e-6)
    assert any(t.startswith("weights/") for t in acc.Tags()["histograms"])


def test_readme_demo_trains_to_its_stated_loss(tmp_path):
    r = CliRunner().invoke(cli, ["train", "--run-dir", str(tmp_path / "demo"), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["last_step"] == 600
    # The README states: held-out loss below 0.15 and accuracy above 0.95 after 600 steps.
    assert summary["evaluation"]["val/loss"] < 0.15 and summary["evaluation"]["val/accuracy"] > 0.95
    first = losses(tmp_path / "demo")[0]
    assert first > 1.0
    best = summary["best"]
    assert best["metric"] == "val/accuracy" and best["value"] == max(
        json.loads(x)["val/accuracy"] for x in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()
        if "val/accuracy" in x)
    assert Path(best["checkpoint"]).is_dir()


def test_embedded_demo_is_the_shipped_demo_spec():
    root = Path(__file__).resolve().parents[1]
    assert (root / "specs" / "demo.yaml").read_text() == (root / "flowctl" / "spec" / "builtin" / "demo.yaml").read_text()


def test_default_run_dirs_are_never_reused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        assert CliRunner().invoke(cli, ["train", "--steps", "2"]).exit_code == 0
    assert (tmp_path / "runs" / "demo" / "run.json").exists()
    assert (tmp_path / "runs" / "demo-2" / "run.json").exists()


def test_train_refuses_an_existing_run_and_resume_a_missing_one(spec_file, tmp_path):
    run = tmp_path / "run"
    assert CliRunner().invoke(cli, ["train", str(spec_file), "--run-dir", str(run), "--steps", "2"]).exit_code == 0
    r = CliRunner().invoke(cli, ["train", str(spec_file), "--run-dir", str(run)])
    assert r.exit_code == 1 and "already holds a run" in r.output
    r = CliRunner().invoke(cli, ["resume", str(tmp_path / "nothing")])
    assert r.exit_code == 6 and "no run here" in r.output


def test_lstm_lm_perplexity_falls_on_a_text_file(tmp_path):
    words = "the cat sat on the mat and the dog sat on the log".split()
    rng = np.random.default_rng(0)
    text = " ".join(words[i % len(words)] if rng.random() < 0.9 else words[rng.integers(len(words))]
                    for i in range(30000))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    root = Path(__file__).resolve().parents[1]
    r = CliRunner().invoke(cli, ["train", str(root / "specs" / "lstm_lm.yaml"), "--data", str(corpus),
                                 "--steps", "12", "--run-dir", str(tmp_path / "lm")])
    assert r.exit_code == 0, r.output
    ls = losses(tmp_path / "lm")
    ppl_first, ppl_last = np.exp(np.mean(ls[:3])), np.exp(np.mean(ls[-3:]))
    assert ppl_first > 5000  # about the vocabulary size (10,000) at initialisation
    assert ppl_last < ppl_first / 5, (ppl_first, ppl_last)


@pytest.mark.parametrize("name, folder", [("../../escape", ".._.._escape"), ("/tmp/abs", "_tmp_abs"),
                                          ("..", "run"), ("lstm_lm", "lstm_lm"), ("a b:c", "a_b_c")])
def test_a_specs_name_is_a_folder_name_under_runs_never_a_path(name, folder, tmp_path, monkeypatch):
    from flowctl.training.runs import choose_run_dir

    monkeypatch.chdir(tmp_path)
    d = choose_run_dir(name, None)
    assert d == Path("runs") / folder
    assert (tmp_path / d).resolve().parent == (tmp_path / "runs").resolve()


@pytest.mark.parametrize("command", [["train", "--steps", "-5"], ["train", "--steps", "0"],
                                     ["resume", "somewhere", "--steps", "-1"], ["train", "--run-dir", ""],
                                     ["train", "--run-dir", "  "]])
def test_a_step_count_below_one_or_an_empty_run_dir_is_a_usage_error(command):
    from click.testing import CliRunner

    from flowctl.cli.main import cli

    r = CliRunner().invoke(cli, command)
    assert r.exit_code == 2 and command[-2] in r.output, r.output


def test_a_train_that_fails_at_start_leaves_no_run_directory_behind(tmp_path, monkeypatch):
    """A start that fails (an unreachable Ray address, say: here, opening the program raises)
    removes the run directory it made; a directory that was there before is left alone."""
    from flowctl.training import runs
    from flowctl.training.trainer import Trainer

    def refuse(self, *a, **k):
        raise ConnectionError("could not reach the Ray cluster at 10.9.9.9:6379")

    monkeypatch.setattr(Trainer, "start_fresh", refuse)
    with pytest.raises(ConnectionError):
        runs.start_run(None, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ConnectionError):
        runs.start_run(None, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
