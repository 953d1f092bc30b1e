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
