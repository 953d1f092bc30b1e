"""The array module a GPU kernel is handed: cupy's names, with the calls a CUDA-graph capture
refuses replaced, and the few operations that are not cupy's added. This is the narrow interface
every GPU kernel reaches the device through; the launch ledger (`kernels/ledger.py`) is the same
interface over numpy, counting what a step launches, synchronises and allocates, and refusing what
a capture refuses.

Beside cupy's names:
- `matmul`, `dot` (2-D): cuBLAS through ctypes (`blas.py`), captured or not;
- `gemm(a, b, out=None, alpha=1, beta=0)`: one product into a given buffer;
- `launch(kernel, grid, block, *args)`: a numba-cuda kernel of ours on the current stream;
- `is_capturing()`: whether the current stream is being captured (a kernel that must read a
  device value to the host, CheckNumerics, does something else then);
- `host(x)`: a device array on the host (a synchronisation: never inside a step that captures);
- `device_kind = "gpu"`, `simulated = False`.
"""
from __future__ import annotations

import types
from typing import Any

from flowctl.kernels.cuda import blas, jit

_modules: dict[int, types.ModuleType] = {}


def device_module(cp: Any) -> types.ModuleType:
    """The GPU array module over `cp` (cupy), made once."""
    mod = _modules.get(id(cp))
    if mod is not None:
        return mod
    mod = types.ModuleType("flowctl_gpu_xp", __doc__)
    mod.__dict__.update({k: v for k, v in vars(cp).items() if not k.startswith("__")})
    mod.cupy = cp

    def matmul(a: Any, b: Any, out: Any = None) -> Any:
        if str(a.dtype) not in blas.FLOATS or a.dtype != b.dtype:  # integers: cupy's own (not capturable)
            return cp.matmul(a, b, out=out)
        if out is not None and a.ndim == 2 and b.ndim == 2 and out.flags.c_contiguous and out.dtype == a.dtype:
            return blas.gemm(cp, a, b, out)
        r = blas.matmul(cp, a, b)
        if out is not None:
            out[...] = r
            return out
        return r

    def dot(a: Any, b: Any, out: Any = None) -> Any:
        if str(a.dtype) not in blas.FLOATS or a.dtype != b.dtype:
            return cp.dot(a, b, out=out)
        if a.ndim == 1 and b.ndim == 1:
            r = (a * b).sum()
        elif a.ndim <= 2 and b.ndim <= 2:
            r = blas.matmul(cp, a, b)
        else:
            return cp.dot(a, b, out=out)
        if out is not None:
            out[...] = r
            return out
        return r

    def gemm(a: Any, b: Any, out: Any = None, alpha: float = 1.0, beta: float = 0.0) -> Any:
        return blas.gemm(cp, a, b, out, alpha, beta)

    def launch(kernel: Any, grid: Any, block: Any, *args: Any) -> None:
        jit.launch_on_gpu(kernel, grid, block, args)

    def is_capturing() -> bool:
        return bool(cp.cuda.get_current_stream().is_capturing())

    def host(x: Any) -> Any:
        return x.get() if isinstance(x, cp.ndarray) else x

    mod.__dict__.update(matmul=matmul, dot=dot, gemm=gemm, launch=launch, is_capturing=is_capturing,
                        host=host, device_kind="gpu", simulated=False)
    _modules[id(cp)] = mod
    return mod
