"""Random ops: RandomUniform, RandomNormal, TruncatedNormal.

Determinism (ARCHITECTURE "Runtime"): each random node owns an RngState (§4.7 container-style
state) seeded from the graph seed and the node's name, or from its own `seed` attr when non-zero.
The numbers a node draws therefore depend only on (graph seed, name or op seed, step count), never on
which other ops exist or ran first; the state persists across steps, so each step draws afresh, and
a new Session over the same graph replays the same sequence. Kernels draw on the host so cpu and gpu
produce identical numbers.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from flowctl.engine.dtypes import as_dtype, is_float, itemsize
from flowctl.engine.graph import Tensor
from flowctl.engine.ops.api import graph_of, make1
from flowctl.engine.opdef import RANDOM, REQUIRED, register_op
from flowctl.engine.shapes import InferError, TensorSpec

__all__ = ["random_normal", "random_uniform", "truncated_normal"]

# FLOPs per element drawn: a Philox block, a float conversion and the scale-and-shift; a rough
# figure for the cost model, which only needs random ops to be cheap relative to a MatMul.
_FLOPS_PER_SAMPLE = 10.0


def _random_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    shape = attrs["shape"]
    if shape is None or any(d is None for d in shape):
        raise InferError(f"random ops need a fully known shape, got {shape}; for a mask shaped like a "
                         f"runtime tensor use dropout")
    if any(d < 0 for d in shape):
        raise InferError(f"negative dimension in shape {shape}")
    return [TensorSpec(tuple(shape), attrs["dtype"])]


def _float_random_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if not is_float(attrs["dtype"]):
        raise InferError(f"needs a float dtype, got {attrs['dtype']}")
    if attrs["stddev"] < 0:
        raise InferError(f"stddev must be >= 0, got {attrs['stddev']}")
    return _random_infer(ins, attrs)


def _uniform_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if attrs["dtype"] == "bool":
        raise InferError("cannot draw uniform bools; compare a float draw instead")
    if not attrs["maxval"] > attrs["minval"]:
        raise InferError(f"maxval ({attrs['maxval']}) must exceed minval ({attrs['minval']})")
    return _random_infer(ins, attrs)


def _random_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                 attrs: dict[str, Any]) -> tuple[float, float]:
    n = float(sum(int(np.prod(s)) for s in outs))
    return _FLOPS_PER_SAMPLE * n, n * itemsize(dtypes[0] if dtypes else "float32")


_COMMON = {"shape": ("shape", REQUIRED), "dtype": ("dtype", "float32"), "seed": ("int", 0)}

register_op("RandomUniform", _uniform_infer, num_inputs=0,
            attrs={**_COMMON, "minval": ("float", 0.0), "maxval": ("float", 1.0)},
            group=RANDOM, stateful=True, resource="rng", differentiable=False, cost=_random_cost)
for _op in ("RandomNormal", "TruncatedNormal"):
    register_op(_op, _float_random_infer, num_inputs=0,
                attrs={**_COMMON, "mean": ("float", 0.0), "stddev": ("float", 1.0)},
                group=RANDOM, stateful=True, resource="rng", differentiable=False, cost=_random_cost)


# ---------------------------------------------------------------------------- Python API
def _attrs(shape: Sequence[int], dtype: Any, seed: int, **kw: float) -> dict[str, Any]:
    return {"shape": tuple(shape), "dtype": as_dtype(dtype), "seed": int(seed), **kw}


def random_uniform(shape: Sequence[int], minval: float = 0.0, maxval: float = 1.0, dtype: Any = "float32",
                   seed: int = 0, name: str | None = None) -> Tensor:
    """Uniform on [minval, maxval). Integer dtypes draw integers in [minval, maxval).
    `seed` 0 derives the stream from the node name; any other value makes it independent of it."""
    return make1("RandomUniform", [], _attrs(shape, dtype, seed, minval=minval, maxval=maxval),
                 name=name or "RandomUniform", graph=graph_of())


def random_normal(shape: Sequence[int], mean: float = 0.0, stddev: float = 1.0, dtype: Any = "float32",
                  seed: int = 0, name: str | None = None) -> Tensor:
    return make1("RandomNormal", [], _attrs(shape, dtype, seed, mean=mean, stddev=stddev),
                 name=name or "RandomNormal", graph=graph_of())


def truncated_normal(shape: Sequence[int], mean: float = 0.0, stddev: float = 1.0, dtype: Any = "float32",
                     seed: int = 0, name: str | None = None) -> Tensor:
    """A normal with every value beyond 2 stddev from the mean redrawn (as TensorFlow does)."""
    return make1("TruncatedNormal", [], _attrs(shape, dtype, seed, mean=mean, stddev=stddev),
                 name=name or "TruncatedNormal", graph=graph_of())
