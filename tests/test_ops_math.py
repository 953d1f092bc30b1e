"""The rounding, division and remainder, erf/gelu, trigonometric and float-test ops (issue 20) against float64
references computed element by element with Python's math module and operators, on every dtype
they take; the gpu kernels against the numpy ones."""
from __future__ import annotations

import math

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.errors import GraphError
from flowctl.engine.gradcheck import run_graph as run

INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16"]


def elementwise_ref(f, *xs: np.ndarray, dtype=np.float64) -> np.ndarray:
    b = np.broadcast_arrays(*xs)
    return np.array([f(*(v.item() for v in vals)) for vals in zip(*(a.reshape(-1) for a in b))],
                    dtype=dtype).reshape(b[0].shape)


def python_round_half_even(v: float) -> float:
    return float(round(v))  # Python's round() rounds halves to even, as TensorFlow's Round does


UNARY = {"floor": math.floor, "ceil": math.ceil, "round_": python_round_half_even, "erf": math.erf,
         "sin": math.sin, "cos": math.cos}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_against_math(name, rng):
    x = np.concatenate([rng.uniform(-6, 6, 200), [0.5, 1.5, 2.5, -0.5, -2.5, 0.0, -0.0, 1e-300, 6.5]])
    got = run(lambda x: getattr(fc, name)(x), x=x)
    ref = elementwise_ref(UNARY[name], x)
    assert got.dtype == np.float64 and got.shape == x.shape
    np.testing.assert_allclose(got, ref, rtol=2e-15, atol=2e-15)
    for dt in ("float16", "float32"):
        low = run(lambda x: getattr(fc, name)(x), x=x.astype(dt))
        assert low.dtype == np.dtype(dt)
        np.testing.assert_allclose(low, elementwise_ref(UNARY[name], x.astype(dt)),
                                   rtol=2e-3 if dt == "float16" else 2e-7, atol=2e-3 if dt == "float16" else 2e-7)


def test_erf_tails_and_specials():
    x = np.array([-np.inf, -30.0, -5.9, -2.5, -2.4999, 2.5000001, 4.0, 26.0, np.inf, np.nan])
    got = run(lambda x: fc.erf(x), x=x)
    ref = np.array([-1.0, -1.0] + [math.erf(v) for v in x[2:-2]] + [1.0, np.nan])
    np.testing.assert_allclose(got, ref, rtol=2e-15, atol=2e-16)
    assert np.signbit(run(lambda x: fc.erf(x), x=np.array([-0.0])))[0]


def test_gelu_is_x_times_the_normal_cdf(rng):
    x = rng.uniform(-5, 5, 100)
    got = run(lambda x: fc.gelu(x), x=x)
    ref = elementwise_ref(lambda v: v * 0.5 * (1.0 + math.erf(v / math.sqrt(2.0))), x)
    np.testing.assert_allclose(got, ref, rtol=1e-14, atol=1e-15)


def truncating(a: int, b: int) -> tuple[int, int]:
    """C's / and % on Python ints (exact at any size): the quotient rounded toward zero."""
    if b == 0:
        return 0, 0
    q = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)
    return q, a - q * b


