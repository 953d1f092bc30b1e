"""The LSTM layer as fast libraries cut it (one input product per sequence or chunk, the recurrent
product per step, one fused LSTMBlockCell, weight gradients as one product over all steps) against
the composition it replaced, built here from primitive ops: outputs and gradients agree to float32
rounding, and the layer above still starts before the layer below has finished."""
from __future__ import annotations

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.gradcheck import check_gradients
from flowctl.spec import load_text
from flowctl.spec.model import build_model

B, T, D, U = 3, 5, 4, 6

SPEC = f"""
version: 1
model:
  layers:
    - {{name: x, type: input, shape: [{T}, {D}], dtype: float32}}
    - {{name: lstm_1, type: lstm, units: {U}, forget_bias: 1.0}}
    - {{name: lstm_2, type: lstm, units: {U}, projection_steps: 2}}
"""


def _reference(x: fc.Tensor, layers: list[tuple[fc.Tensor, fc.Tensor]], forget_bias: list[float]) -> list[fc.Tensor]:
    """The previous composition: per step concat([x_t, h]) @ kernel + bias, split into gates, each
    nonlinearity and the cell update as separate nodes."""
    steps = fc.unstack(x, axis=1)
    for (kernel, bias), fb in zip(layers, forget_bias):
        d = int(steps[0].shape[1])
        w_in = fc.slice_(kernel, (0, 0), (d, 4 * U))
        h = c = None
        outs = []
        for xt in steps:
            if h is None:
                z = fc.bias_add(fc.matmul(xt, w_in), bias)
            else:
                z = fc.bias_add(fc.matmul(fc.concat([xt, h], axis=1), kernel), bias)
            i, f, g, o = fc.split(z, 4, axis=1)
            if fb:
                f = f + fb
            ig = fc.sigmoid(i) * fc.tanh(g)
            c = ig if c is None else fc.sigmoid(f) * c + ig
            h = fc.sigmoid(o) * fc.tanh(c)
            outs.append(h)
        steps = outs
    return steps


def _ancestors(g: fc.Graph, node: str) -> set[str]:
    seen: set[str] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(fc.engine.graph.parse_ref(r)[0] for r in g.nodes[n].inputs)
    return seen


def test_lstm_outputs_and_gradients_match_the_primitive_composition(rng):
    model = build_model(load_text(SPEC, "lstm.yaml"), training=True)
    g = model.graph
    sess = fc.Session(g, store=fc.ContainerStore())
    sess.run(model.initializer())
    weights = [sess.run(model.variables[name]) for name in ("lstm_1", "lstm_2")]
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    r = rng.standard_normal((B, T, U)).astype(np.float32)
    # Non-zero biases exercise the bias gradients and the forget-gate offset beside them.
    weights = [(k, rng.uniform(-0.5, 0.5, b.shape).astype(np.float32)) for k, b in weights]
    sess.load_variables({v.node: val for name, w in zip(("lstm_1", "lstm_2"), weights)
                         for v, val in zip(model.variables[name], w)})
    params = [v for name in ("lstm_1", "lstm_2") for v in model.variables[name]]
    with g.as_default():
        y = model.outputs["lstm_2"]
        loss = fc.reduce_sum(y * fc.constant(r))
        grads = fc.gradients(loss, params + [model.inputs["x"]])
    got = sess.run([y] + grads, {model.inputs["x"]: x})

    ref = fc.Graph()
    with ref.as_default():
        xp = fc.placeholder("float32", (B, T, D))
        consts = [(fc.constant(k), fc.constant(b)) for k, b in weights]
        ys = fc.stack(_reference(xp, consts, [1.0, 0.0]), axis=1)
        rloss = fc.reduce_sum(ys * fc.constant(r))
        rgrads = fc.gradients(rloss, [t for pair in consts for t in pair] + [xp])
    want = fc.Session(ref, store=fc.ContainerStore()).run([ys] + rgrads, {xp: x})
    for name, a, b in zip(["y", "kernel_1", "bias_1", "kernel_2", "bias_2", "x"], got, want):
        scale = float(np.abs(b).max())
        np.testing.assert_allclose(a, b, rtol=0, atol=4e-7 * max(scale, 1.0) * T, err_msg=name)

    # The structure that makes it fast: one input product for the whole first layer, ceil(T / 2)
    # for the second, one recurrent product per step after the first, and one product for each
    # weight's gradient (no AddN over per-step products).
    ops = [n for n in g.nodes.values() if n.name.startswith("lstm_1/")]
    assert sum(n.op == "MatMul" for n in ops) == 1 and sum(n.op == "RecurrentMatMul" for n in ops) == T - 1
    ops = [n for n in g.nodes.values() if n.name.startswith("lstm_2/")]
    assert sum(n.op == "MatMul" for n in ops) == 3 and sum(n.op == "RecurrentMatMul" for n in ops) == T - 1
    assert sum(n.op == "LSTMBlockCell" for n in g.nodes.values()) == 2 * T
    products = {n.name for n in g.nodes.values() if n.op == "MatMul" and n.attrs["transpose_a"]}
    assert not [n for n in g.nodes.values()
                if n.op == "AddN" and any(fc.engine.graph.parse_ref(r)[0] in products for r in n.inputs)]
    # W_h of each layer (T - 1 steps) and W_x of the chunked layer (3 chunks): one product each.
    assert sum("sum_products" in n for n in products) == 3


