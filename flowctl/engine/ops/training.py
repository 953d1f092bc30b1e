"""Training ops: L2Loss, the half squared norm clipping sums (TensorFlow's clip_by_global_norm is
built on it), ApplyGradientDescent, SGD's update as one node (TensorFlow's training_ops), and
the sparse path of an embedding's gradient: GatherGradRows, the rows a Gather read with their
gradients summed (TensorFlow's IndexedSlices, deduplicated), and SparseApplyGradientDescent.

ApplyMomentum and ApplyAdam are the momentum and Adam updates as one node each, updating the
parameter and its slots together (TensorFlow's ApplyMomentum and ApplyAdam).

All replace chains of elementwise nodes over every parameter (§4.1's argument for fused nodes,
here for the optimizer): Square, Sum become one pass that allocates nothing, and the clip's Mul,
SGD's Mul by the learning rate and the AssignSub become one kernel; Adam's eleven elementwise
nodes and three assignments become one. The updates keep AssignSub's semantics: a value read or
fetched before the update never changes under its reader (§4.7); the kernels write into the
variables' arrays only when nothing else can see them, and compute the same bits either way,
in the same order of operations as the chains they replace.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flowctl.engine.dtypes import is_float
from flowctl.engine.graph import Tensor
from flowctl.engine.ops.api import convert, make1
from flowctl.engine.opdef import MOVEMENT, REDUCTION, STATE, memory_bytes, register_op
from flowctl.engine.shapes import InferError, TensorSpec, dims_equal

__all__ = ["apply_adam", "apply_gradient_descent", "apply_momentum", "gather_grad_rows", "l2_loss",
           "sparse_apply_gradient_descent"]


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


def _fits(t: TensorSpec, var: TensorSpec) -> bool:
    return t.dtype == var.dtype and len(t.shape) == len(var.shape) and all(map(dims_equal, t.shape, var.shape))


def _slots_infer(slots: int) -> Any:
    """(var, slot_1..slot_k, step size, grad) -> var's value: the slots and grad are var's shape."""
    def infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
        var, grad = ins[0], ins[-1]
        _apply_infer([var, ins[slots + 1], grad], attrs)
        for k, slot in enumerate(ins[1:slots + 1], start=1):
            if not _fits(slot, var):
                raise InferError(f"slot input {k} {slot.dtype} {slot.shape} does not fit the variable "
                                 f"{var.dtype} {var.shape}")
        return [var]
    return infer


def _slots_cost(flops: float, reads: int) -> Any:
    def cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
             attrs: dict[str, Any]) -> tuple[float, float]:
        n = float(np.prod(ins[0]))
        # reads the variable, its slots and the gradient; writes the variable and its slots
        return flops * n, memory_bytes([ins[0]] * reads, [outs[0]] * (reads - 1), dtypes[:1] * reads)
    return cost


# ApplyMomentum(var, accum, lr, grad): accum <- momentum * accum + grad; var <- var - lr * accum,
# or with `nesterov` var <- var - lr * (grad + momentum * accum). Inputs 0 and 1 name Variables.
register_op("ApplyMomentum", _slots_infer(1), num_inputs=4, group=STATE, stateful=True,
            attrs={"momentum": ("float", 0.9), "nesterov": ("bool", False)}, cost=_slots_cost(5.0, 3),
            differentiable=False, resource="variable_inputs", ref_inputs=(0, 1))
# ApplyAdam(var, m, v, lr_t, grad): m <- beta1*m + (1-beta1)*grad; v <- beta2*v + (1-beta2)*grad^2;
# var <- var - lr_t * m / (sqrt(v) + epsilon) (lr_t already holds the bias corrections).
register_op("ApplyAdam", _slots_infer(2), num_inputs=5, group=STATE, stateful=True,
            attrs={"beta1": ("float", 0.9), "beta2": ("float", 0.999), "epsilon": ("float", 1e-8)},
            cost=_slots_cost(12.0, 4), differentiable=False, resource="variable_inputs", ref_inputs=(0, 1, 2))


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


def apply_momentum(var: Tensor, accum: Tensor, lr: Any, grad: Any, momentum: float = 0.9,
                   nesterov: bool = False, name: str | None = None) -> Tensor:
    """The momentum update of `var` and its accumulator as one node; the Variable's new value."""
    return make1("ApplyMomentum", [var, accum, convert(lr, var.graph, var.dtype), convert(grad, var.graph, var.dtype)],
                 {"momentum": float(momentum), "nesterov": bool(nesterov)}, name=name)


