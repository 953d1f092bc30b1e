"""Reductions: kernels against float64 references built from explicit Python loops (math.fsum, max
over lists), every differentiable op through the finite-difference checker, run-time (None) dims,
the tie rule of Max's gradient, and second derivatives through the fused gradient ops."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.dtypes import FLOATS
from flowctl.engine.gradcheck import check_gradients
from flowctl.engine.gradcheck import run_graph as run
from flowctl.engine.opdef import get_op
from flowctl.engine.shapes import TensorSpec


def loop_reduce(x: np.ndarray, axis, keepdims: bool, combine) -> np.ndarray:
    """Reduce by visiting every index with Python loops; `combine` takes a list of Python floats."""
    rank = x.ndim
    if axis is None:
        axes = set(range(rank))
    else:
        axes = {a % rank for a in ([axis] if isinstance(axis, int) else axis)}
    kept = [i for i in range(rank) if i not in axes]
    out_shape = [x.shape[i] for i in kept]
    out = np.zeros(out_shape, dtype=np.float64)
    for out_idx in itertools.product(*[range(x.shape[i]) for i in kept]):
        vals = []
        for red_idx in itertools.product(*[range(x.shape[i]) for i in sorted(axes)]):
            full = [0] * rank
            for i, v in zip(kept, out_idx):
                full[i] = v
            for i, v in zip(sorted(axes), red_idx):
                full[i] = v
            vals.append(float(x[tuple(full)]))
        out[out_idx] = combine(vals)
    if keepdims:
        out = out.reshape([1 if i in axes else x.shape[i] for i in range(rank)])
    return out


COMBINE = {"reduce_sum": math.fsum, "reduce_mean": lambda v: math.fsum(v) / len(v), "reduce_max": max}
AXES = [None, 0, -1, [0, 2], [-1, -3], (1,), [1, -2]]


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("name", sorted(COMBINE))
def test_reduction_kernel_and_gradient(name, axis, keepdims, rng):
    x = rng.standard_normal((2, 3, 4))  # continuous values: no ties, so Max is differentiable
    got = run(lambda x: getattr(fc, name)(x, axis=axis, keepdims=keepdims), x=x)
    ref = loop_reduce(x, axis, keepdims, COMBINE[name])
    assert isinstance(got, np.ndarray) and got.shape == ref.shape and got.dtype == np.float64
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-14)
    check_gradients(lambda x: getattr(fc, name)(x, axis=axis, keepdims=keepdims), {"x": x})


@pytest.mark.parametrize("name", sorted(COMBINE))
def test_static_shapes_and_float32(name, rng):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    g = fc.Graph()
    with g.as_default():
        p = fc.placeholder("float32", (None, 3, 4))
        assert getattr(fc, name)(p, axis=-1).shape == (None, 3)
        assert getattr(fc, name)(p, axis=[0, 2], keepdims=True).shape == (1, 3, 1)
        assert getattr(fc, name)(p).shape == ()
        y = getattr(fc, name)(p, axis=1)
    out = fc.Session(g, store=fc.ContainerStore()).run(y, {p: x})
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, loop_reduce(x, 1, False, COMBINE[name]), rtol=1e-5, atol=1e-6)


def test_mean_over_unknown_batch_dim_uses_run_time_count(rng):
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (None, 4), name="x")
        m_all, m_rows = fc.reduce_mean(x), fc.reduce_mean(x, axis=0)
        assert m_all.shape == () and m_rows.shape == (4,)
        gx, = fc.gradients(m_all, [x])
        gr, = fc.gradients(fc.reduce_sum(m_rows * m_rows), [x])
    sess = fc.Session(g, store=fc.ContainerStore())
    for batch in (3, 5):
        v = rng.standard_normal((batch, 4))
        a, r, dx, dr = sess.run([m_all, m_rows, gx, gr], {x: v})
        assert a == pytest.approx(math.fsum(v.ravel()) / (batch * 4), rel=1e-12)
        col_means = [math.fsum(v[:, j]) / batch for j in range(4)]
        np.testing.assert_allclose(r, col_means, rtol=1e-12)
        np.testing.assert_allclose(dx, np.full((batch, 4), 1.0 / (batch * 4)), rtol=1e-12)
        # d/dx sum_j mean_j^2 = 2 mean_j / batch for every row
        np.testing.assert_allclose(dr, np.tile(2 * np.array(col_means) / batch, (batch, 1)), rtol=1e-12)


def test_max_gradient_splits_ties_equally():
    x = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [5.0, 1.0, 0.0, -1.0]])
    g = fc.Graph()
    with g.as_default():
        p = fc.placeholder("float64", (3, 4))
        row, = fc.gradients(fc.reduce_sum(fc.reduce_max(p, axis=1) * np.array([1.0, 2.0, 3.0])), [p])
        whole, = fc.gradients(fc.reduce_max(p), [p])
    r, w = fc.Session(g, store=fc.ContainerStore()).run([row, whole], {p: x})
    np.testing.assert_allclose(r, [[0, 0.5, 0.5, 0], [0.5, 0.5, 0.5, 0.5], [3, 0, 0, 0]])
    expect = np.zeros((3, 4))
    expect[2, 0] = 1.0
    np.testing.assert_allclose(w, expect)


def test_second_derivatives_through_the_fused_gradient_ops(rng):
    x = rng.standard_normal((3, 4))

    def mean_sq(x):  # d/dx sum_i mean_i(x)^2 = 2 mean_i / 4, whose own gradient runs through ReduceGrad
        return fc.gradients(fc.reduce_sum(fc.square(fc.reduce_mean(x, axis=1))), [x])[0]

    def max_sq(x):  # 2 max_i onehot_i: its gradient runs through ReduceMaxGrad's dy input
        return fc.gradients(fc.reduce_sum(fc.square(fc.reduce_max(x, axis=-1, keepdims=True))), [x])[0]

    check_gradients(mean_sq, {"x": x})
    check_gradients(max_sq, {"x": x})


def test_integer_and_half_precision_sums_keep_their_dtype(rng):
    xi = rng.integers(-1000, 1000, size=(4, 5)).astype(np.int32)
    out = run(lambda x: [fc.reduce_sum(x, axis=0), fc.reduce_sum(x), fc.reduce_max(x, 1)], x=xi)
    assert [o.dtype for o in out] == [np.int32] * 3
    assert out[0].tolist() == [sum(int(xi[i, j]) for i in range(4)) for j in range(5)]
    assert int(out[1]) == sum(int(v) for v in xi.ravel())
    assert out[2].tolist() == [max(int(v) for v in r) for r in xi]
    xh = rng.uniform(0, 1, size=(3000,)).astype(np.float16)
    s = run(lambda x: fc.reduce_sum(x), x=xh)
    assert s.dtype == np.float16 and float(s) == pytest.approx(math.fsum(map(float, xh)), rel=1e-3)
    with pytest.raises(fc.GraphError, match="Mean needs a float input"):
        run(lambda x: fc.reduce_mean(x), x=xi)


def test_argmax_against_loops(rng):
    x = rng.standard_normal((3, 4, 5))
    a0, a_neg, a32 = run(lambda x: [fc.argmax(x, 0), fc.argmax(x, -1), fc.argmax(x, 1, output_type="int32")], x=x)
    assert a0.dtype == np.int64 and a32.dtype == np.int32
    assert a0.shape == (4, 5) and a_neg.shape == (3, 4) and a32.shape == (3, 5)
    for j, k in itertools.product(range(4), range(5)):
        col = [x[i, j, k] for i in range(3)]
        assert a0[j, k] == col.index(max(col))
    for i, j in itertools.product(range(3), range(4)):
        row = list(x[i, j])
        assert a_neg[i, j] == row.index(max(row))
    for i, k in itertools.product(range(3), range(5)):
        col = [x[i, j, k] for j in range(4)]
        assert a32[i, k] == col.index(max(col))
    ties = run(lambda x: fc.argmax(x, 1), x=np.array([[1.0, 4.0, 4.0], [7.0, 7.0, 7.0]]))
    assert ties.tolist() == [1, 0]  # the first maximum, as numpy and TensorFlow pick
    vec = run(lambda x: fc.argmax(x, 0), x=np.array([0.5, 2.0, 1.0]))
    assert isinstance(vec, np.ndarray) and vec.shape == () and int(vec) == 1


def test_argmax_is_not_differentiable(rng):
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (3, 4))
        y = fc.reduce_sum(fc.cast(fc.argmax(x, 1), "float64"))
        assert fc.gradients(y, [x]) == [None]


def test_axis_errors_and_raw_graphdef_axes(rng):
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (3, 4), name="x")
        with pytest.raises(fc.GraphError, match=r"axis 2 out of range for rank 2.*'x:0'"):
            fc.reduce_sum(x, axis=2, name="bad")
        with pytest.raises(fc.GraphError, match="out of range"):
            fc.argmax(x, -3)
        # A hand-written GraphDef may say (1, -1) for one axis; numpy would call that a duplicate.
        node = g.add_node("Sum", [x], {"axis": (1, -1), "keepdims": False}, name="raw")
        y = fc.Tensor(g, node.name, 0)
        assert y.shape == (3,)
        gx, = fc.gradients(y, [x])
    v = rng.standard_normal((3, 4))
    out, d = fc.Session(g, store=fc.ContainerStore()).run([y, gx], {x: v})
    np.testing.assert_allclose(out, [math.fsum(r) for r in v], rtol=1e-12)
    np.testing.assert_array_equal(d, np.ones((3, 4)))
    g2 = fc.Graph.from_json(g.to_json())  # the raw axes survive the GraphDef round trip
    assert g2.nodes["raw"].attrs["axis"] == (1, -1)


def test_builder_canonicalises_axes():
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (2, 3, 4))
        assert fc.reduce_sum(x, axis=[-1, 0, 2]).op.attrs["axis"] == (0, 2)
        assert fc.reduce_max(x, axis=np.int64(-2)).op.attrs["axis"] == (1,)
        assert fc.reduce_mean(x).op.attrs["axis"] is None


def test_costs():
    spec = TensorSpec((None, 3, 4), "float32")
    flops, nbytes = get_op("Sum").estimate([spec], [TensorSpec((None, 3), "float32")],
                                           {"axis": (2,), "keepdims": False}, batch=8)
    assert flops == 8 * 3 * 4 and nbytes == (8 * 3 * 4 + 8 * 3) * 4


@pytest.mark.gpu
def test_gpu_kernels_match_numpy(rng):
    x = rng.standard_normal((4, 5, 6)).astype(np.float32)
    x[0, 0, :2] = 9.0  # a tie, so the gradient's split is compared too
    g = fc.Graph()
    with g.as_default():
        p = fc.placeholder("float32", (None, 5, 6))
        outs = [fc.reduce_sum(p, axis=[0, -1]), fc.reduce_mean(p, keepdims=True), fc.reduce_max(p, axis=2),
                fc.reduce_sum(fc.reduce_max(p, axis=-1) * fc.reduce_mean(p, axis=2))]
        outs += fc.gradients(outs, [p]) + [fc.argmax(p, -1)]
    cpu = fc.Session(g, store=fc.ContainerStore()).run(outs, {p: x})
    gpu = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(outs, {p: x})
    for c, d in zip(cpu, gpu):
        assert c.dtype == d.dtype and c.shape == d.shape
        np.testing.assert_allclose(d, c, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- empty axes
def _identity(op: str, dtype: str):
    """The reduction's identity over nothing (TensorFlow's and ONNX's answer); Mean has none: 0/0."""
    if op == "Sum":
        return 0
    if op == "Prod":
        return 1
    if op == "Mean":
        return np.nan
    if dtype == "bool":
        return op == "Min"  # all() of nothing is True, any() of nothing is False
    if dtype in FLOATS:
        return -np.inf if op == "Max" else np.inf
    info = np.iinfo(dtype)
    return info.min if op == "Max" else info.max


