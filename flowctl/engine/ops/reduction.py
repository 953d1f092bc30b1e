"""Reductions (whitepaper Table 1 "Array operations"): Sum, Prod, Mean, Max, Min, ArgMax, and the
fused gradient ops they use (§4.1), ReduceGrad, ReduceMaxGrad and ReduceProdGrad.

Over an empty axis each reduction gives its identity, as TensorFlow and ONNX do: Sum 0, Prod 1, Max
-inf / the dtype's smallest integer / False, Min +inf / the dtype's largest integer / True. Mean has
no identity and gives NaN (0/0); ArgMax has none either and fails with the node's name.

CumSum (a scan, kept here with the reductions it generalises) and TopK (the k largest entries of
the last axis, what top-5 accuracy needs) close the file.

The reduced axes are a static attribute (`axis`: None for all, else a tuple of ints, negative allowed),
so a reduction's output shape is known at construction even when some input dims are not; Mean divides
by the element count of the array it actually receives, so a batch dim of None works at run time.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from flowctl.engine.dtypes import is_float
from flowctl.engine.graph import Tensor
from flowctl.engine.ops.api import convert, graph_of, make1
from flowctl.engine.opdef import REDUCTION, REQUIRED, memory_bytes, register_op
from flowctl.engine.shapes import InferError, TensorSpec, normalize_axes, normalize_axis

__all__ = ["reduce_sum", "reduce_prod", "reduce_mean", "reduce_max", "reduce_min", "argmax", "cumsum", "top_k"]

_AXES_ATTRS = {"axis": ("ints", None), "keepdims": ("bool", False)}


# ---------------------------------------------------------------------------- shape functions
def _reduced_shape(shape: tuple, axis: tuple[int, ...] | None, keepdims: bool) -> tuple:
    axes = set(normalize_axes(axis, len(shape)))
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _sum_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    x = ins[0]
    if x.dtype == "bool":
        raise InferError("Sum needs a numeric input, got bool (cast it first)")
    return [TensorSpec(_reduced_shape(x.shape, attrs["axis"], attrs["keepdims"]), x.dtype)]


def _mean_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    x = ins[0]
    if not is_float(x.dtype):
        # TensorFlow's integer mean truncates; a silent truncation is rarely wanted, so ask for a Cast.
        raise InferError(f"Mean needs a float input, got {x.dtype} (cast it first)")
    return [TensorSpec(_reduced_shape(x.shape, attrs["axis"], attrs["keepdims"]), x.dtype)]


def _max_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    # Max / Min of bools are any / all.
    x = ins[0]
    return [TensorSpec(_reduced_shape(x.shape, attrs["axis"], attrs["keepdims"]), x.dtype)]


def _argmax_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    x = ins[0]
    if not x.shape:
        raise InferError("ArgMax needs an input of rank >= 1, got a scalar")
    if attrs["output_type"] not in ("int32", "int64"):
        raise InferError(f"ArgMax output_type must be int32 or int64, got {attrs['output_type']}")
    ax = normalize_axis(attrs["axis"], len(x.shape))
    return [TensorSpec(tuple(d for i, d in enumerate(x.shape) if i != ax), attrs["output_type"])]


def _grad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    # ReduceGrad(dy, x) / ReduceMaxGrad(dy, x, y): a gradient shaped like x, of dy's dtype.
    dy, x = ins[0], ins[1]
    if len(ins) == 3 and not is_float(dy.dtype):
        raise InferError(f"ReduceMaxGrad splits dy among ties, so it needs a float dy, got {dy.dtype}")
    want = _reduced_shape(x.shape, attrs["axis"], attrs["keepdims"])
    if len(want) != len(dy.shape) or any(a is not None and b is not None and a != b
                                         for a, b in zip(want, dy.shape)):
        raise InferError(f"incoming gradient has shape {dy.shape}, the reduction of {x.shape} over "
                         f"axis={attrs['axis']} gives {want}")
    return [TensorSpec(x.shape, dy.dtype)]


# ---------------------------------------------------------------------------- cost functions
def _reduce_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                 attrs: dict[str, Any]) -> tuple[float, float]:
    """One add/compare per input element (Mean adds one divide per output element)."""
    n_in = 1
    for d in ins[0]:
        n_in *= d
    return float(n_in), memory_bytes(ins, outs, dtypes)


def _grad_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
               attrs: dict[str, Any]) -> tuple[float, float]:
    n_out = 1
    for d in outs[0]:
        n_out *= d
    # ReduceGrad reads x for its shape only; ReduceMaxGrad compares, counts and divides per element.
    read = list(ins) if len(ins) == 3 else [ins[0]]
    return float(n_out * (3 if len(ins) == 3 else 1)), memory_bytes(read, outs, dtypes)


# ---------------------------------------------------------------------------- gradient functions
def _g_sum(op: Any, dy: list[Tensor]) -> list[Tensor]:
    a = op.attrs
    return [make1("ReduceGrad", [dy[0], op.inputs[0]],
                  {"axis": a["axis"], "keepdims": a["keepdims"], "mean": False}, name="sum_grad")]


def _g_mean(op: Any, dy: list[Tensor]) -> list[Tensor]:
    a = op.attrs
    return [make1("ReduceGrad", [dy[0], op.inputs[0]],
                  {"axis": a["axis"], "keepdims": a["keepdims"], "mean": True}, name="mean_grad")]


def _g_max(op: Any, dy: list[Tensor]) -> list[Tensor]:
    """dy goes to the positions that attained the max; k tied positions get dy/k each, as TensorFlow's
    reduce_max gradient does, so the gradient still sums to dy (the finite difference at a tie is not
    defined, so this is a convention, not a derivative)."""
    a = op.attrs
    return [make1("ReduceMaxGrad", [dy[0], op.inputs[0], op.outputs[0]],
                  {"axis": a["axis"], "keepdims": a["keepdims"]}, name="max_grad")]


def _g_prod(op: Any, dy: list[Tensor]) -> list[Tensor]:
    """Each entry's derivative is the product of the others in its reduction, computed without a
    division so that zeros in x are handled exactly."""
    a = op.attrs
    return [make1("ReduceProdGrad", [dy[0], op.inputs[0]], {"axis": a["axis"], "keepdims": a["keepdims"]},
                  name="prod_grad")]


def _g_reduce_grad(op: Any, dy: list[Tensor]) -> list[Tensor | None]:
    # ReduceGrad is linear in dy: its adjoint is the reduction it came from (second derivatives).
    a = op.attrs
    fn = reduce_mean if a["mean"] else reduce_sum
    return [fn(dy[0], a["axis"], a["keepdims"]), None]


def _g_reduce_max_grad(op: Any, dy: list[Tensor]) -> list[Tensor | None]:
    # Linear in dy with the tie-split mask as weights; piecewise constant in x, so no x gradient.
    from flowctl.engine.ops.elementwise import ones_like

    a = op.attrs
    g_dy, x, y = op.inputs
    weights = make1("ReduceMaxGrad", [ones_like(g_dy), x, y], {"axis": a["axis"], "keepdims": a["keepdims"]})
    return [reduce_sum(dy[0] * weights, a["axis"], a["keepdims"]), None, None]


register_op("Sum", _sum_infer, num_inputs=1, attrs=dict(_AXES_ATTRS), grad=_g_sum, cost=_reduce_cost,
            group=REDUCTION)
register_op("Mean", _mean_infer, num_inputs=1, attrs=dict(_AXES_ATTRS), grad=_g_mean, cost=_reduce_cost,
            group=REDUCTION)
register_op("Max", _max_infer, num_inputs=1, attrs=dict(_AXES_ATTRS), grad=_g_max, cost=_reduce_cost,
            group=REDUCTION)
register_op("Min", _max_infer, num_inputs=1, attrs=dict(_AXES_ATTRS), grad=_g_max, cost=_reduce_cost,
            group=REDUCTION)
register_op("Prod", _sum_infer, num_inputs=1, attrs=dict(_AXES_ATTRS), grad=_g_prod, cost=_reduce_cost,
            group=REDUCTION)
register_op("ArgMax", _argmax_infer, num_inputs=1,
            attrs={"axis": ("int", REQUIRED), "output_type": ("dtype", "int64")}, cost=_reduce_cost,
            group=REDUCTION, differentiable=False)
# ReduceGrad(dy, x): dy reshaped to the keepdims shape and broadcast to x's shape (divided by the
# reduced element count when mean=True), in one node. x is read for its run-time shape only, which is
# what lets a Mean over a None batch dim differentiate without a Shape/Reshape pair.
register_op("ReduceGrad", _grad_infer, num_inputs=2,
            attrs={**_AXES_ATTRS, "mean": ("bool", False)}, grad=_g_reduce_grad, cost=_grad_cost,
            group=REDUCTION)
# ReduceMaxGrad(dy, x, y): dy routed to where x == y (y = Max(x) or Min(x)), split equally among ties.
register_op("ReduceMaxGrad", _grad_infer, num_inputs=3, attrs=dict(_AXES_ATTRS), grad=_g_reduce_max_grad,
            cost=_grad_cost, group=REDUCTION)
# ReduceProdGrad(dy, x): dy times the product of the other entries of each reduction. Its own
# gradient is not defined here (no second derivatives of Prod).
register_op("ReduceProdGrad", _grad_infer, num_inputs=2, attrs=dict(_AXES_ATTRS), cost=_grad_cost,
            group=REDUCTION, differentiable=False)


# ---------------------------------------------------------------------------- scans and selection
def _cumsum_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    x = ins[0]
    if x.dtype == "bool":
        raise InferError("CumSum needs a numeric input, got bool (cast it first)")
    normalize_axis(attrs["axis"], len(x.shape))
    if not x.shape:
        raise InferError("CumSum needs an input of rank >= 1, got a scalar")
    return [x]


def _g_cumsum(op: Any, dy: list[Tensor]) -> list[Tensor]:
    # Each input feeds the outputs after it (before it, reversed): the adjoint scans the other way.
    a = op.attrs
    return [cumsum(dy[0], a["axis"], exclusive=a["exclusive"], reverse=not a["reverse"])]


def _topk_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    x, k = ins[0], attrs["k"]
    if not x.shape:
        raise InferError("TopK needs an input of rank >= 1, got a scalar")
    if x.dtype == "bool":
        raise InferError("TopK needs a numeric input, got bool")
    n = x.shape[-1]
    if k < 0 or (n is not None and k > n):
        raise InferError(f"k={k} is out of range for a last axis of {n}")
    out = tuple(x.shape[:-1]) + (k,)
    return [TensorSpec(out, x.dtype), TensorSpec(out, "int32")]


def _g_topk(op: Any, dy: list[Tensor]) -> list[Tensor]:
    return [make1("TopKGrad", [dy[0], op.outputs[1], op.inputs[0]], name="top_k_grad")]


def _topk_grad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    return [TensorSpec(ins[2].shape, ins[0].dtype)]


def _topk_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
               attrs: dict[str, Any]) -> tuple[float, float]:
    """A sort of each row: n log2 n compares per row."""
    n = ins[0][-1] if ins[0] else 1
    rows = 1
    for d in ins[0][:-1]:
        rows *= d
    return float(rows * n * max(1.0, math.log2(max(n, 2)))), memory_bytes(ins, outs, dtypes)


register_op("CumSum", _cumsum_infer, num_inputs=1,
            attrs={"axis": ("int", 0), "exclusive": ("bool", False), "reverse": ("bool", False)},
            grad=_g_cumsum, cost=_reduce_cost, group=REDUCTION)
# TopK(x) -> (values, int32 indices) along the last axis, largest first, ties to the lower index.
register_op("TopK", _topk_infer, num_inputs=1, attrs={"k": ("int", REQUIRED)}, grad=_g_topk,
            cost=_topk_cost, group=REDUCTION)
# TopKGrad(dy, indices, x): dy put back where the values came from, zeros elsewhere. Not
# differentiable itself (no second derivatives of TopK).
register_op("TopKGrad", _topk_grad_infer, num_inputs=3, cost=_grad_cost, group=REDUCTION,
            differentiable=False)


# ---------------------------------------------------------------------------- Python API
def _axis_attr(axis: int | Sequence[int] | None, rank: int) -> tuple[int, ...] | None:
    """Canonical axes (sorted, non-negative, unique) so equal reductions have equal attrs (CSE) and
    the kernel can pass them straight to numpy; out-of-range axes are left for the shape function
    to report with the node's name."""
    if axis is None:
        return None
    axes = (int(axis),) if hasattr(axis, "__index__") else tuple(int(a) for a in axis)
    if all(-rank <= a < rank for a in axes):
        return tuple(sorted({a % rank for a in axes}))
    return axes


