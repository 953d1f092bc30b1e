"""Convolution and pooling (whitepaper Table 1 "Neural-net building blocks": Conv2D, MaxPool,
AvgPool), layout NHWC, filters HWIO (kh, kw, in_channels, out_channels), float32 and float64.

Each gradient is one fused node (§4.1: every node costs a dispatch): Conv2D's gradient is
Conv2DBackpropInput and Conv2DBackpropFilter, the pools' are MaxPoolGrad and AvgPoolGrad. Those ops
read the shape of the forward input from a `like` input, so an unknown batch (or spatial) dimension
is resolved at run time. The convolution backprops are linear in each argument, so they have
gradients too (each again a Conv2D or a backprop), which makes second derivatives work.

Padding follows TensorFlow exactly: SAME gives ceil(in/stride) outputs with
max((out-1)*stride + k - in, 0) padding, the smaller half before; VALID pads nothing.
"""
from __future__ import annotations

import operator
from typing import Any, Sequence

from flowctl.engine.dtypes import is_float
from flowctl.engine.errors import GraphError
from flowctl.engine.graph import Tensor
from flowctl.engine.ops.api import make1
from flowctl.engine.opdef import NN, memory_bytes, register_op
from flowctl.engine.shapes import InferError, TensorSpec, dims_equal, merge_dim

__all__ = ["avg_pool", "avg_pool_grad", "conv2d", "conv2d_backprop_filter", "conv2d_backprop_input",
           "max_pool", "max_pool_grad"]

_PADDINGS = ("SAME", "VALID")
_WINDOW_ATTRS = {"strides": ("ints", (1, 1)), "padding": ("str", "SAME")}
_POOL_ATTRS = {"ksize": ("ints", (2, 2)), "strides": ("ints", (2, 2)), "padding": ("str", "VALID")}


