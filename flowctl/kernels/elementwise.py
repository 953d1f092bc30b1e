"""Element-wise kernels, written once against the array module `xp` (numpy or cupy)."""
from __future__ import annotations

from typing import Any, Callable

from flowctl.kernels import bf16
from flowctl.kernels.registry import into, kernel

Fn = Callable[..., Any]


def _direct(op: str, fname: str) -> None:
    # The ufunc itself is the kernel: no Python frame between the executor and numpy.
    kernel(op)(lambda xp, attrs: getattr(xp, fname))


for _op, _f in (("Add", "add"), ("Sub", "subtract"), ("Mul", "multiply"),
                ("Pow", "power"), ("Maximum", "maximum"), ("Minimum", "minimum"), ("Greater", "greater"),
                ("Less", "less"), ("Equal", "equal"), ("GreaterEqual", "greater_equal"),
                ("LessEqual", "less_equal"), ("Neg", "negative"), ("Exp", "exp"), ("Log", "log"),
                ("Sqrt", "sqrt"), ("Square", "square"), ("Tanh", "tanh"), ("Abs", "abs"), ("Sign", "sign"),
                ("Select", "where"), ("ZerosLike", "zeros_like"), ("OnesLike", "ones_like"),
                ("Floor", "floor"), ("Ceil", "ceil"), ("Round", "rint"), ("Sin", "sin"), ("Cos", "cos"),
                ("IsNaN", "isnan"), ("IsInf", "isinf")):
    _direct(_op, _f)


def _ufunc_into(fname: str) -> Callable[[Any, dict[str, Any]], Fn]:
    """The in-place variant of a ufunc kernel (registry.INTO): its output written into input k."""
    def factory(xp: Any, attrs: dict[str, Any]) -> Fn:
        f = getattr(xp, fname)

        def run(k: int, *a: Any) -> Any:
            try:
                return f(*a, out=a[k])
            except ValueError:  # broadcast to a larger shape than input k's: a buffer of its own
                return f(*a)

        return run

    return factory


# Exactly rounded operations only: an in-place result is the allocating kernel's, bit for bit
# (a transcendental's vector and scalar loops need not agree, and which one runs can depend on
# where the buffer lies).
for _op, _f in (("Add", "add"), ("Sub", "subtract"), ("Mul", "multiply"), ("Maximum", "maximum"),
                ("Minimum", "minimum"), ("Neg", "negative"), ("Square", "square"), ("Abs", "abs")):
    into(_op)(_ufunc_into(_f))


def _quiet_on_integers(f: Fn) -> Fn:
    """f, without numpy's warning on an integer division by zero (whose answer here is 0, numpy's
    and cupy's) or of INT_MIN by -1. A float's inf or nan is left to warn as any float op's does."""
    import numpy as np

    def run(x: Any, y: Any) -> Any:
        if x.dtype.kind in "fc":
            return f(x, y)
        with np.errstate(divide="ignore", over="ignore"):
            return f(x, y)

    return run


def _truncated(xp: Any, x: Any, y: Any) -> tuple[Any, Any]:
    """Integer quotient and remainder truncated toward zero (C's `/` and `%`), from the floored ones:
    they differ by one step where the remainder is not 0 and x and y have opposite signs. Built on
    floor_divide and mod, exact on numpy and cupy alike (cupy's integer fmod goes through double,
    which loses int64s past 2**53)."""
    q, r = xp.floor_divide(x, y), xp.mod(x, y)
    if x.dtype.kind == "u":  # no negatives: floor is truncation
        return q, r
    fix = (r != 0) & ((x < 0) != (y < 0))
    return xp.where(fix, q + 1, q), xp.where(fix, r - y, r)


@kernel("Div")
def div(xp: Any, attrs: dict[str, Any]) -> Fn:
    """Floats: true division. Integers: truncating division (TensorFlow's and ONNX's Div, C's `/`:
    -7 / 2 = -3), so the result keeps the integer dtype the shape function declared; x / 0 is 0."""
    return _quiet_on_integers(lambda x, y: xp.true_divide(x, y) if x.dtype.kind in "fc"
                              else _truncated(xp, x, y)[0])


