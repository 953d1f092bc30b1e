"""Training ops: L2Loss, the half squared norm clipping sums (TensorFlow's clip_by_global_norm is
built on it), and ApplyGradientDescent, SGD's update as one node (TensorFlow's training_ops).

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
from flowctl.engine.ops.registry import REDUCTION, STATE, memory_bytes, register_op
from flowctl.engine.shapes import InferError, TensorSpec, dims_equal

__all__ = ["apply_gradient_descent", "l2_loss"]


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


def l2_loss(t: Any, name: str | None = None) -> Tensor:
    """sum(t ** 2) / 2 (TensorFlow's l2_loss)."""
    return make1("L2Loss", [t], name=name or "L2Loss")


def apply_gradient_descent(var: Tensor, alpha: Any, delta: Any, name: str | None = None) -> Tensor:
    """var <- var - alpha * delta, as one node; the Variable's new value."""
    return make1("ApplyGradientDescent", [var, convert(alpha, var.graph, var.dtype),
                                          convert(delta, var.graph, var.dtype)], name=name)