# ---------------------------------------------------------------------------- shape functions
def window(size: int | None, k: int, s: int, padding: str) -> int | None:
    """Output size along one spatial axis (None when the input size is unknown). The kernels'
    `flowctl.kernels.conv.window` applies the same rule and also returns the padding."""
    if size is None:
        return None
    if padding == "SAME":
        return -(-size // s)
    out = (size - k) // s + 1
    if out < 1:
        raise InferError(f"a VALID window of {k} with stride {s} does not fit a spatial size of {size}")
    return out


def _check_window(attrs: dict[str, Any], key: str = "strides") -> tuple[int, int]:
    v = attrs[key]
    if v is None or len(v) != 2 or min(v) < 1:
        raise InferError(f"{key} must be two positive ints (rows, cols), got {v}")
    if attrs["padding"] not in _PADDINGS:
        raise InferError(f"padding must be 'SAME' or 'VALID', got {attrs['padding']!r}")
    return int(v[0]), int(v[1])


def _nhwc(spec: TensorSpec, what: str) -> tuple:
    if len(spec.shape) != 4:
        raise InferError(f"{what} must be rank 4 (NHWC), got shape {spec.shape}")
    if not is_float(spec.dtype):
        raise InferError(f"{what} must be float, got {spec.dtype}")
    return spec.shape


def _same_dtype(*specs: TensorSpec) -> str:
    if len({s.dtype for s in specs}) != 1:
        raise InferError(f"dtypes differ: {', '.join(s.dtype for s in specs)} (insert a Cast)")
    return specs[0].dtype


def _conv_out(x: tuple, f: tuple, attrs: dict[str, Any]) -> tuple:
    """Conv2D's output shape for input shape x and filter shape f, checking the channels agree."""
    sh, sw = _check_window(attrs)
    kh, kw, cin, cout = f
    if not dims_equal(x[3], cin):
        raise InferError(f"the input has {x[3]} channels but the filter {f} (kh, kw, in, out) expects "
                         f"{cin}")
    if kh is None or kw is None:
        raise InferError(f"the filter's spatial size must be known, got {f}")
    return (x[0], window(x[1], kh, sh, attrs["padding"]), window(x[2], kw, sw, attrs["padding"]), cout)


def _agree(got: tuple, want: tuple, what: str) -> tuple:
    if len(got) != len(want) or not all(dims_equal(a, b) for a, b in zip(got, want)):
        raise InferError(f"{what} has shape {got}, expected {want}")
    return tuple(merge_dim(a, b) for a, b in zip(got, want))


def _conv_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    x, f = _nhwc(ins[0], "input"), _nhwc(ins[1], "filter")
    return [TensorSpec(_conv_out(x, f, attrs), _same_dtype(*ins))]


def _backprop_input_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    dy, f, x = (_nhwc(s, w) for s, w in zip(ins, ("dy", "filter", "like_x")))
    _agree(dy, _conv_out(x, f, attrs), "dy")
    return [TensorSpec((merge_dim(x[0], dy[0]),) + tuple(x[1:]), _same_dtype(*ins))]


def _backprop_filter_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    x, dy, f = (_nhwc(s, w) for s, w in zip(ins, ("x", "dy", "like_filters")))
    _agree(dy, _conv_out(x, f, attrs), "dy")
    return [TensorSpec(f, _same_dtype(*ins))]


def _pool_out(x: tuple, attrs: dict[str, Any]) -> tuple:
    kh, kw = _check_window(attrs, "ksize")
    sh, sw = _check_window(attrs)
    return (x[0], window(x[1], kh, sh, attrs["padding"]), window(x[2], kw, sw, attrs["padding"]), x[3])


def _pool_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    return [TensorSpec(_pool_out(_nhwc(ins[0], "input"), attrs), ins[0].dtype)]


def _max_pool_grad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    x, y, dy = (_nhwc(s, w) for s, w in zip(ins, ("x", "y", "dy")))
    want = _pool_out(x, attrs)
    _agree(y, want, "y")
    _agree(dy, want, "dy")
    return [TensorSpec(x, _same_dtype(*ins))]


def _avg_pool_grad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    dy, x = _nhwc(ins[0], "dy"), _nhwc(ins[1], "like_x")
    _agree(dy, _pool_out(x, attrs), "dy")
    return [TensorSpec((merge_dim(x[0], dy[0]),) + tuple(x[1:]), _same_dtype(*ins))]


# ---------------------------------------------------------------------------- cost functions
def _conv_flops(y: Sequence[int], f: Sequence[int]) -> float:
    """2 * N*Ho*Wo * kh*kw*Cin*Cout, the same for the forward pass and both backprops."""
    return 2.0 * y[0] * y[1] * y[2] * f[0] * f[1] * f[2] * f[3]


def _conv_cost(ins: list, outs: list, dtypes: list[str], attrs: dict[str, Any]) -> tuple[float, float]:
    return _conv_flops(outs[0], ins[1]), memory_bytes(ins, outs, dtypes)


def _backprop_input_cost(ins: list, outs: list, dtypes: list[str],
                         attrs: dict[str, Any]) -> tuple[float, float]:
    # like_x lends only its shape: it is not read.
    return _conv_flops(ins[0], ins[1]), memory_bytes(ins[:2], outs, dtypes)


def _backprop_filter_cost(ins: list, outs: list, dtypes: list[str],
                          attrs: dict[str, Any]) -> tuple[float, float]:
    return _conv_flops(ins[1], outs[0]), memory_bytes(ins[:2], outs, dtypes)


def _pool_cost(ins: list, outs: list, dtypes: list[str], attrs: dict[str, Any]) -> tuple[float, float]:
    # One comparison or addition per window element (AvgPool's division is one more per output).
    n, ho, wo, c = outs[0]
    return float(n * ho * wo * c * attrs["ksize"][0] * attrs["ksize"][1]), memory_bytes(ins, outs, dtypes)


def _max_pool_grad_cost(ins: list, outs: list, dtypes: list[str],
                        attrs: dict[str, Any]) -> tuple[float, float]:
    n, ho, wo, c = ins[1]
    return 3.0 * n * ho * wo * c * attrs["ksize"][0] * attrs["ksize"][1], memory_bytes(ins, outs, dtypes)


def _avg_pool_grad_cost(ins: list, outs: list, dtypes: list[str],
                        attrs: dict[str, Any]) -> tuple[float, float]:
    n, ho, wo, c = ins[0]
    return float(n * ho * wo * c * attrs["ksize"][0] * attrs["ksize"][1]), memory_bytes(ins[:1], outs, dtypes)


# ---------------------------------------------------------------------------- gradient functions
def _window_attrs(op: Any) -> dict[str, Any]:
    return {"strides": op.attrs["strides"], "padding": op.attrs["padding"]}


def _g_conv(op: Any, dy: list[Tensor]) -> list[Tensor]:
    x, f = op.inputs
    a = _window_attrs(op)
    return [make1("Conv2DBackpropInput", [dy[0], f, x], a, name="backprop_input"),
            make1("Conv2DBackpropFilter", [x, dy[0], f], a, name="backprop_filter")]


def _g_backprop_input(op: Any, g: list[Tensor]) -> list[Tensor | None]:
    # dx = A_f^T dy is linear in dy and in f: <g, dx> = <conv(g, f), dy>.
    dy, f, _ = op.inputs
    a = _window_attrs(op)
    return [make1("Conv2D", [g[0], f], a), make1("Conv2DBackpropFilter", [g[0], dy, f], a), None]


def _g_backprop_filter(op: Any, g: list[Tensor]) -> list[Tensor | None]:
    # <G, dW(x, dy)> = <conv(x, G), dy>.
    x, dy, _ = op.inputs
    a = _window_attrs(op)
    return [make1("Conv2DBackpropInput", [dy, g[0], x], a), make1("Conv2D", [x, g[0]], a), None]


def _pool_attrs(op: Any) -> dict[str, Any]:
    return {"ksize": op.attrs["ksize"], "strides": op.attrs["strides"], "padding": op.attrs["padding"]}


register_op("Conv2D", _conv_infer, num_inputs=2, attrs=dict(_WINDOW_ATTRS), grad=_g_conv,
            cost=_conv_cost, group=NN)
register_op("Conv2DBackpropInput", _backprop_input_infer, num_inputs=3, attrs=dict(_WINDOW_ATTRS),
            grad=_g_backprop_input, cost=_backprop_input_cost, group=NN)
register_op("Conv2DBackpropFilter", _backprop_filter_infer, num_inputs=3, attrs=dict(_WINDOW_ATTRS),
            grad=_g_backprop_filter, cost=_backprop_filter_cost, group=NN)
register_op("MaxPool", _pool_infer, num_inputs=1, attrs=dict(_POOL_ATTRS), cost=_pool_cost, group=NN,
            grad=lambda op, dy: [make1("MaxPoolGrad", [op.inputs[0], op.outputs[0], dy[0]],
                                       _pool_attrs(op), name="max_pool_grad")])
# No gradient of MaxPoolGrad is registered: asking for one (a second derivative through a max
# pool) raises rather than silently returning zero.
register_op("MaxPoolGrad", _max_pool_grad_infer, num_inputs=3, attrs=dict(_POOL_ATTRS),
            cost=_max_pool_grad_cost, group=NN)
register_op("AvgPool", _pool_infer, num_inputs=1, attrs=dict(_POOL_ATTRS), cost=_pool_cost, group=NN,
            grad=lambda op, dy: [make1("AvgPoolGrad", [dy[0], op.inputs[0]], _pool_attrs(op),
                                       name="avg_pool_grad")])
# AvgPoolGrad is linear in dy and AvgPool is its adjoint.
register_op("AvgPoolGrad", _avg_pool_grad_infer, num_inputs=2, attrs=dict(_POOL_ATTRS),
            cost=_avg_pool_grad_cost, group=NN,
            grad=lambda op, g: [make1("AvgPool", [g[0]], _pool_attrs(op)), None])


# ---------------------------------------------------------------------------- Python API
def _pair(v: int | Sequence[int], what: str) -> tuple[int, int]:
    """An int, a (rows, cols) pair, or TensorFlow's 4-tuple (1, rows, cols, 1)."""
    if not isinstance(v, Sequence):
        n = operator.index(v)
        return (n, n)
    t = tuple(operator.index(a) for a in v)
    if len(t) == 4 and t[0] == t[3] == 1:
        t = t[1:3]
    if len(t) != 2:
        raise GraphError(f"{what} must be an int, (rows, cols) or (1, rows, cols, 1), got {v!r}")
    return t  # type: ignore[return-value]


def _attrs(strides: Any, padding: str, ksize: Any = None) -> dict[str, Any]:
    out = {"strides": _pair(strides, "strides"), "padding": str(padding).upper()}
    if ksize is not None:
        out["ksize"] = _pair(ksize, "ksize")
    return out


def conv2d(x: Any, filters: Any, strides: int | Sequence[int] = (1, 1), padding: str = "SAME",
           name: str | None = None) -> Tensor:
    """2-D convolution (cross-correlation, as in TensorFlow) of NHWC `x` with HWIO `filters`."""
    return make1("Conv2D", [x, filters], _attrs(strides, padding), name=name)


def conv2d_backprop_input(dy: Any, filters: Any, like_x: Any, strides: int | Sequence[int] = (1, 1),
                          padding: str = "SAME", name: str | None = None) -> Tensor:
    """The gradient of conv2d with respect to its input, shaped like `like_x` (only its shape is used)."""
    return make1("Conv2DBackpropInput", [dy, filters, like_x], _attrs(strides, padding), name=name)


def conv2d_backprop_filter(x: Any, dy: Any, like_filters: Any, strides: int | Sequence[int] = (1, 1),
                           padding: str = "SAME", name: str | None = None) -> Tensor:
    """The gradient of conv2d with respect to its filters, shaped like `like_filters`."""
    return make1("Conv2DBackpropFilter", [x, dy, like_filters], _attrs(strides, padding), name=name)


def max_pool(x: Any, ksize: int | Sequence[int] = (2, 2), strides: int | Sequence[int] = (2, 2),
             padding: str = "VALID", name: str | None = None) -> Tensor:
    """Max over each window; padding (SAME) never wins. The gradient goes to the first maximum of a
    window in row-major order when several tie."""
    return make1("MaxPool", [x], _attrs(strides, padding, ksize), name=name)


def max_pool_grad(x: Any, y: Any, dy: Any, ksize: int | Sequence[int] = (2, 2),
                  strides: int | Sequence[int] = (2, 2), padding: str = "VALID",
                  name: str | None = None) -> Tensor:
    return make1("MaxPoolGrad", [x, y, dy], _attrs(strides, padding, ksize), name=name)


def avg_pool(x: Any, ksize: int | Sequence[int] = (2, 2), strides: int | Sequence[int] = (2, 2),
             padding: str = "VALID", name: str | None = None) -> Tensor:
    """Mean over each window; with SAME padding, over the window's unpadded elements only."""
    return make1("AvgPool", [x], _attrs(strides, padding, ksize), name=name)


def avg_pool_grad(dy: Any, like_x: Any, ksize: int | Sequence[int] = (2, 2),
                  strides: int | Sequence[int] = (2, 2), padding: str = "VALID",
                  name: str | None = None) -> Tensor:
    return make1("AvgPoolGrad", [dy, like_x], _attrs(strides, padding, ksize), name=name)
