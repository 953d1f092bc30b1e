"""Batch norm with a fused ReLU (FusedBatchNorm activation="relu"): float64 references, the
finite-difference checker, equality with the unfused pair, the cpu kernels' runs of rows against
the whole batch, and the spec's conv2d layers emitting it."""
from __future__ import annotations

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.gradcheck import check_gradients
from flowctl.engine.gradcheck import run_graph as run
from flowctl.kernels import nn as knn
from tests.test_ops_nn import ref_batch_norm


def _inputs(rng, shape):
    c = shape[-1]
    return {"x": rng.standard_normal(shape) * 1.5 + 0.3, "s": rng.uniform(0.5, 2, c), "o": rng.standard_normal(c) * 0.5}


def test_fused_relu_matches_reference(rng):
    v = _inputs(rng, (3, 4, 5, 3))
    got = run(lambda x, s, o: list(fc.fused_batch_norm(x, s, o, epsilon=1e-3, activation="relu")), **v)
    y, mean, var = ref_batch_norm(v["x"], v["s"], v["o"], 1e-3)
    assert (got[0] == 0).any() and (got[0] > 0).any()
    np.testing.assert_allclose(got[0], np.maximum(y, 0), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[1], mean, rtol=1e-10, atol=1e-12)  # the statistics are the input's
    np.testing.assert_allclose(got[2], var, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", [(7, 3), (2, 3, 2, 2)])
def test_fused_relu_gradients(shape, rng):
    v = _inputs(rng, shape)
    check_gradients(lambda x, s, o: fc.fused_batch_norm(x, s, o, activation="relu")[0], v)
    # The batch statistics used downstream as well: (y, dmean, dvar) all reach the gradient op.
    check_gradients(lambda x, s, o: list(fc.fused_batch_norm(x, s, o, activation="relu")), v)


@pytest.mark.parametrize("dtype, tol", [("float64", 1e-12), ("float32", 1e-5)])
def test_fused_relu_equals_batch_norm_then_relu(dtype, tol, rng):
    v = {k: a.astype(dtype) for k, a in _inputs(rng, (4, 3, 3, 5)).items()}
    w = rng.standard_normal((4, 3, 3, 5)).astype(dtype)

    def build(fused):
        def f(x, s, o):
            if fused:
                y = fc.fused_batch_norm(x, s, o, activation="relu")[0]
            else:
                y = fc.relu(fc.fused_batch_norm(x, s, o)[0])
            return [y] + fc.gradients(fc.reduce_sum(y * fc.constant(w)), [x, s, o])
        return f

    for a, b in zip(run(build(True), **v), run(build(False), **v)):
        assert a.dtype == np.dtype(dtype)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("relu", [False, True])
def test_cpu_runs_of_rows_match_whole_batch(relu, rng):
    x = rng.standard_normal((3, 5, 4, 6)) * 2 + 1
    s, o = rng.uniform(0.5, 2, 6), rng.standard_normal(6)
    dy = rng.standard_normal(x.shape)
    dm, dv = rng.standard_normal(6), rng.standard_normal(6)
    whole = knn.batch_norm_forward(np, x, s, o, 1e-3, relu, None)
    whole_g = knn.batch_norm_grad(np, dy, x, s, whole[1], whole[2], whole[0] if relu else None, (dm, dv), 1e-3)
    for elements in (1, 7, 24, 10_000):
        part = knn.batch_norm_forward(np, x, s, o, 1e-3, relu, elements)
        part_g = knn.batch_norm_grad(np, dy, x, s, part[1], part[2], part[0] if relu else None, (dm, dv), 1e-3,
                                     elements)
        for a, b in zip(part + part_g, whole + whole_g):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_unknown_activation_is_a_graph_error():
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (None, 4), name="x")
        with pytest.raises(fc.GraphError, match="activation must be one of none, relu"):
            fc.fused_batch_norm(x, np.ones(4, np.float32), np.zeros(4, np.float32), activation="gelu")


def test_spec_conv_layer_fuses_its_relu_when_training_and_in_inference():
    from flowctl.spec import load_text
    from flowctl.spec.model import build_model

    text = """
version: 1
model:
  name: tiny
  layers:
    - {name: images, type: input, shape: [6, 6, 2]}
    - {name: c1, type: conv2d, filters: 3, kernel: 3, batch_norm: true, activation: relu}
    - {name: c2, type: conv2d, filters: 3, kernel: 3, batch_norm: true, activation: tanh}
"""
    loaded = load_text(text, "<tiny>")
    train = build_model(loaded, training=True).graph
    bns = {n.name: n.attrs["activation"] for n in train.nodes.values() if n.op == "FusedBatchNorm"}
    assert sorted(bns.values()) == ["none", "relu"]
    assert not any(n.op == "Relu" for n in train.nodes.values())
    infer = build_model(loaded, training=False).graph
    affine = {n.attrs["activation"] for n in infer.nodes.values() if n.op == "ChannelAffine"}
    assert affine == {"none", "relu"}  # inference: the moving statistics' scale, shift and ReLU in one pass
    assert not any(n.op in ("Relu", "FusedBatchNorm") for n in infer.nodes.values())