def apply_adam(var: Tensor, m: Tensor, v: Tensor, lr_t: Any, grad: Any, beta1: float = 0.9, beta2: float = 0.999,
               epsilon: float = 1e-8, name: str | None = None) -> Tensor:
    """The Adam update of `var` and its two moments as one node; the Variable's new value."""
    return make1("ApplyAdam", [var, m, v, convert(lr_t, var.graph, var.dtype), convert(grad, var.graph, var.dtype)],
                 {"beta1": float(beta1), "beta2": float(beta2), "epsilon": float(epsilon)}, name=name)


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


# ------------------------------------------------------------------ multi-tensor updates
# One node updating N variables of one dtype with the same per-variable update (engine/multi_apply.py
# makes them from ApplyGradientDescent / ApplyMomentum / ApplyAdam nodes when it compiles a GPU
# plan; nothing builds them into a spec's graph). Inputs: the N step sizes (one per variable, as the
# nodes it replaces had them; often one tensor N times), then the N gradients. The Variables are
# not inputs (their number varies, and a ref input's position is fixed per op): `variables` names
# them, each variable followed by its slots (`slots` per variable), and the kernel is bound to
# their container slots (resource "variable_list"). No output: its readers wait by control edge.
MULTI_APPLY = {"ApplyGradientDescent": ("MultiApplyGradientDescent", 0),
               "ApplyMomentum": ("MultiApplyMomentum", 1),
               "ApplyAdam": ("MultiApplyAdam", 2)}


def _multi_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if len(ins) % 2:
        raise InferError(f"takes N step sizes then N gradients, got {len(ins)} inputs")
    n = len(ins) // 2
    if len(attrs["variables"]) != n * (1 + attrs["slots"]):
        raise InferError(f"{n} gradients but {len(attrs['variables'])} variables and slots named "
                         f"({1 + attrs['slots']} per gradient)")
    for a, g in zip(ins[:n], ins[n:]):
        if not is_float(g.dtype) or a.shape != () or a.dtype != g.dtype:
            raise InferError(f"step size {a.dtype} {a.shape} does not fit the gradient {g.dtype} {g.shape}")
    return []


def _multi_cost(flops: float, reads: int) -> Any:
    def cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
             attrs: dict[str, Any]) -> tuple[float, float]:
        n = float(sum(np.prod(s) for s in ins[len(ins) // 2:]))
        return flops * n, n * (2 * reads - 1) * 4.0
    return cost


for _single, (_multi, _slots) in MULTI_APPLY.items():
    _base = {"variables": ("strs", ()), "slots": ("int", _slots)}
    if _single == "ApplyMomentum":
        _base.update(momentum=("float", 0.9), nesterov=("bool", False))
    elif _single == "ApplyAdam":
        _base.update(beta1=("float", 0.9), beta2=("float", 0.999), epsilon=("float", 1e-8))
    register_op(_multi, _multi_infer, min_inputs=2, group=STATE, stateful=True, attrs=_base,
                cost=_multi_cost(*{0: (2.0, 2), 1: (5.0, 3), 2: (12.0, 4)}[_slots]), differentiable=False,
                resource="variable_list")


# ------------------------------------------------------------------ summed half squared norms
# MultiL2Loss(t_1..t_N) = L2Loss(t_1) + ... + L2Loss(t_N), summed left to right as AddN sums (a
# scalar of the tensors' dtype). engine/multi_l2.py makes it from an AddN (or a chain of Adds) over
# L2Loss nodes when it compiles a GPU plan (clip_by_global_norm's global norm, an L2 penalty);
# nothing builds it into a spec's graph. Its kernels: the per-tensor L2Loss kernels then AddN's
# (reference), or a few launches for all N tensors (kernels/cuda/kernels.py).
def _multi_l2_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    for k, t in enumerate(ins):
        if not is_float(t.dtype) or t.dtype != ins[0].dtype:
            raise InferError(f"input {k} is {t.dtype}: every input must be of one float dtype ({ins[0].dtype})")
    return [TensorSpec((), ins[0].dtype)]


def _multi_l2_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                   attrs: dict[str, Any]) -> tuple[float, float]:
    return 2.0 * float(sum(np.prod(s) for s in ins)), memory_bytes(ins, outs, dtypes)


register_op("MultiL2Loss", _multi_l2_infer, min_inputs=1, group=REDUCTION, cost=_multi_l2_cost,
            differentiable=False)
