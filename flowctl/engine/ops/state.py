"""Sources and state: Const, Placeholder, Variable, Assign, AssignAdd, AssignSub (§2, §4.7)."""
from __future__ import annotations

from typing import Any

import numpy as np

from flowctl.engine.dtypes import as_dtype, is_float, np_dtype
from flowctl.engine.graph import Tensor
from flowctl.engine.ops.api import constant, convert, graph_of, make1
from flowctl.engine.opdef import REQUIRED, SOURCE, STATE, movement_cost, register_op
from flowctl.engine.shapes import InferError, TensorSpec, dims_equal


def _const_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    v = attrs["value"]
    return [TensorSpec(tuple(v.shape), v.dtype.name)]


def _free(ins: Any, outs: Any, dtypes: Any, attrs: Any) -> tuple[float, float]:
    return 0.0, 0.0


register_op("Const", _const_infer, num_inputs=0, attrs={"value": ("tensor", REQUIRED)},
            group=SOURCE, cost=_free, differentiable=False)
register_op("Placeholder", lambda ins, a: [TensorSpec(a["shape"], a["dtype"])], num_inputs=0,
            attrs={"dtype": ("dtype", "float32"), "shape": ("shape", ())}, group=SOURCE, cost=_free,
            differentiable=False)
register_op("Variable", lambda ins, a: [TensorSpec(a["shape"], a["dtype"])], num_inputs=0,
            attrs={"dtype": ("dtype", "float32"), "shape": ("shape", REQUIRED),
                   "container": ("str", ""), "shared_name": ("str", ""), "trainable": ("bool", True),
                   "mirror_of": ("str", "")},
            group=STATE, stateful=True, cost=_free, resource="variable")


def _assign_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    ref, val = ins
    if len(ref.shape) != len(val.shape) or not all(dims_equal(a, b) for a, b in zip(ref.shape, val.shape)):
        raise InferError(f"cannot assign shape {val.shape} to a variable of shape {ref.shape}")
    if ref.dtype != val.dtype:
        raise InferError(f"cannot assign {val.dtype} to a {ref.dtype} variable")
    return [ref]


for _op in ("Assign", "AssignAdd", "AssignSub"):
    register_op(_op, _assign_infer, num_inputs=2, group=STATE, stateful=True, cost=movement_cost,
                differentiable=False, resource="variable_input",
                ref_inputs=(0,))


def placeholder(dtype: Any = "float32", shape: Any = (), name: str | None = None) -> Tensor:
    g = graph_of()
    return make1("Placeholder", [], {"dtype": as_dtype(dtype), "shape": shape}, name=name or "Placeholder",
                 graph=g)


def variable(initial_value: Any, name: str | None = None, dtype: Any = None, trainable: bool = True,
             container: str = "", shared_name: str = "") -> Tensor:
    """A Variable node plus its initializer, an Assign named `<name>/init` (run by
    `global_variables_initializer`). `initial_value` is a Tensor (e.g. a random op) or an array."""
    g = graph_of(initial_value)
    init = initial_value
    if not isinstance(init, Tensor):
        arr = np.asarray(init) if dtype is None else np.asarray(init, dtype=np_dtype(as_dtype(dtype)))
        first = arr.reshape(-1)[0] if arr.size else None
        if arr.size > 1 and arr.dtype.kind in "iuf" and float(first) == first and bool((arr == first).all()):
            # A uniform value (an optimizer slot's zeros, a bias's ones) is a Fill, not megabytes
            # of the same number in the graph (lstm_lm's graph.json with Adam: 211 MB).
            init = make1("Fill", [], {"shape": arr.shape, "value": float(first), "dtype": as_dtype(arr.dtype)},
                         name=(name or "Variable") + "/initial_value", graph=g)
        else:
            init = constant(arr, dtype=dtype, graph=g)
    dt = as_dtype(dtype) if dtype is not None else init.dtype
    if dt != init.dtype:
        raise InferError(f"variable {name!r}: initial value is {init.dtype}, not {dt}")
    if any(d is None for d in init.shape):
        raise InferError(f"variable {name!r}: initial value has unknown dimensions {init.shape}")
    v = make1("Variable", [], {"dtype": dt, "shape": init.shape, "trainable": trainable and is_float(dt),
                               "container": container, "shared_name": shared_name},
              name=name or "Variable", graph=g)
    with g.colocate_with(v):
        make1("Assign", [v, init], name=g.relative_name(v.node) + "/init", graph=g)
    return v


def assign(ref: Tensor, value: Any, name: str | None = None) -> Tensor:
    return make1("Assign", [ref, convert(value, ref.graph, ref.dtype)], name=name)


def assign_add(ref: Tensor, value: Any, name: str | None = None) -> Tensor:
    return make1("AssignAdd", [ref, convert(value, ref.graph, ref.dtype)], name=name)


def assign_sub(ref: Tensor, value: Any, name: str | None = None) -> Tensor:
    return make1("AssignSub", [ref, convert(value, ref.graph, ref.dtype)], name=name)


def variables(graph: Any = None, trainable_only: bool = False) -> list[Tensor]:
    g = graph or graph_of()
    return [Tensor(g, n.name, 0) for n in g.nodes.values()
            if n.op == "Variable" and (n.attrs["trainable"] or not trainable_only)]


def trainable_variables(graph: Any = None) -> list[Tensor]:
    return variables(graph, trainable_only=True)


def global_variables_initializer(graph: Any = None, name: str = "init") -> Tensor:
    from flowctl.engine.ops.control import group

    g = graph or graph_of()
    inits = [g.nodes[v.node + "/init"] for v in variables(g) if v.node + "/init" in g.nodes]
    return group([Tensor(g, n.name, 0) for n in inits], name=name, graph=g)