EMPTY_AXIS = {"Sum": fc.reduce_sum, "Prod": fc.reduce_prod, "Mean": fc.reduce_mean, "Max": fc.reduce_max,
              "Min": fc.reduce_min}
# Not reductions to a value: ArgMax has no identity (below); CumSum and TopK keep the scanned axis
# (an empty one stays empty, below); the rest are gradient ops.
# L2Loss sums over every axis with no axis attribute (an empty input gives 0: tests/test_optimizers.py),
# MultiL2Loss over every axis of each input (an empty one adds 0: tests/test_multi_l2.py)
NOT_VALUE_REDUCTIONS = {"ArgMax", "CumSum", "TopK", "ReduceGrad", "ReduceMaxGrad", "ReduceProdGrad", "TopKGrad",
                        "L2Loss", "MultiL2Loss"}


def test_every_reduction_op_has_an_empty_axis_case():
    from flowctl.engine.opdef import REDUCTION, ops_in_group

    assert ops_in_group(REDUCTION) - NOT_VALUE_REDUCTIONS == set(EMPTY_AXIS)


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("op", sorted(EMPTY_AXIS))
def test_reduction_over_an_empty_axis_is_the_identity(op, keepdims):
    from flowctl.engine.dtypes import DTYPES
    from flowctl.engine.errors import GraphError

    seen = 0
    for dtype in DTYPES:
        for optimize in (False, True):
            g = fc.Graph()
            with g.as_default():
                x = fc.constant(np.zeros((2, 0, 3), dtype))
                try:
                    ys = [EMPTY_AXIS[op](x, axis=1, keepdims=keepdims), EMPTY_AXIS[op](x, keepdims=keepdims),
                          EMPTY_AXIS[op](x, axis=[0, 2], keepdims=keepdims)]
                except GraphError:
                    continue  # a dtype the op does not take (Mean of ints, Sum of bools)
            seen += 1
            over_empty, everything, non_empty = fc.Session(g, store=fc.ContainerStore(),
                                                           optimize=optimize).run(ys)
            want = _identity(op, dtype)
            for got, shape in ((over_empty, (2, 1, 3) if keepdims else (2, 3)),
                               (everything, (1, 1, 1) if keepdims else ())):
                assert got.dtype == np.dtype(dtype) and got.shape == shape, (dtype, got.dtype, got.shape)
                np.testing.assert_array_equal(got, np.full(shape, want, dtype))
            # reducing the non-empty axes of an empty array leaves an empty result, not an identity
            assert non_empty.shape == ((1, 0, 1) if keepdims else (0,)) and non_empty.dtype == np.dtype(dtype)
    assert seen >= 2 * (3 if op == "Mean" else 9)


