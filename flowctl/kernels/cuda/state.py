"""State writes on a GPU (issue 30): the updates (`ApplyGradientDescent`, `ApplyMomentum`,
`ApplyAdam`, `SparseApplyGradientDescent`), the assignments (`Assign`, `AssignAdd`, `AssignSub`),
`CheckNumerics` and the sparse rows (`GatherGradRows`), each run by one of our kernels
(`kernels.py`).

- Each writes into the variable's array in place where nothing else can see it (so a captured
  step keeps every variable's address), the generic in-place path's operations in its order (the
  same bits), and leaves the variable as it was where the step's guard flag (`StepGuard`: set by
  the loss's CheckNumerics, or fp16's GuardFlag) is 0. Elsewhere (the array shared, another shape
  or dtype) the generic kernel runs, its new arrays selected against the old ones by the flag
  (`guarded`).
- `MultiApplyGradientDescent`, `MultiApplyMomentum`, `MultiApplyAdam` (engine/multi_apply.py):
  the updates of many variables in one launch per K of them (below).
- `CheckNumerics`: under a capture, a kernel that lowers the guard flag instead of raising (never
  raises it again: the host resets it).
- `GatherGradRows`: fixed-size outputs (no `unique`, whose size needs a host read): the indices
  sorted, each run's rows summed in order at the run's first position, zeros elsewhere."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from flowctl.kernels.cuda.kernels import (THREADS, _dummy, _flag, _flat, _go, _is_array, _is_scalar, _kernels,
                                          _launch, _scalar_arg)
from flowctl.kernels.registry import KERNELS, StepGuard, kernel
from flowctl.kernels.state import _resident, check_numerics, dtype_of, updatable_in_place
from flowctl.kernels.training import (_alone, apply_adam, apply_gradient_descent, apply_momentum,
                                      per_variable_attrs, sparse_apply_gradient_descent)

Fn = Callable[..., Any]


# -------------------------------------------------------------------------------- guarded updates
# Each runs in place only where the generic kernel would (the slot's array alone, the shapes and
# dtypes as its in-place path requires) and the variable is float32; otherwise it calls the generic
# kernel, which makes a new array as before (a step that does so is not capturable anyway).
def _update_ok(var: Any, grad: Any, scalar: Any) -> bool:
    return str(var.dtype) == "float32" and grad.shape == var.shape and grad.dtype == var.dtype \
        and np.result_type(dtype_of(grad), dtype_of(scalar)) == var.dtype


@kernel("ApplyGradientDescent", ["gpu"])
def apply_gradient_descent_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    slot = attrs["_resource"]
    generic = guarded(xp, attrs, apply_gradient_descent(xp, attrs))
    dummy = _dummy(xp)
    flag = _flag(xp, attrs)
    k = _kernels()

    def run(alpha: Any, delta: Any) -> Any:
        _resident(xp, slot)
        if not (updatable_in_place(slot) and _update_ok(slot.value, delta, alpha)):
            return generic(alpha, delta)
        var = slot.value
        a = _scalar_arg(xp, alpha, var.dtype, dummy)
        if a is None:
            del var
            return generic(alpha, delta)
        _launch(xp, k.sgd, int(var.size), var.reshape(-1), _flat(xp, delta), *a, flag, int(var.size))
        return var

    return run


@kernel("ApplyMomentum", ["gpu"])
def apply_momentum_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    slots = attrs["_resource"]
    generic = guarded(xp, attrs, apply_momentum(xp, attrs))
    m, nesterov = np.float32(attrs["momentum"]), bool(attrs["nesterov"])
    dummy = _dummy(xp)
    flag = _flag(xp, attrs)
    k = _kernels()

    def run(lr: Any, grad: Any) -> Any:
        if not (_alone(xp, slots) and _update_ok(slots[0].value, grad, lr)
                and slots[1].value.shape == slots[0].value.shape and slots[1].value.dtype == slots[0].value.dtype):
            return generic(lr, grad)
        var, accum = slots[0].value, slots[1].value
        a = _scalar_arg(xp, lr, var.dtype, dummy)
        if a is None:
            del var, accum
            return generic(lr, grad)
        _launch(xp, k.momentum, int(var.size), var.reshape(-1), accum.reshape(-1), _flat(xp, grad), *a, m, nesterov,
                flag, int(var.size))
        return var

    return run


@kernel("ApplyAdam", ["gpu"])
def apply_adam_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    slots = attrs["_resource"]
    generic = guarded(xp, attrs, apply_adam(xp, attrs))
    consts = tuple(np.float32(c) for c in (attrs["beta1"], 1.0 - attrs["beta1"], attrs["beta2"],
                                           1.0 - attrs["beta2"], attrs["epsilon"]))
    dummy = _dummy(xp)
    flag = _flag(xp, attrs)
    k = _kernels()

    def run(lr_t: Any, grad: Any) -> Any:
        if not (_alone(xp, slots) and _update_ok(slots[0].value, grad, lr_t)
                and all(s.value.shape == slots[0].value.shape and s.value.dtype == slots[0].value.dtype
                        for s in slots[1:])):
            return generic(lr_t, grad)
        var, m, v = (s.value for s in slots)
        a = _scalar_arg(xp, lr_t, var.dtype, dummy)
        if a is None:
            del var, m, v
            return generic(lr_t, grad)
        _launch(xp, k.adam, int(var.size), var.reshape(-1), m.reshape(-1), v.reshape(-1), _flat(xp, grad), *a,
                *consts, flag, int(var.size))
        return var

    return run


# -------------------------------------------------------------------------------- multi-tensor updates
# How one launch reaches many tensors. A numba-cuda kernel cannot read a table of raw pointers, so
# the variables of one launch arrive as tuples of arrays (numba flattens each array into its
# parameters; cupy arrays type through __cuda_array_interface__, numpy's in the simulator, so CI
# runs the same kernel): at most K variables per launch, because a launch's parameters must fit in
# 4 KiB and each 1-D array takes 56 bytes (SGD 3 arrays per variable, momentum 4, Adam 5). A chunk
# shorter than K is padded with empty arrays, so each kernel compiles once. The other options were
# worse here: a packed buffer (variables and slots moved into one contiguous array at the first
# step) fixes their side but not the gradients, new arrays every step, which would each need a
# copy into it (a launch per variable again); a pointer table needs a CUDA C kernel the simulator
# cannot run. The variables are sorted by size (largest first) before chunking, so a launch's
# grid (blockIdx.y the variable, x a grid-stride loop over its elements, sized by the chunk's
# largest) idles few blocks. Inception-v3's ~380 momentum updates are 24 launches, lstm_lm's Adam
# a handful.
#
# Each variable takes the fast path only where its per-variable GPU kernel would write in place
# (the same checks) with a one-value float32 device step size; any other runs that per-variable
# kernel, bound at plan time with the node's attributes and guard, so the node is, variable by
# variable, what the per-variable nodes were.
_CHUNK = {"MultiApplyGradientDescent": 16, "MultiApplyMomentum": 16, "MultiApplyAdam": 12}
_MAX_BLOCKS_X = 1024  # per variable of a launch; more elements are reached by the grid-stride loop


def _in_place(xp: Any, slots: tuple[Any, ...], grad: Any, alpha: Any) -> bool:
    """Would the per-variable GPU kernel write in place, with `alpha` a float32 device value?"""
    if not _alone(xp, slots):  # asked before any local name holds an array
        return False
    var = slots[0].value
    return (_update_ok(var, grad, alpha) and _is_array(xp, alpha) and alpha.size == 1
            and alpha.dtype == var.dtype
            and all(s.value.shape == var.shape and s.value.dtype == var.dtype for s in slots[1:]))


def _multi_gpu(op: str, single: Fn) -> Fn:
    def factory(xp: Any, attrs: dict[str, Any]) -> Fn:
        per = per_variable_attrs(op, attrs)
        fns = [single(xp, a) for a in per]  # each variable's own kernel, for those the launch leaves
        slots = [a["_resource"] if isinstance(a["_resource"], tuple) else (a["_resource"],) for a in per]
        n, width = len(per), len(slots[0]) if slots else 1
        flag = _flag(xp, attrs)
        empty, one = xp.zeros(0, dtype="float32"), xp.zeros(1, dtype="float32")
        chunk = _CHUNK[op]
        k = _kernels()
        if op == "MultiApplyGradientDescent":
            kern, extra = k.multi_sgd, ()
        elif op == "MultiApplyMomentum":
            kern, extra = k.multi_momentum, (np.float32(attrs["momentum"]), bool(attrs["nesterov"]))
        else:
            kern, extra = k.multi_adam, tuple(np.float32(c) for c in (
                attrs["beta1"], 1.0 - attrs["beta1"], attrs["beta2"], 1.0 - attrs["beta2"], attrs["epsilon"]))
        simulated = getattr(xp, "simulated", False)

        def run(*args: Any) -> None:
            alphas, grads = args[:n], args[n:]
            fast = []
            for j in range(n):
                if _in_place(xp, slots[j], grads[j], alphas[j]):
                    fast.append(j)
                else:
                    fns[j](alphas[j], grads[j])
            fast.sort(key=lambda j: -int(slots[j][0].value.size))
            for c in range(0, len(fast), chunk):
                part = fast[c:c + chunk]
                # padded to K on a GPU (one compilation); not in the simulator, where an empty block
                # still costs a Python thread per CUDA thread
                pad = 0 if simulated else chunk - len(part)
                cols = [tuple(slots[j][w].value.reshape(-1) for j in part) + (empty,) * pad for w in range(width)]
                g = tuple(_flat(xp, grads[j]) for j in part) + (empty,) * pad
                a = tuple(alphas[j].reshape(1) for j in part) + (one,) * pad
                biggest = int(cols[0][0].size)
                threads = max(1, min(THREADS, biggest)) if simulated else THREADS
                grid = (max(1, min(_MAX_BLOCKS_X, -(-biggest // threads))), len(part) + pad)
                _go(xp, kern, grid, threads, *cols, g, a, *extra, flag)
                del cols, g, a

        return run

    kernel(op, ["gpu"])(factory)
    return factory


multi_apply_gradient_descent_gpu = _multi_gpu("MultiApplyGradientDescent", apply_gradient_descent_gpu)
multi_apply_momentum_gpu = _multi_gpu("MultiApplyMomentum", apply_momentum_gpu)
multi_apply_adam_gpu = _multi_gpu("MultiApplyAdam", apply_adam_gpu)


def guarded(xp: Any, attrs: dict[str, Any], generic: Fn) -> Fn:
    """A state write's generic kernel that honours the step's guard flag, for the cases the
    in-place kernels hand to it (the array seen elsewhere, another dtype): the old arrays are held
    across the call -- so the generic kernel makes new ones rather than writing in place -- and
    each variable then gets, element by element, its new value where the flag is 1 and its old one
    where it is 0 (fp16's skipped step, engine/mixed_precision.py). Without a guard: `generic`."""
    guard = attrs.get("_guard")
    if guard is None:
        return generic
    flag = guard.flag(xp)
    res = attrs["_resource"]
    slots = res if isinstance(res, tuple) else (res,)

    def run(*args: Any) -> Any:
        before = [s.value for s in slots]
        out = generic(*args)
        keep = flag != 0
        for s, old in zip(slots, before):
            new = s.value
            if new is not old and old is not None and getattr(new, "shape", None) == old.shape:
                s.value = xp.where(keep.reshape((1,) * new.ndim if new.ndim else ()), new, old)
                if out is new:
                    out = s.value
        return out

    return run


def _assign_gpu(xp: Any, attrs: dict[str, Any], generic: Fn, sub: bool) -> Fn:
    slot = attrs["_resource"]
    flag = _flag(xp, attrs)
    k = _kernels()

    def run(value: Any) -> Any:
        _resident(xp, slot)
        alone = updatable_in_place(slot)  # asked before any local name holds the array
        cur = slot.value
        if not alone or np.result_type(cur.dtype, dtype_of(value)) != cur.dtype or cur.dtype.kind not in "fiu":
            del cur
            return generic(value)
        n = int(cur.size)
        if _is_array(xp, value) and value.shape == cur.shape:
            _launch(xp, k.assign_arr, n, cur.reshape(-1), _flat(xp, value), False, sub, flag, n)
        elif _is_array(xp, value) and value.size == 1 and np.broadcast_shapes(cur.shape, value.shape) == cur.shape:
            _launch(xp, k.assign_arr, n, cur.reshape(-1), value.reshape(1), True, sub, flag, n)
        elif _is_scalar(value):
            _launch(xp, k.assign_val, n, cur.reshape(-1), cur.dtype.type(value), sub, flag, n)
        else:
            del cur
            return generic(value)
        return cur

    return run


@kernel("AssignAdd", ["gpu"])
def assign_add_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    from flowctl.kernels.state import assign_add

    return _assign_gpu(xp, attrs, guarded(xp, attrs, assign_add(xp, attrs)), sub=False)


@kernel("AssignSub", ["gpu"])
def assign_sub_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    from flowctl.kernels.state import assign_sub

    return _assign_gpu(xp, attrs, guarded(xp, attrs, assign_sub(xp, attrs)), sub=True)


# -------------------------------------------------------------------------------- CheckNumerics
_EXPONENT = {2: np.uint16(0x7C00), 4: np.uint32(0x7F800000), 8: np.uint64(0x7FF0000000000000)}


@kernel("CheckNumerics", ["gpu"])
def check_numerics_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    generic = check_numerics(xp, attrs)
    guard = attrs.get("_guard")
    flag = guard.flag(xp) if isinstance(guard, StepGuard) else None
    k = _kernels()

    def run(x: Any) -> Any:
        # The flag only ever goes down here (sticky): once a step trips it, later steps skip their
        # updates until the host, reading it (perhaps one step late), resets it (StepGuard.reset).
        if xp.is_capturing():  # no host read, no raise: the flag says it, the updates read it
            if flag is not None:
                dt = np.dtype(x.dtype)
                if dt.kind == "f" and dt.itemsize in _EXPONENT:
                    bits = _flat(xp, x).view(f"uint{8 * dt.itemsize}")
                    _launch(xp, k.finite_flag, int(x.size), bits, _EXPONENT[dt.itemsize], flag, int(x.size))
            return x
        return generic(x)  # raises FloatingPointError where x is not finite

    return run


# -------------------------------------------------------------------------------- sparse rows
def _sorted_rows(xp: Any, k: Any, dy: Any, indices: Any, like: Any) -> tuple[Any, Any]:
    n = int(indices.size)
    inner = 1
    for d in like.shape[1:]:
        inner *= int(d)
    idx = _flat(xp, indices)
    # float16 sums as numpy sums it: in float32, rounded once
    half = np.dtype(dy.dtype) == np.float16
    d2 = xp.ascontiguousarray(dy).reshape(n, inner)
    if half:
        d2 = d2.astype("float32")
    order = xp.empty(n, dtype="int64")
    ids = xp.empty(n, dtype="int64")
    rows = xp.empty((n, inner), dtype=d2.dtype)
    _launch(xp, k.rank_sort, n, idx, n, int(like.shape[0]), order, ids)
    _launch(xp, k.segment_rows, n * inner, d2, order, ids, rows, n, inner, np.dtype(d2.dtype).type(0))
    if half:
        rows = rows.astype("float16")
    return ids, rows.reshape((n, *like.shape[1:]))


@kernel("GatherGradRows", ["gpu"])
def gather_grad_rows_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    """Fixed-size outputs, so a captured step never needs `unique`'s size on the host: ids are all n
    indices sorted (stable, negative ones counted from the end), rows[p] the sum in that order of
    the dy rows of the run of equal ids starting at p, where p is its first position, and 0 at
    every other position. A one-pass rank sort (each index's rank among (id, position) pairs,
    n^2 / threads comparisons: for the few thousand indices of a batch) and one segment sum, no
    atomics, so the sums' order and bits are fixed."""
    k = _kernels()

    def run(dy: Any, indices: Any, like: Any) -> tuple[Any, Any]:
        return _sorted_rows(xp, k, dy, indices, like)

    return run


@kernel("SparseApplyGradientDescent", ["gpu"])
def sparse_apply_gradient_descent_gpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    """var[ids] -= rows * alpha, one thread per element of rows; a position whose id equals the one
    before it (the zero rows GatherGradRows' GPU kernel leaves after a run's first) writes nothing,
    so duplicates neither race nor change a bit. Out of place (a copy, then the same kernel) where
    the variable's array is seen elsewhere, as the generic kernel does."""
    slot = attrs["_resource"]
    generic = guarded(xp, attrs, sparse_apply_gradient_descent(xp, attrs))
    dummy = _dummy(xp)
    flag = _flag(xp, attrs)
    k = _kernels()

    def update(var: Any, alpha: Any, ids: Any, rows: Any) -> bool:
        inner = int(var.size // max(1, var.shape[0]))
        a = _scalar_arg(xp, alpha, var.dtype, dummy)
        if a is None:
            return False
        n = int(ids.size)
        _launch(xp, k.sparse_sgd, n * inner, var.reshape(var.shape[0], inner), _flat(xp, ids),
                xp.ascontiguousarray(rows).reshape(n, inner), *a, flag, n, inner, int(var.shape[0]))
        return True

    def run(alpha: Any, ids: Any, rows: Any) -> Any:
        _resident(xp, slot)
        alone = updatable_in_place(slot)
        var = slot.value
        if str(var.dtype) != "float32" or rows.dtype != var.dtype or rows.shape[1:] != var.shape[1:] \
                or np.result_type(rows.dtype, dtype_of(alpha)) != var.dtype or var.ndim == 0:
            del var
            return generic(alpha, ids, rows)
        if not alone:
            var = xp.array(var, copy=True)
        if not update(var, alpha, ids, rows):
            del var
            return generic(alpha, ids, rows)
        slot.value = var
        return var

    return run



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

