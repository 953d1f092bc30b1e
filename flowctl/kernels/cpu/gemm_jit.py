"""A product with few rows, h @ w for h (M, K) and w (K, N), M small (an RNN's batch), compiled
for the CPU: the recurrent product of kernels/cpu/recurrent.py.

OpenBLAS packs w into its own layout on every call, reading and writing the whole (K, N) matrix
before it multiplies; with 20 rows that copy costs as much as the product. Here w is read where it
is: the output is cut into panels of 16 columns (one 512-bit register of float32), and for each
panel and each block of up to ROWS rows (as many as the target's vector registers hold), one loop
over k keeps the block's accumulators in vector registers, adding h[r, k] * w[k, panel] with one
fused multiply-add per row (`panel`, through `fma_block`, LLVM IR in a numba intrinsic: numba's own
loops leave such accumulators in memory; window_jit.py's direct convolution uses it too). The
panel's column of w (K x 64 bytes) stays in L1/L2 while the row blocks take turns over it.

Each output is one sum over k in order 0..K-1, each term added with one rounding (fused), in
float32: the reference's BLAS adds in blocks of its own choosing, so the two agree to float32
rounding (tested against the float64 product), and the bits never depend on how the panels are
shared between threads. A module of its own, with every helper a module global, so that numba's
cache finds the compiled code again in the next process (winograd_jit.py says why).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import literally, types
from numba.core import cgutils
from numba.extending import intrinsic

from flowctl.kernels.cpu.jit import LANES, njit, wide_registers


# Rows per register block, so that its accumulators, w's vector and h's broadcast fit the vector
# registers: AVX-512's 32 hold 10 accumulators of 16 lanes (one register each) + 2; AVX2's 16 hold
# 6 of two 256-bit halves each + 3. Ten rows on AVX2 left accumulators in memory: 20 x 650 @ 650 x
# 2600 took 2.7-8 ms against OpenBLAS's 1.1-1.5 (one thread, a 2-core AMD EPYC), six 1.2-1.3. The
# bits do not depend on it: each output is one in-order sum over k whatever block its row is in.
# numba's cache keys the machine code by the target's features, so one host's block never loads
# on the other.
ROWS = 10 if wide_registers() else 6


@intrinsic
def fma_block(typingctx: Any, x: Any, w: Any, o: Any, x0: Any, w0: Any, o0: Any, row_step: Any, x_k: Any,
              segments: Any, seg_len: Any, seg_x: Any, seg_w: Any, panel_step: Any, w_k: Any, o_row: Any,
              rows: Any, panels: Any, lanes: Any) -> Any:
    """A register block of a small GEMM: for r < rows, p < panels, l < lanes,
    o[o0 + r*o_row + p*lanes + l] = sum over s < segments, k < seg_len of
    x[x0 + s*seg_x + r*row_step + k*x_k] * w[w0 + s*seg_w + p*panel_step + k*w_k + l],
    the rows x panels accumulators held in vector registers through every k and segment, one fused
    multiply-add per term, each output summed in order (s, then k). Offsets count float32 elements
    from each array's first (x, w, o: float32 arrays of any shape and strides; rows, panels and
    lanes literals). Each x value is loaded once and broadcast to all the panels. The recurrent
    products (`panel` below: one segment, A given transposed) and the direct window pass
    (window_jit.py: one segment per tap row, A's rows overlapping) are both this."""
    if not all(isinstance(a, types.IntegerLiteral) for a in (rows, panels, lanes)):
        return None
    nr, npn, nv = rows.literal_value, panels.literal_value, lanes.literal_value
    sig = types.void(x, w, o, x0, w0, o0, row_step, x_k, segments, seg_len, seg_x, seg_w, panel_step, w_k, o_row,
                     rows, panels, lanes)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        xa, wa, oa = (context.make_array(signature.args[i])(context, builder, args[i]) for i in range(3))
        x0v, w0v, o0v, rstep, xk, segn, segl, segx, segw, pstep, wk, orow = args[3:15]
        i64, f32 = ir.IntType(64), ir.FloatType()
        vec = ir.VectorType(f32, nv)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]),
                                             f"llvm.fma.v{nv}f32")
        splat_mask = ir.Constant(ir.VectorType(ir.IntType(32), nv), [0] * nv)
        # accumulators in stack slots, which LLVM's passes promote to registers (r * panels + p)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * nv)) for _ in range(nr * npn)]
        with cgutils.for_range(builder, segn) as seg:
            x_seg = builder.add(x0v, builder.mul(seg.index, segx))
            w_seg = builder.add(w0v, builder.mul(seg.index, segw))
            with cgutils.for_range(builder, segl) as kk:
                w_row = builder.add(w_seg, builder.mul(kk.index, wk))
                wvs = []
                for p in range(npn):
                    at = builder.gep(wa.data, [builder.add(w_row, builder.mul(pstep, ir.Constant(i64, p)))])
                    wvs.append(builder.load(builder.bitcast(at, vec.as_pointer()), align=4))
                x_k_at = builder.add(x_seg, builder.mul(kk.index, xk))
                for r in range(nr):
                    xv = builder.load(builder.gep(xa.data, [builder.add(x_k_at, builder.mul(rstep, ir.Constant(i64, r)))]))
                    one = builder.insert_element(ir.Constant(vec, ir.Undefined), xv, ir.Constant(ir.IntType(32), 0))
                    splat = builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), splat_mask)
                    for p in range(npn):
                        acc = accs[r * npn + p]
                        builder.store(builder.call(fma, [splat, wvs[p], builder.load(acc)]), acc)
        for r in range(nr):
            o_r = builder.add(o0v, builder.mul(orow, ir.Constant(i64, r)))
            for p in range(npn):
                at = builder.gep(oa.data, [builder.add(o_r, ir.Constant(i64, p * nv))])
                builder.store(builder.load(accs[r * npn + p]), builder.bitcast(at, vec.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit
def panel(h_t: Any, w: Any, out: Any, j0: int, r0: int, k_len: int, rows: int, lanes: int, panels: int,
          panel_step: int) -> None:
    """out[r0:r0+rows, j0 + p*lanes : j0 + (p+1)*lanes] = sum over k < k_len of h_t[k, r0:r0+rows] (x)
    w's panel p for p < panels, where panel p's row k starts panel_step elements after panel 0's
    (w's own columns: lanes; packed panels: K * lanes); rows, lanes and panels literals, float32
    2-D arrays, w and out with unit column stride (any row stride), h_t with any strides (h's
    transpose as a view: its values are broadcast one at a time)."""
    literally(rows)
    literally(lanes)
    literally(panels)
    hk, hr, ws, os = h_t.strides[0] // 4, h_t.strides[1] // 4, w.strides[0] // 4, out.strides[0] // 4
    fma_block(h_t, w, out, r0 * hr, j0, r0 * os + j0, hr, hk, 1, k_len, 0, 0, panel_step, ws, os, rows, panels,
              lanes)


@njit
def _columns(h_t: Any, w: Any, out: Any, j: int, lanes: int) -> None:
    """out[:, j:j+lanes] (lanes 16 or 8, compiled once for each), the rows in blocks of ROWS, 4, 2 and 1."""
    literally(lanes)
    k_len, m = h_t.shape
    r = 0
    while r + ROWS <= m:
        panel(h_t, w, out, j, r, k_len, ROWS, lanes, 1, 0)
        r += ROWS
    while r + 4 <= m:
        panel(h_t, w, out, j, r, k_len, 4, lanes, 1, 0)
        r += 4
    while r + 2 <= m:
        panel(h_t, w, out, j, r, k_len, 2, lanes, 1, 0)
        r += 2
    while r < m:
        panel(h_t, w, out, j, r, k_len, 1, lanes, 1, 0)
        r += 1


@njit
def few_rows_matmul(h_t: Any, w: Any, out: Any, p0: int, p1: int) -> None:
    """out[:, 16*p0 : min(16*p1, N)] = (h_t^T @ w) there: panels p0:p1 of 16 columns, the last one
    (N not a multiple of 16) in 8 lanes and then one column at a time, summed in the same order."""
    k_len, m = h_t.shape
    n = w.shape[1]
    for p in range(p0, p1):
        j = p * LANES
        if j + LANES <= n:
            _columns(h_t, w, out, j, LANES)
            continue
        if j + 8 <= n:
            _columns(h_t, w, out, j, 8)
            j += 8
        for jj in range(j, n):
            for r in range(m):
                s = np.float32(0)
                for k in range(k_len):
                    s += h_t[k, r] * w[k, jj]
                out[r, jj] = s


# The packed form (kernels/cpu/recurrent.py's PackPanels and PanelMatMul): w's columns in panels
# of `lanes`, each panel's K x lanes block contiguous, wp[p, k, l] = w[k, p * lanes + l], the last
# panel zero past N. A panel is then one stream of K * lanes floats instead of K rows 4 N bytes
# apart. Ten rows per register block: 10 accumulators of one register each (16 lanes in AVX-512's
# 32 registers, 8 in AVX2's 16) + w's vector + h's broadcast; with 16 lanes, two panels at once
# (PAIR): 20 accumulators, and each broadcast h value feeds two fused multiply-adds, so a k step
# is 12 loads for 20 of them instead of 11 for 10. Measured on lstm_lm's forward shapes (20 x 650
# @ 650 x 2560, W_h packed, a 2-core Xeon with AVX-512): one panel 0.62 ms a product at one thread,
# 0.49 at two; two panels 0.49 and 0.43 (with W_h in L2, 150 against 114 GFLOP/s at one thread).
PACKED_ROWS = 10
PAIR = 16  # the lanes at which panels are taken two at a time


@njit
def pack_panels(w: Any, wp: Any, p0: int, p1: int) -> None:
    """wp[p0:p1] = w's columns p0*lanes : p1*lanes in the packed form (zeros past N). A whole panel
    of 16 or 8 lanes copies its rows at a width known when compiled (one vector each): lstm_lm's
    650 x 2600 W_h 0.61-1.37 -> 0.36-0.62 ms on two threads, W_h^T (a strided view) 0.73-1.09 ->
    0.38-0.61 (two sittings, medians of ten, alternating)."""
    k_len, n = w.shape
    lanes = wp.shape[2]
    for p in range(p0, p1):
        j0 = p * lanes
        width = min(lanes, n - j0)
        if width == 16 and lanes == 16:
            for k in range(k_len):
                row, dst = w[k, j0:j0 + 16], wp[p, k]
                for l in range(16):
                    dst[l] = row[l]
        elif width == 8 and lanes == 8:
            for k in range(k_len):
                row, dst = w[k, j0:j0 + 8], wp[p, k]
                for l in range(8):
                    dst[l] = row[l]
        else:
            for k in range(k_len):
                for l in range(width):
                    wp[p, k, l] = w[k, j0 + l]
                for l in range(width, lanes):
                    wp[p, k, l] = 0


@njit
def _packed_columns(h_t: Any, wpp: Any, out: Any, lanes: int, panels: int, step: int) -> None:
    """out[:, :panels*lanes] = h_t^T @ the `panels` panels from wpp (K, lanes) on, each `step`
    elements after the one before; the rows in blocks of PACKED_ROWS, 4 and 1."""
    literally(lanes)
    literally(panels)
    k_len, m = h_t.shape
    r = 0
    while r + PACKED_ROWS <= m:
        panel(h_t, wpp, out, 0, r, k_len, PACKED_ROWS, lanes, panels, step)
        r += PACKED_ROWS
    while r + 4 <= m:
        panel(h_t, wpp, out, 0, r, k_len, 4, lanes, panels, step)
        r += 4
    while r < m:
        panel(h_t, wpp, out, 0, r, k_len, 1, lanes, panels, step)
        r += 1


@njit
def packed_matmul(h_t: Any, wp: Any, out: Any, tail: Any, p0: int, p1: int) -> None:
    """out[:, lanes*p0 : min(lanes*p1, N)] = (h_t^T @ w) there, w given packed as wp (P, K, lanes);
    a last panel past N is made in `tail` (M, lanes), and its columns up to N copied out. Each
    output is one in-order fused sum over k, as few_rows_matmul's, whatever panels it was made with."""
    m, n = out.shape
    lanes = wp.shape[2]
    step = wp.strides[0] // 4
    p = p0
    while p < p1:
        j0 = p * lanes
        if lanes == PAIR and p + 1 < p1 and j0 + 2 * lanes <= n:
            _packed_columns(h_t, wp[p], out[:, j0:], PAIR, 2, step)
            p += 2
            continue
        if j0 + lanes <= n:
            if lanes == 16:
                _packed_columns(h_t, wp[p], out[:, j0:], 16, 1, step)
            else:
                _packed_columns(h_t, wp[p], out[:, j0:], 8, 1, step)
        else:
            if lanes == 16:
                _packed_columns(h_t, wp[p], tail, 16, 1, step)
            else:
                _packed_columns(h_t, wp[p], tail, 8, 1, step)
            for r in range(m):
                for j in range(n - j0):
                    out[r, j0 + j] = tail[r, j]
        p += 1