def _reduce(op: str, x: Any, axis: int | Sequence[int] | None, keepdims: bool, name: str | None) -> Tensor:
    x = convert(x, graph_of(x))
    return make1(op, [x], {"axis": _axis_attr(axis, len(x.shape)), "keepdims": bool(keepdims)},
                 name=name or op)


def reduce_sum(x: Any, axis: int | Sequence[int] | None = None, keepdims: bool = False,
               name: str | None = None) -> Tensor:
    """Sum over `axis` (None: every axis; negative counts from the end)."""
    return _reduce("Sum", x, axis, keepdims, name)


def reduce_mean(x: Any, axis: int | Sequence[int] | None = None, keepdims: bool = False,
                name: str | None = None) -> Tensor:
    """Mean over `axis`; the count is taken from the run-time shape, so unknown dims work."""
    return _reduce("Mean", x, axis, keepdims, name)


def reduce_max(x: Any, axis: int | Sequence[int] | None = None, keepdims: bool = False,
               name: str | None = None) -> Tensor:
    """Max over `axis`. Its gradient splits dy equally among tied maxima (as TensorFlow does)."""
    return _reduce("Max", x, axis, keepdims, name)


def reduce_min(x: Any, axis: int | Sequence[int] | None = None, keepdims: bool = False,
               name: str | None = None) -> Tensor:
    """Min over `axis`; ties share the gradient equally, as for reduce_max."""
    return _reduce("Min", x, axis, keepdims, name)


