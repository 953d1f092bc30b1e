"""Kernels of the §4.4 control-flow primitives and the loop-gradient accumulator.

Routing (which frame and iteration a value goes to) is the executor's work; these kernels only say
which outputs are alive. `DEAD` is the value of an output on an untaken branch: the executor
propagates it without running kernels, and only Merge looks past it.
"""
from __future__ import annotations

from typing import Any, Callable

from flowctl.kernels.backend import DEAD
from flowctl.kernels.registry import kernel


@kernel("Switch")
def switch(xp: Any, attrs: dict[str, Any]) -> Callable[[Any, Any], tuple[Any, Any]]:
    def run(x: Any, pred: Any) -> tuple[Any, Any]:
        return (DEAD, x) if bool(pred) else (x, DEAD)

    return run


@kernel("Merge")
def merge(xp: Any, attrs: dict[str, Any]) -> Callable[[Any, int], tuple[Any, Any]]:
    # The executor hands Merge the one input that arrived alive and its position.
    return lambda x, index: (x, xp.asarray(index, dtype=xp.int32))


def _identity(xp: Any, attrs: dict[str, Any]) -> Callable[[Any], Any]:
    return lambda x: x


for _op in ("Enter", "Exit", "NextIteration"):
    kernel(_op)(_identity)


@kernel("AccCreate")
def acc_create(xp: Any, attrs: dict[str, Any]) -> Callable[[], list]:
    return lambda: []


@kernel("AccPush")
def acc_push(xp: Any, attrs: dict[str, Any]) -> Callable[[list, Any], list]:
    def run(acc: list, x: Any) -> list:
        acc.append(x)
        return acc

    return run


@kernel("AccRead")
def acc_read(xp: Any, attrs: dict[str, Any]) -> Callable[[list, Any], Any]:
    def run(acc: list, index: Any) -> Any:
        i = int(index)
        if not 0 <= i < len(acc):
            raise IndexError(f"accumulator read at {i}, it holds {len(acc)} value(s)")
        return acc[i]

    return run


@kernel("AccStack")
def acc_stack(xp: Any, attrs: dict[str, Any]) -> Callable[[list, Any], Any]:
    rows = int(attrs["rows"])

    def run(acc: list, like: Any) -> Any:
        if rows and len(acc) > rows:
            raise ValueError(f"AccStack: the loop pushed {len(acc)} values, more than its {rows} rows")
        pad = [xp.zeros_like(like)] * (rows - len(acc)) if rows else []
        if not acc and not pad:
            return xp.zeros((0,) + tuple(like.shape), dtype=like.dtype)
        return xp.stack(list(acc) + pad)

    return run


@kernel("LoopSum")
def loop_sum(xp: Any, attrs: dict[str, Any]) -> Callable[[Any, Any], Any]:
    # The one kernel that writes into an input: the engine builds LoopSum only on a running total
    # that nothing else reads. A buffer it may not write (a folded constant) is summed out of place.
    def run(total: Any, x: Any) -> Any:
        flags = getattr(total, "flags", None)
        if getattr(flags, "writeable", True) and getattr(flags, "c_contiguous", False) \
                and total.shape == x.shape and total.dtype == x.dtype:
            return xp.add(total, x, out=total)
        return total + x

    return run
