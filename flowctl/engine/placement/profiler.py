"""The op profiler behind `MeasuredCostModel`: every kernel of one step timed on a real device.

On a CPU a kernel call is the kernel. On a GPU a call only launches: each call is timed twice at
once, the host's launch time and, between CUDA events behind a spin kernel that holds the stream,
the kernels' own device time (the simulator overlaps the two).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

from flowctl.engine.dtypes import np_dtype
from flowctl.engine.placement.cost import STREAM, MeasuredCostModel, record_key
from flowctl.kernels.registry import cupy_or_none


def profile(model: MeasuredCostModel, session: Any, fetches: Any, feeds: Mapping[Any, Any] | None = None,
            repeat: int = 5, threads: int | None = None) -> int:
    """Run the session's plan for (fetches, feeds) `repeat` times node by node, timing every
    kernel call (the best of the repeats), and record the times in `model`, one per distinct key. This executes
    real steps: stateful ops (variable updates, random ops) advance as in training.
    Returns the number of keys recorded. The plan is the graph's own nodes, without the device's
    plan passes (FusedConv2D, packed recurrent weights, grouped updates): the keys the placer looks
    up."""
    plan = session.plan_for(fetches, feeds, passes=False)
    kind = model.cluster.device(session.device).profile.name
    dev = model.cluster.device(session.device)
    if plan.frame_tables is not None:
        return _profile_frames(model, session, plan, fetches, feeds, repeat, threads or dev.threads)
    values: list[Any] = [None] * plan.num_slots
    by_ref = {session._ref(k): v for k, v in (feeds or {}).items()}
    for i, ref in enumerate(plan.feeds):
        spec = session.graph.tensor(ref).spec
        values[i] = session.xp.asarray(by_ref[ref], dtype=np_dtype(spec.dtype))
    sync = _synchronizer(plan.device_type)
    gate = _gate(plan.device_type)
    best = [float("inf")] * len(plan.nodes)
    best_stream = [float("inf")] * len(plan.nodes)
    with contextlib.ExitStack() as stack:
        if plan.device_type == "cpu":
            stack.enter_context(_blas_limit(threads if threads is not None else dev.threads))
        for _ in range(max(1, repeat)):
            for i, k in enumerate(plan.kernels):
                args = [values[s] for s in plan.in_slots[i]]
                if gate is None:  # synchronous: the call is the kernel
                    t0 = time.perf_counter()
                    out = k(*args)
                    dt = time.perf_counter() - t0
                else:  # the host's launch time, and the kernel's own between CUDA events
                    out, dt, ds = gate(k, args)
                    if ds < best_stream[i]:
                        best_stream[i] = ds
                if dt < best[i]:
                    best[i] = dt
                outs = plan.out_slots[i]
                if len(outs) == 1:
                    out = (out,)
                for s, v in zip(outs, out or ()):
                    values[s] = v
        sync()
    seen: dict[str, list[float]] = {}
    for i, node in enumerate(plan.nodes):
        ins = [_shape_of(values[s]) for s in plan.in_slots[i]]
        outs = [_shape_of(values[s]) for s in plan.out_slots[i]]
        key = record_key(node.op, ins, outs, kind)
        seen.setdefault(key, []).append(best[i])
        if gate is not None:
            seen.setdefault(key + STREAM, []).append(best_stream[i])
    return model.record_times(seen)


def _profile_frames(model: MeasuredCostModel, session: Any, plan: Any, fetches: Any, feeds: Mapping[Any, Any] | None,
                    repeat: int, threads: int) -> int:
    """A plan with loops (§4.4) cannot run node by node in one order: its nodes run once per
    iteration, in frames. It runs whole on the frame executor instead, whose own record of each
    kernel run (start, finish) times every iteration; a node's time is its mean run, the best of
    the repeats, recorded under the key the cost model looks it up by."""
    from flowctl.engine.executor import RunStats

    best: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        if plan.device_type == "cpu":
            stack.enter_context(_blas_limit(threads))
        for _ in range(max(1, repeat)):
            stats = RunStats()
            session.run(fetches, feeds, stats=stats)
            total: dict[str, list[float]] = {}
            for name, started, finished in stats.runs():
                total.setdefault(name, []).append(finished - started)
            for name, runs in total.items():
                mean = sum(runs) / len(runs)
                best[name] = min(best.get(name, float("inf")), mean)
    seen: dict[str, list[float]] = {}
    for node in plan.nodes:
        if node.name in best:
            seen.setdefault(model.key_for(session.graph, node, session.device), []).append(best[node.name])
    return model.record_times(seen)


def _shape_of(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(x, "shape", ()))


def _synchronizer(device_type: str) -> Any:
    """A callable that waits for the device: cupy launches are asynchronous, so a GPU kernel's time
    is only known after the stream drains."""
    if device_type == "gpu":
        cp = cupy_or_none()
        if cp is not None:
            return lambda: cp.cuda.get_current_stream().synchronize()
    return lambda: None


SPIN_CYCLES = 2_000_000  # about a millisecond of a GPU clock: longer than any one node's launches


def _gate(device_type: str) -> Any:
    """For a GPU: a callable timing one kernel call two ways at once. The stream is first held by a
    spin kernel, so the call's launches queue up behind it and the CUDA events around them measure
    the kernels alone, not the host's launch gaps; the host's time for the call is its launches.
    Returns (outputs, host seconds, stream seconds). None for a synchronous device."""
    if device_type != "gpu":
        return None
    cp = cupy_or_none()
    if cp is None:
        return None
    spin = cp.RawKernel(r"""
extern "C" __global__ void flowctl_spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}""", "flowctl_spin")
    stream = cp.cuda.get_current_stream()
    cycles = cp.int64(SPIN_CYCLES)

    def held(k: Any, args: list[Any]) -> tuple[Any, float, float]:
        stream.synchronize()
        spin((1,), (1,), (cycles,))
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        t0 = time.perf_counter()
        out = k(*args)
        host = time.perf_counter() - t0
        end.record(stream)
        end.synchronize()
        return out, host, cp.cuda.get_elapsed_time(start, end) / 1e3

    before, after = cp.cuda.Event(), cp.cuda.Event()  # how long the hold lasts
    before.record(stream)
    spin((1,), (1,), (cycles,))
    after.record(stream)
    after.synchronize()
    spin_s = max(cp.cuda.get_elapsed_time(before, after) / 1e3, 1e-4)

    def timed(k: Any, args: list[Any]) -> tuple[Any, float, float]:
        out, host, dev = held(k, args)
        if host > spin_s / 2:  # the kernel waited for the device (it reads a value back), so its
            host = dev         # host time is its own device time, not the hold it queued behind
        return out, host, dev

    return timed


def _blas_limit(threads: int) -> contextlib.AbstractContextManager[Any]:
    """Limit BLAS to the device's threads while profiling, so a virtual CPU device is timed as the
    runtime will run it. threadpoolctl is optional: without it the times are the whole machine's."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=max(1, int(threads)), user_api="blas")


__all__ = ["SPIN_CYCLES", "profile"]
