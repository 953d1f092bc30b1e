"""bfloat16 kernels: stored in bfloat16, computed in float32.

A node whose inputs or outputs are bfloat16 runs its float32 kernel: its bfloat16 inputs widened
to float32 (exact: a bfloat16 is a float32 with its low 16 mantissa bits zero), its dtype and
tensor attributes read as float32, and the outputs it declares bfloat16 rounded to the nearest
bfloat16 (ties to even). That is how a GPU computes with bfloat16 -- tensor-core products and
cuDNN accumulate in float32 and round once on the way out -- and it makes every op's bfloat16
result a rule over its float32 reference rather than whatever numpy's per-element bfloat16 loops
(ml_dtypes) would do (sums accumulated in bfloat16, matmul handing back float32, einsum refusing).

Kernels that take bfloat16 arrays as they are (cuBLAS and cuDNN products on a GPU, which round
once too) say so with `native`; the rule above stays their reference (`reference_kernels()`
turns them off, as it does variants). State, queue, asynchronous and control ops are the
executor's to leave alone (executor._output_dtypes): they keep and move values, whatever their
dtype; ops whose resource is a random state (Dropout, the draws) compute, so the rule holds there.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from flowctl.engine.dtypes import bfloat16_dtype

__all__ = ["BF16", "EXACT", "NATIVE", "ROUNDED_ONCE", "SUMMED", "computed_in_float32", "is_bf16", "native", "narrow",
           "touches", "widen", "widened", "widened_attrs"]

NAME = "bfloat16"


def __getattr__(name: str) -> Any:
    if name == "BF16":  # ml_dtypes' numpy dtype, imported on first use (engine/dtypes.py says why)
        return bfloat16_dtype()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_bf16(x: Any) -> bool:
    """Whether x (an array, a scalar, a dtype's holder) is bfloat16, without importing ml_dtypes:
    no bfloat16 value exists until something has imported it."""
    if "ml_dtypes" not in sys.modules:
        return False
    dt = getattr(x, "dtype", None)
    return dt is not None and dt == bfloat16_dtype()


# (op, device type) kernels that take bfloat16 arrays as they are and return them.
NATIVE: set[tuple[str, str]] = set()


# Kernels that move or pick values and compute none (each output element is an input element, its
# negation, or a constant): on bfloat16 they give the very bits the rule above would, so they take
# bfloat16 arrays as they are and skip the widening and rounding passes (a CNN's concatenations,
# pools, ReLUs and their gradients move bfloat16, half float32's bytes). tests/test_ops_dtypes.py
# holds each to the rule, bit for bit.
EXACT = ("Abs", "Ceil", "Concat", "Equal", "ExpandDims", "Floor", "Gather", "GatherND", "Greater", "GreaterEqual",
         "Identity", "IsInf", "IsNaN", "Less", "LessEqual", "Maximum", "MaxPool", "Minimum", "Neg", "OnesLike", "Pad",
         "PadGrad", "Rank", "Relu", "ReluGrad", "Reshape", "ReshapeLike", "Round", "Select", "Shape", "Sign", "Slice",
         "SliceGrad", "Split", "SplitLike", "Squeeze", "Stack", "StopGradient", "Tile", "Transpose", "TransposeCopy",
         "Unstack", "ZerosLike")
# One correctly rounded float32 operation per element (numpy's and cupy's bfloat16 loops compute in
# float32 and round to bfloat16, as the rule does: the same two roundings, so the same bits).
ROUNDED_ONCE = ("Add", "BiasAdd", "Mul", "Sqrt", "Square", "Sub")
# AddN sums bfloat16 inputs into one float32 buffer in the rule's order and rounds once
# (kernels/elementwise.py): a CNN's gradients that meet where a tensor fed several branches.
SUMMED = ("AddN",)


def native(op: str, device_types: Iterable[str]) -> None:
    """Say that `op`'s kernels on these device types take bfloat16 arrays as they are."""
    NATIVE.update((op, t) for t in device_types)


def widen(x: Any) -> Any:
    """A bfloat16 array as float32 (exact); anything else as it is."""
    return x.astype(np.float32) if is_bf16(x) else x


def narrow(x: Any) -> Any:
    """A float32 array rounded to the nearest bfloat16 (ties to even; NaN stays NaN, overflow is
    Inf); a value of another dtype as it is (an op may declare bfloat16 for an output its float32
    kernel already hands back as bfloat16, a Const's value, say)."""
    return x.astype(bfloat16_dtype()) if getattr(x, "dtype", None) == np.float32 else x


def computed_in_float32(fn: Callable[..., Any], low: Sequence[bool] | None = None) -> Callable[..., Any]:
    """A kernel that, handed bfloat16 arrays, runs in float32 and rounds its output (or, with
    `low`, the outputs it flags: batch norm's statistics stay float32): the fallback of a native
    kernel that cannot serve a call itself. It carries `fn`'s name (functools.wraps)."""
    @functools.wraps(fn)
    def run(*xs: Any) -> Any:
        if not any(is_bf16(x) for x in xs):
            return fn(*xs)
        ys = fn(*map(widen, xs))
        if low is None:
            return narrow(ys)
        return tuple(narrow(y) if lo else y for y, lo in zip(ys, low))

    return run


def touches(attrs: dict[str, Any], ins: Sequence[Any] | None, outs: Sequence[str]) -> bool:
    """Whether a node reads, makes or is told of bfloat16 (its dtype attribute, a bfloat16 Const)."""
    return (NAME in outs or any(getattr(s, "dtype", None) == NAME for s in ins or ())
            or any(_is_bf16_attr(v) for k, v in attrs.items() if not k.startswith("_")))


def _is_bf16_attr(v: Any) -> bool:
    if isinstance(v, str):
        return v == NAME
    return is_bf16(v)


def widened_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """The node's attributes as its float32 kernel reads them."""
    out = {}
    for k, v in attrs.items():
        if not k.startswith("_") and isinstance(v, str) and v == NAME:
            v = "float32"
        elif not k.startswith("_") and is_bf16(v):
            v = v.astype(np.float32)
        out[k] = v
    return out


def widened(factory: Callable[[Any, dict[str, Any]], Callable[..., Any]], xp: Any, attrs: dict[str, Any],
            outs: Sequence[str]) -> Callable[..., Any]:
    """The step-time callable of `factory` computing in float32 for a node that touches bfloat16:
    bfloat16 inputs widened, bfloat16 attributes read as float32, the outputs declared bfloat16
    rounded. `outs`: the node's output dtypes."""
    fn = factory(xp, widened_attrs(attrs))
    low = tuple(d == NAME for d in outs)
    if len(outs) == 1:
        if low[0]:
            return lambda *xs: narrow(fn(*map(widen, xs)))
        return lambda *xs: fn(*map(widen, xs))

    def run(*xs: Any) -> Any:
        ys = fn(*map(widen, xs))
        return tuple(narrow(y) if lo else y for y, lo in zip(ys, low))

    return run


for _op in EXACT + ROUNDED_ONCE + SUMMED:
    native(_op, ("cpu", "gpu"))
