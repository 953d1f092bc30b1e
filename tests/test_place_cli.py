"""`flowctl place` and `flowctl bench SPEC` through the CLI: exit codes, the explanation, JSON."""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli
from flowctl.engine.devices import canonical

ROOT = Path(__file__).resolve().parents[1]

TWO_TOWERS = """\
version: 1
name: towers
model:
  layers:
    - {name: x, type: input, shape: [64]}
    - {name: left, type: dense, units: 256, activation: relu, inputs: [x]}
    - {name: right, type: dense, units: 256, activation: relu, inputs: [x]}
    - {name: join, type: concat, inputs: [left, right]}
    - {name: logits, type: dense, units: 4}
    - {name: y, type: input, shape: [], dtype: int32, classes: 4}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, y]}
devices: [cpu:0, cpu:1]
placement:
  algorithm: greedy
  constraints:
    - {match: "left*", device: cpu:0}
    - {match: "right*", device: cpu:1}
training: {batch_size: 16, steps: 5}
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "towers.yaml"
    p.write_text(text)
    return p


def test_place_explains_each_node_and_compares(tmp_path):
    spec = write(tmp_path, TWO_TOWERS)
    r = CliRunner().invoke(cli, ["place", str(spec), "--explain", "--json", "--limit", "0"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["algorithm"] == "greedy" and data["valid"]
    assert set(data["compared"]) == {"single", "expert"}
    # The expectation over the static model's assumed jitter, for the chosen and the compared.
    assert data["expected"]["jitter"] == 0.05 and data["expected"]["samples"] == 8
    assert 0 < data["expected"]["low"] <= data["expected"]["high"]
    assert data["expected"]["mean"] == pytest.approx(data["step_time"], rel=0.1)
    assert set(data["compared_expected"]) == {"single", "expert"}
    nodes = {n["name"]: n for n in data["nodes"]}
    left = next(n for k, n in nodes.items() if k.startswith("left/") and n["op"] == "MatMul")
    assert left["device"].endswith("cpu:0") and "constraint device='cpu:0'" in left["narrowed_by"]
    assert {d["device"][-5:] for d in data["devices"]} == {"cpu:0", "cpu:1"}


def test_place_by_layer_and_what_if_cluster(tmp_path):
    spec = write(tmp_path, TWO_TOWERS.replace("devices: [cpu:0, cpu:1]\n", "").replace(
        "  constraints:\n    - {match: \"left*\", device: cpu:0}\n    - {match: \"right*\", device: cpu:1}\n", ""))
    r = CliRunner().invoke(cli, ["place", str(spec), "--devices", "2xgpu:k40", "--explain", "--by", "layer",
                                 "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    layers = {row["layer"] for row in data["layers"]}
    assert {"left", "right", "logits"} <= layers
    assert all("gpu" in d["device"] for d in data["devices"])


def test_place_conflicting_constraints_is_one_placement_error(tmp_path):
    bad = TWO_TOWERS.replace("placement:\n", "placement:\n  colocate: [[left, right]]\n")
    r = CliRunner().invoke(cli, ["place", str(write(tmp_path, bad))])
    assert r.exit_code == 4, r.output
    assert "Traceback" not in r.output and r.output.startswith("error:")


def test_place_unknown_profile_suggests(tmp_path):
    r = CliRunner().invoke(cli, ["place", str(write(tmp_path, TWO_TOWERS)), "--devices", "2xgpu:k4"])
    assert r.exit_code == 4 and "did you mean 'k40'" in r.output


def test_bench_spec_measures_placements_beside_predictions(tmp_path):
    spec = write(tmp_path, TWO_TOWERS)
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(cli, ["bench", str(spec), "--steps", "2", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    for alg in ("single", "expert", "greedy"):
        p = data["placements"][alg]
        assert p["error"] is None and p["measured_step_s"] > 0 and p["predicted_step_s"] > 0
        # The prediction is the expectation over the profile's jitter, beside the exact schedule.
        assert 0 < p["predicted_low_s"] <= p["predicted_high_s"] and p["predicted_exact_s"] > 0
    assert len(data["placements"]["expert"]["devices_used"]) == 2
    assert data["jitter"] >= 0
    assert data["one_device_all_threads"]["step_s"] > 0
    # Rounds of timed steps (3 by default), each summarised by its median and a 95% interval.
    assert data["rounds"] == 3 and data["steps"] == 2
    base = data["one_device_all_threads"]
    for name, p in [("one_device_all_threads", base)] + list(data["placements"].items()):
        assert p["measured_low_s"] <= p["measured_step_s"] <= p["measured_high_s"], name
        assert [len(r) for r in p["rounds_s"]] == [2, 2, 2], name
        assert p["measured_step_s"] == pytest.approx(statistics.median(t for r in p["rounds_s"] for t in r)), name
        assert p["examples_per_s"] == pytest.approx(data["batch"] / p["measured_step_s"]), name
    assert base["step_s"] == base["measured_step_s"]
    # Two virtual CPU devices of one process: the step on both at once against alone, and the
    # simulator's contention factor solved from that ratio (never below 1).
    c = data["contention"]
    assert c["ratio"] == pytest.approx(c["together_s"] / c["alone_s"]) and c["factor"] >= 1.0
    ref = data["one_device_reference"]
    assert ref["name"] in ("single", "one_device_all_threads")
    one_device = {"single": data["placements"]["single"]["measured_step_s"], "one_device_all_threads": base["step_s"]}
    assert ref["step_s"] == min(one_device.values()) == one_device[ref["name"]]
    for alg, p in data["placements"].items():
        v = p["vs_one_device"]
        assert v["low"] <= v["high"] and v["faster"] in ("a", "b", None), alg
        assert v["ratio"] == pytest.approx(p["measured_step_s"] / base["measured_step_s"]), alg
        assert p["vs_best_one_device"]["ratio"] == pytest.approx(p["measured_step_s"] / ref["step_s"]), alg
    # Every pair of placements, the one predicted faster first, with the measured verdict.
    pred = {a: p["predicted_step_s"] for a, p in data["placements"].items()}
    assert data["ranking_predicted"] == sorted(pred, key=pred.get)
    assert len(data["pairs"]) == 3
    for pair in data["pairs"]:
        a, b = pair["predicted_faster"], pair["other"]
        assert pred[a] <= pred[b]
        assert pair["verdict"] in ("same", "reversed", "tie", "predicted tie", "same placement")
        if pair["verdict"] == "same placement":  # two placers chose one assignment: one prediction
            assert pred[a] == pred[b]
        assert pair["measured_low"] <= pair["measured_high"]
        assert pair["measured_ratio"] == pytest.approx(data["placements"][a]["measured_step_s"]
                                                       / data["placements"][b]["measured_step_s"])
    assert data["same_ranking"] == all(pair["verdict"] != "reversed" for pair in data["pairs"])
    assert r.stdout.strip().startswith("{")  # --json: the same results on stdout


def test_bench_spec_rounds_option(tmp_path):
    spec = write(tmp_path, TWO_TOWERS)
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(cli, ["bench", str(spec), "--algorithms", "single,greedy", "--steps", "1",
                                 "--rounds", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["rounds"] == 2 and data["steps"] == 1
    assert set(data["placements"]) == {"single", "greedy"}
    for p in [data["one_device_all_threads"], *data["placements"].values()]:
        assert [len(r) for r in p["rounds_s"]] == [1, 1]
    assert len(data["pairs"]) == 1
    text = " ".join(r.output.split())  # rich wraps lines
    assert "median of 2 rounds x 1 steps, 95% interval" in text
    assert "vs best 1 device" in text and "one-device run" in text
    assert re.search(r"(single|greedy) predicted [\d.]+x (single|greedy); measured [\d.]+x \[[\d.]+-[\d.]+\]", text)


def _run(ms: float) -> dict:
    return {"measured_step_s": ms / 1e3, "measured_low_s": ms / 1e3, "measured_high_s": ms / 1e3,
            "examples_per_s": 16 / (ms / 1e3)}


def _bench_results(single_ms: float, whole_ms: float) -> dict:
    """`bench SPEC` results as report() writes them: single, model parallel (greedy), no expert rules."""
    from flowctl.bench.spec import one_device_reference

    placed = {"single": {**_run(single_ms), "devices_used": ["cpu:0"]},
              "greedy": {**_run(500.0), "devices_used": ["cpu:0", "cpu:1"]}}
    for p in placed.values():
        p.update(predicted_step_s=p["measured_step_s"], prediction_error=0.0, error=None)
    times = {"single": [[single_ms]], "greedy": [[500.0]], "one_device_all_threads": [[whole_ms]]}
    one = SimpleNamespace(assignment={"a": "cpu:0", "b": "cpu:0"})
    ref = one_device_reference(times, {"single": one}, "one_device_all_threads")  # type: ignore[dict-item]
    return {"spec": "towers", "batch": 16, "rounds": 1, "steps": 1,
            "one_device_all_threads": {"threads": 2, "step_s": whole_ms / 1e3, **_run(whole_ms)},
            "one_device_reference": {"name": ref, "step_s": min(single_ms, whole_ms) / 1e3},
            "placements": {"single": placed["single"], "greedy": placed["greedy"],
                           "expert": {"error": "no rules in the spec (placement.constraints or parallelism.groups)"}}}


def test_bench_spec_compares_with_the_faster_one_device_run() -> None:
    # Under load, the whole step on one device with both BLAS threads ran slower than `single` on
    # one thread: the speed-up column was a ratio against that slower run alone ("1.73x").
    from flowctl.cli.bench import spec_table

    cols, rows, notes = spec_table(_bench_results(single_ms=800.0, whole_ms=1384.0))
    assert [c.header for c in cols][-1] == "vs best 1 device"
    by = {row[0]: row for row in rows}
    assert by["single"][-1] == "1.00x" and by["greedy"][-1] == "1.60x"
    assert by["1 device, 2 threads"][-1] == "0.58x"
    assert "the step of single (800.0 ms), the faster one-device run (1 device, 2 threads: 1,384.0 ms)" in notes[0]
    # Where the two threads win, they are the reference.
    _, rows, notes = spec_table(_bench_results(single_ms=900.0, whole_ms=600.0))
    by = {row[0]: row for row in rows}
    assert by["1 device, 2 threads"][-1] == "1.00x" and by["greedy"][-1] == "1.20x"
    assert "the step of 1 device, 2 threads (600.0 ms), the faster one-device run (single: 900.0 ms)" in notes[0]
    # A `single` the spec's constraints spread over two devices is no one-device run.
    r = _bench_results(single_ms=400.0, whole_ms=600.0)
    r["placements"]["single"]["devices_used"] = ["cpu:0", "cpu:1"]
    r["one_device_reference"] = {"name": "one_device_all_threads", "step_s": 0.6}
    _, rows, notes = spec_table(r)
    assert {row[0]: row for row in rows}["single"][-1] == "1.50x"
    assert "the step of 1 device, 2 threads (600.0 ms), the only one-device run measured" in notes[0]


def test_bench_spec_puts_a_placers_reason_in_a_note_not_in_a_numeric_column() -> None:
    from flowctl.cli.bench import spec_table

    cols, rows, notes = spec_table(_bench_results(single_ms=800.0, whole_ms=1384.0))
    expert = next(row for row in rows if row[0] == "expert")
    assert expert[1:] == ["-"] * (len(cols) - 1)
    assert "expert: not measured: no rules in the spec (placement.constraints or parallelism.groups)" in notes
    numeric = [i for i, c in enumerate(cols) if c.header in ("examples/s", "vs best 1 device", "predicted ms")]
    for row in rows:
        for i in numeric:
            assert row[i] == "-" or re.fullmatch(r"[\d,.]+x?", row[i]), (row[0], cols[i].header, row[i])


def test_the_one_device_reference_is_the_faster_run_and_never_a_spread_single() -> None:
    from flowctl.bench.spec import one_device_reference

    one = SimpleNamespace(assignment={"a": "cpu:0", "b": "cpu:0"})
    spread = SimpleNamespace(assignment={"a": "cpu:0", "b": "cpu:1"})  # capped memory spreads `single`
    times = {"single": [[1.0, 1.1]], "whole": [[2.0, 2.1]]}
    assert one_device_reference(times, {"single": one}, "whole") == "single"  # type: ignore[dict-item]
    assert one_device_reference(times, {"single": spread}, "whole") == "whole"  # type: ignore[dict-item]
    assert one_device_reference(times, {"single": one}, None) == "single"  # type: ignore[dict-item]
    assert one_device_reference({"greedy": [[1.0]]}, {}, None) is None


def _strategy_spec(tmp_path: Path, parallelism: str) -> Path:
    base = TWO_TOWERS.split("placement:")[0] + f"parallelism: {parallelism}\ntraining: {{batch_size: 16, steps: 5}}\n"
    return write(tmp_path, base)


def test_place_shows_the_replicas_of_sync_data_parallel(tmp_path):
    spec = _strategy_spec(tmp_path, "{strategy: sync_data_parallel, replicas: 2}")
    r = CliRunner().invoke(cli, ["place", str(spec), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["algorithm"] == "sync_data_parallel"
    a = out["assignment"]
    for k, dev in ((0, "cpu:0"), (1, "cpu:1")):
        mine = [n for n in a if n.startswith(f"replica_{k}/")]
        assert any(n.startswith(f"replica_{k}/left/") for n in mine) and any("/gradients/" in n for n in mine)
        forward = [n for n in mine if "/gradients/" not in n and n.split("/")[1] in ("left", "right", "join")]
        assert forward and {a[n] for n in forward} == {canonical(dev)}
    # One set of parameters, on the parameter device (replica 0's), updated once.
    assert a["left/kernel"] == canonical("cpu:0")


def test_place_follows_model_parallel_groups_whatever_the_algorithm(tmp_path):
    spec = _strategy_spec(tmp_path, "{strategy: model_parallel, groups: [{layers: [left], device: cpu:0}, "
                                    "{layers: [right, join, logits, loss], device: cpu:1}]}")
    for alg in ("single", "greedy"):
        r = CliRunner().invoke(cli, ["place", str(spec), "--json", "--algorithm", alg])
        assert r.exit_code == 0, r.output
        a = json.loads(r.stdout)["assignment"]
        assert a["left/matmul"] == canonical("cpu:0") and a["right/matmul"] == canonical("cpu:1")


def test_place_explain_says_what_makes_each_devices_peak() -> None:
    spec = str(ROOT / "specs" / "lstm4.yaml")
    r = CliRunner().invoke(cli, ["place", spec, "--devices", "2xgpu:k40", "-a", "heft", "--explain", "--json",
                                 "--limit", "0"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    peaks = {d["device"]: d["peak_memory"] for d in out["devices"]}
    held = out["held_at_peak"]
    assert set(held) == {d for d, p in peaks.items() if p}
    for dev, tensors in held.items():
        assert sum(t["bytes"] for t in tensors) == peaks[dev]  # all of them: --limit 0
        assert tensors[0]["bytes"] == max(t["bytes"] for t in tensors)
    shown = CliRunner().invoke(cli, ["place", spec, "--devices", "2xgpu:k40", "-a", "heft", "--explain",
                                     "--limit", "3"])
    biggest = max((t for tensors in held.values() for t in tensors), key=lambda t: t["bytes"])["node"]
    assert "at each device's peak" in shown.output and biggest in shown.output, shown.output
