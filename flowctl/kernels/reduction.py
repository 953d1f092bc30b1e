"""Reduction kernels, written once against the array module `xp` (numpy or cupy).

numpy returns a bare scalar (np.float32, not a 0-d array) when every axis is reduced without
keepdims; the kernels wrap results in `xp.asarray` so every node output is an array (CheckNumerics
and the byte accounting look at arrays only).
"""
from __future__ import annotations

import warnings
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
    import numpy as np

    axes_for, keep = _axes_for(attrs), attrs["keepdims"]

    # x.mean divides by the count of the array it is given, so a None batch dim needs nothing extra;
    # for float16 numpy already accumulates in float32.
    def run(x: Any) -> Any:
        if x.size == 0 and xp is np:  # 0/0: NaN, without numpy's "mean of empty slice" warning
            with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                return xp.asarray(x.mean(axis=axes_for(x.ndim), keepdims=keep))
        return xp.asarray(x.mean(axis=axes_for(x.ndim), keepdims=keep))

    return run


def _identity(dtype: Any, largest: bool) -> Any:
    """The identity of Min (`largest`) or Max for `dtype`: +-inf, the integer limits, True/False."""
    import numpy as np

    if dtype.kind == "f":
        return np.inf if largest else -np.inf
    if dtype.kind == "b":
        return largest
    info = np.iinfo(dtype)
    return info.max if largest else info.min


def _extremum(xp: Any, attrs: dict[str, Any], method: str, largest: bool) -> Fn:
    axes_for, keep = _axes_for(attrs), attrs["keepdims"]

    def run(x: Any) -> Any:
        ax = axes_for(x.ndim)
        if x.size == 0:  # numpy and cupy refuse; the answer is the identity, in the reduced shape
            kshape, _ = _keep_shape(tuple(x.shape), ax)
            red = set(range(x.ndim)) if ax is None else set(ax)
            shape = kshape if keep else tuple(d for i, d in enumerate(x.shape) if i not in red)
            return xp.full(shape, _identity(x.dtype, largest), dtype=x.dtype)
        return xp.asarray(getattr(x, method)(axis=ax, keepdims=keep))

    return run


@kernel("Max")
def max_(xp: Any, attrs: dict[str, Any]) -> Fn:
    return _extremum(xp, attrs, "max", largest=False)


@kernel("Min")
def min_(xp: Any, attrs: dict[str, Any]) -> Fn:
    return _extremum(xp, attrs, "min", largest=True)


@kernel("Prod")
def prod(xp: Any, attrs: dict[str, Any]) -> Fn:
    axes_for, keep = _axes_for(attrs), attrs["keepdims"]
    f16 = xp.dtype("float16")

    def run(x: Any) -> Any:
        ax = axes_for(x.ndim)
        if x.dtype == f16:
            return xp.asarray(x.prod(axis=ax, dtype=xp.float32, keepdims=keep).astype(f16))
        return xp.asarray(x.prod(axis=ax, dtype=x.dtype, keepdims=keep))

    return run


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


@kernel("ReduceProdGrad")
def reduce_prod_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    axes_for = _axes_for(attrs)

    def run(dy: Any, x: Any) -> Any:
        shape = tuple(x.shape)
        ax = axes_for(x.ndim)
        red = sorted(set(range(x.ndim)) if ax is None else set(ax))
        kept = [i for i in range(x.ndim) if i not in red]
        kshape, n = _keep_shape(shape, ax)
        # The reduced axes moved last and flattened: each entry's partner product is the exclusive
        # cumulative product from the left times the one from the right (no division, so zeros work).
        flat = x.transpose(kept + red).reshape(tuple(shape[i] for i in kept) + (n,))
        ones = xp.ones(flat.shape[:-1] + (1,), dtype=x.dtype)
        left = xp.cumprod(xp.concatenate([ones, flat[..., :-1]], axis=-1), axis=-1)
        right = xp.flip(xp.cumprod(xp.concatenate([ones, xp.flip(flat, -1)[..., :-1]], axis=-1), axis=-1), -1)
        others = (left * right).reshape(tuple(shape[i] for i in kept) + tuple(shape[i] for i in red))
        others = others.transpose([(kept + red).index(i) for i in range(x.ndim)])
        return (others * dy.reshape(kshape)).astype(dy.dtype, copy=False)

    return run


@kernel("CumSum")
def cumsum(xp: Any, attrs: dict[str, Any]) -> Fn:
    axis, exclusive, reverse = attrs["axis"], attrs["exclusive"], attrs["reverse"]
    f16 = xp.dtype("float16")

    def run(x: Any) -> Any:
        ax = axis % x.ndim
        if reverse:
            x = xp.flip(x, ax)
        # dtype: numpy widens small integers to int64 (and half floats accumulate better in float32)
        out = xp.cumsum(x, axis=ax, dtype=xp.float32 if x.dtype == f16 else x.dtype).astype(x.dtype, copy=False)
        if exclusive:  # shift by one along the axis: the first entry is 0, the last sum drops off
            lead = [slice(None)] * x.ndim
            lead[ax] = slice(0, x.shape[ax] - 1)
            zero = list(x.shape)
            zero[ax] = min(1, x.shape[ax])
            out = xp.concatenate([xp.zeros(zero, dtype=x.dtype), out[tuple(lead)]], axis=ax)
        return xp.flip(out, ax) if reverse else out

    return run


def _descending_order(xp: Any, x: Any) -> Any:
    """Indices sorting each row of the last axis largest first, equal entries by ascending index:
    a stable ascending sort of the reversed row, read backwards."""
    n = x.shape[-1]
    order = xp.argsort(xp.flip(x, -1), axis=-1, kind="stable")
    return (n - 1) - xp.flip(order, -1)


@kernel("TopK")
def top_k(xp: Any, attrs: dict[str, Any]) -> Fn:
    k = attrs["k"]

    def run(x: Any) -> tuple[Any, Any]:
        idx = _descending_order(xp, x)[..., :k]
        return xp.take_along_axis(x, idx, axis=-1), idx.astype(xp.int32)

    return run


@kernel("TopKGrad")
def top_k_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    def run(dy: Any, indices: Any, x: Any) -> Any:
        n, k = x.shape[-1], indices.shape[-1]
        out = xp.zeros(x.shape, dtype=dy.dtype)
        rows = indices.size // k if k else 0
        # The indices of one row are distinct, so a plain assignment through flat positions is exact.
        flat = (indices.reshape(rows, k) + (xp.arange(rows) * n)[:, None]).reshape(-1)
        out.reshape(-1)[flat] = dy.reshape(-1)
        return out

    return run
