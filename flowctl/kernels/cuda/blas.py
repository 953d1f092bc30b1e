"""Matrix products on a GPU through cuBLAS, called with ctypes on a handle of our own.

cupy refuses every cuBLAS call while a stream is being captured into a CUDA graph ("calling cuBLAS
API during stream capture is currently unsupported"), through `a @ b` and its own cublas module
alike; cuBLAS itself captures (measured on an H200: 100 GEMMs + 200 element-wise kernels captured
through ctypes on cupy's stream replay correctly, 3.9 -> 1.36 ms). So a GPU step's products come
here, captured or not: the same call both ways, the same bits.

The handle is ours (not cupy's, whose pointer mode and workspace cupy's own calls change): made
once per device before any capture (cublasCreate fails inside one), bound to the current stream
and an explicit workspace at every call (cublasSetStream resets the workspace, and a workspace
cuBLAS allocated itself inside a capture would be freed under the graph).

What "float32" means here (`set_fp32_products`): TF32 tensor-core products by default, as cuDNN's
convolutions (and PyTorch's with allow_tf32) compute them -- 10 mantissa bits in the product
inputs, float32 accumulation -- or IEEE float32 ("ieee"), PyTorch's default for matmul. A run
records which it used.
"""
from __future__ import annotations

import ctypes
import glob
import os
import threading
from typing import Any

import numpy as np

# cudaDataType and cublasComputeType_t values (cuBLAS headers).
_CUDA_R = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 14}
FLOATS = frozenset(_CUDA_R)
_COMPUTE_32F, _COMPUTE_32F_FAST_TF32, _COMPUTE_64F = 68, 77, 70
_GEMM_DEFAULT = -1
_OP_N, _OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20

FP32_MODES = ("tf32", "ieee")
_mode = {"fp32": os.environ.get("FLOWCTL_GPU_FP32", "tf32")}
_lock = threading.Lock()
_lib: dict[str, Any] = {}


def set_fp32_products(mode: str) -> None:
    """How float32 products run on a GPU from now on: "tf32" (tensor cores, the default) or
    "ieee" (full float32)."""
    if mode not in FP32_MODES:
        raise ValueError(f"fp32 products are 'tf32' or 'ieee', not {mode!r}")
    _mode["fp32"] = mode


def fp32_products() -> str:
    return _mode["fp32"]


class CublasError(RuntimeError):
    pass


def _load() -> Any:
    if "lib" in _lib:
        return _lib["lib"]
    lib = None
    for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            pass
    if lib is None:  # the pip wheel's copy (nvidia-cublas), where the loader path does not reach it
        try:
            import nvidia.cublas  # type: ignore[import-not-found]

            for root in list(nvidia.cublas.__path__):
                for path in sorted(glob.glob(os.path.join(root, "lib", "libcublas.so*")), reverse=True):
                    try:
                        lib = ctypes.CDLL(path)
                        break
                    except OSError:
                        pass
        except ImportError:
            pass
    if lib is None:
        raise CublasError("libcublas was not found (cupy's CUDA libraries or the nvidia-cublas wheel)")
    p, i, c = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(p)]
    lib.cublasSetStream_v2.argtypes = [p, p]
    lib.cublasSetWorkspace_v2.argtypes = [p, p, ctypes.c_size_t]
    lib.cublasGemmEx.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
    lib.cublasGemmStridedBatchedEx.argtypes = [p, i, i, i, i, i, p, p, i, i, c, p, i, i, c, p, p, i, i, c, i, i, i]
    _lib["lib"] = lib
    return lib


class _Device:
    """One device's handle and workspace."""

    def __init__(self, cp: Any) -> None:
        lib = _load()
        h = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        self.handle = h
        self.workspace = cp.empty(WORKSPACE_BYTES, dtype=cp.uint8)


_devices: dict[int, _Device] = {}


def _device(cp: Any) -> _Device:
    index = cp.cuda.runtime.getDevice()
    d = _devices.get(index)
    if d is None:
        with _lock:
            d = _devices.get(index)
            if d is None:
                d = _devices[index] = _Device(cp)
    return d


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasError(f"{what} failed with cuBLAS status {status}")


def prepare(cp: Any) -> None:
    """Make this device's handle now (never inside a capture)."""
    _device(cp)


