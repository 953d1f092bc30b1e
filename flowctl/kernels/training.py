"""Kernels for the training ops (L2Loss, the fused optimizer updates, the sparse embedding path),
written once against `xp`."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from flowctl.kernels import intra
from flowctl.kernels.array import run_sums
from flowctl.kernels.registry import kernel
from flowctl.kernels.state import _resident, dtype_of, on_device, updatable_in_place

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
        starts = range(0, flat.size, _BLOCK)
        # the blocks' dot products on the intra-op threads, added up here in block order: the bits
        # of one thread's loop whatever the thread count
        dots = intra.for_chunks(len(starts), lambda run: [xp.dot(flat[s:s + _BLOCK], flat[s:s + _BLOCK])
                                                          for s in starts[run.start:run.stop]],
                                xp=xp, least=PARALLEL_RUNS)
        total = xp.zeros((), dtype="float64")
        for part in dots:
            for d in part:
                total += d
        return (total * 0.5).astype(t.dtype)

    return run


# In-place updates go through the parameter in runs of this many values, the step times the
# gradient held in a scratch buffer between its two passes: cache-sized on a CPU; on a GPU, runs
# long enough that each op is one launch for most parameters (16 MiB of float32 scratch).
_RUN = 1 << 16
_GPU_RUN = 1 << 22


def _run_length(xp: Any) -> int:
    return _RUN if xp is np else _GPU_RUN


def _runs(size: int, xp: Any = np) -> list[slice]:
    n = _run_length(xp)
    return [slice(s, min(size, s + n)) for s in range(0, size, n)]


# On the CPU, an update of at least this many runs (2 MiB of float32) -- and L2Loss over as many
# blocks -- goes to the intra-op threads in contiguous groups of runs, each group with scratch of
# its own. Every element's arithmetic is the same whichever group does it, so the bits are one
# thread's. Measured, 2 threads, a 2-core AMD EPYC (memory-bound: two cores are not twice one):
# SGD's update of 6.5 M float32 values 5.8 -> 4.0 ms, L2Loss over them 2.6 -> 2.0.
PARALLEL_RUNS = 8


def _over_runs(xp: Any, size: int, dtype: Any, scratch: int, body: Callable[..., None]) -> None:
    """body(run, *scratch buffers) for every run of a flat parameter of `size` values."""
    runs = _runs(size, xp)
    length = min(_run_length(xp), size)

    def group(g: range) -> None:
        buffers = [xp.empty(length, dtype=dtype) for _ in range(scratch)]
        for i in g:
            body(runs[i], *buffers)

    # a GPU's runs are queued on one stream in line: one group, one scratch
    intra.for_chunks(len(runs), group, parts=None if xp is np else 1, xp=xp, least=PARALLEL_RUNS)


@kernel("ApplyGradientDescent")
def apply_gradient_descent(xp: Any, attrs: dict[str, Any]) -> Fn:
    slot = attrs["_resource"]

    def run(alpha: Any, delta: Any) -> Any:
        _resident(xp, slot)
        if updatable_in_place(slot) and delta.shape == slot.value.shape \
                and np.result_type(dtype_of(delta), dtype_of(alpha)) == slot.value.dtype:
            return _subtract_scaled(xp, slot.value, delta, alpha)
        # A new array, as AssignSub makes (§4.7: a value read before the update keeps its bits):
        # alpha * delta in it, then the subtraction in place, two passes and one buffer.
        new = xp.multiply(delta, alpha)
        xp.subtract(slot.value, new, out=new)
        slot.value = new
        return new

    return run


def _subtract_scaled(xp: Any, var: Any, delta: Any, alpha: Any) -> Any:
    """var -= delta * alpha in place, run by run: each product rounded to var's dtype first, so the
    bits are those of the out-of-place update."""
    flat, d = var.reshape(-1), xp.ascontiguousarray(delta).reshape(-1)
    alpha = on_device(xp, alpha)

    def body(r: slice, scratch: Any) -> None:
        t = scratch[:r.stop - r.start]
        xp.multiply(d[r], alpha, out=t)
        xp.subtract(flat[r], t, out=flat[r])

    _over_runs(xp, flat.size, var.dtype, 1, body)
    return var


def _alone(xp: Any, slots: tuple[Any, ...]) -> bool:
    """Can every slot's array be updated in place? (Each moved to this device first; asked before
    any local name holds an array, which would count as a holder.)"""
    for slot in slots:
        _resident(xp, slot)
    return all(updatable_in_place(slot) for slot in slots)


@kernel("ApplyMomentum")
def apply_momentum(xp: Any, attrs: dict[str, Any]) -> Fn:
    slots = attrs["_resource"]
    momentum, nesterov = attrs["momentum"], attrs["nesterov"]

    def run(lr: Any, grad: Any) -> Any:
        alone = _alone(xp, slots) and np.result_type(dtype_of(grad), dtype_of(lr)) == slots[0].value.dtype \
            and grad.shape == slots[0].value.shape
        var, accum = (slot.value for slot in slots)
        m = xp.asarray(momentum, dtype=var.dtype)
        if not alone:  # new arrays, the ops in the order ApplyMomentum's chain had them
            new_accum = accum * m + grad
            step = grad + new_accum * m if nesterov else new_accum
            new = var - lr * step
            slots[1].value, slots[0].value = new_accum, new
            return new
        v, a, g = var.reshape(-1), accum.reshape(-1), xp.ascontiguousarray(grad).reshape(-1)
        lr = on_device(xp, lr)

        def body(r: slice, t: Any) -> None:
            tr = t[:r.stop - r.start]
            xp.multiply(a[r], m, out=a[r])
            xp.add(a[r], g[r], out=a[r])
            if nesterov:
                xp.multiply(a[r], m, out=tr)
                xp.add(g[r], tr, out=tr)
                xp.multiply(lr, tr, out=tr)
            else:
                xp.multiply(lr, a[r], out=tr)
            xp.subtract(v[r], tr, out=v[r])

        _over_runs(xp, v.size, var.dtype, 1, body)
        return var

    return run


@kernel("ApplyAdam")
def apply_adam(xp: Any, attrs: dict[str, Any]) -> Fn:
    slots = attrs["_resource"]

    def run(lr_t: Any, grad: Any) -> Any:
        alone = _alone(xp, slots) and np.result_type(dtype_of(grad), dtype_of(lr_t)) == slots[0].value.dtype \
            and grad.shape == slots[0].value.shape
        var, m, v = (slot.value for slot in slots)
        b1, c1, b2, c2, eps = (xp.asarray(c, dtype=var.dtype) for c in (
            attrs["beta1"], 1.0 - attrs["beta1"], attrs["beta2"], 1.0 - attrs["beta2"], attrs["epsilon"]))
        if not alone:  # new arrays, the ops in the order Adam's chain had them
            new_m = m * b1 + grad * c1
            new_v = v * b2 + xp.square(grad) * c2
            new = var - lr_t * new_m / (xp.sqrt(new_v) + eps)
            slots[1].value, slots[2].value, slots[0].value = new_m, new_v, new
            return new
        w, mf, vf = var.reshape(-1), m.reshape(-1), v.reshape(-1)
        g = xp.ascontiguousarray(grad).reshape(-1)
        lr_t = on_device(xp, lr_t)

        def body(r: slice, t: Any, u: Any) -> None:
            tr, ur = t[:r.stop - r.start], u[:r.stop - r.start]
            xp.multiply(g[r], c1, out=tr)
            xp.multiply(mf[r], b1, out=mf[r])
            xp.add(mf[r], tr, out=mf[r])
            xp.square(g[r], out=tr)
            xp.multiply(tr, c2, out=tr)
            xp.multiply(vf[r], b2, out=vf[r])
            xp.add(vf[r], tr, out=vf[r])
            xp.sqrt(vf[r], out=tr)
            xp.add(tr, eps, out=tr)
            xp.multiply(lr_t, mf[r], out=ur)
            xp.divide(ur, tr, out=tr)
            xp.subtract(w[r], tr, out=w[r])

        _over_runs(xp, w.size, var.dtype, 2, body)
        return var

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
    """Sort the indices and sum each run of equal ones as add.reduceat does (`array.run_sums`):
    GatherGrad's CPU kernel without the scatter into zeros, so the rows are its rows to the bit."""
    def run(dy: Any, indices: Any, like: Any) -> tuple[Any, Any]:
        idx, d2 = _flat_rows(dy, indices, like)
        if not idx.size:
            return xp.zeros(0, dtype="int64"), xp.zeros((0, *like.shape[1:]), dtype=dy.dtype)
        order = xp.argsort(idx, kind="stable")
        ids = idx[order]
        starts = xp.flatnonzero(xp.concatenate(([True], ids[1:] != ids[:-1])))
        rows = run_sums(d2[order], starts, axis=0)
        return ids[starts].astype("int64"), rows.reshape((starts.size, *like.shape[1:]))

    return run


