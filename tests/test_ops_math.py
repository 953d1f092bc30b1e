"""The rounding, remainder, erf/gelu, trigonometric and float-test ops (issue 20) against float64
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


def test_floor_mod_and_div_on_floats_follow_python(rng):
    x = rng.uniform(-10, 10, 300)
    y = rng.choice([-3.5, -1.0, 0.75, 2.0, 4.25], 300)
    np.testing.assert_allclose(run(lambda x, y: fc.mod(x, y), x=x, y=y),
                               elementwise_ref(lambda a, b: a % b, x, y), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(run(lambda x, y: fc.div(x, y), x=x, y=y), x / y, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_integer_div_and_mod_are_floor_division_and_keep_the_dtype(dtype, rng):
    info = np.iinfo(dtype)
    lo, hi = max(info.min, -100), min(info.max, 100)
    x = rng.integers(lo, hi + 1, 400).astype(dtype)
    y = rng.integers(lo, hi + 1, 400).astype(dtype)
    y[:5] = 0
    q, r = run(lambda x, y: [fc.div(x, y), fc.mod(x, y)], x=x, y=y)
    assert q.dtype == np.dtype(dtype) and r.dtype == np.dtype(dtype)
    ref_q = elementwise_ref(lambda a, b: a // b if b else 0, x, y, dtype=np.int64)
    ref_r = elementwise_ref(lambda a, b: a % b if b else 0, x, y, dtype=np.int64)
    np.testing.assert_array_equal(q.astype(np.int64), ref_q)
    np.testing.assert_array_equal(r.astype(np.int64), ref_r)
    nz = y != 0
    np.testing.assert_array_equal((q * y + r)[nz], x[nz])  # the identity the docstring promises


def test_the_issue_example_gives_the_same_int32_answer_with_the_optimizer_on_and_off():
    g = fc.Graph()
    with g.as_default():
        a = fc.constant(np.array([7, -7], np.int32))
        y = fc.div(a, fc.constant(np.array([2, 2], np.int32)))
    assert y.dtype == "int32"
    off = fc.Session(g, store=fc.ContainerStore()).run(y)
    on = fc.Session(g, store=fc.ContainerStore(), optimize=True).run(y)
    for got in (off, on):
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, [3, -4])


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
    yi = rng.integers(-5, 5, (7,)).astype(np.int16)
    g = fc.Graph()
    with g.as_default():
        px, py = fc.placeholder("float32", (5, 7)), fc.placeholder("float32", (7,))
        pi, pj = fc.placeholder("int16", (5, 7)), fc.placeholder("int16", (7,))
        outs = [fc.floor(px), fc.ceil(px), fc.round_(px), fc.mod(px, py), fc.erf(px), fc.gelu(px), fc.sin(px),
                fc.cos(px), fc.is_nan(fc.log(px)), fc.is_inf(px / 0.0), fc.div(pi, pj), fc.mod(pi, pj)]
        outs += fc.gradients([fc.reduce_sum(o) for o in outs[3:8]], [px, py])
    feeds = {px: x, py: y, pi: xi, pj: yi}
    with np.errstate(all="ignore"):
        cpu = fc.Session(g, store=fc.ContainerStore()).run(outs, feeds)
        gpu = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(outs, feeds)
    for c, d in zip(cpu, gpu):
        assert c.dtype == d.dtype and c.shape == d.shape
        np.testing.assert_allclose(d, c, rtol=1e-5, atol=1e-5)
