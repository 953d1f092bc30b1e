"""The command line through click's CliRunner: exit codes, messages, JSON on stdout."""
from __future__ import annotations

import json

from click.testing import CliRunner

from flowctl.cli.main import cli


def test_unknown_bench_target_is_one_clear_error():
    r = CliRunner().invoke(cli, ["bench", "no_such_suite"])
    assert r.exit_code == 1
    assert "no spec file or built-in suite named 'no_such_suite'" in r.output
    assert "Traceback" not in r.output


def test_demo_trains_and_prints_json():
    r = CliRunner().invoke(cli, ["demo", "--steps", "60", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout.strip().splitlines()[-1])
    assert data["steps"] == 60 and data["final_loss"] < data["first_loss"]


def test_bench_engine_quick_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(cli, ["bench", "engine", "--quick", "--json", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["suite"] == "engine"
    assert data["dispatch_chain"]["nodes"] == 2000
    assert len(data["conv2d"]) == 3 and all(d["ratio_to_matmul"] > 0 for d in data["conv2d"])
    assert data["lstm_cell"]["ratio_to_matmuls"] > 0


def test_bench_prefetch_quick_reports_both_rates():
    r = CliRunner().invoke(cli, ["bench", "prefetch", "--quick", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout[r.stdout.index("{"):])
    assert data["steps_per_s_plain"] > 0 and data["steps_per_s_prefetch"] > 0 and "speedup" in data