@kernel("SparseApplyGradientDescent")
def sparse_apply_gradient_descent(xp: Any, attrs: dict[str, Any]) -> Fn:
    slot = attrs["_resource"]

    def subtract(var: Any, ids: Any, delta: Any) -> None:
        # Rows from a GPU's GatherGradRows repeat an id (each run's sum at its first position,
        # zeros after it): an assignment through repeated indices keeps only the last row's.
        if xp is np and ids.size > 1 and bool((ids[1:] == ids[:-1]).any()):
            np.subtract.at(var, ids, delta)
        else:
            var[ids] -= delta  # only the touched rows are read or written

    def run(alpha: Any, ids: Any, rows: Any) -> Any:
        _resident(xp, slot)
        if updatable_in_place(slot):
            subtract(slot.value, ids, rows * alpha)
            return slot.value
        # A copy for the slot, as ApplyGradientDescent makes, then only the touched rows change.
        new = xp.array(slot.value, copy=True)
        subtract(new, ids, rows * alpha)
        slot.value = new
        return new

    return run


# -------------------------------------------------------------------------------- multi-tensor updates
# MultiApply* (engine/multi_apply.py): one node updating N variables. The reference kernel is the
# per-variable kernel bound once per variable and called in turn, so its results are those of the N
# nodes it stands for, bit for bit, on any device; kernels/cuda/state.py's GPU kernel launches once
# for many variables and is tested against it.
_SINGLE = {"MultiApplyGradientDescent": ("ApplyGradientDescent", ()),
           "MultiApplyMomentum": ("ApplyMomentum", ("momentum", "nesterov")),
           "MultiApplyAdam": ("ApplyAdam", ("beta1", "beta2", "epsilon"))}


