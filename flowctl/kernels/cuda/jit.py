"""Kernels of our own, written once in numba-cuda's Python: on a GPU numba compiles them and they
run on cupy arrays on cupy's current stream (inside a CUDA-graph capture too); on a CPU, with
NUMBA_ENABLE_CUDASIM=1, numba's CUDA simulator runs the same source on numpy arrays, so CI tests
every custom kernel without a GPU.

Kernels are launched through the array module (`xp.launch(kernel, grid, block, *args)`): the
device module (`cuda/xp.py`) launches on the GPU, the launch ledger (`kernels/ledger.py`) counts and
runs the launch in the simulator. A kernel module defines its kernels inside a cached builder, so
numba is imported only when a kernel is first wanted:

    @functools.cache
    def _kernels():
        cuda = numba_cuda()
        @cuda.jit
        def scale(x, a, y): ...
        return SimpleNamespace(scale=scale)"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

_state: dict[str, Any] = {}


def numba_cuda() -> Any:
    """numba.cuda (the simulator where NUMBA_ENABLE_CUDASIM=1), or None where numba-cuda is not
    installed. numba-cuda 0.30.4 still names np.row_stack, which numpy 2.5 removed."""
    if "cuda" not in _state:
        if not hasattr(np, "row_stack"):
            np.row_stack = np.vstack  # type: ignore[attr-defined]
        # A cupy array handed to a kernel must not make numba synchronise its stream: that would be
        # a host synchronisation inside every launch, and illegal inside a capture.
        os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")
        try:
            from numba import cuda  # type: ignore[import-not-found]
        except Exception:  # noqa: BLE001 -- numba missing or broken: no custom kernels here
            cuda = None
        _state["cuda"] = cuda
    return _state["cuda"]


def simulated() -> bool:
    """True where kernels run in numba's CUDA simulator (a CPU)."""
    cuda = numba_cuda()
    return cuda is not None and bool(getattr(cuda, "simulator_enabled", False) or
                                     os.environ.get("NUMBA_ENABLE_CUDASIM") == "1")


def _external_stream(ptr: int) -> Any:
    streams = _state.setdefault("streams", {})
    s = streams.get(ptr)
    if s is None:
        s = streams[ptr] = numba_cuda().external_stream(ptr)
    return s


def launch_on_gpu(kernel: Any, grid: Any, block: Any, args: tuple[Any, ...]) -> None:
    """Launch on cupy's current stream (cupy arrays pass through __cuda_array_interface__)."""
    import cupy  # type: ignore[import-not-found]

    ptr = cupy.cuda.get_current_stream().ptr
    kernel[grid, block, _external_stream(ptr)](*args)


def launch_simulated(kernel: Any, grid: Any, block: Any, args: tuple[Any, ...]) -> None:
    """Run a launch in numba's CUDA simulator on host arrays (plain ndarray views of them)."""
    def one(a: Any) -> Any:
        return a.view(np.ndarray) if isinstance(a, np.ndarray) else a

    # a tuple of arrays (a multi-tensor update's) passes into the simulated kernel as it is, each viewed
    plain = tuple(tuple(one(b) for b in a) if type(a) is tuple else one(a) for a in args)
    kernel[grid, block](*plain)


def blocks(n: int, threads: int = 256) -> tuple[int, int]:
    """(grid, block) covering n threads, one per element."""
    return max(1, (n + threads - 1) // threads), threads


def simulated_module() -> Any:
    """numpy's names with the device module's extras (`launch` in the simulator, `is_capturing`
    False, `host` the identity, `gemm` and `matmul` by numpy): enough to run a GPU kernel of ours
    on a CPU in a test. The launch ledger (kernels/ledger.py) is the counting version of this."""
    import types

    mod = types.ModuleType("flowctl_simulated_xp")
    mod.__dict__.update({k: v for k, v in vars(np).items() if not k.startswith("__")})

    def gemm(a: Any, b: Any, out: Any = None, alpha: float = 1.0, beta: float = 0.0) -> Any:
        r = np.matmul(a, b)
        if alpha != 1.0:
            r = r * r.dtype.type(alpha)
        if out is None:
            return r
        out[...] = r if beta == 0 else r + out * out.dtype.type(beta)
        return out

    mod.__dict__.update(gemm=gemm, launch=lambda k, grid, block, *args: launch_simulated(k, grid, block, args),
                        is_capturing=lambda: False, host=lambda x: x, device_kind="gpu", simulated=True)
    return mod