@into("Div")
def div_into(xp: Any, attrs: dict[str, Any]) -> Fn:
    plain = div(xp, attrs)
    true_divide = _ufunc_into("true_divide")(xp, attrs)
    return lambda k, x, y: true_divide(k, x, y) if x.dtype.kind in "fc" else plain(x, y)


@kernel("TruncateMod")
def truncate_mod(xp: Any, attrs: dict[str, Any]) -> Fn:
    """Div's remainder, with the sign of x: fmod for floats (exact)."""
    return _quiet_on_integers(lambda x, y: xp.fmod(x, y) if x.dtype.kind in "fc" else _truncated(xp, x, y)[1])


@kernel("FloorDiv")
def floor_div(xp: Any, attrs: dict[str, Any]) -> Fn:
    """Python's `//`, for integers and floats alike (a float quotient is numpy's and Python's:
    floor((x - x % y) / y), so 1.0 // 0.1 is 9.0, not floor(1.0 / 0.1) = 10.0)."""
    return _quiet_on_integers(xp.floor_divide)


@kernel("FloorMod")
def floor_mod(xp: Any, attrs: dict[str, Any]) -> Fn:
    """numpy's `mod` is floor modulo (the sign of y), for floats and integers alike."""
    return _quiet_on_integers(xp.mod)


_SERIES_TERMS = 60
_FRACTION_TERMS = 80
_SWITCH = 2.5


def erf(xp: Any, x: Any) -> Any:
    """erf in float64 to a few ulp, from two expansions that are exact in the limit:
    below |x| = 2.5 the all-positive series erf(a) = 2/sqrt(pi) e^(-a^2) sum_n (2a^2)^n a / (2n+1)!!
    (no cancellation), above it 1 - erfc(a) with erfc's continued fraction
    e^(-a^2)/sqrt(pi) / (a + (1/2)/(a + 1/(a + (3/2)/(a + ...)))). numpy has no erf, and one source
    serves numpy and cupy alike."""
    a = xp.abs(x)
    s = xp.minimum(a, _SWITCH)
    two_s2 = 2.0 * s * s
    term = s
    total = s
    for n in range(1, _SERIES_TERMS):
        term = term * two_s2 / (2 * n + 1)
        total = total + term
    series = 1.1283791670955126 * xp.exp(-0.5 * two_s2) * total
    c = xp.maximum(a, _SWITCH)
    f = c
    for k in range(_FRACTION_TERMS, 0, -1):
        f = c + (0.5 * k) / f
    tail = 1.0 - 0.5641895835477563 * xp.exp(-c * c) / f
    return xp.copysign(xp.where(a < _SWITCH, series, tail), x)


