"""Element-wise kernels, written once against the array module `xp` (numpy or cupy)."""
from __future__ import annotations

from typing import Any, Callable

from flowctl.kernels.registry import kernel

Fn = Callable[..., Any]


def _direct(op: str, fname: str) -> None:
    # The ufunc itself is the kernel: no Python frame between the executor and numpy.
    kernel(op)(lambda xp, attrs: getattr(xp, fname))


for _op, _f in (("Add", "add"), ("Sub", "subtract"), ("Mul", "multiply"),
                ("Pow", "power"), ("Maximum", "maximum"), ("Minimum", "minimum"), ("Greater", "greater"),
                ("Less", "less"), ("Equal", "equal"), ("GreaterEqual", "greater_equal"),
                ("LessEqual", "less_equal"), ("Neg", "negative"), ("Exp", "exp"), ("Log", "log"),
                ("Sqrt", "sqrt"), ("Square", "square"), ("Tanh", "tanh"), ("Abs", "abs"), ("Sign", "sign"),
                ("Select", "where"), ("ZerosLike", "zeros_like"), ("OnesLike", "ones_like")):
    _direct(_op, _f)


@kernel("Div")
def div(xp: Any, attrs: dict[str, Any]) -> Fn:
    """Floats: true division. Integers: floor division (Python's `//`, TensorFlow's FloorDiv), so the
    result keeps the integer dtype the shape function declared; x // 0 is 0 (numpy's and cupy's
    answer) rather than an error, without numpy's warning."""
    import numpy as np

    def run(x: Any, y: Any) -> Any:
        if x.dtype.kind in "fc":
            return xp.true_divide(x, y)
        if xp is np:
            with np.errstate(divide="ignore"):
                return np.floor_divide(x, y)
        return xp.floor_divide(x, y)

    return run


@kernel("Rsqrt")
def rsqrt(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda x: 1.0 / xp.sqrt(x)


@kernel("Relu")
def relu(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda x: xp.maximum(x, 0)


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


@kernel("Cast")
def cast(xp: Any, attrs: dict[str, Any]) -> Fn:
    dtype = attrs["dtype"]
    return lambda x: x.astype(dtype, copy=False)


@kernel("AddN")
def add_n(xp: Any, attrs: dict[str, Any]) -> Fn:
    def run(*xs: Any) -> Any:
        if len(xs) == 1:
            return xs[0]
        out = xs[0] + xs[1]  # a fresh buffer, so the rest can accumulate in place
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