def reduce_prod(x: Any, axis: int | Sequence[int] | None = None, keepdims: bool = False,
                name: str | None = None) -> Tensor:
    """Product over `axis` (1 over an empty axis); integers wrap around on overflow, as in numpy."""
    return _reduce("Prod", x, axis, keepdims, name)


def argmax(x: Any, axis: int, output_type: Any = "int64", name: str | None = None) -> Tensor:
    """Index of the largest entry along `axis` (the first one on ties). Not differentiable."""
    x = convert(x, graph_of(x))
    return make1("ArgMax", [x], {"axis": int(axis), "output_type": output_type}, name=name or "ArgMax")



def cumsum(x: Any, axis: int = 0, exclusive: bool = False, reverse: bool = False,
           name: str | None = None) -> Tensor:
    """Running sum along `axis`; `exclusive` leaves each entry out of its own sum (the first is 0),
    `reverse` sums from the end. Integers keep their dtype (and wrap around, as numpy's do)."""
    x = convert(x, graph_of(x))
    return make1("CumSum", [x], {"axis": int(axis), "exclusive": bool(exclusive), "reverse": bool(reverse)},
                 name=name or "CumSum")


def top_k(x: Any, k: int, name: str | None = None) -> tuple[Tensor, Tensor]:
    """The k largest entries of the last axis, largest first (ties: the lower index first), and
    their int32 indices. The gradient reaches the selected entries only."""
    x = convert(x, graph_of(x))
    g = x.graph
    node = g.add_node("TopK", [x], {"k": int(k)}, name=name or "TopK")
    return Tensor(g, node.name, 0), Tensor(g, node.name, 1)
