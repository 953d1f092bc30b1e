"""Products that only a row Concat reads, written into its rows (engine/concat_products.py): the
ConcatMatMul kernel against MatMul's then Concat's (bit for bit), and the pass on an LSTM's kernel
gradient (its input and recurrent rows) with the unfused plan's bits, and where it stays away."""
from __future__ import annotations

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine import concat_products
from flowctl.engine.shapes import TensorSpec
from flowctl.kernels.registry import bind
from flowctl.spec import load_text
from flowctl.spec.model import build_model
from plan_runs import run_plan


def _specs(*arrays: np.ndarray) -> list[TensorSpec]:
    return [TensorSpec(tuple(a.shape), str(a.dtype)) for a in arrays]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("flags", [((1, 0), (1, 0)), ((0, 0), (1, 1)), ((0, 1), (1, 0), (0, 0))])
def test_the_kernel_gives_the_products_then_the_concats_bits(dtype, flags) -> None:
    rng = np.random.default_rng(len(flags))
    n, ins, want = 37, [], []
    for i, (ta, tb) in enumerate(flags):
        m, k = 5 + 13 * i, 19 + i
        a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
        b = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
        ins += [a, b]
        want.append(bind("MatMul", "cpu", {"transpose_a": bool(ta), "transpose_b": bool(tb)}, _specs(a, b))(a, b))
    concat = np.concatenate(want, axis=0)
    attrs = {"transpose_a": [f[0] for f in flags], "transpose_b": [f[1] for f in flags]}
    got = bind("ConcatMatMul", "cpu", attrs, _specs(*ins))(*ins)
    assert got.dtype == concat.dtype and got.flags.c_contiguous
    np.testing.assert_array_equal(got, concat)


def _lstm(dtype: str):
    spec = f"""
version: 1
model:
  dtype: {dtype}
  layers:
    - {{name: x, type: input, shape: [5, 4], dtype: {dtype}}}
    - {{name: lstm_1, type: lstm, units: 6}}
"""
    model = build_model(load_text(spec, "lstm.yaml"), training=True)
    params = model.variables["lstm_1"]
    rng = np.random.default_rng(3)
    with model.graph.as_default():
        y = model.outputs["lstm_1"]
        loss = fc.reduce_sum(y * fc.constant(rng.standard_normal((3, 5, 6)).astype(dtype)))
        grads = [fc.identity(g) for g in fc.gradients(loss, params)]  # as an optimizer reads them
    return model, [loss] + grads, {model.inputs["x"]: rng.standard_normal((3, 5, 4)).astype(dtype)}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_an_lstms_kernel_gradient_is_one_node_with_the_same_bits(monkeypatch, dtype) -> None:
    model, fetches, feeds = _lstm(dtype)
    monkeypatch.setattr(concat_products, "ENABLED", False)
    s, want, ops = run_plan(model, fetches, feeds)
    assert "ConcatMatMul" not in ops
    monkeypatch.setattr(concat_products, "ENABLED", True)
    _, got, fused = run_plan(model, fetches, feeds, s.store)
    assert fused.count("ConcatMatMul") == 1
    assert fused.count("MatMul") == ops.count("MatMul") - 2 and fused.count("Concat") == ops.count("Concat") - 1
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=str(i))


def test_a_product_read_elsewhere_or_fetched_stays_a_matmul(monkeypatch) -> None:
    monkeypatch.setattr(concat_products, "ENABLED", True)
    g = fc.Graph()
    with g.as_default():
        a, b = fc.constant(np.ones((3, 4), "float32")), fc.constant(np.ones((4, 5), "float32"))
        p, q = fc.matmul(a, b), fc.matmul(a, b, name="q")
        both = fc.concat([p, q], axis=0)
        side = fc.concat([p, q], axis=1)  # not rows: never fused
        twice = fc.concat([fc.matmul(a, b), fc.matmul(a, b)], axis=0)
    s = fc.Session(g)
    ops = [n.op for n in s.plan_for([both, side], {}).nodes]
    assert "ConcatMatMul" not in ops  # p and q have two readers each
    ops = [n.op for n in s.plan_for([twice], {}).nodes]
    assert ops.count("ConcatMatMul") == 1
    ops = [n.op for n in s.plan_for([twice, twice.op.inputs[0]], {}).nodes]  # one product fetched
    assert "ConcatMatMul" not in ops
    np.testing.assert_array_equal(s.run(twice), np.full((6, 5), 4.0, "float32"))
