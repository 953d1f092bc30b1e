"""`flowctl train --trace STEP`: a step's timeline in the Chrome trace format, checked as data and
in a real browser's JSON (tests/browser.py finds the Chromium). The graph page is
tests/test_graph_page.py.

The trace is of one step of the real specs/lstm_lm.yaml (650-unit LSTMs, a 10,000-word softmax) on
two virtual CPU devices, one LSTM layer each as the expert's layer groups put them; only the
number of steps is changed on the command line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli
from flowctl.engine import recurrent_pack
from flowctl.training.trace import busy_ms
from browser import chromium
from test_place_cli import TWO_TOWERS
from tiny_specs import LM_TWO_DEVICES

ROOT = Path(__file__).resolve().parents[1]
LM = ROOT / "specs" / "lstm_lm.yaml"
# The expert's placement of lstm_lm on two devices: the first LSTM layer (with the embedding) on
# one, the second with the softmax on the other (what `flowctl place --explain --by layer` shows).
LM_GROUPS = ('parallelism={strategy: model_parallel, groups: ['
             '{layers: [embedding, dropout_0, lstm_1], device: "cpu:0"}, '
             '{layers: [dropout_1, lstm_2, dropout_2, softmax, loss], device: "cpu:1"}]}')

@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> tuple[Path, dict]:
    """Step 2 of lstm_lm traced (step 1 pays for first touches of memory)."""
    d = tmp_path_factory.mktemp("trace")
    r = CliRunner().invoke(cli, ["train", str(LM), "--devices", "cpu:0,cpu:1", "--set", LM_GROUPS,
                                 "--set", "training.steps=2", "--run-dir", str(d / "run"), "--trace", "2"])
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
    # Send/Recv and control-edge carriers, and the CPU plan's packed recurrent weights (each CPU
    # partition goes through the passes a one-device step does)
    added = [e for e in measured if e["name"] not in placement]
    assert added and all(e["cat"] in ("Send", "Recv", "Const", "PackPanels") for e in added)
    assert any(e["cat"] == "PanelMatMul" for e in measured) == recurrent_pack.enabled()
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
    # The simulator's prediction of the same placement is the second process, op for op: of the
    # graph the spec builds, where the CPU plan's passes folded some nodes into others (the
    # softmax's bias into its loss, an LSTM kernel gradient's products into their Concat).
    predicted = {e["name"] for e in events if e["ph"] == "X" and e["pid"] == 2}
    folded = _folded_by_the_cpu_passes(d / "run")
    assert {"softmax/bias_add", "gradients/softmax/bias_add/BiasAddGrad"} <= folded
    assert not folded & set(names)
    assert predicted and predicted - set(names) <= {"tokens", "targets", "learning_rate"} | folded  # fed: never run


def _folded_by_the_cpu_passes(run: Path) -> set[str]:
    """The run's step nodes that the CPU plan's passes (session.cpu_passes) fold into others."""
    from flowctl.engine.graph import Graph
    from flowctl.engine.session import cpu_passes

    g = Graph.from_json((run / "graph.json").read_text())
    fed = ["tokens:0", "targets:0", "learning_rate:0"]
    return set(g.nodes) - set(cpu_passes(g, ["loss/mean:0"], fed, ["SGD"]).nodes)


def test_each_devices_ops_sum_to_its_executor_busy_time_within_10_percent(traced):
    """The ops on a device's compute track against what that device's executor thread counted
    around the step itself (entering to leaving, less its waits for a Recv with nothing ready),
    which no trace event enters: the ops are the thread's work but for the executor's bookkeeping."""
    d, trace = traced
    placement = json.loads((d / "run" / "placement.json").read_text())["assignment"]
    assert placement["lstm_1/kernel"].endswith("cpu:0") and placement["lstm_2/kernel"].endswith("cpu:1")
    ops = busy_ms(trace)
    executor = trace["otherData"]["executor"]
    for device in ("cpu:0", "cpu:1"):
        summed, ex = ops[f"{device} compute"], executor[device]
        assert 0 < summed <= ex["busy_ms"] <= ex["wall_ms"]
        assert abs(summed - ex["busy_ms"]) <= 0.10 * ex["busy_ms"], (device, summed, ex)
        # A thread waiting on its condition burns no CPU: its CPU time fits in its busy time.
        assert ex["thread_cpu_ms"] <= ex["busy_ms"] * 1.02 + 1


def test_a_tiny_models_trace_is_well_formed_too(tmp_path):
    """Ops of microseconds: executor bookkeeping is a large share of the thread's time there, so
    only the ordering of the counts holds, not the 10%."""
    spec = tmp_path / "lstm2.yaml"
    spec.write_text(LM_TWO_DEVICES)
    r = CliRunner().invoke(cli, ["train", str(spec), "--run-dir", str(tmp_path / "run"), "--trace", "2"])
    assert r.exit_code == 0, r.output
    trace = json.loads((tmp_path / "run" / "trace-2.json").read_text())
    ops, executor = busy_ms(trace), trace["otherData"]["executor"]
    for device in ("cpu:0", "cpu:1"):
        assert 0 < ops[f"{device} compute"] <= executor[device]["busy_ms"] <= executor[device]["wall_ms"]



def test_a_one_device_trace_names_the_ops_its_plan_ran(tmp_path):
    """One device: the trace reads the graph after the CPU's plan passes, so the packed recurrent
    weights and the products that read them appear as they ran (the spec's graph labelled them
    RecurrentMatMul and left PackPanels out)."""
    spec = tmp_path / "lstm1.yaml"
    spec.write_text(LM_TWO_DEVICES.split("devices:")[0] + "training: {optimizer: {type: sgd}, batch_size: 8, steps: 2}\n")
    r = CliRunner().invoke(cli, ["train", str(spec), "--run-dir", str(tmp_path / "run"), "--trace", "2"])
    assert r.exit_code == 0, r.output
    trace = json.loads((tmp_path / "run" / "trace-2.json").read_text())
    cats = {e["cat"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 1}
    packed = recurrent_pack.enabled()
    assert ("PackPanels" in cats, "PanelMatMul" in cats, "RecurrentMatMul" in cats) == (packed, packed, not packed)

# test_place_cli's two towers, the constraints deciding (no placer named).
TOWERS = TWO_TOWERS.replace("  algorithm: greedy\n", "")


def test_bench_trace_writes_a_step_of_each_placement(tmp_path):
    spec = tmp_path / "towers.yaml"
    spec.write_text(TOWERS)
    r = CliRunner().invoke(cli, ["bench", str(spec), "--algorithms", "single,expert", "--steps", "1", "--rounds", "1",
                                 "--devices", "cpu:0,cpu:1,cpu:2",
                                 "--out", str(tmp_path / "b.json"), "--trace", str(tmp_path / "traces")])
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "b.json").read_text())
    assert [d["name"].split("/")[-1][-5:] for d in data["devices"]] == ["cpu:0", "cpu:1", "cpu:2"]  # --devices
    assert set(data["traces"]) == {"single", "expert"}
    for alg, path in data["traces"].items():
        assert f"trace of one {alg} step" in " ".join(r.output.split())
        trace = json.loads(Path(path).read_text())
        measured = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
        assert {e["args"]["layer"] for e in measured} >= {"left", "right", "logits", "loss"}
        for e in measured:  # the constraints hold in the timeline too
            if e["args"]["layer"] in ("left", "right"):
                assert e["args"]["device"].endswith("cpu:0" if e["args"]["layer"] == "left" else "cpu:1")
        ops = busy_ms(trace)
        for device, ex in trace["otherData"]["executor"].items():
            assert 0 < ops[f"{device} compute"] <= ex["busy_ms"] <= ex["wall_ms"]
        assert trace["otherData"]["predicted_step_ms"] > 0
    for flag in (["--trace", str(tmp_path / "t")], ["--devices", "cpu:0"]):
        r = CliRunner().invoke(cli, ["bench", "prefetch", "--quick", *flag])
        assert r.exit_code == 1 and "built-in suite" in r.output and "Traceback" not in r.output


def test_the_trace_loads_in_a_real_browser(traced):
    d, trace = traced
    with chromium() as browser:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_content("<!doctype html><title>trace</title>")
        # The lstm_lm trace parses in the browser's JSON, and summed there per compute track (as a
        # viewer reads the tracks) its ops come within 10% of each device's executor busy time.
        got = page.evaluate("""t => { const j = JSON.parse(t), e = j.traceEvents, names = {}, sums = {};
            e.filter(x => x.ph === 'M' && x.name === 'thread_name' && x.pid === 1)
             .forEach(x => { names[x.tid] = x.args.name; });
            e.filter(x => x.ph === 'X' && x.pid === 1)
             .forEach(x => { sums[names[x.tid]] = (sums[names[x.tid]] || 0) + x.dur / 1000; });
            return {x: e.filter(x => x.ph === 'X').length, flows: e.filter(x => x.ph === 's').length,
                    sums: sums, executor: j.otherData.executor}; }""",
                            (d / "run" / "trace-2.json").read_text())
    assert got["x"] == len([e for e in trace["traceEvents"] if e["ph"] == "X"]) and got["flows"] > 0
    for device in ("cpu:0", "cpu:1"):
        busy = got["executor"][device]["busy_ms"]
        assert abs(got["sums"][f"{device} compute"] - busy) <= 0.10 * busy
    assert not errors, errors


def test_a_loop_nodes_every_iteration_is_its_own_span_in_the_trace():
    """A node in a while loop runs once per iteration: each run is a span of its own, from its start
    to its finish (pairing each finish with the node's last start made all but one negative)."""
    import numpy as np

    import flowctl as fc
    from flowctl.engine.control_flow import while_loop
    from flowctl.training.trace import step_trace

    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (4, 8), name="x")
        w = fc.constant(np.eye(8, dtype=np.float32), name="w")
        out = while_loop(lambda i, h: fc.less(i, fc.constant(np.int32(10))),
                         lambda i, h: (i + 1, fc.tanh(fc.matmul(h, w, name="mm"))), [fc.constant(np.int32(0)), x])
    stats = fc.RunStats()
    fc.Session(g).run(out, {x: np.ones((4, 8), np.float32)}, stats=stats)
    spans = [e for e in step_trace(stats, {"cpu:0": g}, {})["traceEvents"] if e.get("name") == "while/mm"]
    assert len(spans) == 10 and all(e["dur"] >= 0 for e in spans)
    assert [e["ts"] for e in spans] == sorted(e["ts"] for e in spans)
