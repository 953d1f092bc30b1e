"""CumSum, TopK, Range, GatherND, ScatterND and Einsum (issue 20) against float64 references built
from explicit Python loops, their integer dtypes, their errors, and the gpu kernels against numpy."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.errors import ExecutionError, GraphError
from flowctl.engine.gradcheck import run_graph as run


def loop_cumsum(x: np.ndarray, axis: int, exclusive: bool, reverse: bool) -> np.ndarray:
    out = np.zeros(x.shape, dtype=np.float64)
    axis %= x.ndim
    for idx in itertools.product(*map(range, x.shape)):
        i = idx[axis]
        span = range(i + 1 if exclusive else i, x.shape[axis]) if reverse else range(0, i if exclusive else i + 1)
        out[idx] = math.fsum(float(x[idx[:axis] + (j,) + idx[axis + 1:]]) for j in span)
    return out


@pytest.mark.parametrize("exclusive,reverse", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_cumsum_against_loops(axis, exclusive, reverse, rng):
    x = rng.standard_normal((3, 4, 2))
    got = run(lambda x: fc.cumsum(x, axis, exclusive=exclusive, reverse=reverse), x=x)
    assert got.dtype == np.float64 and got.shape == x.shape
    np.testing.assert_allclose(got, loop_cumsum(x, axis, exclusive, reverse), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("dtype", ["int8", "int16", "uint8", "uint16", "int32"])
def test_cumsum_keeps_small_integer_dtypes(dtype, rng):
    x = rng.integers(0, 20, (4, 5)).astype(dtype)
    got = run(lambda x: fc.cumsum(x, 1, exclusive=True), x=x)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, loop_cumsum(x, 1, True, False).astype(dtype))


def test_top_k_against_sorting_with_ties_to_the_lower_index(rng):
    x = rng.integers(0, 5, (6, 9)).astype(np.float64)  # many ties
    values, indices = run(lambda x: list(fc.top_k(x, 4)), x=x)
    assert values.dtype == np.float64 and indices.dtype == np.int32 and values.shape == (6, 4)
    for row, v, i in zip(x, values, indices):
        ref = sorted(range(len(row)), key=lambda j: (-row[j], j))[:4]
        assert list(i) == ref and list(v) == [row[j] for j in ref]


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "float16"])
def test_top_k_on_other_dtypes(dtype, rng):
    x = rng.permutation(60).reshape(3, 20).astype(dtype)
    values, indices = run(lambda x: list(fc.top_k(x, 5)), x=x)
    assert values.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(values, -np.sort(-x.astype(np.int64), axis=1)[:, :5].astype(dtype))
    np.testing.assert_array_equal(np.take_along_axis(x, indices, 1), values)


def test_top_5_accuracy_from_top_k(rng):
    logits = rng.standard_normal((50, 10))
    labels = rng.integers(0, 10, 50).astype(np.int32)
    hit = run(lambda l, y: fc.reduce_sum(fc.cast(fc.equal(fc.top_k(l, 5)[1], fc.expand_dims(y, 1)), "int32")),
              l=logits, y=labels)
    assert int(hit) == sum(int(y in np.argsort(-l)[:5]) for l, y in zip(logits, labels))


def test_top_k_refuses_a_k_past_the_axis():
    with pytest.raises(GraphError, match="k=5"):
        run(lambda x: fc.top_k(x, 5)[0], x=np.zeros((2, 4)))


@pytest.mark.parametrize("args,dtype", [((5,), "int32"), ((2, 11, 3), "int16"), ((1.0, -2.0, -0.5), "float64"),
                                        ((0, 1, 0.1), "float32"), ((3, 3), "uint8"), ((4, 0, 1), "int8")])
def test_range_against_python(args, dtype):
    g = fc.Graph()
    with g.as_default():
        r = fc.range_(*args, dtype=dtype)
    got = fc.Session(g, store=fc.ContainerStore()).run(r)
    start, limit, delta = (0, args[0], 1) if len(args) == 1 else (args + (1,))[:3]
    ref = []
    v = 0
    while (start + v * delta < limit) if delta > 0 else (start + v * delta > limit):
        ref.append(start + v * delta)
        v += 1
    assert got.dtype == np.dtype(dtype) and got.shape == (len(ref),) == tuple(r.shape)
    np.testing.assert_allclose(got, np.array(ref, dtype=np.float64).astype(dtype), rtol=1e-6)


def test_range_refuses_a_zero_delta():
    with pytest.raises(GraphError, match="delta"):
        with fc.Graph().as_default():
            fc.range_(0, 4, 0)


def test_gather_nd_and_scatter_nd_against_loops(rng):
    p = rng.standard_normal((4, 3, 2))
    idx = np.array([[[0, 1], [3, 2]], [[0, 1], [1, 0]]], np.int64)  # shape (2, 2, 2): depth 2, a repeat
    got = run(lambda p: fc.gather_nd(p, idx), p=p)
    assert got.shape == (2, 2, 2)
    for a, b in itertools.product(range(2), range(2)):
        np.testing.assert_array_equal(got[a, b], p[idx[a, b, 0], idx[a, b, 1]])
    u = rng.standard_normal((2, 2, 2))
    out = run(lambda u: fc.scatter_nd(idx, u, (4, 3, 2)), u=u)
    ref = np.zeros((4, 3, 2))
    for a, b in itertools.product(range(2), range(2)):
        ref[idx[a, b, 0], idx[a, b, 1]] += u[a, b]  # the repeated index [0, 1] adds up
    np.testing.assert_allclose(out, ref, rtol=1e-15)


@pytest.mark.parametrize("dtype", ["int8", "uint16", "int32", "bool", "float16"])
def test_gather_nd_on_other_dtypes(dtype, rng):
    p = (rng.integers(0, 2, (3, 4)) if dtype == "bool" else rng.integers(0, 50, (3, 4))).astype(dtype)
    idx = np.array([[2, 3], [0, 0]], np.int32)
    got = run(lambda p: fc.gather_nd(p, idx), p=p)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, [p[2, 3], p[0, 0]])


def test_out_of_range_indices_fail_with_the_node_name():
    with pytest.raises(ExecutionError, match="gnd"):
        run(lambda p: fc.gather_nd(p, np.array([[5, 0]], np.int32), name="gnd"), p=np.zeros((3, 2)))
    with pytest.raises(ExecutionError, match="out of range"):
        run(lambda u: fc.scatter_nd(np.array([[-1]], np.int32), u, (3,)), u=np.ones(1))


def loop_einsum(equation: str, *xs: np.ndarray) -> np.ndarray:
    lhs, out = equation.split("->")
    subs = lhs.split(",")
    sizes = {c: d for s, x in zip(subs, xs) for c, d in zip(s, x.shape)}
    letters = sorted(sizes)
    res = np.zeros([sizes[c] for c in out])
    for point in itertools.product(*(range(sizes[c]) for c in letters)):
        at = dict(zip(letters, point))
        res[tuple(at[c] for c in out)] += math.prod(float(x[tuple(at[c] for c in s)]) for s, x in zip(subs, xs))
    return res


@pytest.mark.parametrize("equation,shapes", [("ij,jk->ik", [(2, 3), (3, 4)]), ("bij,bjk->bik", [(2, 2, 3), (2, 3, 2)]),
                                             ("ij->ji", [(2, 3)]), ("ii->i", [(3, 3)]), ("ij,ij->", [(2, 3), (2, 3)]),
                                             ("i,j,k->ijk", [(2,), (3,), (2,)]), ("ijk->", [(2, 3, 2)])])
def test_einsum_against_loops(equation, shapes, rng):
    xs = {f"x{i}": rng.standard_normal(s) for i, s in enumerate(shapes)}
    got = run(lambda **kw: fc.einsum(equation, *kw.values()), **xs)
    np.testing.assert_allclose(got, loop_einsum(equation, *xs.values()), rtol=1e-13, atol=1e-14)


def test_einsum_implicit_output_and_integers():
    a = np.arange(6, dtype=np.int16).reshape(2, 3)
    b = np.arange(12, dtype=np.int16).reshape(3, 4)
    got = run(lambda a, b: fc.einsum("ij,jk", a, b), a=a, b=b)  # implicit: -> ik
    assert got.dtype == np.int16
    np.testing.assert_array_equal(got, loop_einsum("ij,jk->ik", a, b).astype(np.int16))


@pytest.mark.parametrize("equation,shapes,match", [("ij,jk->ik", [(2, 3), (4, 4)], "letter 'j'"),
                                                   ("ij->ik", [(2, 3)], "output letter"),
                                                   ("i...->i", [(2, 3)], "letters"),
                                                   ("ij,jk->ik", [(2, 3)], "2 operand")])
def test_einsum_errors(equation, shapes, match):
    with pytest.raises(GraphError, match=match):
        run(lambda **kw: fc.einsum(equation, *kw.values()), **{f"x{i}": np.zeros(s) for i, s in enumerate(shapes)})


@pytest.mark.gpu
def test_gpu_kernels_match_numpy(rng):
    x = rng.standard_normal((4, 6)).astype(np.float32)
    p = rng.standard_normal((4, 3, 2)).astype(np.float32)
    idx = np.array([[0, 1], [3, 2], [0, 1]], np.int32)
    g = fc.Graph()
    with g.as_default():
        px, pp = fc.placeholder("float32", (4, 6)), fc.placeholder("float32", (4, 3, 2))
        v, i = fc.top_k(px, 3)
        outs = [fc.cumsum(px, 1, exclusive=True), fc.cumsum(px, 0, reverse=True), v, i, fc.gather_nd(pp, idx),
                fc.scatter_nd(idx, fc.gather_nd(pp, idx), (4, 3, 2)), fc.einsum("ij,kj->ik", px, px),
                fc.range_(2, 9, 2, dtype="int16"), fc.reduce_prod(px, axis=1), fc.reduce_min(px, axis=0)]
        outs += fc.gradients([fc.reduce_sum(o) for o in (outs[0], outs[1], v, outs[4], outs[6], outs[8])], [px, pp])
    cpu = fc.Session(g, store=fc.ContainerStore()).run(outs, {px: x, pp: p})
    gpu = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(outs, {px: x, pp: p})
    for c, d in zip(cpu, gpu):
        assert c.dtype == d.dtype and c.shape == d.shape
        np.testing.assert_allclose(d, c, rtol=1e-4, atol=1e-4)
