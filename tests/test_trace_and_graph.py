"""`flowctl train --trace STEP` and `flowctl graph`: a step's timeline in the Chrome trace format
and the step's graph as one HTML page, checked as data and, where a headless Chromium and the
`playwright` package are present, in a real browser (skipped cleanly otherwise)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli
from flowctl.training.trace import busy_ms

SPEC = """\
version: 1
name: lstm2
model:
  layers:
    - {name: tokens, type: input, shape: [8], dtype: int32, classes: 200}
    - {name: embedding, type: embedding, vocab: 200, dim: 32}
    - {name: lstm_1, type: lstm, units: 48}
    - {name: lstm_2, type: lstm, units: 48}
    - {name: softmax, type: dense, units: 200}
    - {name: targets, type: input, shape: [8], dtype: int32, classes: 200}
    - {name: loss, type: softmax_cross_entropy, inputs: [softmax, targets]}
devices: [cpu:0, cpu:1]
parallelism:
  strategy: model_parallel
  groups:
    - {layers: [embedding, lstm_1], device: cpu:0}
    - {layers: [lstm_2, softmax, loss], device: cpu:1}
training: {optimizer: {type: sgd}, learning_rate: 0.5, batch_size: 8, steps: 3}
"""


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> tuple[Path, dict]:
    d = tmp_path_factory.mktemp("trace")
    spec = d / "lstm2.yaml"
    spec.write_text(SPEC)
    r = CliRunner().invoke(cli, ["train", str(spec), "--run-dir", str(d / "run"), "--trace", "2"])
    assert r.exit_code == 0, r.output
    return d, json.loads((d / "run" / "trace-2.json").read_text())


def test_the_trace_has_a_track_per_device_and_every_op_of_the_step_once(traced):
    d, trace = traced
    events = trace["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 1}
    assert {"cpu:0 compute", "cpu:1 compute"} <= tracks
    assert any("async" in t for t in tracks)  # the Recvs, off the compute threads
    measured = [e for e in events if e["ph"] == "X" and e["pid"] == 1]
    names = [e["name"] for e in measured]
    assert len(names) == len(set(names))  # each node once
    placement = json.loads((d / "run" / "placement.json").read_text())["assignment"]
    added = [e for e in measured if e["name"] not in placement]  # Send/Recv and control-edge carriers
    assert added and all(e["cat"] in ("Send", "Recv", "Const") for e in added)
    for e in measured:
        if e["name"] in placement:
            assert e["args"]["device"] == placement[e["name"]]
    lstm = [e for e in measured if e["args"]["layer"] == "lstm_2"]
    assert lstm and all(e["args"]["device"].endswith("cpu:1") for e in lstm)
    assert all(e["dur"] >= 0 and e["args"]["shapes"] is not None for e in measured)
    # Every Send is joined to its Recv by a flow arrow that leaves before it lands.
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    sends = [e for e in measured if e["cat"] == "Send"]
    assert sends and set(starts) == set(ends) and len(starts) == len(sends)
    assert all(starts[k]["ts"] <= ends[k]["ts"] + 1e-3 for k in starts)
    # The simulator's prediction of the same placement is the second process, op for op.
    predicted = {e["name"] for e in events if e["ph"] == "X" and e["pid"] == 2}
    assert predicted and predicted - set(names) <= {"tokens", "targets", "learning_rate"}  # fed: they never run


def test_the_traced_ops_sum_to_each_devices_busy_time(traced):
    """A device thread runs one kernel at a time, so its kernels' durations sum to no more than
    the step; and they are most of what its thread did."""
    _, trace = traced
    step_ms = trace["otherData"]["measured_step_ms"]
    busy = busy_ms(trace)
    for track in ("cpu:0 compute", "cpu:1 compute"):
        assert 0 < busy[track] <= step_ms * 1.001


def test_graph_page_has_a_box_per_layer_coloured_by_device(tmp_path):
    spec = tmp_path / "lstm2.yaml"
    spec.write_text(SPEC)
    out = tmp_path / "g.html"
    r = CliRunner().invoke(cli, ["graph", str(spec), "--out", str(out)])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    for layer in ("embedding", "lstm_1", "lstm_2", "softmax", "loss"):
        assert f">{layer}</text>" in text
    assert 'data-device="/job:localhost/task:0/device:cpu:1"' in text and "http" not in text.split("<svg")[0]


def _browser():
    playwright = pytest.importorskip("playwright.sync_api")
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium)")
    return playwright, exe


def test_the_graph_page_and_the_trace_load_in_a_real_browser(traced, tmp_path):
    playwright, exe = _browser()
    d, trace = traced
    spec = d / "lstm2.yaml"
    out = tmp_path / "g.html"
    assert CliRunner().invoke(cli, ["graph", str(spec), "--out", str(out)]).exit_code == 0
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(out.as_uri())
        assert page.locator("g.layer").count() >= 5
        page.locator("g.layer", has_text="lstm_2").first.click()
        assert "lstm_2" in page.locator("#side h3").inner_text()
        assert page.locator("#side tr").count() > 10
        # The trace parses in the browser's JSON and has the tracks and events the viewers read.
        counts = page.evaluate("""t => { const e = JSON.parse(t).traceEvents;
            return [e.filter(x => x.ph === 'X').length, e.filter(x => x.ph === 's').length]; }""",
                               (d / "run" / "trace-2.json").read_text())
        assert counts[0] == len([e for e in trace["traceEvents"] if e["ph"] == "X"]) and counts[1] > 0
        browser.close()
    assert not errors, errors
