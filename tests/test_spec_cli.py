"""`flowctl validate` and `flowctl inspect` through click's CliRunner: exit codes, the summary
line, the JSON reports, the schema, and the key reference kept in step with it."""
from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner

from flowctl.cli.main import cli
from flowctl.spec.reference import key_paths, render

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"


def _run(*args: str):
    result = CliRunner().invoke(cli, list(args))
    assert "Traceback" not in result.output
    return result


def test_validate_ok_prints_one_summary_line():
    r = _run("validate", str(SPECS / "demo.yaml"))
    assert r.exit_code == 0, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1
    assert "ok:" in lines[0] and "3,300 parameters" in lines[0] and "graph nodes" in lines[0]


def test_validate_all_shipped_specs():
    for spec in sorted(SPECS.glob("*.yaml")):
        r = _run("validate", "--no-build", str(spec))
        assert r.exit_code == 0, (spec, r.output)


def test_validate_missing_file_and_no_argument():
    r = _run("validate", "no/such/spec.yaml")
    assert r.exit_code == 2 and "no such spec file" in r.output
    r = _run("validate")
    assert r.exit_code == 2 and "give a SPEC file" in r.output


def test_inspect_json_inception_reports_the_reference_numbers():
    r = _run("inspect", str(SPECS / "inception_v3.yaml"), "--json")
    assert r.exit_code == 0
    report = json.loads(r.stdout)
    assert report["params"] == {"total": 23_851_784, "trainable": 23_817_352, "non_trainable": 34_432}
    blocks = {b["name"]: b for b in report["blocks"]}
    assert blocks["mixed_5b"]["output_shape"] == [None, 35, 35, 256]
    assert blocks["mixed_7c"]["output_shape"] == [None, 8, 8, 2048]
    layers = {row["name"]: row for row in report["layers"]}
    assert layers["logits"]["params"] == 2048 * 1000 + 1000
    assert report["nodes"]["training_step"] > report["nodes"]["forward"] > 0
    assert report["flops"]["training_step"] > report["flops"]["forward"] > 0
    assert report["memory"]["activation_bytes"] > 0
    assert sum(row["params"] for row in report["layers"]) == report["params"]["total"]


def test_inspect_lstm_lm_table():
    r = _run("inspect", str(SPECS / "lstm_lm.yaml"))
    assert r.exit_code == 0, r.output
    assert "19,775,200" in r.output  # 6.5M embedding + 2 x 3,382,600 LSTM + 6.51M softmax
    assert "lstm_1" in r.output and "(?, 35, 650)" in r.output
    assert re.search(r"FLOPs at batch 20: forward [\d.]+G, training step [\d.]+G", r.output)


def test_inspect_a_broken_spec_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nmodel:\n  layers:\n    - {name: x, type: imput, shape: [3]}\n")
    r = _run("inspect", str(bad))
    assert r.exit_code == 2
    assert f"{bad}:4:23: model.layers[x].type: unknown layer type 'imput'; did you mean 'input'?" in r.output


def test_schema_is_json_and_the_reference_is_in_step():
    r = _run("validate", "--schema")
    assert r.exit_code == 0
    schema = json.loads(r.stdout)
    assert schema["title"] == "Spec" and "model" in schema["properties"]
    documented = (ROOT / "flowctl" / "spec" / "REFERENCE.md").read_text()
    paths = {row["path"] for row in key_paths(schema)}
    in_doc = set(re.findall(r"^\| `([^`]+)` \|", documented, flags=re.M))
    assert paths - in_doc == set(), "keys missing from REFERENCE.md (regenerate with reference.render())"
    assert in_doc - paths == set(), "REFERENCE.md documents keys the schema no longer has"
    assert documented == render()
    # every section the issue lists is in the schema
    for section in ("model", "data", "devices", "placement", "parallelism", "training", "checkpoint", "cluster"):
        assert section in paths
