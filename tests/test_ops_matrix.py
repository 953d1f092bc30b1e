"""Matrix ops: kernels against float64 references computed by hand (triple loops, Gauss-Jordan
elimination, cofactor expansion), every transpose case and broadcast batch through the
finite-difference checker, and shape errors that name both inputs."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.gradcheck import check_gradients
from flowctl.engine.gradcheck import run_graph as run
from flowctl.engine.opdef import get_op
from flowctl.engine.shapes import TensorSpec

FLAGS = list(itertools.product([False, True], repeat=2))


def loop_matmul(a, b) -> list[list[float]]:
    """Plain Python triple loop with math.fsum: the product of two nested lists."""
    m, k, n = len(a), len(b), len(b[0])
    assert len(a[0]) == k
    return [[math.fsum(a[i][p] * b[p][j] for p in range(k)) for j in range(n)] for i in range(m)]


def transposed(rows) -> list[list[float]]:
    return [list(col) for col in zip(*rows)]


def gauss_jordan_inverse(a) -> list[list[float]]:
    """Invert by Gauss-Jordan elimination with partial pivoting on [A | I]."""
    n = len(a)
    aug = [[float(v) for v in row] + [1.0 if i == j else 0.0 for j in range(n)] for i, row in enumerate(a)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(aug[r][c]))
        aug[c], aug[piv] = aug[piv], aug[c]
        p = aug[c][c]
        aug[c] = [v / p for v in aug[c]]
        for r in range(n):
            if r != c:
                f = aug[r][c]
                aug[r] = [v - f * w for v, w in zip(aug[r], aug[c])]
    return [row[n:] for row in aug]


def cofactor_det(a) -> float:
    """Laplace expansion along the first row."""
    n = len(a)
    if n == 1:
        return float(a[0][0])
    return math.fsum((-1) ** j * a[0][j] * cofactor_det([row[:j] + row[j + 1:] for row in a[1:]])
                     for j in range(n))


def well_conditioned(rng, shape):
    n = shape[-1]
    return rng.standard_normal(shape) + 3.0 * np.eye(n)


# ---------------------------------------------------------------------------- MatMul
@pytest.mark.parametrize("ta,tb", FLAGS)
def test_matmul_kernel_and_gradient_for_every_transpose_case(ta, tb, rng):
    m, k, n = 3, 4, 5
    a = rng.standard_normal((k, m) if ta else (m, k))
    b = rng.standard_normal((n, k) if tb else (k, n))
    got = run(lambda a, b: fc.matmul(a, b, transpose_a=ta, transpose_b=tb), a=a, b=b)
    ref = loop_matmul(transposed(a.tolist()) if ta else a.tolist(), transposed(b.tolist()) if tb else b.tolist())
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-13)
    check_gradients(lambda a, b: fc.matmul(a, b, transpose_a=ta, transpose_b=tb), {"a": a, "b": b})


@pytest.mark.parametrize("ta,tb", FLAGS)
def test_matmul_gradient_is_one_matmul_per_input_with_transpose_flags(ta, tb):
    g = fc.Graph()
    with g.as_default():
        a = fc.placeholder("float32", (4, 3) if ta else (3, 4))
        b = fc.placeholder("float32", (5, 4) if tb else (4, 5))
        c = fc.matmul(a, b, ta, tb)
        before = set(g.nodes)
        ga, gb = fc.gradients(c, [a, b])
    new_ops = sorted(g.nodes[n].op for n in set(g.nodes) - before)
    assert new_ops == ["MatMul", "MatMul", "OnesLike"]
    assert ga.shape == a.shape and gb.shape == b.shape


def test_operator_matmul_uses_default_attrs_and_integers_stay_integers(rng):
    a = rng.integers(-5, 5, size=(3, 4)).astype(np.int32)
    b = rng.integers(-5, 5, size=(4, 2)).astype(np.int32)
    g = fc.Graph()
    with g.as_default():
        pa, pb = fc.placeholder("int32", (3, 4)), fc.placeholder("int32", (4, 2))
        c = pa @ pb
    assert c.op.op == "MatMul" and c.op.attrs == {"transpose_a": False, "transpose_b": False}
    out = fc.Session(g, store=fc.ContainerStore()).run(c, {pa: a, pb: b})
    assert out.dtype == np.int32
    assert out.tolist() == [[sum(int(a[i, p]) * int(b[p, j]) for p in range(4)) for j in range(2)] for i in range(3)]


def test_matmul_unknown_batch_dim(rng):
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (None, 4))
        w = fc.placeholder("float64", (4, 2))
        y = fc.matmul(x, w)
        assert y.shape == (None, 2)
    wv = rng.standard_normal((4, 2))
    for batch in (1, 6):
        xv = rng.standard_normal((batch, 4))
        got = fc.Session(g, store=fc.ContainerStore()).run(y, {x: xv, w: wv})
        np.testing.assert_allclose(got, loop_matmul(xv.tolist(), wv.tolist()), rtol=1e-12, atol=1e-13)


def test_matmul_shape_errors_name_both_inputs():
    g = fc.Graph()
    with g.as_default():
        a = fc.placeholder("float32", (2, 3), name="a")
        b = fc.placeholder("float32", (4, 5), name="b")
        with pytest.raises(fc.GraphError, match=r"3 vs 4.*'a:0' \(2, 3\).*'b:0' \(4, 5\)"):
            fc.matmul(a, b, name="mm")
        with pytest.raises(fc.GraphError, match=r"'a:0'.*'b:0'"):
            _ = a @ b
        v = fc.placeholder("float32", (3,), name="v")
        with pytest.raises(fc.GraphError, match="two matrices"):
            fc.matmul(a, v)
        d = fc.placeholder("float64", (3, 2), name="d")
        with pytest.raises(fc.GraphError, match="dtypes differ"):
            fc.matmul(a, d)
        x = fc.placeholder("float32", (2, 3, 4), name="x")
        y = fc.placeholder("float32", (5, 4, 2), name="y")
        with pytest.raises(fc.GraphError, match=r"batch dimensions \(2,\) and \(5,\).*'x:0'.*'y:0'"):
            fc.batch_matmul(x, y)


# ---------------------------------------------------------------------------- BatchMatMul
def loop_batch_matmul(a, b, adj_x, adj_y):
    """Broadcast the batch dims by index arithmetic, then multiply each pair by the triple loop."""
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    out = {}
    for idx in itertools.product(*[range(d) for d in batch]):
        def pick(x):
            lead = x.shape[:-2]
            off = len(batch) - len(lead)
            return x[tuple(0 if lead[i] == 1 else idx[off + i] for i in range(len(lead)))]
        ma, mb = pick(a).tolist(), pick(b).tolist()
        out[idx] = loop_matmul(transposed(ma) if adj_x else ma, transposed(mb) if adj_y else mb)
    first = next(iter(out.values()))
    res = np.zeros(batch + (len(first), len(first[0])))
    for idx, mat in out.items():
        res[idx] = mat
    return res


BATCH_SHAPES = [((3,), (3,)), ((2, 1), (3,)), ((1,), (2, 3)), ((2, 3), ())]


@pytest.mark.parametrize("adj_x,adj_y", FLAGS)
@pytest.mark.parametrize("batch_a,batch_b", BATCH_SHAPES, ids=str)
def test_batch_matmul_kernel_and_gradient(batch_a, batch_b, adj_x, adj_y, rng):
    m, k, n = 2, 3, 4
    a = rng.standard_normal(batch_a + ((k, m) if adj_x else (m, k)))
    b = rng.standard_normal(batch_b + ((n, k) if adj_y else (k, n)))
    got = run(lambda a, b: fc.batch_matmul(a, b, adj_x=adj_x, adj_y=adj_y), a=a, b=b)
    ref = loop_batch_matmul(a, b, adj_x, adj_y)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-13)
    check_gradients(lambda a, b: fc.batch_matmul(a, b, adj_x=adj_x, adj_y=adj_y), {"a": a, "b": b})


def test_matmul_of_a_stack_becomes_batch_matmul(rng):
    a, b = rng.standard_normal((2, 4, 3)), rng.standard_normal((5, 4))
    g = fc.Graph()
    with g.as_default():
        pa, pb = fc.placeholder("float64", a.shape), fc.placeholder("float64", b.shape)
        c = fc.matmul(pa, pb, transpose_a=True, transpose_b=True)
    assert c.op.op == "BatchMatMul" and c.op.attrs == {"adj_x": True, "adj_y": True}
    assert c.shape == (2, 3, 5)
    out = fc.Session(g, store=fc.ContainerStore()).run(c, {pa: a, pb: b})
    np.testing.assert_allclose(out, loop_batch_matmul(a, b, True, True), rtol=1e-12)


def test_batch_matmul_with_unknown_batch_dim(rng):
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (None, 2, 3))
        w = fc.placeholder("float64", (3, 4))
        y = fc.batch_matmul(x, w)
        assert y.shape == (None, 2, 4)
        gw, = fc.gradients(fc.reduce_sum(y), [w])
    xv, wv = rng.standard_normal((5, 2, 3)), rng.standard_normal((3, 4))
    out, d = fc.Session(g, store=fc.ContainerStore()).run([y, gw], {x: xv, w: wv})
    np.testing.assert_allclose(out, loop_batch_matmul(xv, wv, False, False), rtol=1e-12)
    # d sum(XW)/dW[p, j] = sum over batch and rows of X[..., p]
    np.testing.assert_allclose(d, np.tile([[math.fsum(xv[..., p].ravel())] for p in range(3)], (1, 4)), rtol=1e-12)


# ---------------------------------------------------------------------------- MatrixInverse
def test_matrix_inverse_against_gauss_jordan(rng):
    x = well_conditioned(rng, (2, 3, 4, 4))
    got = run(lambda x: fc.matrix_inverse(x), x=x)
    for i, j in itertools.product(range(2), range(3)):
        np.testing.assert_allclose(got[i, j], gauss_jordan_inverse(x[i, j].tolist()), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(loop_matmul(x[i, j].tolist(), got[i, j].tolist()), np.eye(4), atol=1e-12)
    single = run(lambda x: fc.matrix_inverse(x), x=x[0, 0])
    np.testing.assert_allclose(loop_matmul(x[0, 0].tolist(), single.tolist()), np.eye(4), atol=1e-12)


@pytest.mark.parametrize("shape", [(3, 3), (2, 3, 3)], ids=str)
def test_matrix_inverse_gradient(shape, rng):
    check_gradients(lambda x: fc.matrix_inverse(x), {"x": well_conditioned(rng, shape)})


def test_matrix_inverse_float32_and_errors(rng):
    x = well_conditioned(rng, (3, 3)).astype(np.float32)
    out = run(lambda x: fc.matrix_inverse(x), x=x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, gauss_jordan_inverse(x.astype(np.float64).tolist()), rtol=1e-4, atol=1e-5)
    g = fc.Graph()
    with g.as_default():
        with pytest.raises(fc.GraphError, match=r"square.*\(3, 4\)"):
            fc.matrix_inverse(fc.placeholder("float32", (3, 4)))
        with pytest.raises(fc.GraphError, match="float32 or float64"):
            fc.matrix_determinant(fc.placeholder("int32", (3, 3)))
        s = fc.matrix_inverse(fc.placeholder("float64", (2, 2), name="s"))
    with pytest.raises(fc.ExecutionError, match="MatrixInverse"):
        fc.Session(g, store=fc.ContainerStore()).run(s, {"s:0": np.ones((2, 2))})


# ---------------------------------------------------------------------------- MatrixDeterminant
def test_determinant_against_cofactor_expansion(rng):
    x = rng.standard_normal((2, 3, 3))
    got = run(lambda x: fc.matrix_determinant(x), x=x)
    assert got.shape == (2,)
    for i in range(2):
        m = x[i].tolist()
        # 3x3 by hand (rule of Sarrus) and by Laplace expansion: two independent references.
        sarrus = (m[0][0] * m[1][1] * m[2][2] + m[0][1] * m[1][2] * m[2][0] + m[0][2] * m[1][0] * m[2][1]
                  - m[0][2] * m[1][1] * m[2][0] - m[0][0] * m[1][2] * m[2][1] - m[0][1] * m[1][0] * m[2][2])
        assert got[i] == pytest.approx(sarrus, rel=1e-12, abs=1e-13)
        assert got[i] == pytest.approx(cofactor_det(m), rel=1e-12, abs=1e-13)
    y = rng.standard_normal((4, 4))
    one = run(lambda x: fc.matrix_determinant(x), x=y)
    assert isinstance(one, np.ndarray) and one.shape == ()
    assert float(one) == pytest.approx(cofactor_det(y.tolist()), rel=1e-11)


@pytest.mark.parametrize("shape", [(3, 3), (2, 1, 3, 3)], ids=str)
def test_determinant_gradient(shape, rng):
    check_gradients(lambda x: fc.matrix_determinant(x), {"x": well_conditioned(rng, shape)})


def test_determinant_second_derivative_fails_loudly(rng):
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (3, 3))
        gx, = fc.gradients(fc.matrix_determinant(x), [x])
        with pytest.raises(fc.GraphError, match="MatrixDeterminantGrad"):
            fc.gradients(fc.reduce_sum(gx), [x])


# ---------------------------------------------------------------------------- costs
def test_costs():
    f32 = "float32"
    flops, nbytes = get_op("MatMul").estimate(
        [TensorSpec((None, 64), f32), TensorSpec((32, 64), f32)], [TensorSpec((None, 32), f32)],
        {"transpose_a": False, "transpose_b": True}, batch=16)
    assert flops == 2 * 16 * 32 * 64 and nbytes == (16 * 64 + 32 * 64 + 16 * 32) * 4
    flops, _ = get_op("BatchMatMul").estimate(
        [TensorSpec((8, 5, 3), f32), TensorSpec((3, 7), f32)], [TensorSpec((8, 3, 7), f32)],
        {"adj_x": True, "adj_y": False})
    assert flops == 2 * 8 * 3 * 7 * 5
    flops, _ = get_op("MatrixInverse").estimate([TensorSpec((4, 10, 10), f32)], [TensorSpec((4, 10, 10), f32)], {})
    assert flops == 2 * 4 * 1000


@pytest.mark.gpu
def test_gpu_kernels_match_numpy(rng):
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((5, 4))
    xa, xb = rng.standard_normal((2, 1, 4, 3)), rng.standard_normal((3, 4, 5))
    sq = well_conditioned(rng, (2, 3, 3))
    g = fc.Graph()
    with g.as_default():
        pa, pb, pxa, pxb, psq = (fc.placeholder("float64", v.shape) for v in (a, b, xa, xb, sq))
        outs = [fc.matmul(pa, pb, transpose_b=True), fc.matmul(pa, pa, True, False),
                fc.batch_matmul(pxa, pxb, adj_x=True), fc.matrix_inverse(psq), fc.matrix_determinant(psq)]
        outs += fc.gradients(outs, [pa, pb, pxa, pxb, psq])
    feeds = {pa: a, pb: b, pxa: xa, pxb: xb, psq: sq}
    cpu = fc.Session(g, store=fc.ContainerStore()).run(outs, feeds)
    gpu = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(outs, feeds)
    for c, d in zip(cpu, gpu):
        np.testing.assert_allclose(d, c, rtol=1e-9, atol=1e-10)
