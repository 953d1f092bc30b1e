"""A direct window pass (a convolution without im2col) for inputs of few channels, compiled for
AVX-512 targets: kernels/cpu/conv.py's `direct` variants.

An NHWC input's window at output position (y, x) reads, for each tap row i, kw*C values that are
contiguous in memory once the input is padded along W: x[b, sh*y + i - pt, sw*x + j, c] at
(sw*x)*C + (j*C + c) from the row's start. So one output row's block of `rows` positions times one
panel of 16 output channels is a small GEMM whose A rows start sw*C apart and whose K loop runs
over (j, c) in one stretch per tap row: `window_panel` keeps rows x panels accumulators in vector
registers through all of a window's taps (an LLVM-IR intrinsic, as gemm_jit.py's `panel`), the
filter read as 16-column panels packed once per call (gemm_jit.pack_panels over the filter's
(kh*kw*C, Co) matrix). Tap rows above or below the image are skipped (their terms are zeros).

The stem of Inception-v3 (299x299x3 -> 32, 3x3 stride 2) multiplies K = 27 values per output:
the reference's im2col + GEMM ran at ~30 GFLOP/s there (8.3-9.4 ms at batch 8, 2 threads, a
2-core Xeon), this pass at ~140 (2.2 ms). Each output is one in-order fused sum (tap row, then
tap column and channel), so the bits never depend on how the rows are shared between threads.
"""
from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import literally, types
from numba.core import cgutils
from numba.extending import intrinsic

from flowctl.kernels.cpu.jit import njit

LANES = 16
ROWS = 12  # positions per register block: 12 x 2 panels = 24 accumulators of AVX-512's 32 registers


@intrinsic
def window_panel(typingctx: Any, x: Any, w: Any, o: Any, x0: Any, w0: Any, o0: Any, row_step: Any, segments: Any,
                 seg_len: Any, seg_x: Any, seg_w: Any, panel_step: Any, o_row: Any, rows: Any, panels: Any) -> Any:
    """o[o0 + r*o_row + p*16 + l] = sum over s < segments, k < seg_len of
    x[x0 + s*seg_x + r*row_step + k] * w[w0 + s*seg_w + p*panel_step + k*16 + l], for r < rows,
    p < panels, l < 16 (rows and panels literals; x, w, o flat float32 arrays)."""
    if not (isinstance(rows, types.IntegerLiteral) and isinstance(panels, types.IntegerLiteral)):
        return None
    nr, npn = rows.literal_value, panels.literal_value
    sig = types.void(x, w, o, x0, w0, o0, row_step, segments, seg_len, seg_x, seg_w, panel_step, o_row, rows, panels)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        xa, wa, oa = (context.make_array(signature.args[i])(context, builder, args[i]) for i in range(3))
        x0v, w0v, o0v, rstep, segn, segl, segx, segw, pstep, orow = args[3:13]
        i64, f32 = ir.IntType(64), ir.FloatType()
        vec = ir.VectorType(f32, LANES)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]),
                                             f"llvm.fma.v{LANES}f32")
        splat_mask = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
        # accumulators in stack slots, which LLVM's passes promote to registers (r * panels + p)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * LANES)) for _ in range(nr * npn)]
        with cgutils.for_range(builder, segn) as seg:
            x_seg = builder.add(x0v, builder.mul(seg.index, segx))
            w_seg = builder.add(w0v, builder.mul(seg.index, segw))
            with cgutils.for_range(builder, segl) as kk:
                w_row = builder.add(w_seg, builder.mul(kk.index, ir.Constant(i64, LANES)))
                wvs = []
                for p in range(npn):
                    at = builder.gep(wa.data, [builder.add(w_row, builder.mul(pstep, ir.Constant(i64, p)))])
                    wvs.append(builder.load(builder.bitcast(at, vec.as_pointer()), align=4))
                x_k = builder.add(x_seg, kk.index)
                for r in range(nr):
                    xv = builder.load(builder.gep(xa.data, [builder.add(x_k, builder.mul(rstep, ir.Constant(i64, r)))]))
                    one = builder.insert_element(ir.Constant(vec, ir.Undefined), xv, ir.Constant(ir.IntType(32), 0))
                    splat = builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), splat_mask)
                    for p in range(npn):
                        acc = accs[r * npn + p]
                        builder.store(builder.call(fma, [splat, wvs[p], builder.load(acc)]), acc)
        for r in range(nr):
            o_r = builder.add(o0v, builder.mul(orow, ir.Constant(i64, r)))
            for p in range(npn):
                at = builder.gep(oa.data, [builder.add(o_r, ir.Constant(i64, p * LANES))])
                builder.store(builder.load(accs[r * npn + p]), builder.bitcast(at, vec.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit
def _blocks(xf: Any, wf: Any, of: Any, x0: int, o0: int, row_step: int, segments: int, seg_len: int, seg_x: int,
            seg_w: int, panel_step: int, co: int, wo: int, wp: int, q: int, rows: int, panels: int) -> int:
    """Positions q, q+rows, ... of one output row in blocks of `rows` (a literal, as `panels`) while
    a whole block fits; the first position left."""
    literally(rows)
    literally(panels)
    while q + rows <= wo:
        window_panel(xf, wf, of, x0 + q * row_step, wp, o0 + q * co, row_step, segments, seg_len, seg_x, seg_w,
                     panel_step, co, rows, panels)
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
