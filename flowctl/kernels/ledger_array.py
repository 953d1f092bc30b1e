"""The launch ledger's device arrays (`ledger.py` is the module): `LedgerArray`, an ndarray whose
buffer is a block of the ledger's modelled pool, whose numpy calls are counted as kernel launches
(through `__array_ufunc__`, `__array_function__` and the methods that dispatch to neither) and
whose reads back to the host are counted as synchronisations; the ufunc wrapper; and the tables
of what cupy does on the host or through its own cuBLAS (data-dependent output sizes, pointer
tables of joins), which a capture refuses."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

BLOCK = 512  # cupy's pool rounds every allocation up to this many bytes


class CaptureError(RuntimeError):
    """What a CUDA-graph capture refuses: a host synchronisation, a host-to-device copy, a cupy
    cuBLAS call, or an allocation the ledger could not put on the tape."""


def _root(a: Any) -> Any:
    """The array that owns `a`'s memory (followed through `.base`; a LedgerArray's own block is
    not its base, as a cupy array's memory is not)."""
    while isinstance(a, np.ndarray) and isinstance(a.base, np.ndarray):
        a = a.base
    return a


class _Block(np.ndarray):
    """A pool block: raw device memory (bytes) that owning LedgerArrays are laid over."""


_c_base = np.ndarray.base.__get__  # the base numpy itself keeps (the property below hides blocks)


def _block_of(x: Any) -> Any:
    """The pool block under `x`'s memory, or None."""
    while isinstance(x, np.ndarray):
        if type(x) is _Block:
            return x
        x = _c_base(x)
    return None


def _ptr(x: np.ndarray) -> int:
    return int(x.__array_interface__["data"][0])


# numpy functions whose output shape depends on the data: cupy reads a count back to the host.
_DATA_SHAPED = {"nonzero", "flatnonzero", "argwhere", "unique", "unique_values", "unique_counts",
                "unique_inverse", "unique_all", "compress", "extract", "trim_zeros", "setdiff1d",
                "intersect1d", "union1d", "setxor1d"}
# cupy's own cuBLAS / cuSOLVER calls: refused inside a capture (use xp.matmul / xp.gemm).
_BLAS = {"matmul", "dot", "vdot", "inner", "tensordot", "einsum", "kron"}
# Functions that look at metadata only: no launch, no data.
# Joins that cupy runs as one kernel over a table of the inputs' pointers, uploaded from the host,
# when they join more than JOIN_TABLE arrays (cupy 14's _concatenate; the exact threshold is a
# model: kernels join many arrays by copies into slices instead, kernels/array._joined).
_JOINS = {"concatenate", "stack", "hstack", "vstack", "dstack", "column_stack"}
JOIN_TABLE = 4

_NO_DATA = {"shape", "ndim", "size", "result_type", "can_cast", "min_scalar_type", "may_share_memory",
            "shares_memory", "iscomplexobj", "isrealobj", "isscalar", "common_type", "promote_types",
            "broadcast_shapes", "iterable", "isfortran", "get_printoptions", "printoptions", "set_printoptions",
            "seterr", "geterr", "errstate", "finfo", "iinfo", "dtype", "ndindex", "ndenumerate", "issubdtype",
            "isdtype", "broadcast", "nditer"}
# Functions that allocate without writing (no kernel).
_NO_LAUNCH = {"empty", "empty_like"}
# Array methods that do not reach __array_ufunc__/__array_function__ and write data, or may copy.
_METHODS = ("astype", "copy", "flatten", "ravel", "reshape", "fill", "take", "argmax", "argmin", "argsort",
            "sort", "clip", "cumsum", "cumprod", "repeat", "round", "searchsorted", "diagonal", "trace",
            "conj", "conjugate", "choose", "put", "partition", "argpartition", "sum", "prod", "mean", "var",
            "std", "max", "min", "any", "all", "dot", "nonzero", "compress", "byteswap", "resize")


def _plain(x: Any) -> Any:
    """`x` with device arrays seen as plain numpy arrays (for metadata-only functions)."""
    if isinstance(x, LedgerArray):
        return np.ndarray.view(x, np.ndarray)
    if type(x) in (list, tuple):
        return type(x)(_plain(i) for i in x)
    return x