def _operand(x: Any) -> tuple[int, int]:
    """(op, leading dimension) of a row-major 2-D operand as cuBLAS's column-major sees it: a
    C-ordered matrix (rows of stride ld) is its transpose; a transposed view (columns of stride
    ld) is itself. Raises ValueError on any other layout (the caller copies)."""
    r, c = x.shape
    s0, s1 = (s // x.itemsize for s in x.strides)
    if s1 == 1 and (s0 >= max(1, c) or r == 1):
        return _OP_N, max(s0, c, 1)  # column-major: x^T with ld = row stride
    if s0 == 1 and (s1 >= max(1, r) or c == 1):
        return _OP_T, max(s1, r, 1)
    raise ValueError("operand layout")


def _plain(cp: Any, x: Any) -> Any:
    try:
        _operand(x)
        return x
    except ValueError:
        return cp.ascontiguousarray(x)


def _compute(dtype: str) -> tuple[int, Any]:
    if dtype == "float64":
        return _COMPUTE_64F, ctypes.c_double
    if dtype == "float32" and _mode["fp32"] == "tf32":
        return _COMPUTE_32F_FAST_TF32, ctypes.c_float
    return _COMPUTE_32F, ctypes.c_float  # float32 (ieee), float16, bfloat16: float32 accumulation


def gemm(cp: Any, a: Any, b: Any, out: Any = None, alpha: float = 1.0, beta: float = 0.0) -> Any:
    """out = alpha * (a @ b) + beta * out for 2-D a (m x k) and b (k x n), any strides cuBLAS can
    read (a transposed view costs nothing). `out` (m x n, C-ordered) is made when not given."""
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"gemm: shapes {a.shape} and {b.shape} do not align")
    dtype = str(a.dtype)
    if str(b.dtype) != dtype or dtype not in _CUDA_R:
        raise TypeError(f"gemm: operands of {a.dtype} and {b.dtype}")
    if out is None:
        out = cp.empty((m, n), dtype=a.dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        out[...] = 0 if beta == 0 else out * beta
        return out
    a, b = _plain(cp, a), _plain(cp, b)
    args = gemm_args(a, b)
    d = _device(cp)
    lib = _load()
    compute, scalar = _compute(dtype)
    one, zero = scalar(alpha), scalar(beta)
    t = _CUDA_R[dtype]
    _check(lib.cublasSetStream_v2(d.handle, cp.cuda.get_current_stream().ptr), "cublasSetStream")
    _check(lib.cublasSetWorkspace_v2(d.handle, d.workspace.data.ptr, WORKSPACE_BYTES), "cublasSetWorkspace")
    op1, op2, rows, cols, inner, ld1, ld2, ldc = args
    _check(lib.cublasGemmEx(d.handle, op1, op2, rows, cols, inner, ctypes.byref(one), b.data.ptr, t, ld1,
                            a.data.ptr, t, ld2, ctypes.byref(zero), out.data.ptr, t, ldc, compute, _GEMM_DEFAULT),
           f"cublasGemmEx {m}x{k}x{n} {dtype}")
    return out


def gemm_args(a: Any, b: Any) -> tuple[int, int, int, int, int, int, int, int]:
    """cublasGemmEx's (transa, transb, m, n, k, lda, ldb, ldc) for row-major out = a @ b into a
    C-ordered out: column-major out^T = b^T a^T, so cuBLAS's first operand is b (tests/
    test_cuda_blas.py checks the mapping against a column-major GEMM written in numpy)."""
    m, k = a.shape
    n = b.shape[1]
    op_a, lda = _operand(a)
    op_b, ldb = _operand(b)
    return op_b, op_a, n, m, k, ldb, lda, n


def matmul(cp: Any, a: Any, b: Any) -> Any:
    """np.matmul's semantics (1-D operands, broadcast batch dimensions) through `gemm`."""
    return matmul_by(cp, a, b, lambda x, y, out=None: gemm(cp, x, y, out))


def matmul_by(xp: Any, a: Any, b: Any, gemm2: Any) -> Any:
    """np.matmul's semantics through `gemm2(a, b, out=None)`, one 2-D product per batch entry (the
    device module's and the launch ledger's, which counts them)."""
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError("matmul: scalar operands")
    va, vb = a.ndim == 1, b.ndim == 1
    a2 = a[None, :] if va else a
    b2 = b[:, None] if vb else b
    if a2.ndim == 2 and b2.ndim == 2:
        out = gemm2(a2, b2)
    else:
        batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
        a3 = xp.broadcast_to(a2, batch + a2.shape[-2:]).reshape((-1,) + a2.shape[-2:]) \
            if a2.shape[:-2] != batch else a2.reshape((-1,) + a2.shape[-2:])
        b3 = xp.broadcast_to(b2, batch + b2.shape[-2:]).reshape((-1,) + b2.shape[-2:]) \
            if b2.shape[:-2] != batch else b2.reshape((-1,) + b2.shape[-2:])
        out = xp.empty((a3.shape[0], a3.shape[1], b3.shape[2]), dtype=a.dtype)
        for i in range(a3.shape[0]):
            gemm2(a3[i], b3[i], out[i])
        out = out.reshape(batch + out.shape[1:])
    if va:
        out = out[..., 0, :]
    if vb:
        out = out[..., 0]
    return out
