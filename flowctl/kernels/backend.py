"""Array modules per device type: numpy for `cpu`, cupy for `gpu`, imported only when asked for."""
from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

_cupy: ModuleType | None = None
_cupy_checked = False


def cupy_or_none() -> ModuleType | None:
    """cupy if it imports and sees a device, else None. Never raises: a CPU machine lists no GPU."""
    global _cupy, _cupy_checked
    if not _cupy_checked:
        _cupy_checked = True
        try:
            import cupy  # type: ignore[import-not-found]

            if cupy.cuda.runtime.getDeviceCount() > 0:
                _cupy = cupy
        except Exception:  # no cupy, no driver, or no device: all mean "no GPU here"
            _cupy = None
    return _cupy


def gpu_count() -> int:
    cp = cupy_or_none()
    return 0 if cp is None else int(cp.cuda.runtime.getDeviceCount())


def array_module(device_type: str) -> Any:
    if device_type == "cpu":
        return np
    if device_type == "gpu":
        cp = cupy_or_none()
        if cp is None:
            raise RuntimeError("device type 'gpu' requested but cupy or a CUDA device is not available")
        return cp
    raise ValueError(f"unknown device type {device_type!r}")


def to_host(x: Any) -> Any:
    """A numpy array (or scalar) from a numpy or cupy array."""
    get = getattr(x, "get", None)
    if get is not None and not isinstance(x, np.ndarray):
        return get()
    return x
