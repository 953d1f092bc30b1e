"""Many runs (issue 35): checkpoint.keep_best.count, `flowctl runs` (each status told right, a live
run left untouched) and `flowctl runs compare` (--set lines that rebuild B's spec from A's, charts)."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli
from flowctl.engine import checkpoint as ckpt
from flowctl.engine.errors import CheckpointError
from flowctl.training.evaluate import ranked
from flowctl.training.inference import _checkpoint
from flowctl.training.rundir import RunDir, RunLock, resolved
from flowctl.training.runs import load_training_spec

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
BEST4 = ["--set", "training.eval_every_steps=1", "--set", "training.learning_rate=0.05", "--set",
         "checkpoint={every_steps: 5, keep: 2, keep_best: {metric: val/accuracy, mode: max, count: 4}}"]


def _train(run: Path, *args: str, steps: int = 30) -> dict:
    r = CliRunner().invoke(cli, ["train", "--run-dir", str(run), "--json", "--set", f"training.steps={steps}", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])


def _evaluations(run: Path, metric: str) -> list[tuple[int, float]]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[metric]) for r in recs if metric in r]


def _best_dirs(run: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run / "checkpoints" / "best").glob("ckpt-*"))


# ---------------------------------------------------------------------------- keep_best count
def test_ranked_keeps_the_earlier_of_ties_and_no_nan():
    r: list = []
    for step, v in enumerate([0.5, 0.7, 0.7, float("nan"), 0.6, 0.7, 0.9], 1):
        r = ranked(r, v, step, "max", 3)
    assert r == [[0.9, 7], [0.7, 2], [0.7, 3]]  # the 0.7s of steps 2 and 3 before step 6's
    r = []
    for step, v in enumerate([3.0, 1.0, 2.0, 1.0], 1):
        r = ranked(r, v, step, "min", 2)
    assert r == [[1.0, 2], [1.0, 4]]
    assert ranked([[1.0, 2]], 1.0, 5, "min", 1) == [[1.0, 2]]  # count 1: a tie never replaces


def test_keep_best_count_keeps_the_k_best_ranked(tmp_path):
    run = tmp_path / "best4"
    summary = _train(run, *BEST4)
    evals = _evaluations(run, "val/accuracy")
    assert len(evals) == 30
    # Reference: best first, a tie ordered by step (the earlier kept).
    want = sorted(evals, key=lambda e: (-e[1], e[0]))[:4]
    assert _best_dirs(run) == sorted(s for s, _ in want)
    ranking = json.loads((run / "checkpoints" / "best" / "ranking.json").read_text())
    assert [(r["step"], r["value"]) for r in ranking["ranking"]] == want
    assert ranking["metric"] == "val/accuracy" and ranking["count"] == 4
    assert summary["best"]["step"] == want[0][0] and summary["best"]["value"] == want[0][1]
    # `--checkpoint best` is the first of the ranking, not the newest of the four.
    assert _checkpoint(RunDir(run), "best").state["step"] == want[0][0]


def test_keep_best_count_one_keeps_todays_layout(tmp_path):
    run = tmp_path / "best1"
    _train(run, "--set", "training.eval_every_steps=2", steps=12)  # the demo's keep_best: val/accuracy, max
    evals = _evaluations(run, "val/accuracy")
    best = min(evals, key=lambda e: (-e[1], e[0]))
    assert _best_dirs(run) == [best[0]]
    assert (run / "checkpoints" / "best" / "latest").read_text().strip() == f"ckpt-{best[0]:08d}"


def test_the_ranking_survives_a_resume_exactly(tmp_path):
    straight = tmp_path / "straight"
    _train(straight, *BEST4)
    # A run that crashed after step 17: its last checkpoint is step 15, and checkpoints/best/ holds
    # what it saved after that (abandoned). The resume must rank exactly as the straight run did.
    run = tmp_path / "resumed"
    _train(run, *BEST4, steps=17)
    shutil.rmtree(run / "checkpoints" / "ckpt-00000017")
    (run / "checkpoints" / "latest").write_text("ckpt-00000015\n")
    r = CliRunner().invoke(cli, ["resume", str(run), "--steps", "30"])
    assert r.exit_code == 0, r.output
    a = json.loads((straight / "checkpoints" / "best" / "ranking.json").read_text())["ranking"]
    b = json.loads((run / "checkpoints" / "best" / "ranking.json").read_text())["ranking"]
    assert [(x["step"], x["value"]) for x in a] == [(x["step"], x["value"]) for x in b]
    assert _best_dirs(straight) == _best_dirs(run)
    last = [ckpt.load(p / "checkpoints" / "ckpt-00000030").state["tracking"]["ranking"] for p in (straight, run)]
    assert last[0] == last[1]


# ---------------------------------------------------------------------------- runs: the four statuses
def _flowctl(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flowctl.cli.main", *args], cwd=cwd, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _snapshot(run: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    """A finished, an interrupted (a real train, SIGINT) and a failed run (a NaN loss)."""
    root = tmp_path_factory.mktemp("many") / "runs"
    _train(root / "finished", "--set", "training.eval_every_steps=5", steps=20)
    proc = _flowctl("train", "--run-dir", str(root / "interrupted"), "--set", "training.steps=2000000",
                    "--set", "training.eval_every_steps=1000000", cwd=root.parent)
    metrics = root / "interrupted" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or metrics.stat().st_size < 2000):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    r = CliRunner().invoke(cli, ["train", "--run-dir", str(root / "failed"), "--set", "training.steps=50",
                                 "--set", "training.learning_rate=1.0e+30"])
    assert r.exit_code == 5, r.output
    return root


def _views(root: Path) -> dict[str, dict]:
    r = CliRunner().invoke(cli, ["runs", str(root), "--json"])
    assert r.exit_code == 0, r.output
    return {Path(v["path"]).name: v for v in json.loads(r.stdout.strip().splitlines()[-1])}


def test_runs_tells_each_status(runs_dir):
    v = _views(runs_dir)
    assert v["finished"]["status"] == "finished"
    assert v["finished"]["step"] == 20 and v["finished"]["planned"] == 20 and v["finished"]["spec"] == "demo"
    assert v["finished"]["metric"] == "val/accuracy"  # the demo's keep_best
    evals = _evaluations(runs_dir / "finished", "val/accuracy")
    assert v["finished"]["last"] == evals[-1][1] and v["finished"]["best"] == max(e[1] for e in evals)
    assert v["interrupted"]["status"] == "interrupted" and v["interrupted"]["detail"] == "SIGINT"
    assert 0 < v["interrupted"]["step"] < v["interrupted"]["planned"] == 2000000
    assert v["interrupted"]["metric"] == "val/accuracy" and v["interrupted"]["last"] is None  # never evaluated
    assert v["failed"]["status"] == "failed" and "not finite" in v["failed"]["detail"]
    assert all(x["strategy"] == "single" and x["seconds"] > 0 for x in v.values())
    # The table a person reads, on stdout.
    r = CliRunner().invoke(cli, ["runs", str(runs_dir)], env={"COLUMNS": "160"})
    assert r.exit_code == 0 and "Traceback" not in r.output
    for name in ("finished", "interrupted", "failed"):
        assert name in r.stdout


def test_a_live_run_reads_running_and_is_left_untouched(runs_dir, tmp_path):
    root = tmp_path / "runs"
    run = root / "live"
    shutil.copytree(runs_dir / "finished", run)
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "status": "running", "started": time.time()}))
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 21, "loss": 0.3')  # the line the trainer is writing
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from flowctl.training.rundir import RunLock; RunLock(Path(sys.argv[1])).acquire(); "
                               "print('locked', flush=True); time.sleep(600)", str(run)],
                              env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        before = _snapshot(run)
        v = _views(root)["live"]
        assert v["status"] == "running" and v["step"] == 20
        assert _snapshot(run) == before  # nothing written, no mtime moved
        with pytest.raises(CheckpointError, match="in use by another flowctl process"):
            RunLock(run).acquire()  # the holder still has it
    finally:
        holder.kill()  # our own child, by its handle
        holder.wait()
    v = _views(root)["live"]  # the process is gone, its lock file stays
    assert (run / ".lock").exists()
    assert v["status"] == "interrupted" and "process gone" in v["detail"]


# ---------------------------------------------------------------------------- runs compare
def test_compare_set_lines_rebuild_b_from_a(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _train(a, steps=6)
    b_sets = ["training.learning_rate=0.003", "model.layers.hidden_1.units=48", "training.optimizer={type: sgd}",
              "training.metrics=[loss]", "checkpoint.keep_best=null", "training.eval_every_steps=3"]
    _train(b, *[x for s in b_sets for x in ("--set", s)], steps=8)
    png = tmp_path / "out" / "curves.png"
    r = CliRunner().invoke(cli, ["runs", "compare", str(a), str(b), "--json", "--png", str(png)])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    lines = out["set"]
    assert "model.layers.hidden_1.units=48" in lines and "training.steps=8" in lines
    a_info = json.loads((a / "run.json").read_text())
    rebuilt, _, _ = load_training_spec(None, overrides=[*a_info["overrides"]["set"], *lines])
    assert resolved(rebuilt.spec) == json.loads((b / "spec.resolved.json").read_text())["spec"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert [s for s, _ in out["curves"]["loss"][str(b)]] == list(range(1, 9))
    # The terminal chart: both runs' marks under the title.
    assert "loss by step: * " in r.output and "o " + str(b) in r.output


def test_compare_set_lines_read_back_floats_and_strings():
    from flowctl.spec.overrides import parse
    from flowctl.training.runs_view import set_lines

    a = {"x": {"f": 0.1, "s": "a", "l": [1, 2]}, "y": [{"name": "p", "v": 1}]}
    b = {"x": {"f": 1e-08, "s": "yes", "l": [1, 2, 3]}, "y": [{"name": "p", "v": float("inf")}]}
    lines = set_lines(a, b)
    assert lines == ["x.f=1.0e-08", 'x.s="yes"', "x.l=[1, 2, 3]", "y.p.v=.inf"]
    values = [parse(line)[1] for line in lines]
    assert values[:3] == [1e-08, "yes", [1, 2, 3]] and math.isinf(values[3])


def test_png_without_matplotlib_is_one_clear_error(runs_dir, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    r = CliRunner().invoke(cli, ["runs", "compare", str(runs_dir / "finished"), str(runs_dir / "failed"),
                                 "--png", str(tmp_path / "x.png")])
    assert r.exit_code == 2 and "pip install 'flowctl[plot]'" in r.output and "Traceback" not in r.output
