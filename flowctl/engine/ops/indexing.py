"""Multi-dimensional indexing (TensorFlow's gather_nd / scatter_nd) and Range.

GatherND(params, indices): `indices` has shape [..., m]; each of its rows picks the slice
params[i_0, ..., i_{m-1}], so the output has shape indices.shape[:-1] + params.shape[m:].
ScatterND(indices, updates) is its adjoint: a zero tensor of the static `shape` with each update
added at its index (repeated indices add up, as in TensorFlow's scatter_nd). GatherNDGrad is the
same scatter into the run-time shape of params, so an unknown batch dimension still differentiates.
Out-of-range indices fail the step with the node's name.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from flowctl.engine.dtypes import INTS, as_dtype, is_float
from flowctl.engine.graph import Tensor
from flowctl.engine.ops.api import constant, convert, graph_of, make1
from flowctl.engine.opdef import MOVEMENT, REQUIRED, SOURCE, memory_bytes, register_op
from flowctl.engine.shapes import InferError, TensorSpec, dims_equal

__all__ = ["gather_nd", "scatter_nd", "range_"]


def _index_depth(indices: TensorSpec, what: str) -> int:
    if indices.dtype not in INTS:
        raise InferError(f"{what} indices must be integers, got {indices.dtype}")
    if not indices.shape or indices.shape[-1] is None:
        raise InferError(f"{what} indices need a known last dimension (the index depth), got {indices.shape}")
    return int(indices.shape[-1])


def _gather_nd_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    params, indices = ins
    m = _index_depth(indices, "GatherND")
    if m > len(params.shape):
        raise InferError(f"index depth {m} exceeds the rank of params {params.shape}")
    return [TensorSpec(tuple(indices.shape[:-1]) + tuple(params.shape[m:]), params.dtype)]


def _scatter_nd_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    indices, updates = ins
    shape = attrs["shape"]
    if shape is None or any(d is None or d < 0 for d in shape):
        raise InferError(f"ScatterND needs a fully known output shape, got {shape}")
    m = _index_depth(indices, "ScatterND")
    if m > len(shape):
        raise InferError(f"index depth {m} exceeds the rank of the output shape {shape}")
    want = tuple(indices.shape[:-1]) + tuple(shape[m:])
    if updates.dtype == "bool":
        raise InferError("ScatterND adds updates, so it needs numeric updates, got bool")
    if len(want) != len(updates.shape) or not all(dims_equal(a, b) for a, b in zip(want, updates.shape)):
        raise InferError(f"updates have shape {updates.shape}; indices {indices.shape} into {shape} need {want}")
    return [TensorSpec(tuple(shape), updates.dtype)]


def _gather_nd_grad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    dy, indices, params = ins
    if not is_float(dy.dtype):
        raise InferError(f"GatherNDGrad needs a float dy, got {dy.dtype}")
    _gather_nd_infer([params, indices], attrs)
    return [TensorSpec(params.shape, dy.dtype)]


def _range_length(start: float, limit: float, delta: float) -> int:
    if delta == 0:
        raise InferError("Range's delta must not be 0")
    return max(0, math.ceil((limit - start) / delta))


def _range_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if attrs["dtype"] == "bool":
        raise InferError("Range makes numbers, not bool")
    return [TensorSpec((_range_length(attrs["start"], attrs["limit"], attrs["delta"]),), attrs["dtype"])]


def _scatter_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                  attrs: dict[str, Any]) -> tuple[float, float]:
    """One add per update element; the output is zeroed first."""
    n = int(np.prod(ins[1] if len(ins) == 2 else ins[0]))
    return float(n), memory_bytes(ins, outs, dtypes)


def _g_gather_nd(op: Any, dy: list[Tensor]) -> list[Tensor | None]:
    params, indices = op.inputs
    return [make1("GatherNDGrad", [dy[0], indices, params], name="gather_nd_grad"), None]


def _g_gather_nd_grad(op: Any, dy: list[Tensor]) -> list[Tensor | None]:
    # Linear in dy: its adjoint is the gather it came from.
    return [gather_nd(dy[0], op.inputs[1]), None, None]


def _g_scatter_nd(op: Any, dy: list[Tensor]) -> list[Tensor | None]:
    return [None, gather_nd(dy[0], op.inputs[0])]


register_op("GatherND", _gather_nd_infer, num_inputs=2, grad=_g_gather_nd, cost=_scatter_cost, group=MOVEMENT)
register_op("GatherNDGrad", _gather_nd_grad_infer, num_inputs=3, grad=_g_gather_nd_grad, cost=_scatter_cost,
            group=MOVEMENT)
register_op("ScatterND", _scatter_nd_infer, num_inputs=2, attrs={"shape": ("shape", REQUIRED)},
            grad=_g_scatter_nd, cost=_scatter_cost, group=MOVEMENT)
# Range: start, start + delta, ... up to (not including) limit, as numpy.arange; attributes rather
# than tensors so the length is known when the node is added.
register_op("Range", _range_infer, num_inputs=0,
            attrs={"start": ("float", 0.0), "limit": ("float", REQUIRED), "delta": ("float", 1.0),
                   "dtype": ("dtype", "int32")},
            group=SOURCE, cost=lambda i, o, d, a: (float(np.prod(o[0])), memory_bytes(i, o, d)),
            differentiable=False)


# ---------------------------------------------------------------------------- Python API
def _indices(x: Any, like: Any) -> Tensor:
    if isinstance(x, Tensor):
        return x
    arr = np.asarray(x)
    return constant(arr if arr.dtype.kind in "iu" else arr.astype(np.int32), graph=graph_of(like, x))


def gather_nd(params: Any, indices: Any, name: str | None = None) -> Tensor:
    """params[indices[..., 0], ..., indices[..., m-1]] for each row of `indices` (shape [..., m])."""
    params = convert(params, graph_of(params, indices))
    return make1("GatherND", [params, _indices(indices, params)], name=name)


def scatter_nd(indices: Any, updates: Any, shape: Sequence[int], name: str | None = None) -> Tensor:
    """A zero tensor of `shape` with each row of `updates` added at its index (repeats add up)."""
    updates = convert(updates, graph_of(updates, indices))
    return make1("ScatterND", [_indices(indices, updates), updates], {"shape": tuple(int(d) for d in shape)},
                 name=name)


def range_(start: float, limit: float | None = None, delta: float = 1.0, dtype: Any = "int32",
           name: str | None = None) -> Tensor:
    """start, start + delta, ... below `limit` (range_(n) counts 0..n-1), as numpy.arange."""
    if limit is None:
        start, limit = 0.0, start
    return make1("Range", [], {"start": float(start), "limit": float(limit), "delta": float(delta),
                               "dtype": as_dtype(dtype)}, name=name or "Range", graph=graph_of())
