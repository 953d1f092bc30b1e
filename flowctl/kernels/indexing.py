"""GatherND, ScatterND, GatherNDGrad and Range kernels, written once against `xp` (numpy or cupy)."""
from __future__ import annotations

import math
from typing import Any, Callable

from flowctl.kernels.array import add_at_into_zeros
from flowctl.kernels.registry import kernel

Fn = Callable[..., Any]


def _add_at(xp: Any) -> Fn:
    add_at = getattr(xp.add, "at", None)
    if add_at is None:  # cupy before ufunc.at: cupyx.scatter_add is the same operation
        import cupyx  # type: ignore[import-not-found]

        add_at = cupyx.scatter_add
    return add_at


def _checked(indices: Any, shape: tuple[int, ...], node: str) -> tuple[Any, ...]:
    """The index rows as a tuple of arrays, one per indexed axis. numpy would read a negative index
    from the end; TensorFlow refuses it, and so does this (an IndexError names the node)."""
    m = indices.shape[-1]
    if indices.size and (bool((indices < 0).any()) or any(bool((indices[..., i] >= shape[i]).any())
                                                        for i in range(m))):
        raise IndexError(f"{node}: an index in {indices.tolist() if indices.size <= 16 else 'indices'} "
                         f"is out of range for shape {tuple(shape[:m])}")
    return tuple(indices[..., i] for i in range(m))


@kernel("GatherND")
def gather_nd(xp: Any, attrs: dict[str, Any]) -> Fn:
    node = attrs.get("_node", "GatherND")
    return lambda params, indices: params[_checked(indices, params.shape, node)]


def _scatter(xp: Any, add_at: Fn, indices: Any, updates: Any, shape: tuple[int, ...], node: str) -> Any:
    # every dtype on cupy too (whose add.at refuses the narrow integers and bool): array.py
    return add_at_into_zeros(xp, add_at, shape, _checked(indices, shape, node), updates)


@kernel("ScatterND")
def scatter_nd(xp: Any, attrs: dict[str, Any]) -> Fn:
    shape, add_at, node = tuple(attrs["shape"]), _add_at(xp), attrs.get("_node", "ScatterND")
    return lambda indices, updates: _scatter(xp, add_at, indices, updates, shape, node)


@kernel("GatherNDGrad")
def gather_nd_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    add_at, node = _add_at(xp), attrs.get("_node", "GatherNDGrad")
    return lambda dy, indices, params: _scatter(xp, add_at, indices, dy, tuple(params.shape), node)


@kernel("Range")
def range_(xp: Any, attrs: dict[str, Any]) -> Fn:
    start, delta, dtype = attrs["start"], attrs["delta"], attrs["dtype"]
    n = max(0, math.ceil((attrs["limit"] - start) / delta))  # as inference counted it (delta is not 0)
    # start + i * delta for each i, in float64 and then cast: the length is the one inference gave.
    return lambda: (start + xp.arange(n, dtype=xp.float64) * delta).astype(dtype)
