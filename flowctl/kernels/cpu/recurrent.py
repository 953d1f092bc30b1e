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

from typing import Any, Callable

import numpy as np

from flowctl.kernels import intra
from flowctl.kernels.cpu.jit import LANES, available, compiled, wide_registers
from flowctl.kernels.cpu.team import team
from flowctl.kernels.recurrent import unpack
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
    h_t = np.ascontiguousarray(h).T  # a view: the kernel broadcasts h's values one at a time
    out = np.empty((m, n), np.float32)
    intra.for_chunks(-(-n // LANES), lambda run: kernel(h_t, w, out, run.start, run.stop))
    return out


def _applies(attrs: dict[str, Any], ins: Any) -> bool:
    """Rule: numba present, a target with AVX-512's registers, float32 h and w, both matrices, K at
    least 1. With AVX2's sixteen (a 2-core AMD EPYC) the kernel lost to OpenBLAS: 1.2-1.5x its time
    alone at one thread, about even at two; lstm_lm's step 1.09x at one thread, 1.02x at two
    (alternating, in one process). Why is not measured; the same kernel over W_h packed in
    contiguous panels beats OpenBLAS there, so reading w's rows 10 KB apart is the suspect. The CPU
    plan now packs W_h once a step on every target (engine/recurrent_pack.py, PanelMatMul below:
    two packed panels at a time beat this kernel on AVX-512 too); this variant runs the products
    the pass leaves (a loop's, or fewer than its minimum)."""
    if not available() or not wide_registers():
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


# -- the packed form: PackPanels and PanelMatMul, made by the CPU plan's pass (engine/recurrent_pack.py)

@compiled
def _packed_kernels() -> Any:
    from flowctl.kernels.cpu.gemm_jit import pack_panels, packed_matmul

    return pack_panels, packed_matmul


def pack(w: Any, lanes: int, transpose: bool) -> Any:
    """PackPanels's compiled kernel: w's (or w^T's) columns in panels of `lanes`, split between the
    intra-op threads by panel (a copy: the bits are w's whatever the split)."""
    src = w.T if transpose else w
    k, n = src.shape
    wp = np.empty((-(-n // lanes), k, lanes), w.dtype)
    kernel = _packed_kernels()[0]
    intra.for_chunks(wp.shape[0], lambda run: kernel(src, wp, run.start, run.stop))
    return wp


def panel_matmul(a: Any, wp: Any, n: int, transpose_out: bool) -> Any:
    """a @ w from w packed as wp; the reference's unpacking and BLAS past MAX_ROWS rows of a."""
    m = a.shape[0]
    if m > MAX_ROWS or m == 0 or wp.shape[1] == 0:
        out = a @ unpack(wp, n)
    else:
        kernel = _packed_kernels()[1]
        a = np.ascontiguousarray(a)  # read in place, its transpose a view (no copy: 20 us at 20 x 2600)
        out = np.empty((m, n), np.float32)
        tail = np.empty((m, wp.shape[2]), np.float32)  # the last panel's, made by the one piece holding it
        threads = intra.threads()
        if threads == 1:
            kernel(a.T, wp, out, tail, 0, wp.shape[0])
        elif not team().product(a, wp, out, tail, threads):  # another thread's product holds the team
            intra.for_chunks(wp.shape[0], lambda run: kernel(a.T, wp, out, tail, run.start, run.stop))
    return out.T if transpose_out else out


def _packed_applies(positions: tuple[int, ...], packed_at: int | None = None) -> Callable[[dict[str, Any], Any], bool]:
    def rule(attrs: dict[str, Any], ins: Any) -> bool:
        """Rule: numba present, float32 inputs (float64 keeps the reference's 1e-12 path); for the
        product, panels one vector register wide on this target (16 lanes with AVX-512's registers,
        8 with AVX2's), the width the CPU plan's pass asks the registry for."""
        if not available():
            return False
        try:
            if packed_at is not None and ins[packed_at].shape[2] != register_lanes():
                return False
            return all(ins[i].dtype == "float32" for i in positions)
        except (IndexError, TypeError, AttributeError):
            return False

    return rule


def register_lanes() -> int:
    """float32 lanes in one vector register of the target numba compiles for."""
    return 16 if wide_registers() else 8


@variant("PackPanels", "cpu", "numba", _packed_applies((0,)))
def pack_panels_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    lanes, transpose = attrs["lanes"], attrs["transpose"]
    return lambda w: pack(w, lanes, transpose)


@variant("PanelMatMul", "cpu", "numba", _packed_applies((0, 1), packed_at=1))
def panel_matmul_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    n, transpose_out = attrs["n"], attrs["transpose_out"]
    return lambda a, wp: panel_matmul(a, wp, n, transpose_out)