class LedgerArray(np.ndarray):
    """An array on the ledger's simulated device (each Ledger has its own subclass, `ledger.ndarray`)."""

    _ledger: Any  # the Ledger (module) this array belongs to

    def __array_finalize__(self, obj: Any) -> None:
        if _c_base(self) is None:  # a buffer numpy made itself (the ledger lays arrays over blocks)
            type(self)._ledger._allocate(self)

    @property
    def base(self) -> Any:  # type: ignore[override]
        """None for an array that owns its pool block (as a cupy array owning its memory)."""
        b = _c_base(self)
        return None if type(b) is _Block else b

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        return type(self)._ledger._ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
        return type(self)._ledger._call(func, args, kwargs, getattr(func, "__name__", str(func)))

    # ---------------------------------------------------------------- indexing
    def __getitem__(self, key: Any) -> Any:
        return type(self)._ledger._getitem(self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        type(self)._ledger._setitem(self, key, value)

    # ---------------------------------------------------------------- reads to the host: syncs
    def get(self, stream: Any = None, out: Any = None, order: str = "C") -> np.ndarray:
        type(self)._ledger._sync("get")
        h = np.array(np.ndarray.view(self, np.ndarray), order=order)
        if out is not None:
            out[...] = h
            return out
        return h

    def __repr__(self) -> str:  # counted, never refused (a debugger or a failing assert prints it)
        type(self)._ledger._sync("repr", refuse=False)
        return "Ledger" + repr(np.ndarray.view(self, np.ndarray))

    def __str__(self) -> str:
        type(self)._ledger._sync("str", refuse=False)
        return str(np.ndarray.view(self, np.ndarray))

    def __reduce__(self) -> Any:  # a pickle of a device array is a copy to the host
        return self.get().__reduce__()


def _method(name: str) -> Callable[..., Any]:
    unbound = getattr(np.ndarray, name)

    def m(self: LedgerArray, *args: Any, **kwargs: Any) -> Any:
        return type(self)._ledger._call(unbound, (self,) + args, kwargs, name)

    m.__name__ = name
    return m


for _n in _METHODS:
    setattr(LedgerArray, _n, _method(_n))


def _host_read(name: str, read: Any) -> Any:
    """A read of a LedgerArray's value on the host (float(a), bool(a), a.item(), ...): counted as
    a synchronisation (refused inside a capture, as cupy's are)."""
    def method(self: Any, *args: Any) -> Any:
        type(self)._ledger._sync(name)
        return read(np.ndarray.view(self, np.ndarray), *args)

    method.__name__ = name
    return method


for _name, _read in (("__float__", float), ("__int__", int), ("__complex__", complex), ("__bool__", bool),
                     ("__index__", lambda a: a.__index__()), ("item", lambda a, *i: a.item(*i)),
                     ("tolist", lambda a: a.tolist())):
    setattr(LedgerArray, _name, _host_read(_name.strip("_"), _read))


class _Ufunc:
    """A numpy ufunc as the ledger module hands it out (counted, refusing host arrays)."""

    def __init__(self, ledger: Any, uf: np.ufunc) -> None:
        self._ledger, self._uf = ledger, uf
        self.__name__ = uf.__name__
        self.__doc__ = uf.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._ledger._ufunc(self._uf, "__call__", args, kwargs)

    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        return self._ledger._ufunc(self._uf, "reduce", args, kwargs)

    def accumulate(self, *args: Any, **kwargs: Any) -> Any:
        return self._ledger._ufunc(self._uf, "accumulate", args, kwargs)

    def reduceat(self, *args: Any, **kwargs: Any) -> Any:
        return self._ledger._ufunc(self._uf, "reduceat", args, kwargs)

    def outer(self, *args: Any, **kwargs: Any) -> Any:
        return self._ledger._ufunc(self._uf, "outer", args, kwargs)

    def at(self, *args: Any, **kwargs: Any) -> Any:
        return self._ledger._ufunc(self._uf, "at", args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._uf, name)

    def __repr__(self) -> str:
        return f"<ledger ufunc {self.__name__}>"