def per_variable_attrs(op: str, attrs: dict[str, Any]) -> list[dict[str, Any]]:
    """The attrs each replaced per-variable node's kernel would be bound with: its slot (SGD) or
    tuple of slots, the op's attributes, and the step's guard where the node has one."""
    k = attrs["slots"]
    res = attrs["_resource"]
    out = []
    for j in range(len(res) // (k + 1)):
        group = res[j * (k + 1):(j + 1) * (k + 1)]
        a = {name: attrs[name] for name in _SINGLE[op][1]}
        a["_resource"] = group[0] if k == 0 else tuple(group)
        a["_node"] = f"{attrs.get('_node', op)}[{j}]"
        if "_guard" in attrs:
            a["_guard"] = attrs["_guard"]
        out.append(a)
    return out


def _multi(op: str, single: Fn) -> Fn:
    def factory(xp: Any, attrs: dict[str, Any]) -> Fn:
        fns = [single(xp, a) for a in per_variable_attrs(op, attrs)]
        n = len(fns)

        def run(*args: Any) -> None:
            for fn, alpha, grad in zip(fns, args[:n], args[n:]):
                fn(alpha, grad)

        return run

    kernel(op)(factory)
    return factory


multi_apply_gradient_descent = _multi("MultiApplyGradientDescent", apply_gradient_descent)
multi_apply_momentum = _multi("MultiApplyMomentum", apply_momentum)
multi_apply_adam = _multi("MultiApplyAdam", apply_adam)


# -------------------------------------------------------------------------------- summed L2 losses
# MultiL2Loss (engine/multi_l2.py): the L2Loss nodes an AddN summed, as one node. The reference
# kernel is theirs: each tensor's L2Loss, then AddN's left-to-right sum, so its bits are the
# unfused graph's on any device (kernels/cuda/kernels.py's GPU kernel is tested against it).
@kernel("MultiL2Loss")
def multi_l2_loss(xp: Any, attrs: dict[str, Any]) -> Fn:
    from flowctl.kernels.elementwise import add_n

    single, total = l2_loss(xp, attrs), add_n(xp, attrs)

    def run(*ts: Any) -> Any:
        return total(*[single(t) for t in ts])

    return run
