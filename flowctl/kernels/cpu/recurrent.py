"""The recurrent product h_{t-1} W_h (RecurrentMatMul) compiled for the CPU: W_h read where it is,
not packed (kernels/cpu/gemm_jit.py says how and why), its 16-column panels shared between the
intra-op threads. The reference is kernels/recurrent.py's h @ w through BLAS.

Measured on lstm_lm's shapes (20 x 650 @ 650 x 2600, 2 threads, the step's own order): 0.42 ms a
product in the step against OpenBLAS's 0.54 (0.39 against 0.52 with W_h hot in cache); lstm_lm's
forward takes 68 of them. Taken for float32 (float64 keeps the reference's 1e-12 path) and at most
MAX_ROWS rows, checked when the kernel runs (a graph's batch size is unknown until then): past it
each panel reads h's whole transpose again, and the BLAS keeps those products (not measured).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from flowctl.kernels import intra
from flowctl.kernels.cpu.jit import LANES, available, compiled
from flowctl.kernels.registry import variant

Fn = Callable[..., Any]

MAX_ROWS = 64


@compiled
def _kernel() -> Any:
    from flowctl.kernels.cpu.gemm_jit import few_rows_matmul

    return few_rows_matmul


def matmul(h: Any, w: Any) -> Any:
    """h @ w for float32 h (M, K) and w (K, N) with w's rows contiguous; the BLAS's past MAX_ROWS rows."""
    m, n = h.shape[0], w.shape[1]
    if m > MAX_ROWS or m == 0 or w.shape[0] == 0 or w.strides[1] != w.itemsize:  # panel's loop runs k = 0 first
        return h @ w
    kernel = _kernel()
    h_t = np.ascontiguousarray(h.T)
    out = np.empty((m, n), np.float32)
    intra.for_chunks(-(-n // LANES), lambda run: kernel(h_t, w, out, run.start, run.stop))
    return out


@functools.cache
def _wide_registers() -> bool:
    from flowctl.kernels.cpu.gemm_jit import wide_registers

    return wide_registers()


def _applies(attrs: dict[str, Any], ins: Any) -> bool:
    """Rule: numba present, a target with AVX-512's registers, float32 h and w, both matrices, K at
    least 1. With AVX2's sixteen (a 2-core AMD EPYC) the kernel lost to OpenBLAS: 1.2-1.5x its time
    alone at one thread, about even at two; lstm_lm's step 1.09x at one thread, 1.02x at two
    (alternating, in one process). Why is not measured; the same kernel over W_h packed in
    contiguous panels beat OpenBLAS there (a micro-benchmark), so reading w's rows 10 KB apart is
    the suspect."""
    if not available() or not _wide_registers():
        return False
    try:
        h, w = ins[0], ins[1]
        return (h.dtype == "float32" and w.dtype == "float32" and len(h.shape) == 2 and len(w.shape) == 2
                and w.shape[0] not in (None, 0))
    except (IndexError, TypeError, AttributeError):
        return False


@variant("RecurrentMatMul", "cpu", "numba", _applies)
def recurrent_matmul_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda h, w, w_t=None: matmul(h, w)
