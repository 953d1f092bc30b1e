"""Building blocks for the Python API: turning values into Const nodes and adding nodes, and
Tensor's operators (`a + b`), installed here because the graph imports no op."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from flowctl.engine.dtypes import as_dtype
from flowctl.engine.graph import Graph, Tensor, default_graph


def graph_of(*xs: Any) -> Graph:
    for x in xs:
        if isinstance(x, Tensor):
            return x.graph
        if isinstance(x, (list, tuple)):
            for y in x:
                if isinstance(y, Tensor):
                    return y.graph
    return default_graph()


def constant(value: Any, dtype: Any = None, name: str | None = None, graph: Graph | None = None) -> Tensor:
    g = graph or default_graph()
    arr = np.asarray(value)
    if dtype is not None:
        arr = arr.astype(as_dtype(dtype))
    elif not isinstance(value, (np.ndarray, np.generic)):
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        elif arr.dtype == np.int64:
            arr = arr.astype(np.int32)
    node = g.add_node("Const", [], {"value": arr}, name=name or "Const")
    return Tensor(g, node.name, 0)


def convert(x: Any, graph: Graph, dtype: str | None = None) -> Tensor:
    """A Tensor as is; anything else becomes a Const of `dtype` (the other operand's dtype)."""
    if isinstance(x, Tensor):
        return x
    return constant(x, dtype=dtype, graph=graph)


def make(op: str, inputs: Sequence[Any] = (), attrs: dict[str, Any] | None = None,
         name: str | None = None, graph: Graph | None = None, **kw: Any) -> list[Tensor]:
    g = graph or graph_of(*inputs)
    dtype = next((x.dtype for x in inputs if isinstance(x, Tensor)), None)
    tensors = [convert(x, g, dtype) for x in inputs]
    node = g.add_node(op, tensors, attrs, name=name, **kw)
    return [Tensor(g, node.name, i) for i in range(len(node.outputs))]


def make1(op: str, inputs: Sequence[Any] = (), attrs: dict[str, Any] | None = None,
          name: str | None = None, graph: Graph | None = None, **kw: Any) -> Tensor:
    out = make(op, inputs, attrs, name, graph, **kw)
    return out[0]


def make_op(op: str, inputs: Sequence[Any] = (), attrs: dict[str, Any] | None = None,
            name: str | None = None, graph: Graph | None = None, **kw: Any) -> Tensor:
    """For ops with no outputs (NoOp, Group): a handle whose `.node` names the op, usable as a
    fetch target or a control input."""
    g = graph or graph_of(*inputs)
    node = g.add_node(op, [convert(x, g) for x in inputs], attrs, name=name, **kw)
    return Tensor(g, node.name, 0)


def binary(op: str, a: Any, b: Any, name: str | None = None) -> Tensor:
    return make1(op, [a, b], name=name)


def unary(op: str, x: Any, name: str | None = None) -> Tensor:
    return make1(op, [x], name=name)


def _operator(op: str, reverse: bool) -> Callable[[Tensor, Any], Tensor]:
    def method(self: Tensor, other: Any) -> Tensor:
        return binary(op, other, self) if reverse else binary(op, self, other)
    return method


# Tensor.OPERATORS -> (the op it builds, whether the Tensor is the right operand)
_OPERATORS = {"__add__": ("Add", False), "__radd__": ("Add", True), "__sub__": ("Sub", False),
              "__rsub__": ("Sub", True), "__mul__": ("Mul", False), "__rmul__": ("Mul", True),
              "__truediv__": ("Div", False), "__rtruediv__": ("Div", True), "__floordiv__": ("FloorDiv", False),
              "__rfloordiv__": ("FloorDiv", True), "__mod__": ("FloorMod", False), "__rmod__": ("FloorMod", True),
              "__pow__": ("Pow", False),
              "__matmul__": ("MatMul", False)}
for _name in Tensor.OPERATORS:
    if _name == "__neg__":
        Tensor._override_operator(_name, lambda self: unary("Neg", self))
    else:
        Tensor._override_operator(_name, _operator(*_OPERATORS[_name]))