def test_the_layer_above_starts_before_the_layer_below_finishes():
    model = build_model(load_text(SPEC, "lstm.yaml"), training=False)
    g = model.graph
    first_above = _ancestors(g, "lstm_2/t0/cell")
    assert "lstm_1/t1/cell" in first_above  # its first chunk: steps 0 and 1
    assert "lstm_1/t2/cell" not in first_above and "lstm_1/t4/cell" not in first_above


@pytest.mark.parametrize("first", [True, False], ids=["zero_state", "with_state"])
def test_lstm_block_cell_gradients(first):
    def build(xw, hw, c_prev):
        if first:
            h, c = fc.lstm_block_cell(xw, forget_bias=0.5)
        else:
            h, c = fc.lstm_block_cell(xw, hw, c_prev, forget_bias=0.5)
        return [h, c * 0.7]

    rng = np.random.default_rng(3)
    inputs = {"xw": rng.uniform(-2, 2, (2, 12)), "hw": rng.uniform(-2, 2, (2, 12)),
              "c_prev": rng.uniform(-1, 1, (2, 3))}
    check_gradients(build, inputs, wrt=["xw"] if first else None)


def test_lstm_block_cell_matches_float64_formula(rng):
    xw, hw = rng.standard_normal((4, 8)), rng.standard_normal((4, 8))
    c_prev = rng.standard_normal((4, 2))
    g = fc.Graph()
    with g.as_default():
        h, c = fc.lstm_block_cell(fc.constant(xw), fc.constant(hw), fc.constant(c_prev), forget_bias=1.0)
    got_h, got_c = fc.Session(g, store=fc.ContainerStore()).run([h, c])
    z = xw + hw
    sig = lambda v: 1.0 / (1.0 + np.exp(-v))
    want_c = sig(z[:, 2:4] + 1.0) * c_prev + sig(z[:, :2]) * np.tanh(z[:, 4:6])
    np.testing.assert_allclose(got_c, want_c, rtol=1e-12)
    np.testing.assert_allclose(got_h, sig(z[:, 6:]) * np.tanh(want_c), rtol=1e-12)


def test_lstm_block_cell_rejects_half_a_state():
    g = fc.Graph()
    with g.as_default(), pytest.raises(fc.GraphError, match="both hw and c_prev"):
        fc.lstm_block_cell(fc.constant(np.zeros((2, 8), np.float32)), hw=fc.constant(np.zeros((2, 8), np.float32)))



@pytest.mark.parametrize("devices, strategy, products", [
    ("[cpu:0]", "single", 1),  # one device: nothing to overlap with, one product over all steps
    ("[cpu:0, cpu:1]", "single", 2),  # a placer may split the layers: 9 steps in chunks of 7
    ("[cpu:0, cpu:1]", "sync_data_parallel", 1),  # each replica holds the whole model
])
def test_the_default_chunks_only_where_layers_may_split(devices, strategy, products):
    spec = load_text(f"""
version: 1
model:
  layers:
    - {{name: x, type: input, shape: [9, {D}], dtype: float32}}
    - {{name: lstm_1, type: lstm, units: {U}}}
    - {{name: lstm_2, type: lstm, units: {U}}}
devices: {devices}
parallelism: {{strategy: {strategy}}}
""", "lstm.yaml")

    def input_products(**kw: int) -> int:
        g = build_model(spec, training=False, **kw).graph
        return sum(n.op == "MatMul" and n.name.startswith("lstm_2/") for n in g.nodes.values())

    assert input_products() == products
    if devices == "[cpu:0]":  # placed on a what-if cluster of two (flowctl place --devices): chunked
        assert input_products(devices=2) == 2
