"""Element-wise ops: kernels against float64 references computed another way (math module,
explicit formulas), and every differentiable op through the finite-difference checker."""
from __future__ import annotations

import math

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.gradcheck import check_gradients
from flowctl.engine.gradcheck import run_graph as run


UNARY_REF = {
    "neg": lambda v: -v, "exp": math.exp, "log": math.log, "sqrt": math.sqrt,
    "rsqrt": lambda v: 1 / math.sqrt(v), "square": lambda v: v * v, "relu": lambda v: v if v > 0 else 0.0,
    "sigmoid": lambda v: 1 / (1 + math.exp(-v)), "tanh": math.tanh, "abs_": abs,
}


@pytest.mark.parametrize("name", sorted(UNARY_REF))
def test_unary_kernel_matches_scalar_reference(name, rng):
    x = rng.uniform(0.2, 3.0, size=(3, 4)) * (1 if name in ("log", "sqrt", "rsqrt") else rng.choice([-1, 1], (3, 4)))
    got = run(lambda x: getattr(fc, name)(x), x=x)
    ref = np.vectorize(UNARY_REF[name])(x)
    np.testing.assert_allclose(got, ref, rtol=1e-12)


@pytest.mark.parametrize("name", sorted(UNARY_REF))
def test_unary_gradient(name, rng):
    x = rng.uniform(0.3, 2.0, size=(2, 3)) * (1 if name in ("log", "sqrt", "rsqrt") else rng.choice([-1, 1], (2, 3)))
    check_gradients(lambda x: getattr(fc, name)(x), {"x": x})


BINARY_REF = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b, "pow_": lambda a, b: math.exp(b * math.log(a)),
    "maximum": max, "minimum": min,
}


@pytest.mark.parametrize("name", sorted(BINARY_REF))
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 4)), ((), (2, 2))])
def test_binary_broadcast_kernel_and_gradient(name, shapes, rng):
    a = rng.uniform(0.5, 2.0, size=shapes[0])
    b = rng.uniform(0.5, 2.0, size=shapes[1])
    if name in ("maximum", "minimum"):
        b = b + 0.05  # keep clear of ties, where the derivative is not defined
    got = run(lambda a, b: getattr(fc, name)(a, b), a=a, b=b)
    ab, bb = np.broadcast_arrays(a, b)
    ref = np.vectorize(BINARY_REF[name])(ab, bb)
    np.testing.assert_allclose(got, ref, rtol=1e-12)
    check_gradients(lambda a, b: getattr(fc, name)(a, b), {"a": a, "b": b})


def test_comparisons_and_select(rng):
    a, b = rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
    gt, lt, eq = run(lambda a, b: [fc.greater(a, b), fc.less(a, b), fc.equal(a, a)], a=a, b=b)
    assert gt.dtype == bool and (gt == (a > b)).all() and (lt == (a < b)).all() and eq.all()
    sel = run(lambda a, b: fc.select(fc.greater(a, b), a, b), a=a, b=b)
    np.testing.assert_array_equal(sel, [[max(x, y) for x, y in zip(r, s)] for r, s in zip(a, b)])
    check_gradients(lambda a, b: fc.select(fc.greater(a, b), a * 2.0, b * 3.0), {"a": a, "b": b})


def test_cast_addn_and_their_gradients(rng):
    x = rng.standard_normal((3, 3))
    out = run(lambda x: fc.cast(fc.cast(x, "float32"), "float64"), x=x)
    np.testing.assert_allclose(out, x.astype(np.float32).astype(np.float64))
    assert run(lambda x: fc.cast(x, "int32"), x=np.array([1.7, -2.2])).tolist() == [1, -2]
    check_gradients(lambda x: fc.cast(fc.cast(x, "float32"), "float64") * 1.0, {"x": x}, eps=1e-2, rtol=1e-4, atol=1e-5)
    y, z = rng.standard_normal((3, 3)), rng.standard_normal((3, 3))
    np.testing.assert_allclose(run(lambda x, y, z: fc.add_n([x, y, z]), x=x, y=y, z=z), x + y + z)
    check_gradients(lambda x, y, z: fc.add_n([x, y * y, z]), {"x": x, "y": y, "z": z})


def test_fan_out_gradient_is_summed(rng):
    x = rng.standard_normal((2, 2))
    # y = x*x + exp(x) + x: x feeds three consumers, one of them twice
    check_gradients(lambda x: x * x + fc.exp(x) + x, {"x": x})


def test_dtype_mismatch_names_both_inputs():
    g = fc.Graph()
    with g.as_default():
        a = fc.placeholder("float32", (2,), name="a")
        b = fc.placeholder("float64", (2,), name="b")
        with pytest.raises(fc.GraphError, match="'a:0'.*'b:0'"):
            fc.add(a, b, name="bad")


@pytest.mark.parametrize("name", ["relu", "sigmoid", "tanh"])
def test_second_derivatives_of_activations(name, rng):
    x = rng.uniform(0.2, 1.5, size=(2, 3)) * rng.choice([-1, 1], (2, 3))

    def first_grad(x):
        y = getattr(fc, name)(x)
        return fc.gradients(y * y, [x])[0]

    check_gradients(first_grad, {"x": x})


def test_second_derivative_without_a_rule_is_an_error_not_zero(rng):
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (2, 3), name="x")
        dx = fc.gradients(fc.reduce_sum(fc.softmax(x) * x), [x])[0]
        with pytest.raises(fc.GraphError, match="no gradient registered for op SoftmaxGrad"):
            fc.gradients(fc.reduce_sum(dx), [x])