def test_cumsum_and_top_k_over_an_empty_axis_are_empty():
    x = np.zeros((2, 0), np.int16)
    c, e, (v, i) = run(lambda x: [fc.cumsum(x, 1), fc.cumsum(x, 1, exclusive=True, reverse=True),
                                  list(fc.top_k(x, 0))], x=x)
    assert c.shape == e.shape == v.shape == i.shape == (2, 0)
    assert c.dtype == e.dtype == v.dtype == np.int16 and i.dtype == np.int32


def test_argmax_over_an_empty_axis_fails_with_the_node_name():
    g = fc.Graph()
    with g.as_default():
        y = fc.argmax(fc.constant(np.zeros((2, 0), np.float32)), axis=1, name="am")
    with pytest.raises(fc.ExecutionError, match="am"):
        fc.Session(g, store=fc.ContainerStore()).run(y)


def test_min_and_prod_against_loops(rng):
    x = rng.standard_normal((2, 3, 4))
    for axis in (None, 1, [0, 2]):
        got = run(lambda x: fc.reduce_min(x, axis=axis), x=x)
        np.testing.assert_array_equal(got, loop_reduce(x, axis, False, min))
        got = run(lambda x: fc.reduce_prod(x, axis=axis, keepdims=True), x=x)
        np.testing.assert_allclose(got, loop_reduce(x, axis, True, math.prod), rtol=1e-13)
    xi = rng.integers(-3, 4, (3, 4)).astype(np.int16)
    got = run(lambda x: fc.reduce_prod(x, axis=0), x=xi)
    assert got.dtype == np.int16
    np.testing.assert_array_equal(got, loop_reduce(xi, 0, False, math.prod).astype(np.int16))


@pytest.mark.gpu
def test_gpu_min_prod_and_empty_axes_match_numpy(rng):
    x = rng.standard_normal((4, 5, 6)).astype(np.float32)
    g = fc.Graph()
    with g.as_default():
        p = fc.placeholder("float32", (4, 5, 6))
        e = fc.constant(np.zeros((3, 0), np.int16))
        outs = [fc.reduce_min(p, axis=1), fc.reduce_prod(p, axis=[0, 2]), fc.reduce_max(e, axis=1),
                fc.reduce_min(e, axis=1), fc.reduce_prod(e, axis=1)]
        outs += fc.gradients([fc.reduce_sum(outs[0]), fc.reduce_sum(outs[1])], [p])
    cpu = fc.Session(g, store=fc.ContainerStore()).run(outs, {p: x})
    gpu = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(outs, {p: x})
    for c, d in zip(cpu, gpu):
        assert c.dtype == d.dtype and c.shape == d.shape
        np.testing.assert_allclose(d, c, rtol=1e-5, atol=1e-5)
