"""Dtype names as they appear in graphs and GraphDef JSON, mapped to numpy dtypes.

bfloat16 is ml_dtypes' numpy dtype (the one cupy's arrays take too): a float32's sign, exponent and
upper 7 mantissa bits. numpy sees it as kind "V", so ask `is_float` here, never `dtype.kind`.

ml_dtypes is imported where bfloat16 is first needed (`bfloat16_dtype`; `DTYPES` and `BFLOAT16`
are made on first use): its extension registers its ufunc loops one at a time, numpy's search for
each linear in the loops already there, and importing it took 1.2-1.7 s on a 2-core host, which
every command paid (`flowctl --help` included) though most runs never touch bfloat16."""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from flowctl.engine.errors import GraphError


@functools.cache
def bfloat16_dtype() -> np.dtype:
    """ml_dtypes' bfloat16 as a numpy dtype, importing ml_dtypes the first time."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


_EAGER: dict[str, np.dtype] = {
    "float16": np.dtype("float16"),
    "float32": np.dtype("float32"),
    "float64": np.dtype("float64"),
    "int8": np.dtype("int8"),
    "int16": np.dtype("int16"),
    "int32": np.dtype("int32"),
    "int64": np.dtype("int64"),
    "uint8": np.dtype("uint8"),
    "uint16": np.dtype("uint16"),
    "bool": np.dtype("bool"),
}
# The tensor dtypes' names, in DTYPES' order
NAMES = ("float16", "bfloat16", *(n for n in _EAGER if n != "float16"))
# A handle on per-step state that is no array (a control-flow accumulator, §4.4): never
# differentiated, folded or sent off the process; not among the tensor dtypes above.
VARIANT = "variant"
_EAGER[VARIANT] = np.dtype(object)
_KNOWN = frozenset(NAMES) | {VARIANT}
FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
INTS = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16"})


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # name -> numpy dtype for every tensor dtype, bfloat16's included
        return {n: np_dtype(n) for n in NAMES}
    if name == "BFLOAT16":
        return bfloat16_dtype()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def as_dtype(d: Any) -> str:
    """Canonical dtype name for a name, numpy dtype or Python type."""
    if isinstance(d, str) and d in _KNOWN:
        return d
    try:
        name = np.dtype(d).name
    except TypeError as e:
        raise GraphError(f"unknown dtype {d!r}; known: {', '.join(NAMES)}") from e
    if name == "object":
        return VARIANT
    if name not in NAMES:
        raise GraphError(f"unsupported dtype {name!r}; known: {', '.join(NAMES)}")
    return name


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        return bfloat16_dtype()
    return _EAGER[name]


def itemsize(name: str) -> int:
    return 2 if name == "bfloat16" else _EAGER[name].itemsize


def is_float(name: str) -> bool:
    return name in FLOATS
