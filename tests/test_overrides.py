"""`--set KEY=VALUE` on train, place, bench, inspect and validate: values read as YAML, keys checked
with a "did you mean", the run directory records the resolved spec with them and resume applies
them again; `--devices` takes the spec's device names as well as profiles."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli
from flowctl.engine.errors import SpecError
from flowctl.spec.loader import load_spec

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "specs" / "demo.yaml"
LM = ROOT / "specs" / "lstm_lm.yaml"


def test_overrides_change_the_spec_as_the_file_would():
    loaded = load_spec(LM, ["training.batch_size=4", "model.layers.lstm_1.units=32",
                            "training.optimizer={type: adam, beta1: 0.8}", "devices=[cpu:0, cpu:1]"])
    assert loaded.global_batch == 4
    assert loaded.layers["lstm_1"].layer.units == 32  # type: ignore[attr-defined]
    assert loaded.spec.training.optimizer.type == "adam" and loaded.spec.training.optimizer.beta1 == 0.8
    assert [d.name.rsplit(":", 1)[-1] for d in loaded.spec.devices] == ["0", "1"]
    # Values still pass validation, with the spec's own messages.
    with pytest.raises(SpecError, match="Input should be 'sgd', 'momentum', 'adam' or 'adamw'"):
        load_spec(LM, ["training.optimizer.type=adagrad"])


@pytest.mark.parametrize("override, message", [
    ("training.batchsize=3", "unknown key 'batchsize' in training; did you mean 'batch_size'?"),
    ("model.layers.lstm_1.unitz=5", "unknown key 'unitz' in model.layers.lstm_1; did you mean 'units'?"),
    ("model.layers.lstm_3.units=5", "no item named 'lstm_3' in model.layers; did you mean"),
    ("trainig.steps=3", "unknown key 'trainig' in the spec; did you mean 'training'?"),
    ("training.batch_size", "write KEY=VALUE"),
])
def test_a_wrong_override_is_one_line_and_exit_2(override, message):
    for command in (["validate", str(LM)], ["inspect", str(LM)], ["place", str(LM)], ["train", str(LM)]):
        r = CliRunner().invoke(cli, [*command, "--set", override])
        assert r.exit_code == 2, r.output
        assert message in r.output and "Traceback" not in r.output
        assert len(r.output.strip().splitlines()) == 1, r.output


def test_the_run_records_its_overrides_and_resume_applies_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    r = CliRunner().invoke(cli, ["train", str(DEMO), "--run-dir", str(run), "--steps", "4",
                                 "--set", "training.batch_size=8", "--set", "model.layers.hidden_1.units=16"])
    assert r.exit_code == 0, r.output
    info = json.loads((run / "run.json").read_text())
    assert info["overrides"]["set"] == ["training.batch_size=8", "model.layers.hidden_1.units=16"]
    resolved = json.loads((run / "spec.resolved.json").read_text())["spec"]
    assert resolved["training"]["batch_size"] == 8
    assert next(layer for layer in resolved["model"]["layers"] if layer["name"] == "hidden_1")["units"] == 16
    # Resume reads the spec again with the same overrides: no change, so it continues.
    r = CliRunner().invoke(cli, ["resume", str(run), "--steps", "6"])
    assert r.exit_code == 0, r.output
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 6


def test_train_devices_and_algorithm_set_the_spec_keys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    r = CliRunner().invoke(cli, ["train", str(DEMO), "--run-dir", str(run), "--steps", "2",
                                 "--devices", "cpu:0,cpu:1", "--algorithm", "heft"])
    assert r.exit_code == 0, r.output
    spec = json.loads((run / "spec.resolved.json").read_text())["spec"]
    assert len(spec["devices"]) == 2 and spec["placement"]["algorithm"] == "heft"
    assert (run / "placement.json").exists()  # the step ran placed over the two devices
    r = CliRunner().invoke(cli, ["train", str(DEMO), "--run-dir", str(tmp_path / "b"), "--devices", "4xgpu:k40"])
    assert r.exit_code == 2 and "give device names" in r.output


def test_place_devices_takes_names_or_profiles():
    r = CliRunner().invoke(cli, ["place", str(DEMO), "--devices", "cpu:0,cpu:1", "--json", "-a", "greedy"])
    assert r.exit_code == 0, r.output
    names = [d["name"] for d in json.loads(r.stdout)["cluster"]]
    assert [n.rsplit("/", 1)[-1] for n in names] == ["device:cpu:0", "device:cpu:1"]
    r = CliRunner().invoke(cli, ["place", str(DEMO), "--devices", "2xgpu:k40", "--json"])
    assert r.exit_code == 0, r.output
    assert [d["profile"] for d in json.loads(r.stdout)["cluster"]] == ["k40", "k40"]


def test_a_spec_that_is_not_utf8_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("version: 1\nname: caf\xe9\n".encode("latin-1"))
    for command in (["validate", str(bad)], ["train", str(bad)], ["place", str(bad)], ["inspect", str(bad)]):
        r = CliRunner().invoke(cli, command)
        assert r.exit_code == 2, r.output
        assert f"{bad}:2: not UTF-8 text (byte 0xe9" in r.output and "Traceback" not in r.output
        assert len(r.output.strip().splitlines()) == 1