@kernel("Erf")
def erf_(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda x: erf(xp, x.astype(xp.float64, copy=False)).astype(x.dtype, copy=False)


@kernel("Rsqrt")
def rsqrt(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda x: 1.0 / xp.sqrt(x)


@kernel("Relu")
def relu(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda x: xp.maximum(x, 0)


@into("Relu")
def relu_into(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda k, x: xp.maximum(x, 0, out=x)


@kernel("Sigmoid")
def sigmoid(xp: Any, attrs: dict[str, Any]) -> Fn:
    # 0.5 (1 + tanh(x/2)) equals 1/(1+e^-x) and never overflows.
    return lambda x: 0.5 * (1.0 + xp.tanh(0.5 * x))


@kernel("ReluGrad")
def relu_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda dy, y: dy * (y > 0)


@kernel("SigmoidGrad")
def sigmoid_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda dy, y: dy * y * (1.0 - y)


@kernel("TanhGrad")
def tanh_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda dy, y: dy * (1.0 - y * y)


# The gradient pairs in place: what reads the buffer being written is computed first, and the
# operations are the allocating kernels' in their order.
def _same_shape(a: Any, b: Any) -> bool:
    return tuple(a.shape) == tuple(b.shape)


@into("ReluGrad")
def relu_grad_into(xp: Any, attrs: dict[str, Any]) -> Fn:
    def run(k: int, dy: Any, y: Any) -> Any:
        if not _same_shape(dy, y):
            return dy * (y > 0)
        return xp.multiply(dy, y > 0, out=(dy, y)[k])

    return run


@into("SigmoidGrad")
def sigmoid_grad_into(xp: Any, attrs: dict[str, Any]) -> Fn:
    def run(k: int, dy: Any, y: Any) -> Any:
        if not _same_shape(dy, y):
            return dy * y * (1.0 - y)
        buf = (dy, y)[k]
        t = 1.0 - y
        xp.multiply(dy, y, out=buf)
        return xp.multiply(buf, t, out=buf)

    return run


@into("TanhGrad")
def tanh_grad_into(xp: Any, attrs: dict[str, Any]) -> Fn:
    def run(k: int, dy: Any, y: Any) -> Any:
        if not _same_shape(dy, y):
            return dy * (1.0 - y * y)
        t = y * y
        xp.subtract(1.0, t, out=t)
        return xp.multiply(dy, t, out=(dy, y)[k])

    return run


@kernel("Cast")
def cast(xp: Any, attrs: dict[str, Any]) -> Fn:
    dtype = attrs["dtype"]
    return lambda x: x.astype(dtype, copy=False)


@kernel("RoundBF16")
def round_bf16(xp: Any, attrs: dict[str, Any]) -> Fn:
    """Round to nearest even on the upper 16 bits of the float32 pattern: add 0x7FFF plus the bit
    that survives lowest, then clear the low half (a carry into the exponent rounds up to the next
    binade, or to infinity past bfloat16's largest value, as a real conversion does). NaN stays NaN
    (its payload may sit only in the cleared bits)."""
    def run(x: Any) -> Any:
        x = xp.asarray(x)
        bits = x.view(xp.uint32)
        up = bits + (((bits >> 16) & 1) + 0x7FFF).astype(xp.uint32)
        out = (up & 0xFFFF0000).astype(xp.uint32).view(xp.float32)
        return xp.where(xp.isnan(x), x, out)
    return run


@kernel("AddN")
def add_n(xp: Any, attrs: dict[str, Any]) -> Fn:
    def run(*xs: Any) -> Any:
        if len(xs) == 1:
            return xs[0]
        if bf16.is_bf16(xs[0]):  # summed in float32 and rounded once: the rule's bits, one
            out = xs[0].astype(xp.float32)  # float32 buffer instead of one per input
            for x in xs[1:]:
                out += x
            return bf16.narrow(out)
        out = xs[0] + xs[1]  # a fresh buffer, so the rest can accumulate in place
        for x in xs[2:]:
            out += x
        return out

    return run


@into("AddN")
def add_n_into(xp: Any, attrs: dict[str, Any]) -> Fn:
    """Into input 0 or 1 (OpDef.forward), which the first sum reads before it writes; a later
    input would be overwritten before it is added."""
    plain = add_n(xp, attrs)

    def run(k: int, *xs: Any) -> Any:
        if len(xs) == 1 or any(not _same_shape(x, xs[k]) for x in xs):
            return plain(*xs)
        out = xp.add(xs[0], xs[1], out=xs[k])
        for x in xs[2:]:
            out += x
        return out

    return run


def sum_to_shape(xp: Any, x: Any, shape: tuple) -> Any:
    """Sum `x` over the axes along which an operand of `shape` was broadcast to reach x.shape."""
    if tuple(x.shape) == tuple(shape):
        return x
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape) if d == 1 and x.shape[lead + i] != 1)
    # Integers keep their dtype (numpy would widen int8 to int64); floats accumulate as numpy does.
    out = x.sum(axis=axes, keepdims=True, dtype=None if x.dtype.kind == "f" else x.dtype) if axes else x
    return out.reshape(shape)


@kernel("ReduceTo")
def reduce_to(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda x, like: sum_to_shape(xp, x, like.shape)


@kernel("BroadcastLike")
def broadcast_like(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda x, like: xp.broadcast_to(x, like.shape)
