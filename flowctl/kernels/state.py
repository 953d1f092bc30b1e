"""Kernels for sources, state and utility ops. Resources (Container slots, random state) arrive
bound in `attrs["_resource"]`; they are duck-typed objects with a `.value` attribute."""
from __future__ import annotations

import sys
from typing import Any, Callable

import numpy as np

from flowctl.kernels import bf16
from flowctl.kernels.backend import cupy_or_none
from flowctl.kernels.registry import kernel

bf16.native("Const", ("cpu", "gpu"))  # its value, whatever its dtype
bf16.native("Placeholder", ("cpu", "gpu"))


@kernel("Const")
def const(xp: Any, attrs: dict[str, Any]) -> Callable[[], Any]:
    value = xp.asarray(attrs["value"])

    def run() -> Any:
        return value

    return run


@kernel("Placeholder")
def placeholder(xp: Any, attrs: dict[str, Any]) -> Callable[[], Any]:
    name = attrs.get("_node", "?")

    def run() -> Any:
        raise ValueError(f"placeholder '{name}' must be fed: pass a value for it in feeds")

    return run


def _resident(xp: Any, slot: Any) -> Any:
    """The slot's value on this kernel's device. A variable lives where its node is placed, but the
    store is shared by name between sessions (§4.7): one initialised or restored on the host and
    then read on a GPU, or the reverse, moves once, and the slot keeps the moved array."""
    v = slot.value
    if v is None:
        return v
    if xp is np:
        if not isinstance(v, (np.ndarray, np.generic)) and hasattr(v, "get"):  # a cupy array
            v = slot.value = v.get()
    elif isinstance(v, (np.ndarray, np.generic)):
        v = slot.value = xp.asarray(v)
    return v


def _held(slot: Any) -> int:
    v = slot.value
    return sys.getrefcount(v)


class _Probe:
    value: Any = None


def _alone() -> int:
    probe = _Probe()
    probe.value = np.empty(1)
    return _held(probe)


# The references a variable's array has when its slot is the only holder, as this interpreter
# counts them through `_held` (measured, not assumed: the count differs between Python versions).
_ALONE = _alone()


def _owns_buffer(v: Any) -> bool:
    """A numpy or cupy array that is not a view and may be written (a cupy array always may)."""
    if type(v) is np.ndarray or type(v).__module__ == "flowctl.kernels.ledger":  # (or the launch ledger's)
        return v.base is None and bool(v.flags.writeable)
    if type(v).__module__.startswith("cupy"):
        cp = cupy_or_none()
        return cp is not None and type(v) is cp.ndarray and v.base is None
    return False


def updatable_in_place(slot: Any) -> bool:
    """May an update write into the slot's array (numpy's or cupy's) instead of replacing it?
    Only when nothing else can see it: no fetched copy held by a caller, no reader of this step
    still waiting for it (the executor drops a value after its last reader; a copy off a GPU
    holds it until the copy is done), no view of it or its base, nor an array that is not its own
    (a Const's, a fed one, a read-only restored one). Otherwise the update makes a new array, so
    a value read before the update keeps its bits (§4.7). On a GPU a write in place also keeps the
    array's address, which a captured CUDA graph needs, and holds no second copy of the state."""
    v = slot.value
    if not _owns_buffer(v):
        return False
    del v
    return _held(slot) <= _ALONE


def dtype_of(x: Any) -> Any:
    """An array's or scalar's dtype for np.result_type, which would convert a cupy array to read it."""
    return getattr(x, "dtype", x)


def on_device(xp: Any, x: Any) -> Any:
    """An operand of an in-place update where its ufuncs take it: cupy's reject a host array (the
    expressions of the new-array path reach them through operator dispatch); numpy's as it is, so
    a Python float stays weakly typed."""
    return x if xp is np else xp.asarray(x)


@kernel("Variable")
def variable(xp: Any, attrs: dict[str, Any]) -> Callable[[], Any]:
    slot = attrs["_resource"]

    def run() -> Any:
        v = _resident(xp, slot)
        if v is None:
            raise ValueError(f"variable '{slot.name}' is uninitialized: run its initializer "
                             f"(global_variables_initializer) or restore a checkpoint first")
        return v

    return run


# Assignments replace the slot's array rather than writing into it, so a value fetched earlier
# never changes under the caller, and a read in the same step sees a consistent array; AssignAdd
# and AssignSub write into it only when nothing else can see it (`updatable_in_place`).
@kernel("Assign")
def assign(xp: Any, attrs: dict[str, Any]) -> Callable[[Any], Any]:
    slot = attrs["_resource"]

    def run(value: Any) -> Any:
        slot.value = value
        return value

    return run


def _assign_op(xp: Any, slot: Any, value: Any, op: Any) -> Any:
    _resident(xp, slot)
    alone = updatable_in_place(slot)  # asked before any local name holds the array
    current = slot.value
    if alone and np.result_type(current.dtype, dtype_of(value)) == current.dtype \
            and np.broadcast_shapes(current.shape, np.shape(value)) == current.shape:
        return op(current, on_device(xp, value), out=current)  # the same bits as op(current, value), no new array
    new = op(current, value)
    slot.value = new
    return new


@kernel("AssignAdd")
def assign_add(xp: Any, attrs: dict[str, Any]) -> Callable[[Any], Any]:
    slot = attrs["_resource"]
    return lambda value: _assign_op(xp, slot, value, xp.add)


@kernel("AssignSub")
def assign_sub(xp: Any, attrs: dict[str, Any]) -> Callable[[Any], Any]:
    slot = attrs["_resource"]
    return lambda value: _assign_op(xp, slot, value, xp.subtract)


@kernel("NoOp")
def no_op(xp: Any, attrs: dict[str, Any]) -> Callable[[], None]:
    return lambda: None


@kernel("Group")
def group(xp: Any, attrs: dict[str, Any]) -> Callable[..., None]:
    return lambda *xs: None


@kernel("Identity")
def identity(xp: Any, attrs: dict[str, Any]) -> Callable[[Any], Any]:
    return lambda x: x


@kernel("StopGradient")
def stop_gradient(xp: Any, attrs: dict[str, Any]) -> Callable[[Any], Any]:
    return lambda x: x


@kernel("CheckNumerics")
def check_numerics(xp: Any, attrs: dict[str, Any]) -> Callable[[Any], Any]:
    message = attrs.get("message") or "non-finite value"

    def run(x: Any) -> Any:
        if not bool(xp.isfinite(x).all()):
            n_nan = int(xp.isnan(x).sum())
            raise FloatingPointError(f"{message}: {n_nan} NaN and {int(x.size) - n_nan - int(xp.isfinite(x).sum())} "
                                     f"Inf of {x.size} values")
        return x

    return run


@kernel("GuardFlag")
def guard_flag(xp: Any, attrs: dict[str, Any]) -> Callable[[Any], Any]:
    """Its input; on a device whose state writes read the step's guard (attrs["_guard"]), the
    device flag set from it first (one launch: no host read, so a captured step can skip)."""
    guard = attrs.get("_guard")
    if guard is None:
        return lambda ok: ok
    flag = guard.flag(xp)

    def run(ok: Any) -> Any:
        xp.copyto(flag, ok.reshape(1), casting="unsafe")
        return ok

    return run
