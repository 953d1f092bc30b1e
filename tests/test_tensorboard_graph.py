"""The placed training graph in TensorBoard: `flowctl train` writes it into the run's event file and
`flowctl graph SPEC --tensorboard DIR` into a directory of its own; read back with TensorBoard's
own event reader and served by its Graphs plugin, it is the graph that was placed, node for node."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli
from flowctl.engine.graph import parse_ref
from flowctl.spec.loader import load_spec
from flowctl.training.program import plan
from tiny_specs import LM_TWO_DEVICES as _TRACE_SPEC

pytest.importorskip("tensorboard")

# test_trace_and_graph's two LSTM layers on two devices, for two steps.
SPEC = _TRACE_SPEC.replace("steps: 3}", "steps: 2}")


def _graph_from_events(directory: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return acc.Graph()


def _tf_inputs(node) -> list[str]:
    out = []
    for ref in node.inputs:
        name, port = parse_ref(ref)
        out.append(name if port == 0 else f"{name}:{port}")
    return out + ["^" + c for c in node.control_inputs]


def _assert_is_the_placed_graph(got, spec: Path, assignment: dict[str, str]) -> None:
    placed = plan(load_spec(spec), compare=())
    graph, layers = placed.step.graph, placed.step.layers
    assert len(got.node) == len(graph) and [n.name for n in got.node] == list(graph.nodes)
    by_name = {n.name: n for n in got.node}
    for name, node in graph.nodes.items():
        nd = by_name[name]
        assert nd.op == node.op and list(nd.input) == _tf_inputs(node), name
        assert nd.device == assignment[name], name
        shapes = [[d.size for d in s.dim] for s in nd.attr["_output_shapes"].list.shape]
        assert shapes == [[-1 if d is None else d for d in s.shape] for s in node.outputs], name
        assert nd.attr["_layer"].s.decode() == layers.get(name, "")
    # A few by hand: the scoped names TensorBoard collapses, a control input, the two devices.
    cell = by_name["lstm_2/t3/cell"]
    assert cell.op == "LSTMBlockCell" and cell.device.endswith("cpu:1")
    assert cell.attr["forget_bias"].f == pytest.approx(0.0) and len(cell.attr["_output_types"].list.type) == 3
    assert by_name["lstm_1/kernel"].device.endswith("cpu:0") and by_name["lstm_1/kernel"].attr["trainable"].b
    assert any(i.startswith("^") for n in got.node for i in n.input)
    tokens = by_name["tokens"]
    assert [d.size for d in tokens.attr["shape"].shape.dim] == [-1, 8]
    from tensorboard.compat.proto.types_pb2 import DT_INT32

    assert tokens.attr["dtype"].type == DT_INT32


def test_train_writes_the_placed_graph_into_the_runs_event_file(tmp_path):
    spec = tmp_path / "lstm2.yaml"
    spec.write_text(SPEC)
    run = tmp_path / "run"
    r = CliRunner().invoke(cli, ["train", str(spec), "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    assignment = json.loads((run / "placement.json").read_text())["assignment"]
    events = [p.parent for p in run.rglob("events.out.tfevents.*")]
    assert len(events) == 1
    got = _graph_from_events(events[0])
    _assert_is_the_placed_graph(got, spec, assignment)
    # A resume writes a second event file without the graph; TensorBoard reads the run's files
    # together and still has it.
    r = CliRunner().invoke(cli, ["resume", str(run), "--steps", "4"])
    assert r.exit_code == 0, r.output
    assert len(list(run.rglob("events.out.tfevents.*"))) == 2
    assert [n.name for n in _graph_from_events(events[0]).node] == [n.name for n in got.node]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # bleach, inside tensorboard
def test_graph_tensorboard_writes_it_and_tensorboards_graphs_plugin_serves_it(tmp_path):
    from google.protobuf import text_format
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer as pem
    from tensorboard.compat.proto import graph_pb2
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.graph import graphs_plugin

    spec = tmp_path / "lstm2.yaml"
    spec.write_text(SPEC)
    tb = tmp_path / "tb"
    r = CliRunner().invoke(cli, ["graph", str(spec), "--tensorboard", str(tb)])
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "g.html").exists()
    placed = plan(load_spec(spec), compare=())
    _assert_is_the_placed_graph(_graph_from_events(tb), spec, placed.assignment)
    # What the Graphs tab asks for: the run has a graph, and the graph it is sent is ours.
    mux = pem.EventMultiplexer()
    mux.AddRunsFromDirectory(str(tb))
    mux.Reload()
    plugin = graphs_plugin.GraphsPlugin(base_plugin.TBContext(
        data_provider=data_provider.MultiplexerDataProvider(mux, str(tb)), logdir=str(tb)))
    ctx = context.RequestContext()
    assert plugin.info_impl(ctx, experiment="")["."]["run_graph"] is True
    body, mime = plugin.graph_impl(ctx, ".", None, False, experiment="", limit_attr_size=1024,
                                   large_attrs_key="_too_large_attrs")
    served = text_format.Parse(body, graph_pb2.GraphDef())
    assert mime == "text/x-protobuf" and [n.name for n in served.node] == list(placed.step.graph.nodes)
    assert {n.device for n in served.node} == set(placed.cluster.names)


def test_graph_needs_an_output(tmp_path):
    spec = tmp_path / "lstm2.yaml"
    spec.write_text(SPEC)
    r = CliRunner().invoke(cli, ["graph", str(spec)])
    assert r.exit_code == 2 and "--out" in r.output and "Traceback" not in r.output


def test_every_flowctl_dtype_reads_back_as_tensorflows():
    from tensorboard.compat.proto.attr_value_pb2 import AttrValue
    from tensorboard.compat.proto.types_pb2 import DataType

    from flowctl.engine.dtypes import DTYPES, VARIANT
    from flowctl.engine.shapes import TensorSpec
    from flowctl.training.events import _outputs

    names = [*DTYPES, VARIANT]
    sent = _outputs([TensorSpec((None, 2), d) for d in names])["_output_types"]
    got = [DataType.Name(t) for t in AttrValue.FromString(sent.SerializeToString()).list.type]
    assert got == ["DT_" + {"float16": "HALF", "float32": "FLOAT", "float64": "DOUBLE"}.get(d, d.upper())
                   for d in names]
