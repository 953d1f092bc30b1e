"""Each command's result on stdout, its progress and logs on stderr (issue 31, item 10): tables,
summary lines and `--json` are what `flowctl x | less` or `> file` gets; step lines, progress,
warnings and the banner reach the person without mixing in. With --json, stdout is the JSON alone
and the tables go to stderr."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "specs" / "demo.yaml")
TABLE = re.compile("[┏┃┡│└]")  # a rich table's rules
STEP_LINE = re.compile(r"^step +\d+ +loss", re.M)


def _invoke(*args: str):
    r = CliRunner(env={"COLUMNS": "120"}).invoke(cli, list(args))
    assert r.exit_code == 0, r.output
    return r


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 20-step demo run (evaluated and checkpointed at step 20)."""
    path = tmp_path_factory.mktemp("streams") / "run"
    _invoke("train", DEMO, "--run-dir", str(path), "--steps", "20", "--set", "training.log_every_steps=5",
            "--set", "training.eval_every_steps=20", "--set", "checkpoint.every_steps=20")
    return path


def test_validate_prints_its_verdict_on_stdout():
    r = _invoke("validate", DEMO)
    assert r.stdout.startswith(f"ok: {DEMO}: model 'demo_mlp'") and r.stderr == ""


def test_inspect_prints_its_tables_on_stdout():
    r = _invoke("inspect", DEMO)
    assert TABLE.search(r.stdout) and "hidden_1" in r.stdout and "parameters: 3,300" in r.stdout
    assert r.stderr == ""
    j = _invoke("inspect", DEMO, "--json")
    assert json.loads(j.stdout)["params"]["total"] == 3300 and j.stderr == ""


def test_place_prints_its_tables_on_stdout_and_beside_json_on_stderr():
    r = _invoke("place", DEMO, "--devices", "cpu:0,cpu:1", "--explain", "--limit", "5")
    assert TABLE.search(r.stdout) and "predicted step time" in r.stdout and "per node" in r.stdout
    assert r.stderr == ""
    j = _invoke("place", DEMO, "--devices", "cpu:0,cpu:1", "--json")
    assert json.loads(j.stdout)["algorithm"]  # stdout is one JSON document
    assert "predicted step time" in j.stderr and TABLE.search(j.stderr)


def test_train_prints_steps_on_stderr_and_its_summary_on_stdout(tmp_path):
    r = _invoke("train", DEMO, "--run-dir", str(tmp_path / "r"), "--steps", "10",
                "--set", "training.log_every_steps=5")
    assert len(STEP_LINE.findall(r.stderr)) == 2 and "training demo (3,300 parameters)" in r.stderr
    assert not STEP_LINE.search(r.stdout)
    assert r.stdout.startswith("trained steps 1-10 in ") and r.stdout.count("\n") == 1
    j = _invoke("train", DEMO, "--run-dir", str(tmp_path / "j"), "--steps", "5", "--json")
    assert json.loads(j.stdout)["last_step"] == 5 and "trained steps 1-5" in j.stderr


def test_resume_prints_restored_on_stderr_and_its_summary_on_stdout(run, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    r = _invoke("resume", str(copy), "--steps", "25")
    assert "restored " in r.stderr and "restored " not in r.stdout
    assert r.stdout.startswith("trained steps 21-25 in ")
    done = _invoke("resume", str(copy), "--steps", "25")
    assert done.stdout.startswith("nothing to do: the run is at step 25 of 25")


def test_evaluate_predict_and_export_print_their_results_on_stdout(run, tmp_path):
    r = _invoke("evaluate", str(run))
    assert "(step 20) on " in r.stdout and "val/accuracy" in r.stdout and r.stderr == ""
    j = _invoke("evaluate", str(run), "--json")
    assert json.loads(j.stdout)["step"] == 20 and "val/accuracy" in j.stderr
    data = tmp_path / "in.npz"
    np.savez(data, features=np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32))
    p = _invoke("predict", str(run), str(data))
    assert p.stdout.startswith("3 examples predicted") and p.stderr == ""
    e = _invoke("export", str(run), "--out", str(tmp_path / "out"))
    assert e.stdout.startswith("exported step 20 (") and e.stderr == ""


def test_demo_and_bench_show_progress_on_stderr_and_results_on_stdout():
    r = _invoke("demo", "--steps", "30")
    assert r.stdout.startswith("trained 30 steps in ") and r.stderr == ""  # no terminal: no progress bar
    b = _invoke("bench", "prefetch", "--quick")
    assert TABLE.search(b.stdout) and "steps_per_s_plain" in b.stdout
    assert not TABLE.search(b.stderr)
    j = _invoke("bench", "prefetch", "--quick", "--json")
    assert json.loads(j.stdout)["steps_per_s_plain"] > 0 and "steps_per_s_plain" in j.stderr


def test_graph_says_what_it_wrote_on_stdout(tmp_path):
    r = _invoke("graph", DEMO, "--out", str(tmp_path / "g.html"))
    assert r.stdout.startswith(f"wrote {tmp_path / 'g.html'}: ") and r.stderr == ""


def test_errors_and_warnings_stay_on_stderr(tmp_path):
    r = CliRunner().invoke(cli, ["inspect", str(tmp_path / "missing.yaml")])
    assert r.exit_code != 0 and r.stdout == "" and "error:" in r.stderr


def test_a_piped_inspect_gets_its_tables_without_colour_codes():
    """`flowctl inspect x.yaml | less`: the tables reach the pipe, plain."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    env.pop("FORCE_COLOR", None)
    p = subprocess.run([sys.executable, "-m", "flowctl.cli.main", "inspect", DEMO], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    assert TABLE.search(p.stdout) and "hidden_1" in p.stdout and "\x1b[" not in p.stdout
    assert p.stderr == ""
