"""A graph holds no arrays that are one number over and over: a Variable's uniform initial value
(an optimizer slot's zeros, a batch-norm scale's ones) is a Fill op, not a constant array. Before,
lstm_lm's graph.json with Adam was 211 MB and NMT's 1.375 GB (issue 31, item 2)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import flowctl as fc
from flowctl.spec import load_spec
from flowctl.spec.model import build_model
from flowctl.training.program import build_step, step_config

SPECS = Path(__file__).resolve().parents[1] / "specs"


@pytest.mark.parametrize("spec", sorted(p.name for p in SPECS.glob("*.yaml")))
def test_a_shipped_specs_training_graph_holds_no_large_constant(spec):
    loaded = load_spec(SPECS / spec, ["training.optimizer={type: adam}"])
    step = build_step(build_model(loaded, training=True), step_config(loaded))
    text = step.model.graph.to_json()
    nodes = json.loads(text)["nodes"]
    values = [(n["name"], len(json.dumps(n["attrs"]["value"]))) for n in nodes if n["op"] == "Const"]
    assert max(size for _, size in values) < 4096, max(values, key=lambda v: v[1])  # no array of values
    # Inception-v3 with Adam has 4,470 nodes: 1.26 MB, its names and sources; the rest far less.
    assert len(text) < 1.5e6


def test_a_uniform_initial_value_is_a_fill_that_initialises_the_same_values():
    g = fc.Graph(seed=0)
    with g.as_default():
        z = fc.variable(np.zeros((3, 4), np.float32), name="z")
        o = fc.variable(np.ones(5, np.int64), name="o")
        r = fc.variable(np.arange(4.0, dtype=np.float32), name="r")
        s = fc.variable(np.float32(2.5), name="s")  # a scalar: one number, a Const as before
        init = fc.global_variables_initializer()
    ops = {n: g.nodes[g.nodes[n + "/init"].inputs[1].split(":")[0]].op for n in ("z", "o", "r", "s")}
    assert ops == {"z": "Fill", "o": "Fill", "r": "Const", "s": "Const"}
    sess = fc.Session(g, store=fc.ContainerStore())
    sess.run(init)
    v = sess.variable_values()
    assert v["z"].dtype == np.float32 and not v["z"].any() and v["z"].shape == (3, 4)
    assert v["o"].dtype == np.int64 and (v["o"] == 1).all()
    np.testing.assert_array_equal(v["r"], np.arange(4.0))
    assert float(v["s"]) == 2.5
