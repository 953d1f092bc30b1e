"""Dtype names as they appear in graphs and GraphDef JSON, mapped to numpy dtypes.

bfloat16 is ml_dtypes' numpy dtype (the one cupy's arrays take too): a float32's sign, exponent and
upper 7 mantissa bits. numpy sees it as kind "V", so ask `is_float` here, never `dtype.kind`."""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from flowctl.engine.errors import GraphError

DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype("float16"),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
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
# A handle on per-step state that is no array (a control-flow accumulator, §4.4): never
# differentiated, folded or sent off the process; not among the tensor dtypes above.
VARIANT = "variant"
_ALL: dict[str, np.dtype] = {**DTYPES, VARIANT: np.dtype(object)}
FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
BFLOAT16 = DTYPES["bfloat16"]
INTS = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16"})


def as_dtype(d: Any) -> str:
    """Canonical dtype name for a name, numpy dtype or Python type."""
    if isinstance(d, str) and d in _ALL:
        return d
    try:
        name = np.dtype(d).name
    except TypeError as e:
        raise GraphError(f"unknown dtype {d!r}; known: {', '.join(DTYPES)}") from e
    if name == "object":
        return VARIANT
    if name not in DTYPES:
        raise GraphError(f"unsupported dtype {name!r}; known: {', '.join(DTYPES)}")
    return name


def np_dtype(name: str) -> np.dtype:
    return _ALL[name]


def itemsize(name: str) -> int:
    return _ALL[name].itemsize


def is_float(name: str) -> bool:
    return name in FLOATS
