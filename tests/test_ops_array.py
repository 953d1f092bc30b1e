"""Array (movement) ops: kernels against references built another way (explicit index loops over
Python lists), every differentiable op through the finite-difference checker, gradients through
unknown (batch) dimensions against hand-computed values, and shape errors that name the inputs."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.gradcheck import check_gradients
from flowctl.engine.gradcheck import run_graph as run
from flowctl.engine.ops.api import make, make1


def run_unknown(build, x, unknown, wrt_weights_seed=0):
    """Build on a placeholder whose dims listed in `unknown` are None, feed `x`, and return
    (outputs, d(sum w*y)/dx, weights, graph) so a test can compare against a reference."""
    g = fc.Graph()
    with g.as_default():
        ph = fc.placeholder(x.dtype.name, tuple(None if i in unknown else d for i, d in enumerate(x.shape)),
                            name="x")
        outs = build(ph)
        outs = [outs] if isinstance(outs, fc.Tensor) else list(outs)
        sess = fc.Session(g, store=fc.ContainerStore())
        vals = sess.run(outs, {ph: x})
        rng = np.random.default_rng(wrt_weights_seed)
        ws = [rng.standard_normal(np.shape(v)) for v in vals]
        (gx,) = fc.gradients(outs, [ph], grad_ys=[fc.constant(w) for w in ws])
    sess = fc.Session(g, store=fc.ContainerStore())
    return vals, sess.run(gx, {ph: x}), ws, g


def ops_in(g):
    return {n.op for n in g.nodes.values()}


def cells(shape):
    return itertools.product(*[range(d) for d in shape])


# ---------------------------------------------------------------------------- Shape, Rank
def test_shape_and_rank_read_the_runtime_shape(rng):
    x = rng.standard_normal((4, 3, 2))
    g = fc.Graph()
    with g.as_default():
        ph = fc.placeholder("float64", (None, 3, None), name="x")
        s32, s64, r = fc.shape(ph), fc.shape(ph, out_type="int64"), fc.rank(ph)
    assert s32.shape == (3,) and r.shape == ()
    a, b, c = fc.Session(g, store=fc.ContainerStore()).run([s32, s64, r], {ph: x})
    assert a.dtype == np.int32 and b.dtype == np.int64 and c.dtype == np.int32
    assert a.tolist() == [4, 3, 2] and b.tolist() == [4, 3, 2] and int(c) == 3
    assert run(lambda x: fc.shape(x), x=np.float64(1.0)).tolist() == []


# ---------------------------------------------------------------------------- Reshape
def _unflatten(flat, shape):
    if not shape:
        return flat[0]
    step = len(flat) // shape[0]
    return [_unflatten(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def _flatten(nested):
    return [v for item in nested for v in _flatten(item)] if isinstance(nested, list) else [nested]


@pytest.mark.parametrize("src,target,expect", [((2, 3, 4), (4, -1), (4, 6)), ((6,), (3, 2), (3, 2)),
                                               ((2, 3), (-1,), (6,)), ((1, 6), (2, 1, 3), (2, 1, 3))])
def test_reshape_kernel_and_gradient(src, target, expect, rng):
    x = rng.standard_normal(src)
    y = run(lambda x: fc.reshape(x, target), x=x)
    assert y.shape == expect
    np.testing.assert_array_equal(y, np.array(_unflatten(_flatten(x.tolist()), list(expect))))
    check_gradients(lambda x: fc.reshape(x, target), {"x": x})


def test_reshape_infers_static_dims_and_keeps_unknown_ones():
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (None, 4, 3), name="x")
        assert fc.reshape(x, [-1, 12]).shape == (None, 12)
        assert fc.reshape(x, [2, 3, 2]).shape == (2, 3, 2)
        assert fc.reshape(fc.placeholder("float32", (2, 6)), [3, -1]).shape == (3, 4)


@pytest.mark.parametrize("unknown,shape,target,helper", [({0}, (5, 2, 3), (-1, 6), "Reshape"),
                                                         ({0, 2}, (3, 2, 4), (-1,), "ReshapeLike")])
def test_reshape_gradient_through_unknown_dims(unknown, shape, target, helper, rng):
    x = rng.standard_normal(shape)
    (y,), gx, (w,), g = run_unknown(lambda t: fc.reshape(t, target), x, unknown)
    assert y.shape == (x.size // 6, 6) if len(target) == 2 else (x.size,)
    np.testing.assert_array_equal(gx, np.array(_unflatten(_flatten(w.tolist()), list(shape))))
    grad_ops = {n.op for name, n in g.nodes.items() if name.startswith("gradients/")}
    assert helper in grad_ops and (helper == "ReshapeLike" or "ReshapeLike" not in grad_ops)


# ---------------------------------------------------------------------------- Transpose
@pytest.mark.parametrize("perm", [None, (1, 0, 2), (2, 0, 1), (-1, 0, 1)])
def test_transpose_kernel_and_gradient(perm, rng):
    x = rng.standard_normal((2, 3, 4))
    y = run(lambda x: fc.transpose(x, perm), x=x)
    p = [2, 1, 0] if perm is None else [a % 3 for a in perm]
    assert y.shape == tuple(x.shape[a] for a in p)
    for idx in cells(x.shape):
        assert y[tuple(idx[a] for a in p)] == x[idx]
    check_gradients(lambda x: fc.transpose(x, perm), {"x": x})


def test_transpose_gradient_with_unknown_batch(rng):
    x = rng.standard_normal((3, 2, 4))
    _, gx, (w,), _ = run_unknown(lambda t: fc.transpose(t, [2, 0, 1]), x, {0})
    for i, j, k in cells(x.shape):
        assert gx[i, j, k] == w[k, i, j]


# ---------------------------------------------------------------------------- Concat, Split
def _concat_ref(xs, axis):
    axis %= xs[0].ndim
    out_shape = list(xs[0].shape)
    out_shape[axis] = sum(x.shape[axis] for x in xs)
    out = np.empty(out_shape)
    offset = 0
    for x in xs:
        for idx in cells(x.shape):
            at = list(idx)
            at[axis] += offset
            out[tuple(at)] = x[idx]
        offset += x.shape[axis]
    return out


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat_kernel_and_gradient(axis, rng):
    shapes = {0: [(1, 3), (2, 3), (3, 3)], 1: [(2, 1), (2, 3), (2, 2)], -1: [(2, 1), (2, 3), (2, 2)]}[axis]
    a, b, c = (rng.standard_normal(s) for s in shapes)
    y = run(lambda a, b, c: fc.concat([a, b, c], axis), a=a, b=b, c=c)
    np.testing.assert_array_equal(y, _concat_ref([a, b, c], axis))
    check_gradients(lambda a, b, c: fc.concat([a, b * b, c], axis), {"a": a, "b": b, "c": c})


@pytest.mark.parametrize("axis,helper", [(1, "Split"), (0, "SplitLike")])
def test_concat_gradient_with_unknown_batch(axis, helper, rng):
    a, b = rng.standard_normal((3, 2)), rng.standard_normal((4, 2)) if axis == 0 else rng.standard_normal((3, 5))
    g = fc.Graph()
    with g.as_default():
        pa = fc.placeholder("float64", (None, 2), name="a")
        pb = fc.placeholder("float64", (None, b.shape[1]), name="b")
        y = fc.concat([pa, pb], axis)
        w = rng.standard_normal(_concat_ref([a, b], axis).shape)
        ga, gb = fc.gradients(y, [pa, pb], grad_ys=[fc.constant(w)])
    va, vb = fc.Session(g, store=fc.ContainerStore()).run([ga, gb], {pa: a, pb: b})
    for idx in cells(a.shape):
        assert va[idx] == w[idx]
    for i, j in cells(b.shape):
        assert vb[i, j] == (w[i + a.shape[0], j] if axis == 0 else w[i, j + a.shape[1]])
    assert helper in {n.op for name, n in g.nodes.items() if name.startswith("gradients/")}


@pytest.mark.parametrize("spec,axis", [(3, 0), ([1, -1, 2], 1), ([2, 1, 3], -1), (1, 1)])
def test_split_kernel_and_gradient(spec, axis, rng):
    x = rng.standard_normal((6, 6))
    parts = run(lambda x: fc.split(x, spec, axis=axis), x=x)
    sizes = [6 // spec] * spec if isinstance(spec, int) else [3 if s == -1 else s for s in spec]
    assert len(parts) == len(sizes)
    offset = 0
    for part, size in zip(parts, sizes):
        for i, j in cells(part.shape):
            assert part[i, j] == (x[i + offset, j] if axis == 0 else x[i, j + offset])
        offset += size
    check_gradients(lambda x: [p * float(k + 1) for k, p in enumerate(fc.split(x, spec, axis=axis))], {"x": x})


def test_split_along_an_unknown_dim(rng):
    x = rng.standard_normal((5, 2))
    (p0, p1), gx, (w0, w1), _ = run_unknown(lambda t: fc.split(t, [2, -1], axis=0), x, {0})
    np.testing.assert_array_equal(p0, x[:2])
    np.testing.assert_array_equal(p1, x[2:])
    np.testing.assert_array_equal(gx, np.array(w0.tolist() + w1.tolist()))


# ---------------------------------------------------------------------------- Slice, Pad
@pytest.mark.parametrize("begin,size", [((1, 0, 2), (2, -1, 1)), ((0, 1, 0), (3, 2, -1)), ((2, 3, 3), (1, 0, 1))])
def test_slice_kernel_and_gradient(begin, size, rng):
    x = rng.standard_normal((3, 4, 5))
    y = run(lambda x: fc.slice_(x, begin, size), x=x)
    expect = tuple(d - b if s == -1 else s for d, b, s in zip(x.shape, begin, size))
    assert y.shape == expect
    for idx in cells(expect):
        assert y[idx] == x[tuple(i + b for i, b in zip(idx, begin))]
    if 0 not in expect:
        check_gradients(lambda x: fc.slice_(x, begin, size), {"x": x})


@pytest.mark.parametrize("size,helper", [((-1, 2), "Pad"), ((2, 2), "SliceGrad")])
def test_slice_gradient_with_unknown_batch(size, helper, rng):
    x = rng.standard_normal((4, 3))
    (y,), gx, (w,), g = run_unknown(lambda t: fc.slice_(t, [1, 1], size), x, {0})
    np.testing.assert_array_equal(y, x[1:1 + y.shape[0], 1:3])
    for i, j in cells(x.shape):
        inside = 1 <= i < 1 + y.shape[0] and 1 <= j < 3
        assert gx[i, j] == (w[i - 1, j - 1] if inside else 0.0)
    assert helper in {n.op for name, n in g.nodes.items() if name.startswith("gradients/")}


def test_pad_kernel_both_paddings_forms_and_int_dtype(rng):
    x = rng.standard_normal((2, 3))
    nested = run(lambda x: fc.pad(x, [[1, 2], [0, 1]], constant_values=-7.0), x=x)
    flat = run(lambda x: fc.pad(x, [1, 2, 0, 1], constant_values=-7.0), x=x)
    assert nested.shape == (5, 4)
    for i, j in cells(nested.shape):
        assert nested[i, j] == (x[i - 1, j] if 1 <= i < 3 and j < 3 else -7.0)
    np.testing.assert_array_equal(nested, flat)
    xi = np.arange(4, dtype=np.int32).reshape(2, 2)
    yi = run(lambda x: fc.pad(x, [[0, 1], [1, 0]], constant_values=9), x=xi)
    assert yi.dtype == np.int32 and yi.tolist() == [[9, 0, 1], [9, 2, 3], [9, 9, 9]]


def test_pad_gradient_including_unknown_batch(rng):
    x = rng.standard_normal((2, 3, 2))
    check_gradients(lambda x: fc.pad(x, [[1, 0], [2, 1], [0, 0]]), {"x": x})
    (y,), gx, (w,), g = run_unknown(lambda t: fc.pad(t, [[2, 1], [0, 1], [1, 1]]), x, {0})
    assert y.shape == (5, 4, 4)
    for i, j, k in cells(x.shape):
        assert gx[i, j, k] == w[i + 2, j, k + 1]
    assert "PadGrad" in ops_in(g)


# ---------------------------------------------------------------------------- Tile
@pytest.mark.parametrize("multiples", [(2, 3), (1, 2), (3, 1)])
def test_tile_kernel_and_gradient(multiples, rng):
    x = rng.standard_normal((2, 3))
    y = run(lambda x: fc.tile(x, multiples), x=x)
    assert y.shape == (2 * multiples[0], 3 * multiples[1])
    for i, j in cells(y.shape):
        assert y[i, j] == x[i % 2, j % 3]
    check_gradients(lambda x: fc.tile(x, multiples), {"x": x})


def test_tile_gradient_with_unknown_batch(rng):
    x = rng.standard_normal((3, 2))
    (y,), gx, (w,), _ = run_unknown(lambda t: fc.tile(t, [2, 3]), x, {0})
    ref = np.zeros_like(x)
    for i, j in cells(y.shape):
        ref[i % 3, j % 2] += w[i, j]
    np.testing.assert_allclose(gx, ref, rtol=1e-12)


# ---------------------------------------------------------------------------- ExpandDims, Squeeze
@pytest.mark.parametrize("axis,expect", [(0, (1, 2, 3)), (1, (2, 1, 3)), (-1, (2, 3, 1)), (-3, (1, 2, 3))])
def test_expand_dims_and_squeeze(axis, expect, rng):
    x = rng.standard_normal((2, 3))
    y, back = run(lambda x: [fc.expand_dims(x, axis), fc.squeeze(fc.expand_dims(x, axis), axis)], x=x)
    assert y.shape == expect and back.shape == (2, 3)
    assert _flatten(y.tolist()) == _flatten(x.tolist()) and back.tolist() == x.tolist()
    check_gradients(lambda x: fc.expand_dims(x, axis), {"x": x})
    check_gradients(lambda x: fc.squeeze(fc.reshape(x, expect), axis), {"x": x})


def test_squeeze_none_keeps_unknown_dims_and_gradient_reshapes_back(rng):
    x = rng.standard_normal((3, 1, 2, 1))
    g = fc.Graph()
    with g.as_default():
        ph = fc.placeholder("float64", (None, 1, None, 1), name="x")
        assert fc.squeeze(ph).shape == (None, None)
        assert fc.squeeze(ph, [-1]).shape == (None, 1, None)
    (y,), gx, (w,), g = run_unknown(lambda t: fc.squeeze(t), x, {0, 2})
    assert y.shape == (3, 2)
    np.testing.assert_array_equal(gx[:, 0, :, 0], w)
    assert "ReshapeLike" in ops_in(g)
    check_gradients(lambda x: fc.squeeze(x), {"x": x})
    # An unknown dim that is 1 at run time stays: the graph promised its rank statically.
    (y1,), _, _, _ = run_unknown(lambda t: fc.squeeze(t), np.ones((1, 1, 1, 1)), {0, 2})
    assert y1.shape == (1, 1)


# ---------------------------------------------------------------------------- Stack, Unstack
@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_stack_unstack_kernels_and_gradients(axis, rng):
    xs = [rng.standard_normal((2, 3)) for _ in range(4)]
    y = run(lambda a, b, c, d: fc.stack([a, b, c, d], axis), a=xs[0], b=xs[1], c=xs[2], d=xs[3])
    ax = axis % 3
    for idx in cells(y.shape):
        rest = idx[:ax] + idx[ax + 1:]
        assert y[idx] == xs[idx[ax]][rest]
    parts = run(lambda y: fc.unstack(y, axis), y=y)
    assert len(parts) == 4 and all(p.tolist() == x.tolist() for p, x in zip(parts, xs))
    check_gradients(lambda a, b: fc.stack([a, b * b], axis), {"a": xs[0], "b": xs[1]})
    check_gradients(lambda y: [p * float(k) for k, p in enumerate(fc.unstack(y, axis))], {"y": y})


def test_unstack_single_entry_and_unknown_batch(rng):
    x = rng.standard_normal((3, 1, 2))
    (only,) = run(lambda x: fc.unstack(x, 1), x=x)
    np.testing.assert_array_equal(only, x[:, 0, :])
    parts, gx, ws, _ = run_unknown(lambda t: fc.unstack(t, -1), x, {0})
    assert [p.tolist() for p in parts] == [x[:, :, k].tolist() for k in range(2)]
    for i, j, k in cells(x.shape):
        assert gx[i, j, k] == ws[k][i, j]


# ---------------------------------------------------------------------------- Gather
def _gather_ref(params, indices, axis):
    axis %= params.ndim
    out = np.empty(params.shape[:axis] + indices.shape + params.shape[axis + 1:])
    for pre in cells(params.shape[:axis]):
        for ii in cells(indices.shape):
            for post in cells(params.shape[axis + 1:]):
                out[pre + ii + post] = params[pre + (int(indices[ii]),) + post]
    return out


def _scatter_ref(dy, indices, params_shape, axis):
    axis %= len(params_shape)
    out = np.zeros(params_shape)
    for pre in cells(params_shape[:axis]):
        for ii in cells(indices.shape):
            for post in cells(params_shape[axis + 1:]):
                out[pre + (int(indices[ii]) % params_shape[axis],) + post] += dy[pre + ii + post]
    return out


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("itype", ["int32", "int64"])
def test_gather_kernel_and_gradient_with_repeated_indices(axis, itype, rng):
    params = rng.standard_normal((4, 5, 3))
    dim = params.shape[axis]
    indices = np.array([[0, dim - 1, 1], [1, 1, 0]], dtype=itype)  # repeats: the gradient must add
    y = run(lambda p, i: fc.gather(p, i, axis), p=params, i=indices)
    np.testing.assert_array_equal(y, _gather_ref(params, indices, axis))
    check_gradients(lambda p, i: fc.gather(p, i, axis), {"p": params, "i": indices})


def test_gather_with_list_indices_and_unknown_batch(rng):
    params = rng.standard_normal((5, 3))
    (y,), gx, (w,), _ = run_unknown(lambda t: fc.gather(t, [4, 0, 4, 2]), params, {0})
    np.testing.assert_array_equal(y, params[[4, 0, 4, 2]])
    np.testing.assert_allclose(gx, _scatter_ref(w, np.array([4, 0, 4, 2]), params.shape, 0), rtol=1e-12)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_gather_grad_generic_and_cpu_kernels_match_loop_reference(axis, rng):
    from flowctl.kernels.array import gather_grad, gather_grad_cpu

    params_shape = (3, 4, 2)
    indices = rng.integers(-params_shape[axis], params_shape[axis], size=(2, 5))  # negatives count from the end
    dy = rng.standard_normal(params_shape[:axis] + indices.shape + params_shape[axis + 1:])
    like = np.zeros(params_shape)
    ref = _scatter_ref(dy, indices, params_shape, axis)
    for factory in (gather_grad, gather_grad_cpu):
        got = factory(np, {"axis": axis})(dy, indices, like)
        assert got.shape == params_shape and got.dtype == dy.dtype
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    empty = gather_grad_cpu(np, {"axis": 0})(np.zeros((0, 2)), np.zeros((0,), np.int32), np.zeros((3, 2)))
    assert empty.shape == (3, 2) and not empty.any()


# ---------------------------------------------------------------------------- OneHot, Fill
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_one_hot(axis, rng):
    idx = np.array([[0, 3, 1], [-1, 2, 4]], dtype=np.int32)  # -1 and 4 are out of range: all off
    y = run(lambda i: fc.one_hot(i, 4, on_value=5.0, off_value=-1.0, axis=axis, dtype="float64"), i=idx)
    ax = axis % 3
    assert y.dtype == np.float64 and y.shape == idx.shape[:ax] + (4,) + idx.shape[ax:]
    for out_idx in cells(y.shape):
        k = out_idx[ax]
        src = out_idx[:ax] + out_idx[ax + 1:]
        assert y[out_idx] == (5.0 if idx[src] == k else -1.0)
    assert run(lambda i: fc.one_hot(i, 3, dtype="int32"), i=np.array([2, 0])).tolist() == [[0, 0, 1], [1, 0, 0]]


def test_fill_zeros_ones():
    g = fc.Graph()
    with g.as_default():
        f, z, o = fc.fill((2, 3), 2.5), fc.zeros((4,), "int32"), fc.ones((), "float64")
    a, b, c = fc.Session(g, store=fc.ContainerStore()).run([f, z, o])
    assert a.dtype == np.float32 and a.tolist() == [[2.5] * 3] * 2
    assert b.dtype == np.int32 and b.tolist() == [0, 0, 0, 0]
    assert c.dtype == np.float64 and float(c) == 1.0
    with g.as_default(), pytest.raises(fc.GraphError, match="fully known"):
        fc.fill((None, 2), 1.0, name="bad_fill")


# ---------------------------------------------------------------------------- helper ops, costs, GraphDef
def test_gradient_helper_ops_are_linear_and_differentiable(rng):
    dy = rng.standard_normal((4, 6))
    like = rng.standard_normal((2, 6))
    like2 = rng.standard_normal((2, 6))
    idx = np.array([1, 0, 1, 2], dtype=np.int32)
    p = rng.standard_normal((3, 6))
    # Second-order gradients pass through these ops: each must have its own (adjoint) gradient.
    check_gradients(lambda dy: make1("PadGrad", [dy], {"paddings": (1, 1, 2, 0)}), {"dy": dy})
    check_gradients(lambda dy: make1("TileGrad", [dy], {"multiples": (2, 3)}), {"dy": dy})
    check_gradients(lambda dy, x: make1("SliceGrad", [dy, x], {"begin": (1, 2), "size": (2, 3)}),
                    {"dy": dy[:2, :3].copy(), "x": dy}, wrt=["dy"])
    check_gradients(lambda dy, i, p: make1("GatherGrad", [dy, i, p], {"axis": 0}),
                    {"dy": dy, "i": idx, "p": p}, wrt=["dy"])
    check_gradients(lambda dy, a, b: make("SplitLike", [dy, a, b], {"axis": 0}),
                    {"dy": dy, "a": like, "b": like2}, wrt=["dy"])
    check_gradients(lambda dy, a: make1("ReshapeLike", [dy, a], {}), {"dy": dy[:2], "a": like.reshape(3, 4)},
                    wrt=["dy"])


def test_costs_count_real_work():
    from flowctl.engine.opdef import get_op
    from flowctl.engine.shapes import TensorSpec as S

    f32 = "float32"
    flops, nbytes = get_op("TileGrad").estimate([S((None, 6), f32)], [S((None, 2), f32)], {}, batch=8)
    assert flops == 48 and nbytes == (48 + 16) * 4
    assert get_op("Reshape").estimate([S((8, 6), f32)], [S((48,), f32)], {}) == (0.0, 0.0)
    _, nbytes = get_op("Concat").estimate([S((2, 3), f32), S((2, 5), f32)], [S((2, 8), f32)], {})
    assert nbytes == 2 * 16 * 4
    _, nbytes = get_op("Gather").estimate([S((100, 4), f32), S((10,), "int32")], [S((10, 4), f32)], {})
    assert nbytes == 2 * 40 * 4 + 8 * 10


def test_array_ops_round_trip_through_graphdef(rng):
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (None, 4), name="x")
        y = fc.concat(fc.split(fc.transpose(fc.reshape(x, [-1, 2, 2])), [1, -1], axis=2), 2)
        z = fc.gather(fc.pad(fc.squeeze(fc.expand_dims(y, 0), 0), [[0, 0], [1, 1], [0, 0]]), [0, 1], axis=1)
        fc.gradients(fc.one_hot([1], 3) + fc.zeros((1, 3)), [])
        fc.gradients(z, [x])
    h = fc.Graph.from_json(g.to_json())
    assert [n.outputs for n in h.nodes.values()] == [n.outputs for n in g.nodes.values()]
    v = rng.standard_normal((3, 4)).astype(np.float32)
    a = fc.Session(g, store=fc.ContainerStore()).run(z, {x: v})
    b = fc.Session(h, store=fc.ContainerStore()).run(h.tensor(z.name), {h.tensor("x:0"): v})
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------- shape errors
@pytest.mark.parametrize("build,match", [
    (lambda x, y: fc.reshape(x, [4, -1], name="bad"), r"cannot reshape 6 elements.*\(4, -1\)"),
    (lambda x, y: fc.reshape(x, [4, 2], name="bad"), r"cannot reshape 6 elements"),
    (lambda x, y: fc.reshape(x, [-1, -1], name="bad"), r"at most one -1"),
    (lambda x, y: fc.concat([x, y], 0, name="bad"), r"one rank, got ranks 2, 1"),
    (lambda x, y: fc.concat([x, fc.reshape(x, [3, 2])], 1, name="bad"), r"disagree on dim 0"),
    (lambda x, y: fc.concat([x, x], 2, name="bad"), r"axis 2 out of range"),
    (lambda x, y: fc.split(x, 2, axis=1, name="bad"), r"size 3 into 2"),
    (lambda x, y: fc.split(x, [1, 1], axis=1, name="bad"), r"sum to 2, but the dim is 3"),
    (lambda x, y: fc.slice_(x, [1, 1], [2, 1], name="bad"), r"runs past"),
    (lambda x, y: fc.transpose(x, [0, 0], name="bad"), r"not a permutation"),
    (lambda x, y: fc.squeeze(x, 0, name="bad"), r"cannot squeeze dim 0 of size 2"),
    (lambda x, y: fc.pad(x, [1, 1], name="bad"), r"4 numbers for rank 2"),
    (lambda x, y: fc.tile(x, [2], name="bad"), r"one non-negative entry per dim"),
    (lambda x, y: fc.unstack(fc.placeholder("float32", (None, 2), name="u"), name="bad"), r"known size"),
    (lambda x, y: fc.gather(x, y, name="bad"), r"indices must be int32 or int64"),
    (lambda x, y: fc.stack([x, y], name="bad"), r"one rank"),
])
def test_shape_errors_name_the_node_and_its_inputs(build, match):
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (2, 3), name="x")
        y = fc.placeholder("float32", (3,), name="y")
        with pytest.raises(fc.GraphError, match=r"node 'bad' \(\w+\): .*" + match + r".*inputs: '\w+:0' \("):
            build(x, y)


# ---------------------------------------------------------------------------- gpu
@pytest.mark.gpu
def test_array_kernels_on_gpu_match_numpy(rng):
    x = rng.standard_normal((4, 6)).astype(np.float32)

    def build(x):
        y = fc.concat([fc.transpose(fc.reshape(x, [-1, 3, 2]), [0, 2, 1]), fc.tile(fc.slice_(
            fc.reshape(x, [4, 3, 2]), [0, 1, 0], [-1, 2, 1]), [1, 1, 2])], -1)  # (4, 2, 5)
        z = fc.gather(fc.pad(y, [[1, 0], [0, 2], [0, 1]]), [[0, 3], [3, 1]], axis=1)  # (5, 2, 2, 6)
        s = fc.stack(fc.split(z, 6, axis=-1), 0) * fc.expand_dims(fc.one_hot([1, 0], 2), -1)
        out = fc.squeeze(fc.unstack(s, 0)[0], [-1]) * 2.0
        return [out, fc.shape(out)] + fc.gradients(out, [x])

    g = fc.Graph()
    with g.as_default():
        ph = fc.placeholder("float32", (None, 6), name="x")
        outs = build(ph)
    cpu = fc.Session(g, store=fc.ContainerStore()).run(outs, {ph: x})
    gpu = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(outs, {ph: x})
    for a, b in zip(cpu, gpu):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
