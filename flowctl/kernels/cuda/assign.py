"""Assign on a GPU: into the variable's array where nothing else can see it (as AssignAdd and the
updates already write), so a step that assigns -- Adam's beta powers, a moving average -- keeps
every variable's address and can be captured as a CUDA graph. Where the step's guard flag says
the step was not finite, the variable keeps its value. Elsewhere (the array shared, another shape
or dtype) the generic kernel replaces the array, as on a CPU."""
from __future__ import annotations

from typing import Any, Callable

from flowctl.kernels.cuda.kernels import guarded
from flowctl.kernels.registry import KERNELS, kernel
from flowctl.kernels.state import _resident, updatable_in_place


@kernel("Assign", ["gpu"])
def assign_gpu(xp: Any, attrs: dict[str, Any]) -> Callable[[Any], Any]:
    slot = attrs["_resource"]
    generic = guarded(xp, attrs, KERNELS[("Assign", "cpu")](xp, attrs))
    guard = attrs.get("_guard")
    flag = guard.flag(xp) if guard is not None else None

    def run(value: Any) -> Any:
        _resident(xp, slot)
        if slot.value is None or not updatable_in_place(slot):
            return generic(value)
        v = slot.value
        if getattr(value, "shape", None) != v.shape or getattr(value, "dtype", None) != v.dtype or value is v:
            return generic(value)
        if flag is None:
            xp.copyto(v, value)
        else:
            keep = (flag != 0).reshape((1,) * v.ndim if v.ndim else ())
            xp.copyto(v, value, where=keep)
        return v

    return run

