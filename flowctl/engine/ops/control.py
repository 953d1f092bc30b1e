"""Utility ops: NoOp, Group, Identity, StopGradient, CheckNumerics (§6 lesson 5), and the §4.4
control-flow primitives: Switch, Merge, Enter, Exit, NextIteration (with the accumulator a loop's
gradient reads its forward values from)."""
from __future__ import annotations

from typing import Any, Sequence

from flowctl.engine.dtypes import is_float
from flowctl.engine.errors import GraphError
from flowctl.engine.graph import Graph, Tensor
from flowctl.engine.ops.api import graph_of, make, make1, make_op
from flowctl.engine.opdef import (
    CONTROL, MOVEMENT, REQUIRED, STATE, elementwise_cost, movement_cost, register_op, view_same,
)
from flowctl.engine.shapes import InferError, TensorSpec


def _none(ins: Any, outs: Any, dtypes: Any, attrs: Any) -> tuple[float, float]:
    return 0.0, 0.0


def _same(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    return [ins[0]]


def _float_same(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if not is_float(ins[0].dtype):
        raise InferError(f"CheckNumerics needs a float input, got {ins[0].dtype}")
    return [ins[0]]


register_op("NoOp", lambda ins, a: [], num_inputs=0, group=CONTROL, cost=_none, differentiable=False)
# Group: waits for all its inputs and produces nothing (its inputs are data edges so pruning keeps them).
register_op("Group", lambda ins, a: [], group=CONTROL, cost=_none, differentiable=False)
register_op("Identity", _same, num_inputs=1, group=MOVEMENT, cost=_none,
            grad=lambda op, dy: [dy[0]], view=view_same)
register_op("StopGradient", _same, num_inputs=1, group=MOVEMENT, cost=_none, differentiable=False,
            view=view_same)
register_op("CheckNumerics", _float_same, num_inputs=1, attrs={"message": ("str", "")}, group=CONTROL,
            cost=movement_cost, grad=lambda op, dy: [dy[0]], view=view_same)


def _bool_scalar(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if ins[0].dtype != "bool" or ins[0].shape != ():
        raise InferError(f"GuardFlag needs a bool scalar, got {ins[0].dtype} of shape {ins[0].shape}")
    return [ins[0]]


# GuardFlag(ok): its input, and on a device whose steps are captured, the device flag every state
# write that waits for it (a control edge) reads: where ok is false the write leaves its variable
# as it was (fp16's skipped step without a cond, engine/mixed_precision.py). A CPU's writes do not
# read it: a CPU step skips with the cond.
register_op("GuardFlag", _bool_scalar, num_inputs=1, group=CONTROL, cost=movement_cost, differentiable=False,
            view=view_same)

def no_op(name: str | None = None, control_inputs: Sequence[Tensor] = (), graph: Graph | None = None) -> Tensor:
    g = graph or graph_of(*control_inputs)
    return make_op("NoOp", [], name=name or "NoOp", graph=g, control_inputs=list(control_inputs))


def group(tensors: Sequence[Tensor], name: str | None = None, graph: Graph | None = None) -> Tensor:
    """One target that runs everything in `tensors` (their outputs are consumed, not copied)."""
    g = graph or graph_of(*tensors)
    data = [t for t in tensors if t.op.outputs]
    ctrl = [t for t in tensors if not t.op.outputs]
    return make_op("Group", data, name=name or "Group", graph=g, control_inputs=ctrl)


def identity(x: Tensor, name: str | None = None) -> Tensor:
    return make1("Identity", [x], name=name)


def stop_gradient(x: Tensor, name: str | None = None) -> Tensor:
    return make1("StopGradient", [x], name=name)


def check_numerics(x: Tensor, message: str = "", name: str | None = None) -> Tensor:
    return make1("CheckNumerics", [x], {"message": message}, name=name)


def guard_flag(ok: Tensor, name: str | None = None) -> Tensor:
    """`ok` (a bool scalar), raising the device's guard flag for the state writes that wait for it."""
    return make1("GuardFlag", [ok], {}, name=name)


# ---------------------------------------------------------------------------------------------------
# §4.4 control flow: the five primitives the executor gives frame semantics (engine/frames.py), and
# the accumulator a while loop's gradient reads its forward values back from. `cond` and
# `while_loop` (engine/control_flow.py) are built from these; nobody needs to wire them by hand.

def _join_shapes(a: tuple, b: tuple) -> tuple:
    """The most specific shape both fit: dimensions that differ become unknown."""
    return tuple(x if x == y else None for x, y in zip(a, b))


def _compatible(general: tuple | None, specific: tuple) -> bool:
    """`specific` is an instance of `general` (an unknown dimension admits any size)."""
    if general is None:
        return True
    return len(general) == len(specific) and all(g is None or g == s for g, s in zip(general, specific))


def _enter(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    invariant = attrs["shape"]
    if invariant is not None:
        if not _compatible(invariant, ins[0].shape):
            raise InferError(f"shape invariant {invariant} does not admit the initial value's shape "
                             f"{ins[0].shape}")
        return [TensorSpec(invariant, ins[0].dtype)]
    return [ins[0]]


def _switch(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if ins[1].dtype != "bool" or ins[1].shape not in ((), (1,)):
        raise InferError(f"Switch's predicate must be a bool scalar, got {ins[1].shape} {ins[1].dtype}")
    return [ins[0], ins[0]]


def _merge(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    # A loop's Merge may be inferred before its back edge (NextIteration) is: it then joins fewer.
    shape, dtype = ins[0].shape, ins[0].dtype
    for s in ins[1:]:
        if s.dtype != dtype or len(s.shape) != len(shape):
            raise InferError(f"Merge inputs disagree: {ins[0].shape} {dtype} vs {s.shape} {s.dtype}")
        shape = _join_shapes(shape, s.shape)
    return [TensorSpec(shape, dtype), TensorSpec((), "int32")]


def _acc_read(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if ins[1].dtype != "int32" or ins[1].shape != ():
        raise InferError(f"AccRead's index must be an int32 scalar, got {ins[1].shape} {ins[1].dtype}")
    return [TensorSpec(attrs["shape"], attrs["dtype"])]


_FRAME = {"frame_name": ("str", REQUIRED)}
register_op("Enter", _enter, num_inputs=1, group=CONTROL, cost=_none, differentiable=False,
            attrs={**_FRAME, "is_constant": ("bool", False), "parallel_iterations": ("int", 10),
                   "shape": ("shape", None),
                   # the trip count the cost model assumes (0: unknown, counted as one iteration)
                   "expected_iterations": ("int", 0)})
register_op("Exit", _same, num_inputs=1, group=CONTROL, cost=_none, differentiable=False, attrs=_FRAME)
register_op("NextIteration", _same, num_inputs=1, group=CONTROL, cost=_none, differentiable=False,
            attrs=_FRAME)
register_op("Switch", _switch, num_inputs=2, group=CONTROL, cost=_none, grad=lambda op, dy: _switch_grad(op, dy))
register_op("Merge", _merge, min_inputs=1, group=CONTROL, cost=_none, grad=lambda op, dy: _merge_grad(op, dy))
# The accumulator: a per-step list a forward loop appends to, one entry per iteration, in order.
register_op("AccCreate", lambda ins, a: [TensorSpec((), "variant")], num_inputs=0, group=STATE,
            cost=_none, stateful=True, differentiable=False)
register_op("AccPush", lambda ins, a: [ins[0]], num_inputs=2, group=STATE, cost=_none, stateful=True,
            differentiable=False)
register_op("AccRead", _acc_read, num_inputs=2, group=STATE, cost=_none, stateful=True,
            differentiable=False, attrs={"dtype": ("dtype", REQUIRED), "shape": ("shape", REQUIRED)})


def _acc_stack(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    rows = attrs["rows"] or None
    return [TensorSpec((rows,) + tuple(ins[1].shape), ins[1].dtype)]


# AccStack(acc, like): a loop's per-iteration values as one [iterations, ...] tensor (a dynamic
# RNN's outputs), zero-padded to `rows` when the loop stopped early (variable lengths); `like` is
# a value of the element's shape and dtype. Its gradient goes to the accumulator's Exit; the loop's
# gradient hands row t to iteration t.
register_op("AccStack", _acc_stack, num_inputs=2, group=STATE, cost=_none, stateful=True,
            attrs={"rows": ("int", 0)}, grad=lambda op, dy: [dy[0], None])


def _loop_sum(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if ins[0].dtype != ins[1].dtype or len(ins[0].shape) != len(ins[1].shape):
        raise InferError(f"LoopSum adds equal shapes: {ins[0].shape} {ins[0].dtype} and {ins[1].shape} {ins[1].dtype}")
    return [ins[0]]


# LoopSum(total, x): total + x, written into `total` when its buffer allows. Only a loop's gradient
# builds it, for a running sum that is a loop variable no one else reads (a loop invariant's
# gradient): summing a weight gradient per iteration in place instead of allocating a new one.
register_op("LoopSum", _loop_sum, num_inputs=2, group=CONTROL, cost=elementwise_cost, differentiable=False)


def _switch_grad(op: Any, dy: list[Tensor | None]) -> list[Tensor | None]:
    """The gradient of the taken output flows back; the untaken one is dead, so Merge picks the
    live one (§4.4: cond differentiates the branch that ran)."""
    from flowctl.engine.ops import elementwise as ew

    parts = [g if g is not None else ew.zeros_like(op.outputs[p]) for p, g in enumerate(dy)]
    return [merge(parts)[0], None]


def _merge_grad(op: Any, dy: list[Tensor | None]) -> list[Tensor | None]:
    """Route the output's gradient to the input that was taken, using Merge's own index output."""
    from flowctl.engine.ops import elementwise as ew

    n = len(op.inputs)
    if n != 2:
        raise GraphError(f"the gradient of Merge '{op.name}' needs exactly 2 inputs (a cond), it has {n}")
    taken = ew.equal(op.outputs[1], api_constant(1, "int32", op.graph))
    g = dy[0] if dy[0] is not None else ew.zeros_like(op.outputs[0])
    f, t = switch(g, taken)
    return [f, t]


def api_constant(value: Any, dtype: str, graph: Graph) -> Tensor:
    from flowctl.engine.ops.api import constant

    return constant(value, dtype=dtype, graph=graph)


def switch(x: Tensor, pred: Tensor, name: str | None = None) -> tuple[Tensor, Tensor]:
    """(output when pred is false, output when pred is true); the other is dead."""
    a, b = make("Switch", [x, pred], name=name or "Switch")
    return a, b


def merge(xs: Sequence[Tensor], name: str | None = None) -> tuple[Tensor, Tensor]:
    """(the value of whichever input arrived alive, its index)."""
    a, b = make("Merge", list(xs), name=name or "Merge")
    return a, b


def accumulator(graph: Graph | None = None, name: str = "acc") -> Tensor:
    """A fresh per-step list for a loop to push one value per iteration onto (a loop variable)."""
    from flowctl.engine.graph import default_graph

    return make1("AccCreate", [], name=name, graph=graph or default_graph())


def acc_push(acc: Tensor, x: Tensor, name: str = "push") -> Tensor:
    return make1("AccPush", [acc, x], name=name)


def acc_stack(acc: Tensor, like: Tensor, rows: int = 0, name: str = "stack") -> Tensor:
    """The values pushed, one per iteration, stacked on a new leading axis, zero-padded to `rows`
    (0: as many as were pushed); `like` has the values' shape and dtype. Differentiable: iteration
    t's value gets row t of the gradient."""
    return make1("AccStack", [acc, like], {"rows": rows}, name=name)
