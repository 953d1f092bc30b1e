"""Utility ops: NoOp, Group, Identity, StopGradient, CheckNumerics (§6 lesson 5)."""
from __future__ import annotations

from typing import Any, Sequence

from flowctl.engine.graph import Graph, Tensor
from flowctl.engine.ops.api import graph_of, make1, make_op
from flowctl.engine.ops.registry import CONTROL, MOVEMENT, movement_cost, register_op
from flowctl.engine.shapes import InferError, TensorSpec


def _none(ins: Any, outs: Any, dtypes: Any, attrs: Any) -> tuple[float, float]:
    return 0.0, 0.0


def _same(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    return [ins[0]]


def _float_same(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if ins[0].dtype not in ("float16", "float32", "float64"):
        raise InferError(f"CheckNumerics needs a float input, got {ins[0].dtype}")
    return [ins[0]]


register_op("NoOp", lambda ins, a: [], num_inputs=0, group=CONTROL, cost=_none, differentiable=False)
# Group: waits for all its inputs and produces nothing (its inputs are data edges so pruning keeps them).
register_op("Group", lambda ins, a: [], group=CONTROL, cost=_none, differentiable=False)
register_op("Identity", _same, num_inputs=1, group=MOVEMENT, cost=_none,
            grad=lambda op, dy: [dy[0]])
register_op("StopGradient", _same, num_inputs=1, group=MOVEMENT, cost=_none, differentiable=False)
register_op("CheckNumerics", _float_same, num_inputs=1, attrs={"message": ("str", "")}, group=CONTROL,
            cost=movement_cost, grad=lambda op, dy: [dy[0]])


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
