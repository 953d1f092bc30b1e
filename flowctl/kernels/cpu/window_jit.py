"""A direct window pass (a convolution without im2col) for inputs of few channels, compiled for
AVX-512 targets: kernels/cpu/conv.py's `direct` variants.

An NHWC input's window at output position (y, x) reads, for each tap row i, kw*C values that are
contiguous in memory once the input is padded along W: x[b, sh*y + i - pt, sw*x + j, c] at
(sw*x)*C + (j*C + c) from the row's start. So one output row's block of `rows` positions times one
panel of 16 output channels is a small GEMM whose A rows start sw*C apart and whose K loop runs
over (j, c) in one stretch per tap row: gemm_jit.py's `fma_block` keeps rows x panels accumulators
in vector registers through all of a window's taps (the intrinsic the recurrent products use), the
filter read as 16-column panels packed once per call (gemm_jit.pack_panels over the filter's
(kh*kw*C, Co) matrix). Tap rows above or below the image are skipped (their terms are zeros).

The stem of Inception-v3 (299x299x3 -> 32, 3x3 stride 2) multiplies K = 27 values per output:
the reference's im2col + GEMM ran at ~30 GFLOP/s there (8.3-9.4 ms at batch 8, 2 threads, a
2-core Xeon), this pass at ~140 (2.2 ms). Each output is one in-order fused sum (tap row, then
tap column and channel), so the bits never depend on how the rows are shared between threads.
"""
from __future__ import annotations

from typing import Any

from numba import literally

from flowctl.kernels.cpu.gemm_jit import fma_block
from flowctl.kernels.cpu.jit import njit

LANES = 16
ROWS = 12  # positions per register block: 12 x 2 panels = 24 accumulators of AVX-512's 32 registers


@njit
def _blocks(xf: Any, wf: Any, of: Any, x0: int, o0: int, row_step: int, segments: int, seg_len: int, seg_x: int,
            seg_w: int, panel_step: int, co: int, wo: int, wp: int, q: int, rows: int, panels: int) -> int:
    """Positions q, q+rows, ... of one output row in blocks of `rows` (a literal, as `panels`) while
    a whole block fits; the first position left."""
    literally(rows)
    literally(panels)
    while q + rows <= wo:
        fma_block(xf, wf, of, x0 + q * row_step, wp, o0 + q * co, row_step, 1, segments, seg_len, seg_x, seg_w,
                  panel_step, LANES, co, rows, panels, LANES)
        q += rows
    return q


@njit
def _row(xf: Any, wf: Any, of: Any, x0: int, o0: int, row_step: int, segments: int, seg_len: int, seg_x: int,
         seg_w: int, panel_step: int, co: int, wo: int, w0: int) -> None:
    """One output row: wo positions x every panel of co, positions in blocks of ROWS, 4 and 1,
    panels two at a time (one alone where co/16 is odd)."""
    panels = co // LANES
    p = 0
    while p < panels:
        wp, op = w0 + p * panel_step, o0 + p * LANES
        if p + 2 <= panels:
            q = _blocks(xf, wf, of, x0, op, row_step, segments, seg_len, seg_x, seg_w, panel_step, co, wo, wp, 0, ROWS, 2)
            q = _blocks(xf, wf, of, x0, op, row_step, segments, seg_len, seg_x, seg_w, panel_step, co, wo, wp, q, 4, 2)
            _blocks(xf, wf, of, x0, op, row_step, segments, seg_len, seg_x, seg_w, panel_step, co, wo, wp, q, 1, 2)
            p += 2
        else:
            q = _blocks(xf, wf, of, x0, op, row_step, segments, seg_len, seg_x, seg_w, panel_step, co, wo, wp, 0, ROWS, 1)
            q = _blocks(xf, wf, of, x0, op, row_step, segments, seg_len, seg_x, seg_w, panel_step, co, wo, wp, q, 4, 1)
            _blocks(xf, wf, of, x0, op, row_step, segments, seg_len, seg_x, seg_w, panel_step, co, wo, wp, q, 1, 1)
            p += 1


@njit
def window_rows(xp: Any, wp: Any, out: Any, kh: int, kw: int, sh: int, sw: int, pt: int, r0: int, r1: int) -> None:
    """Rows r0:r1 of out (N, Ho, Wo, Co) seen as N*Ho output rows. xp (N, H, W', C): the input,
    already padded along W (W' >= (Wo-1)*sw + kw); along H tap rows outside the image are skipped;
    wp (Co/16, kh*kw*C, 16): the filter's packed panels; pt: the padding above."""
    n, h, wpad, c = xp.shape
    ho, wo, co = out.shape[1], out.shape[2], out.shape[3]
    xf, wf, of = xp.reshape(-1), wp.reshape(-1), out.reshape(-1)
    panel_step = wp.shape[1] * LANES
    seg_len = kw * c
    for row in range(r0, r1):
        b = row // ho
        top = sh * (row - b * ho) - pt
        i_lo = max(0, -top)
        i_hi = min(kh, h - top)
        o0 = row * wo * co
        if i_hi <= i_lo:  # every tap row outside the image: zeros
            for i in range(wo * co):
                of[o0 + i] = 0.0
            continue
        _row(xf, wf, of, ((b * h + top + i_lo) * wpad) * c, o0, sw * c, i_hi - i_lo, seg_len, wpad * c,
             seg_len * LANES, panel_step, co, wo, i_lo * seg_len * LANES)