def flooring(a: int, b: int) -> tuple[int, int]:
    return (a // b, a % b) if b else (0, 0)


SIGNS = np.array([(7, 2), (-7, 2), (7, -2), (-7, -2), (6, 3), (-6, 3), (6, -3), (-6, -3), (0, 5), (0, -5),
                  (1, 7), (-1, 7), (1, -7), (-1, -7), (5, 0), (-5, 0)])


@pytest.mark.parametrize("dtype", INT_DTYPES + ["int64"])
def test_integer_div_truncates_floordiv_floors_and_each_pairs_with_its_remainder(dtype, rng):
    info = np.iinfo(dtype)
    lo, hi = max(info.min, -100), min(info.max, 100)
    x = rng.integers(lo, hi + 1, 400).astype(dtype)
    y = rng.integers(lo, hi + 1, 400).astype(dtype)
    y[:5] = 0
    if info.min < 0:  # every sign combination, and exact multiples, whatever the draw
        x[5:5 + len(SIGNS)], y[5:5 + len(SIGNS)] = SIGNS[:, 0], SIGNS[:, 1]
    q, r, fq, fr = run(lambda x, y: [fc.div(x, y), fc.truncatemod(x, y), fc.floordiv(x, y), fc.mod(x, y)],
                       x=x, y=y)
    for got in (q, r, fq, fr):
        assert got.dtype == np.dtype(dtype) and got.shape == x.shape
    for got, ref, port in ((q, truncating, 0), (r, truncating, 1), (fq, flooring, 0), (fr, flooring, 1)):
        want = elementwise_ref(lambda a, b: ref(a, b)[port], x, y, dtype=np.int64)
        np.testing.assert_array_equal(got.astype(np.int64), want)
    nz = y != 0
    np.testing.assert_array_equal((q * y + r)[nz], x[nz])  # within each pair: x == div * y + mod
    np.testing.assert_array_equal((fq * y + fr)[nz], x[nz])
    if info.min < 0:
        assert np.all(np.sign(r[nz]) * np.sign(x[nz]) >= 0)  # the truncating remainder: x's sign
        assert np.all(np.sign(fr[nz]) * np.sign(y[nz]) >= 0)  # the floor remainder: y's sign


def test_int64_division_is_exact_past_float64s_integers():
    x = np.array([2**62 + 1, -(2**62 + 1), 2**53 + 1, -(2**53 + 3)], np.int64)
    y = np.array([3, 3, -2, 2], np.int64)
    q, r, fq, fr = run(lambda x, y: [fc.div(x, y), fc.truncatemod(x, y), fc.floordiv(x, y), fc.mod(x, y)],
                       x=x, y=y)
    for i, (a, b) in enumerate(zip(x.tolist(), y.tolist())):
        assert (int(q[i]), int(r[i])) == truncating(a, b)
        assert (int(fq[i]), int(fr[i])) == flooring(a, b)


def test_the_issue_example_truncates_with_the_optimizer_on_and_off():
    g = fc.Graph()
    with g.as_default():
        a = fc.constant(np.array([7, -7, -3], np.int32))
        b = fc.constant(np.array([2, 2, 2], np.int32))
        outs = [fc.div(a, b), fc.truncatemod(a, b), fc.floordiv(a, b), fc.mod(a, b), a // b, a % b]
    assert {t.dtype for t in outs} == {"int32"}
    off = fc.Session(g, store=fc.ContainerStore()).run(outs)
    on = fc.Session(g, store=fc.ContainerStore(), optimize=True).run(outs)
    for got in (off, on):
        assert all(v.dtype == np.int32 for v in got)
        for v, want in zip(got, ([3, -3, -1], [1, -1, -1], [3, -4, -2], [1, 1, 1], [3, -4, -2], [1, 1, 1])):
            np.testing.assert_array_equal(v, want)


def test_float_division_and_remainders_follow_python(rng):
    x = np.concatenate([rng.uniform(-10, 10, 300), [1.0, -1.0, 7.5, -7.5, 0.0]])
    y = np.concatenate([rng.choice([-3.5, -1.0, 0.75, 2.0, 4.25], 300), [0.1, 0.1, -2.0, 2.0, -3.0]])
    q, r, fq, fr = run(lambda x, y: [fc.div(x, y), fc.truncatemod(x, y), fc.floordiv(x, y), fc.mod(x, y)],
                       x=x, y=y)
    np.testing.assert_array_equal(q, x / y)  # true division
    np.testing.assert_array_equal(fq, elementwise_ref(lambda a, b: a // b, x, y))  # 1.0 // 0.1 == 9.0
    np.testing.assert_allclose(fr, elementwise_ref(lambda a, b: a % b, x, y), rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(r, elementwise_ref(math.fmod, x, y))
    nz = fr != 0
    assert np.all(np.sign(fr[nz]) == np.sign(y[nz]))  # the divisor's sign, as Python's %
    assert np.all(np.sign(r[r != 0]) == np.sign(x[r != 0]))
    np.testing.assert_allclose(fq * y + fr, x, rtol=1e-12, atol=1e-12)


def test_floordiv_passes_no_gradient_and_truncatemod_one():
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (3,))
        y = fc.placeholder("float64", (3,))
        assert fc.gradients(fc.reduce_sum(fc.floordiv(x, y)), [x, y]) == [None, None]
        dx, dy = fc.gradients(fc.reduce_sum(fc.truncatemod(x, y)), [x, y])
    feeds = {x: np.array([7.5, -7.5, 7.5]), y: np.array([2.0, 2.0, -2.0])}
    gx, gy = fc.Session(g, store=fc.ContainerStore()).run([dx, dy], feeds)
    np.testing.assert_array_equal(gx, [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(gy, [-3.0, 3.0, 3.0])  # -trunc(x / y)


def test_is_nan_and_is_inf():
    x = np.array([0.0, np.nan, np.inf, -np.inf, -1.5, 1e308 * 10], dtype=np.float64)
    nan, inf = run(lambda x: [fc.is_nan(x), fc.is_inf(x)], x=x)
    assert nan.dtype == np.bool_ and inf.dtype == np.bool_
    np.testing.assert_array_equal(nan, [math.isnan(v) for v in x])
    np.testing.assert_array_equal(inf, [math.isinf(v) for v in x])


@pytest.mark.parametrize("build", [lambda x: fc.floor(x), lambda x: fc.erf(x), lambda x: fc.is_nan(x),
                                   lambda x: fc.sin(x)])
def test_float_only_ops_refuse_integers(build):
    with pytest.raises(GraphError, match="float"):
        run(build, x=np.array([1, 2], np.int32))


def test_bool_arithmetic_is_refused():
    with pytest.raises(GraphError, match="bool"):
        run(lambda x: fc.sub(x, x), x=np.array([True, False]))


@pytest.mark.gpu
def test_gpu_kernels_match_numpy(rng):
    x = rng.uniform(-4, 4, (5, 7)).astype(np.float32)
    y = rng.uniform(0.5, 2, (7,)).astype(np.float32)
    xi = rng.integers(-50, 50, (5, 7)).astype(np.int16)
    yi = rng.integers(-5, 5, (7,)).astype(np.int16)  # mixed signs and a 0
    g = fc.Graph()
    with g.as_default():
        px, py = fc.placeholder("float32", (5, 7)), fc.placeholder("float32", (7,))
        pi, pj = fc.placeholder("int16", (5, 7)), fc.placeholder("int16", (7,))
        outs = [fc.floor(px), fc.ceil(px), fc.round_(px), fc.mod(px, py), fc.erf(px), fc.gelu(px), fc.sin(px),
                fc.cos(px), fc.is_nan(fc.log(px)), fc.is_inf(px / 0.0), fc.div(pi, pj), fc.mod(pi, pj),
                fc.truncatemod(pi, pj), fc.floordiv(pi, pj), fc.truncatemod(px, py), fc.floordiv(px, py)]
        outs += fc.gradients([fc.reduce_sum(o) for o in outs[3:8]], [px, py])
    feeds = {px: x, py: y, pi: xi, pj: yi}
    with np.errstate(all="ignore"):
        cpu = fc.Session(g, store=fc.ContainerStore()).run(outs, feeds)
        gpu = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(outs, feeds)
    for c, d in zip(cpu, gpu):
        assert c.dtype == d.dtype and c.shape == d.shape
        np.testing.assert_allclose(d, c, rtol=1e-5, atol=1e-5)
    big = np.array([2**62 + 1, -(2**62 + 1), -7, 7], np.int64)  # exact past float64's integers
    div = np.array([3, 3, 2, -2], np.int64)
    g = fc.Graph()
    with g.as_default():
        a, b = fc.constant(big), fc.constant(div)
        outs = [fc.div(a, b), fc.truncatemod(a, b), fc.floordiv(a, b), fc.mod(a, b)]
    cpu = fc.Session(g, store=fc.ContainerStore()).run(outs)
    gpu = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(outs)
    for c, d in zip(cpu, gpu):
        np.testing.assert_array_equal(d, c)


def test_onnx_export_maps_each_division_to_its_exact_onnx_form():
    onnx = pytest.importorskip("onnx")
    from onnx.reference import ReferenceEvaluator

    from flowctl.engine.errors import SpecError
    from flowctl.training.onnx_export import to_onnx

    g = fc.Graph()
    with g.as_default():
        xi, yi = fc.placeholder("int32", (None,), name="xi"), fc.placeholder("int32", (None,), name="yi")
        xf, yf = fc.placeholder("float32", (None,), name="xf"), fc.placeholder("float32", (None,), name="yf")
        outs = {"q": fc.div(xi, yi), "r": fc.truncatemod(xi, yi), "fr": fc.mod(xi, yi),
                "qf": fc.div(xf, yf), "rf": fc.truncatemod(xf, yf)}
        refused = {"floordiv": fc.floordiv(xi, yi), "float_floormod": fc.mod(xf, yf)}
    ins = {"xi": xi.name, "yi": yi.name, "xf": xf.name, "yf": yf.name}
    model = to_onnx(g, ins, {k: t.name for k, t in outs.items()}, {})
    x, y = SIGNS[:-2, 0].astype(np.int32), SIGNS[:-2, 1].astype(np.int32)  # ONNX leaves x / 0 undefined
    feeds = {"xi": x, "yi": y, "xf": x.astype(np.float32) + 0.5, "yf": y.astype(np.float32)}
    got = ReferenceEvaluator(model).run(None, feeds)
    want = fc.Session(g, store=fc.ContainerStore()).run(list(outs.values()), {xi: x, yi: y, xf: feeds["xf"],
                                                                              yf: feeds["yf"]})
    for name, a, b in zip(outs, got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=name)
    for name, t in refused.items():
        with pytest.raises(SpecError, match="has no ONNX form"):
            to_onnx(g, ins, {name: t.name}, {})
