"""Training ops: L2Loss, the half squared norm clipping sums (TensorFlow's clip_by_global_norm is
built on it), ApplyGradientDescent, SGD's update as one node (TensorFlow's training_ops), and
the sparse path of an embedding's gradient: GatherGradRows, the rows a Gather read with their
gradients summed (TensorFlow's IndexedSlices, deduplicated), and SparseApplyGradientDescent.

Both replace chains of elementwise nodes over every parameter (§4.1's argument for fused nodes,
here for the optimizer): Square, Sum become one pass that allocates nothing, and the clip's Mul,
SGD's Mul by the learning rate and the AssignSub become one kernel that writes the new value into
one fresh buffer. The update keeps AssignSub's semantics: the Variable's slot takes a new array,
so a value read or fetched before the update never changes under its reader (§4.7).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flowctl.engine.dtypes import is_float
from flowctl.engine.graph import Tensor
from flowctl.engine.ops.api import convert, make1
from flowctl.engine.ops.registry import MOVEMENT, REDUCTION, STATE, memory_bytes, register_op
from flowctl.engine.shapes import InferError, TensorSpec, dims_equal

__all__ = ["apply_gradient_descent", "gather_grad_rows", "l2_loss", "sparse_apply_gradient_descent"]


def _l2_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if not is_float(ins[0].dtype):
        raise InferError(f"needs a float input, got {ins[0].dtype}")
    return [TensorSpec((), ins[0].dtype)]


def _l2_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
             attrs: dict[str, Any]) -> tuple[float, float]:
    return 2.0 * float(np.prod(ins[0])), memory_bytes(ins, outs, dtypes)


def _g_l2(op: Any, dy: list[Tensor]) -> list[Tensor]:
    from flowctl.engine.ops.elementwise import mul

    return [mul(op.inputs[0], dy[0], name="l2_loss_grad")]


# L2Loss(t) = sum(t^2) / 2, a scalar of t's dtype.
register_op("L2Loss", _l2_infer, num_inputs=1, group=REDUCTION, grad=_g_l2, cost=_l2_cost)


def _apply_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    var, alpha, delta = ins
    if not is_float(var.dtype):
        raise InferError(f"cannot update a {var.dtype} variable")
    if alpha.shape != () or alpha.dtype != var.dtype:
        raise InferError(f"alpha must be a {var.dtype} scalar, got {alpha.dtype} of shape {alpha.shape}")
    if delta.dtype != var.dtype or len(delta.shape) != len(var.shape) or not all(
            map(dims_equal, delta.shape, var.shape)):
        raise InferError(f"delta {delta.dtype} {delta.shape} does not fit the variable {var.dtype} {var.shape}")
    return [var]


def _apply_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                attrs: dict[str, Any]) -> tuple[float, float]:
    n = float(np.prod(outs[0]))
    return 2.0 * n, memory_bytes([ins[0], ins[2]], outs, dtypes)


# ApplyGradientDescent(var, alpha, delta): var <- var - alpha * delta; returns the new value.
# Input 0 names the Variable by reference (colocated with it, §4.3, as AssignSub is).
register_op("ApplyGradientDescent", _apply_infer, num_inputs=3, group=STATE, stateful=True,
            cost=_apply_cost, differentiable=False, resource="variable_input", ref_inputs=(0,))


def _rows_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    dy, indices, like = ins
    if not indices.dtype.startswith("int"):
        raise InferError(f"indices must be integers, got {indices.dtype}")
    if not like.shape:
        raise InferError("the gathered tensor must have rank >= 1")
    k = len(indices.shape)
    expect = (*indices.shape, *like.shape[1:])
    if len(dy.shape) != len(expect) or not all(map(dims_equal, dy.shape, expect)):
        raise InferError(f"gradient shape {dy.shape} is not the gather's output shape {expect}")
    return [TensorSpec((None,), "int64"), TensorSpec((None, *dy.shape[k:]), dy.dtype)]


def _rows_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
               attrs: dict[str, Any]) -> tuple[float, float]:
    # a sort of the indices and one add per element of dy; reads dy, writes at most as much
    n = float(np.prod(ins[1]))
    return float(np.prod(ins[0])) + n * max(np.log2(max(n, 2.0)), 1.0), 2.0 * memory_bytes(ins[:1], [], dtypes)


# GatherGradRows(dy, indices, params) -> (ids, rows): the distinct indices of Gather(params,
# indices) along axis 0, ascending, and the sum of dy's rows for each; GatherGrad is these rows
# scattered into zeros of params' shape. Not itself differentiated.
register_op("GatherGradRows", _rows_infer, num_inputs=3, group=MOVEMENT, cost=_rows_cost,
            differentiable=False)


def _sparse_apply_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    var, alpha, ids, rows = ins
    _apply_infer([var, alpha, TensorSpec(var.shape, var.dtype)], attrs)
    if not ids.dtype.startswith("int") or len(ids.shape) != 1:
        raise InferError(f"ids must be a vector of integers, got {ids.dtype} of shape {ids.shape}")
    if rows.dtype != var.dtype or len(rows.shape) != len(var.shape) or not all(
            map(dims_equal, rows.shape[1:], var.shape[1:])) or not dims_equal(rows.shape[0], ids.shape[0]):
        raise InferError(f"rows {rows.dtype} {rows.shape} do not fit ids {ids.shape} and the variable "
                         f"{var.dtype} {var.shape}")
    return [var]


def _sparse_apply_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                       attrs: dict[str, Any]) -> tuple[float, float]:
    # the copy of the variable (its new array) and two FLOPs per updated element
    return 2.0 * float(np.prod(ins[3])), memory_bytes([ins[0], ins[3]], outs, dtypes)


# SparseApplyGradientDescent(var, alpha, ids, rows): var[ids] <- var[ids] - alpha * rows, into a
# copy of var (ids distinct, as GatherGradRows gives them).
register_op("SparseApplyGradientDescent", _sparse_apply_infer, num_inputs=4, group=STATE, stateful=True,
            cost=_sparse_apply_cost, differentiable=False, resource="variable_input", ref_inputs=(0,))


def l2_loss(t: Any, name: str | None = None) -> Tensor:
    """sum(t ** 2) / 2 (TensorFlow's l2_loss)."""
    return make1("L2Loss", [t], name=name or "L2Loss")


def apply_gradient_descent(var: Tensor, alpha: Any, delta: Any, name: str | None = None) -> Tensor:
    """var <- var - alpha * delta, as one node; the Variable's new value."""
    return make1("ApplyGradientDescent", [var, convert(alpha, var.graph, var.dtype),
                                          convert(delta, var.graph, var.dtype)], name=name)


def gather_grad_rows(grad: Tensor) -> tuple[Tensor, Tensor] | None:
    """For a GatherGrad along axis 0 (an embedding table's gradient), its sparse form (ids, rows);
    None for any other tensor. Made once per GatherGrad: a second call finds the first's node."""
    node = grad.op
    if node.op != "GatherGrad" or node.attrs["axis"] != 0 or grad.port != 0:
        return None
    g = grad.graph
    for n in g.nodes.values():
        if n.op == "GatherGradRows" and n.inputs == node.inputs:
            return Tensor(g, n.name, 0), Tensor(g, n.name, 1)
    dy, indices, like = (g.tensor(r) for r in node.inputs)
    with g.absolute_scope(node.name.rsplit("/", 1)[0] if "/" in node.name else ""):
        ids = make1("GatherGradRows", [dy, indices, like], name="gather_grad_rows")
    g.nodes[ids.node].follows = node.follows
    return ids, Tensor(g, ids.node, 1)


def sparse_apply_gradient_descent(var: Tensor, alpha: Any, ids: Tensor, rows: Tensor,
                                  name: str | None = None) -> Tensor:
    """var[ids] <- var[ids] - alpha * rows (ids distinct), as one node; the Variable's new value."""
    return make1("SparseApplyGradientDescent", [var, convert(alpha, var.graph, var.dtype), ids, rows], name=name)
