"""Reduction kernels, written once against the array module `xp` (numpy or cupy).

numpy returns a bare scalar (np.float32, not a 0-d array) when every axis is reduced without
keepdims; the kernels wrap results in `xp.asarray` so every node output is an array (CheckNumerics
and the byte accounting look at arrays only).
"""
from __future__ import annotations

from typing import Any, Callable

from flowctl.kernels.registry import kernel

Fn = Callable[..., Any]
AxesFn = Callable[[int], "tuple[int, ...] | None"]


def _axes_for(attrs: dict[str, Any]) -> AxesFn:
    """rank -> the axes to hand numpy. The Python builders store axes sorted and non-negative, which
    numpy takes as is; a hand-written GraphDef may hold negative or repeated axes (numpy rejects
    (1, -1) on a matrix as a duplicate), so those are resolved against the actual rank."""
    axes = attrs["axis"]
    if axes is None or (all(a >= 0 for a in axes) and len(set(axes)) == len(axes)):
        return lambda ndim: axes
    return lambda ndim: tuple(sorted({a % ndim for a in axes}))


def _keep_shape(shape: tuple[int, ...], axes: tuple[int, ...] | None) -> tuple[tuple[int, ...], int]:
    """(keepdims shape, number of elements reduced into each output) for an input of `shape`."""
    red = set(range(len(shape))) if axes is None else set(axes)
    count = 1
    for i in red:
        count *= shape[i]
    return tuple(1 if i in red else d for i, d in enumerate(shape)), count


@kernel("Sum")
def sum_(xp: Any, attrs: dict[str, Any]) -> Fn:
    axes_for, keep = _axes_for(attrs), attrs["keepdims"]
    f16 = xp.dtype("float16")

    def run(x: Any) -> Any:
        ax = axes_for(x.ndim)
        if x.dtype == f16:  # accumulate half precision in float32, as TensorFlow does
            return xp.asarray(x.sum(axis=ax, dtype=xp.float32, keepdims=keep).astype(f16))
        # dtype=x.dtype: numpy would widen int32 sums to int64, but the shape function promised int32.
        return xp.asarray(x.sum(axis=ax, dtype=x.dtype, keepdims=keep))

    return run


@kernel("Mean")
def mean(xp: Any, attrs: dict[str, Any]) -> Fn:
    axes_for, keep = _axes_for(attrs), attrs["keepdims"]
    # x.mean divides by the count of the array it is given, so a None batch dim needs nothing extra;
    # for float16 numpy already accumulates in float32.
    return lambda x: xp.asarray(x.mean(axis=axes_for(x.ndim), keepdims=keep))


@kernel("Max")
def max_(xp: Any, attrs: dict[str, Any]) -> Fn:
    axes_for, keep = _axes_for(attrs), attrs["keepdims"]
    return lambda x: xp.asarray(x.max(axis=axes_for(x.ndim), keepdims=keep))


@kernel("ArgMax")
def argmax(xp: Any, attrs: dict[str, Any]) -> Fn:
    axis, out = attrs["axis"], attrs["output_type"]
    return lambda x: xp.asarray(xp.argmax(x, axis=axis)).astype(out, copy=False)


@kernel("ReduceGrad")
def reduce_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    axes_for, mean_ = _axes_for(attrs), attrs["mean"]
    cache: dict[tuple[int, ...], tuple[tuple[int, ...], int]] = {}

    def run(dy: Any, x: Any) -> Any:
        shape = tuple(x.shape)
        hit = cache.get(shape)
        if hit is None:
            hit = cache[shape] = _keep_shape(shape, axes_for(len(shape)))
        kshape, count = hit
        if mean_:
            dy = dy / count  # divide the small tensor before broadcasting, not the large one
        # A read-only broadcast view, as BroadcastLike returns: consumers never write their inputs.
        return xp.broadcast_to(dy.reshape(kshape), shape)

    return run


@kernel("ReduceMaxGrad")
def reduce_max_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    axes_for = _axes_for(attrs)

    def run(dy: Any, x: Any, y: Any) -> Any:
        ax = axes_for(x.ndim)
        kshape, _ = _keep_shape(tuple(x.shape), ax)
        hits = x == y.reshape(kshape)
        # k tied maxima share dy equally (TensorFlow's rule); the count is cast first because
        # float32 / int64 would promote the result to float64.
        ties = hits.sum(axis=ax, keepdims=True).astype(dy.dtype)
        return hits * (dy.reshape(kshape) / ties)

    return run
