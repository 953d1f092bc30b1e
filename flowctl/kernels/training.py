"""Kernels for the training ops (L2Loss, ApplyGradientDescent), written once against `xp`."""
from __future__ import annotations

from typing import Any, Callable

from flowctl.kernels.registry import kernel
from flowctl.kernels.state import _resident

Fn = Callable[..., Any]

# Elements per dot product in L2Loss: BLAS sums a block in float32 (in a few dozen vector
# lanes), the blocks' sums add up in float64, so a norm over millions of values loses no more
# than a block's rounding (pairwise summation of t*t would need a [n] temporary).
_BLOCK = 1 << 16


@kernel("L2Loss")
def l2_loss(xp: Any, attrs: dict[str, Any]) -> Fn:
    def run(t: Any) -> Any:
        flat = t.reshape(-1)
        if flat.dtype.itemsize < 4:  # float16: the squares would overflow its range
            flat = flat.astype("float32")
        total = xp.zeros((), dtype="float64")
        for s in range(0, flat.size, _BLOCK):
            b = flat[s:s + _BLOCK]
            total += xp.dot(b, b)
        return (total * 0.5).astype(t.dtype)

    return run


@kernel("ApplyGradientDescent")
def apply_gradient_descent(xp: Any, attrs: dict[str, Any]) -> Fn:
    slot = attrs["_resource"]

    def run(alpha: Any, delta: Any) -> Any:
        # A new array, as AssignSub makes (§4.7: a value read before the update keeps its bits):
        # alpha * delta in it, then the subtraction in place, two passes and one buffer.
        new = xp.multiply(delta, alpha)
        xp.subtract(_resident(xp, slot), new, out=new)
        slot.value = new
        return new

    return run


def _flat_rows(dy: Any, indices: Any, like: Any) -> tuple[Any, Any]:
    """The indices as one non-negative vector (numpy's take counts a negative one from the end,
    so its adjoint must), and dy as one row per index."""
    idx = indices.reshape(-1)
    idx = idx + like.shape[0] * (idx < 0)
    inner = 1
    for d in like.shape[1:]:
        inner *= int(d)
    return idx, dy.reshape(idx.size, inner)


@kernel("GatherGradRows")
def gather_grad_rows(xp: Any, attrs: dict[str, Any]) -> Fn:
    add_at = getattr(xp.add, "at", None)
    if add_at is None:  # cupy before ufunc.at: cupyx.scatter_add is the same operation
        import cupyx  # type: ignore[import-not-found]

        add_at = cupyx.scatter_add

    def run(dy: Any, indices: Any, like: Any) -> tuple[Any, Any]:
        idx, d2 = _flat_rows(dy, indices, like)
        ids, inverse = xp.unique(idx, return_inverse=True)
        rows = xp.zeros((ids.size, d2.shape[1]), dtype=dy.dtype)
        add_at(rows, inverse.reshape(-1), d2)
        return ids.astype("int64"), rows.reshape((ids.size, *like.shape[1:]))

    return run


@kernel("GatherGradRows", device_types=("cpu",))
def gather_grad_rows_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    """Sort the indices and sum each run of equal ones with add.reduceat: GatherGrad's CPU kernel
    without the scatter into zeros, so the rows are its rows to the bit."""
    def run(dy: Any, indices: Any, like: Any) -> tuple[Any, Any]:
        idx, d2 = _flat_rows(dy, indices, like)
        if not idx.size:
            return xp.zeros(0, dtype="int64"), xp.zeros((0, *like.shape[1:]), dtype=dy.dtype)
        order = xp.argsort(idx, kind="stable")
        ids = idx[order]
        starts = xp.flatnonzero(xp.concatenate(([True], ids[1:] != ids[:-1])))
        rows = xp.add.reduceat(d2[order], starts, axis=0)
        return ids[starts].astype("int64"), rows.reshape((starts.size, *like.shape[1:]))

    return run


@kernel("SparseApplyGradientDescent")
def sparse_apply_gradient_descent(xp: Any, attrs: dict[str, Any]) -> Fn:
    slot = attrs["_resource"]

    def run(alpha: Any, ids: Any, rows: Any) -> Any:
        # A copy for the slot, as ApplyGradientDescent makes, then only the touched rows change.
        new = xp.array(_resident(xp, slot), copy=True)
        new[ids] -= rows * alpha
        slot.value = new
        return new

    return run
