"""The graph IR: construction-time inference, check(), and the JSON GraphDef."""
from __future__ import annotations

import json

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.graph import attrs_equal


def small_graph() -> fc.Graph:
    g = fc.Graph(seed=7)
    with g.as_default():
        x = fc.placeholder("float32", (None, 3), name="x")
        with g.device("cpu:0"), g.name_scope("layer"):
            w = fc.variable(np.arange(3, dtype=np.float32), name="w")
            y = fc.tanh(x * w + 1.5, name="y")
        with g.colocate_with(w):
            z = fc.exp(y, name="z")
        with g.control_dependencies([z]):
            fc.no_op(name="after_z")
        fc.cast(z, "float64", name="z64")
    return g


def test_shapes_and_dtypes_are_inferred_at_construction():
    g = small_graph()
    y = g.tensor("layer/y")
    assert y.shape == (None, 3) and y.dtype == "float32"
    assert g.tensor("z64").dtype == "float64"
    assert g.nodes["layer/y"].device == "cpu:0"
    assert g.nodes["z"].colocate_with == ["layer/w"]
    assert g.nodes["after_z"].control_inputs == ["z"]


def test_graphdef_json_round_trips_exactly():
    g = small_graph()
    text = g.to_json()
    g2 = fc.Graph.from_json(text)
    assert g2.to_json() == text
    assert list(g2.nodes) == list(g.nodes)
    for name, node in g.nodes.items():
        other = g2.nodes[name]
        assert (other.op, other.inputs, other.control_inputs, other.device, other.colocate_with,
                other.outputs) == (node.op, node.inputs, node.control_inputs, node.device,
                                   node.colocate_with, node.outputs)
        assert attrs_equal(other.attrs, node.attrs)
    # constants keep their exact bytes and dtype
    const = next(n for n in g2.nodes.values() if n.op == "Const" and n.attrs["value"].dtype == np.float32
                 and n.attrs["value"].shape == (3,))
    np.testing.assert_array_equal(const.attrs["value"], np.arange(3, dtype=np.float32))
    assert json.loads(text)["seed"] == 7


def test_round_tripped_graph_computes_the_same():
    g = small_graph()
    g2 = fc.Graph.from_json(g.to_json())
    xv = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    outs = []
    for graph in (g, g2):
        s = fc.Session(graph, store=fc.ContainerStore())
        s.run("init" if "init" in graph else graph.nodes["layer/w/init"].name)
        outs.append(s.run("z64", {"x": xv}))
    np.testing.assert_array_equal(outs[0], outs[1])


def _def(g: fc.Graph) -> dict:
    return json.loads(g.to_json())


def test_check_rejects_dangling_input_naming_both_nodes():
    d = _def(small_graph())
    for n in d["nodes"]:
        if n["name"] == "z":
            n["inputs"] = ["ghost:0"]
    with pytest.raises(fc.GraphError, match="node 'z' input 'ghost:0' refers to missing node 'ghost'"):
        fc.Graph.from_dict(d)


def test_check_rejects_shape_mismatch_naming_both_nodes():
    g = fc.Graph()
    with g.as_default():
        a = fc.constant(np.ones((2, 3), np.float32), name="a")
        b = fc.constant(np.ones((2, 3), np.float32), name="b")
        fc.add(a, b, name="sum")
    d = _def(g)
    # rewrite b as a (4, 5) constant: Add of (2,3) and (4,5) cannot broadcast
    from flowctl.engine.opdef import ATTR_TYPES

    d["nodes"][1]["attrs"]["value"] = ATTR_TYPES["tensor"].encode(np.ones((4, 5), np.float32))
    with pytest.raises(fc.GraphError) as e:
        fc.Graph.from_dict(d)
    msg = str(e.value)
    assert "'sum'" in msg and "'a:0'" in msg and "'b:0'" in msg and "(4, 5)" in msg


def test_construction_rejects_shape_mismatch_naming_both_inputs():
    g = fc.Graph()
    with g.as_default():
        a = fc.placeholder("float32", (None, 3), name="left")
        b = fc.placeholder("float32", (4,), name="right")
        with pytest.raises(fc.GraphError, match=r"'left:0' \(None, 3\).*'right:0' \(4,\)"):
            fc.add(a, b)


def test_check_rejects_a_cycle_naming_the_nodes():
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (2,), name="x")
        a = fc.exp(x, name="a")
        fc.tanh(a, name="b")
    d = _def(g)
    for n in d["nodes"]:
        if n["name"] == "a":
            n["inputs"] = ["b:0"]
    with pytest.raises(fc.GraphError, match=r"cycle in graph: 'a' -> 'b' -> 'a'|cycle in graph: 'b' -> 'a' -> 'b'"):
        fc.Graph.from_dict(d)


def test_unknown_op_and_attribute_are_reported():
    d = _def(small_graph())
    d["nodes"][0]["op"] = "Placeholdr"
    with pytest.raises(fc.GraphError, match="did you mean 'Placeholder'"):
        fc.Graph.from_dict(d)
    g = fc.Graph()
    with pytest.raises(fc.GraphError, match="unknown attribute"):
        g.add_node("Cast", [], {"dtyp": "float32"})


def test_unique_names_and_scopes():
    g = fc.Graph()
    with g.as_default():
        a = fc.constant(1.0, name="c")
        b = fc.constant(1.0, name="c")
        with g.name_scope("s"):
            c = fc.constant(1.0, name="c")
    assert (a.node, b.node, c.node) == ("c", "c_1", "s/c")



def test_a_plan_runs_the_chain_built_first_where_breadth_first_would_interleave():
    """Two chains built one after the other, the second reading the first's second node (as a
    model's second LSTM layer reads the first's steps): breadth first interleaves them once the
    second can start; a session's plan (`earliest_first`) finishes the chain built first, which
    keeps one layer's weights in cache. Both are orders of the graph; the values are the same."""
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (2,), name="x")
        a = [x]
        for i in range(5):
            a.append(fc.tanh(a[-1], name=f"a{i}"))
        b = [a[2]]
        for i in range(3):
            b.append(fc.exp(b[-1], name=f"b{i}"))
        out = fc.add(a[-1], b[-1], name="out")
    chains = {f"a{i}" for i in range(5)} | {f"b{i}" for i in range(3)}
    breadth = [n for n in g.topo_order() if n in chains]
    assert breadth.index("b0") < breadth.index("a4")  # interleaved
    s = fc.Session(g)
    feeds = {x: np.ones(2, np.float32)}
    got = s.run(out, feeds)
    plan = s.plan_for(out, feeds)
    assert [n for n in plan.order if n in chains] == [*(f"a{i}" for i in range(5)), *(f"b{i}" for i in range(3))]
    assert [n for n in g.topo_order(earliest_first=True) if n in chains] == [n for n in plan.order if n in chains]
    for order in (g.topo_order(), plan.order):
        seen = {"x"}  # fed
        for n in order:
            assert all(r.split(":")[0] in seen for r in g.nodes[n].inputs), n
            seen.add(n)
    t = np.tanh
    want = t(t(t(t(t(np.ones(2, np.float32)))))) + np.exp(np.exp(np.exp(t(t(np.ones(2, np.float32))))))
    np.testing.assert_allclose(got, want, rtol=1e-6)
