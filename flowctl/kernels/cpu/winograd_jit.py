"""The compiled transforms of kernels/cpu/winograd.py (its docstring says what they compute).

A module of their own, imported by `winograd._kernels()` on first use (numba is imported only when
a Winograd convolution runs), with every helper and constant a module global: numba keys its
on-disk cache on a function's code and the pickled contents of its closure, and a dispatcher
pickles differently in every process, so kernels that close over their helpers compile afresh in
each process (measured: 4.5 s for these three on every start). Globals are frozen at compile time
and leave the key alone.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flowctl.kernels.cpu.jit import LANES, njit

# The six-point transforms written out (zeros skipped, +-1 as additions), their constants
# float32 as the matrices' are: B^T (6 -> 6, any F(m, r) at six points: the same points), and
# F(4, 3)'s A^T (6 -> 4) and A (4 -> 6). Each sums its terms in column order, as the general
# loops below do, so both paths give the same bits; tests check each against `transforms`.
_HALF, _QUARTER, _EIGHTH, _Q3, _P2, _P4 = (np.float32(v) for v in (0.5, 0.25, 0.125, 0.75, 0.2, 0.4))
_TWO, _FOUR, _EIGHT = np.float32(2), np.float32(4), np.float32(8)


@njit(inline=True)
def bt6(d0: Any, d1: Any, d2: Any, d3: Any, d4: Any, d5: Any) -> tuple:
    return (_HALF * d0 - _Q3 * d1 - d2 + _Q3 * d3 + _HALF * d4,
            -_P4 * d1 + _P2 * d2 + d3 + _P4 * d4,
            -_P4 * d1 + d2 - _P2 * d3 - _P4 * d4,
            d1 + _HALF * d2 - d3 - _HALF * d4,
            _HALF * d1 - d2 - _HALF * d3 + d4,
            _HALF * d1 - _Q3 * d2 - d3 + _Q3 * d4 + _HALF * d5)


@njit(inline=True)
def at4(m0: Any, m1: Any, m2: Any, m3: Any, m4: Any, m5: Any) -> tuple:
    return (m0 + m1 + m2 + m3 + m4, m1 - m2 + _HALF * m3 - _TWO * m4,
            m1 + m2 + _QUARTER * m3 + _FOUR * m4, m1 - m2 + _EIGHTH * m3 - _EIGHT * m4 + m5)


@njit(inline=True)
def a4(d0: Any, d1: Any, d2: Any, d3: Any) -> tuple:
    return (d0, d0 + d1 + d2 + d3, d0 - d1 + d2 - d3, d0 + _HALF * d1 + _QUARTER * d2 + _EIGHTH * d3,
            d0 - _TWO * d1 + _FOUR * d2 - _EIGHT * d3, d3)


@njit(inline=True)
def axpy(out: Any, a: Any, src: Any) -> None:
    """out += a * src, element by element in order (the loops below over a tile's channels)."""
    for ch in range(out.shape[0]):
        out[ch] += a * src[ch]


@njit
def origin(t: int, tiles_h: int, tiles_w: int, mh: int, mw: int) -> tuple[int, int, int]:
    """(image, first output row, first output column) of tile t (tiles image by image, row-major)."""
    n, rest = t // (tiles_h * tiles_w), t % (tiles_h * tiles_w)
    return n, (rest // tiles_w) * mh, (rest % tiles_w) * mw

# The straight-line paths work on LANES channels at a time in small buffers (a: in, b: out,
# s: between the two axes), so that every access is at a fixed offset and the lanes vectorise.

@njit(inline=True)
def input_block(a: Any, s: Any, b: Any) -> None:
    """b[k*6 + l] = (B^T P B)[k, l] for the 6x6 patch P in a (row-major)."""
    for j in range(6):
        for q in range(LANES):
            o = bt6(a[j, q], a[6 + j, q], a[12 + j, q], a[18 + j, q], a[24 + j, q], a[30 + j, q])
            s[j, q], s[6 + j, q], s[12 + j, q], s[18 + j, q], s[24 + j, q], s[30 + j, q] = o
    for k in range(6):
        for q in range(LANES):
            o = bt6(s[6 * k, q], s[6 * k + 1, q], s[6 * k + 2, q], s[6 * k + 3, q], s[6 * k + 4, q],
                    s[6 * k + 5, q])
            b[6 * k, q], b[6 * k + 1, q], b[6 * k + 2, q], b[6 * k + 3, q], b[6 * k + 4, q], b[6 * k + 5, q] = o


@njit(inline=True)
def output_block(a: Any, s: Any, b: Any) -> None:
    """b[p*4 + q] = (A^T M A)[p, q] for the 6x6 points M in a."""
    for l in range(6):
        for q in range(LANES):
            x0, x1, x2, x3, x4, x5 = a[l, q], a[6 + l, q], a[12 + l, q], a[18 + l, q], a[24 + l, q], a[30 + l, q]
            s[l, q], s[6 + l, q], s[12 + l, q], s[18 + l, q] = at4(x0, x1, x2, x3, x4, x5)
    for p in range(4):
        for q in range(LANES):
            x0, x1, x2, x3, x4, x5 = s[6 * p, q], s[6 * p + 1, q], s[6 * p + 2, q], s[6 * p + 3, q], \
                s[6 * p + 4, q], s[6 * p + 5, q]
            b[4 * p, q], b[4 * p + 1, q], b[4 * p + 2, q], b[4 * p + 3, q] = at4(x0, x1, x2, x3, x4, x5)


@njit(inline=True)
def gradient_block(a: Any, s: Any, b: Any) -> None:
    """b[k*6 + l] = (A dY A^T)[k, l] for the 4x4 outputs dY in a (row-major)."""
    for j in range(4):
        for q in range(LANES):
            o = a4(a[j, q], a[4 + j, q], a[8 + j, q], a[12 + j, q])
            s[j, q], s[4 + j, q], s[8 + j, q], s[12 + j, q], s[16 + j, q], s[20 + j, q] = o
    for k in range(6):
        for q in range(LANES):
            o = a4(s[4 * k, q], s[4 * k + 1, q], s[4 * k + 2, q], s[4 * k + 3, q])
            b[6 * k, q], b[6 * k + 1, q], b[6 * k + 2, q], b[6 * k + 3, q], b[6 * k + 4, q], b[6 * k + 5, q] = o


@njit
def gather(x: Any, t0: int, t1: int, tiles_h: int, tiles_w: int, mh: int, mw: int, ph: int, pw: int,
           bth: Any, btw: Any, v: Any) -> None:
    """v[k*aw + l, t - t0, :] = (B_h^T patch B_w)[k, l, :] for tiles t0:t1, the patch being the
    a_h x a_w inputs under tile t (zero outside x: the padding)."""
    _, h, w, c = x.shape
    ah, aw = bth.shape[0], btw.shape[0]
    fast = ah == 6 and aw == 6 and c % LANES == 0
    rows = np.empty((ah, aw, c), x.dtype)
    a, s, b = np.empty((36, LANES), x.dtype), np.empty((36, LANES), x.dtype), np.empty((36, LANES), x.dtype)
    for t in range(t0, t1):
        n, r0, c0 = origin(t, tiles_h, tiles_w, mh, mw)
        r0, c0 = r0 - ph, c0 - pw
        if fast and r0 >= 0 and c0 >= 0 and r0 + 6 <= h and c0 + 6 <= w:
            for ch0 in range(0, c, LANES):
                for i in range(6):
                    for j in range(6):
                        for q in range(LANES):
                            a[6 * i + j, q] = x[n, r0 + i, c0 + j, ch0 + q]
                input_block(a, s, b)
                for p in range(36):
                    for q in range(LANES):
                        v[p, t - t0, ch0 + q] = b[p, q]
            continue
        rows[:] = 0
        for i in range(ah):  # rows[k, j] = sum over i of B_h^T[k, i] x[r0 + i, c0 + j]
            if not 0 <= r0 + i < h:
                continue
            for j in range(aw):
                if not 0 <= c0 + j < w:
                    continue
                src = x[n, r0 + i, c0 + j]
                for k in range(ah):
                    bk = bth[k, i]
                    if bk != 0:
                        axpy(rows[k, j], bk, src)
        for k in range(ah):
            for l in range(aw):
                out = v[k * aw + l, t - t0]
                out[:] = 0
                for j in range(aw):
                    bl = btw[l, j]
                    if bl != 0:
                        axpy(out, bl, rows[k, j])


@njit
def scatter(m: Any, t0: int, t1: int, tiles_h: int, tiles_w: int, ath: Any, atw: Any, y: Any) -> None:
    """y's outputs under tiles t0:t1 = A_h^T M A_w (outputs past y's edge dropped)."""
    _, ho, wo, co = y.shape
    mh, ah = ath.shape
    mw, aw = atw.shape
    fast = ah == 6 and aw == 6 and mh == 4 and mw == 4 and co % LANES == 0
    rows = np.empty((mh, aw, co), y.dtype)
    a, s, b = np.empty((36, LANES), y.dtype), np.empty((36, LANES), y.dtype), np.empty((36, LANES), y.dtype)
    for t in range(t0, t1):
        n, r0, c0 = origin(t, tiles_h, tiles_w, mh, mw)
        if fast and r0 + mh <= ho and c0 + mw <= wo:
            for ch0 in range(0, co, LANES):
                for p in range(36):
                    for q in range(LANES):
                        a[p, q] = m[p, t - t0, ch0 + q]
                output_block(a, s, b)
                for i in range(mh):
                    for j in range(mw):
                        for q in range(LANES):
                            y[n, r0 + i, c0 + j, ch0 + q] = b[mw * i + j, q]
            continue
        for p in range(mh):
            for l in range(aw):
                for ch in range(co):
                    rows[p, l, ch] = 0
                for k in range(ah):
                    ak = ath[p, k]
                    if ak != 0:
                        src = m[k * aw + l, t - t0]
                        for ch in range(co):
                            rows[p, l, ch] += ak * src[ch]
        for p in range(mh):
            if r0 + p >= ho:
                continue
            for q in range(mw):
                if c0 + q >= wo:
                    continue
                out = y[n, r0 + p, c0 + q]
                for ch in range(co):
                    out[ch] = 0
                for l in range(aw):
                    al = atw[q, l]
                    if al != 0:
                        for ch in range(co):
                            out[ch] += al * rows[p, l, ch]


@njit
def gather_outputs(dy: Any, t0: int, t1: int, tiles_h: int, tiles_w: int, ath: Any, atw: Any,
                   dm: Any) -> None:
    """scatter's transpose: dm[k*aw + l, t - t0, :] = (A_h dY A_w^T)[k, l, :], dY the outputs
    under tile t (zero past dy's edge)."""
    _, ho, wo, co = dy.shape
    mh, ah = ath.shape
    mw, aw = atw.shape
    fast = ah == 6 and aw == 6 and mh == 4 and mw == 4 and co % LANES == 0
    rows = np.empty((ah, mw, co), dy.dtype)
    a, s, b = np.empty((36, LANES), dy.dtype), np.empty((36, LANES), dy.dtype), np.empty((36, LANES), dy.dtype)
    for t in range(t0, t1):
        n, r0, c0 = origin(t, tiles_h, tiles_w, mh, mw)
        if fast and r0 + mh <= ho and c0 + mw <= wo:
            for ch0 in range(0, co, LANES):
                for i in range(mh):
                    for j in range(mw):
                        for q in range(LANES):
                            a[mw * i + j, q] = dy[n, r0 + i, c0 + j, ch0 + q]
                gradient_block(a, s, b)
                for p in range(36):
                    for q in range(LANES):
                        dm[p, t - t0, ch0 + q] = b[p, q]
            continue
        for k in range(ah):
            for q in range(mw):
                for ch in range(co):
                    rows[k, q, ch] = 0
                if c0 + q >= wo:
                    continue
                for p in range(mh):
                    ak = ath[p, k]
                    if ak != 0 and r0 + p < ho:
                        src = dy[n, r0 + p, c0 + q]
                        for ch in range(co):
                            rows[k, q, ch] += ak * src[ch]
        for k in range(ah):
            for l in range(aw):
                out = dm[k * aw + l, t - t0]
                for ch in range(co):
                    out[ch] = 0
                for q in range(mw):
                    al = atw[q, l]
                    if al != 0:
                        for ch in range(co):
                            out[ch] += al * rows[k, q, ch]


# One-axis windows (1xr, rx1): the other axis is F(1, 1), whose transforms are the identity, so the
# general loops' first or second stage is a copy. These take the long axis alone, straight between
# x, v, m and y: the same sums in the same order, so the general loops' bits (tested).

@njit(inline=True)
def _along(kh: int, j: int) -> tuple[int, int]:
    """The (row, column) step of a one-axis window's j-th point: down the rows when kh > 1."""
    return (j, 0) if kh > 1 else (0, j)


@njit
def gather_1d(x: Any, t0: int, t1: int, tiles_h: int, tiles_w: int, mh: int, mw: int, ph: int, pw: int,
              bth: Any, btw: Any, v: Any) -> None:
    """gather for a one-axis window: v[l, t - t0, :] = (B^T d)[l, :], d the a inputs under tile t."""
    ah = bth.shape[0]
    bt = bth if ah > 1 else btw
    for t in range(t0, t1):
        n, r0, c0 = origin(t, tiles_h, tiles_w, mh, mw)
        for l in range(bt.shape[0]):
            _window_sum(v[l, t - t0], bt[l], x, n, r0 - ph, c0 - pw, ah)


@njit(inline=True)
def _window_sum(out: Any, coeffs: Any, src: Any, n: int, r0: int, c0: int, ah: int) -> None:
    """out = sum over j of coeffs[j] src[n, (r0, c0) + j-th step along a one-axis window's long
    axis], in order of j, the zero coefficients and the points outside src skipped."""
    _, h, w, _ = src.shape
    out[:] = 0
    for j in range(coeffs.shape[0]):
        cj = coeffs[j]
        di, dj = _along(ah, j)
        if cj != 0 and 0 <= r0 + di < h and 0 <= c0 + dj < w:
            axpy(out, cj, src[n, r0 + di, c0 + dj])


@njit(inline=True)
def _long_axis(ath: Any, atw: Any) -> tuple:
    """(outputs per tile down, across, points down, the long axis's A^T) of a one-axis window."""
    mh, ah = ath.shape
    return mh, atw.shape[0], ah, ath if ah > 1 else atw


@njit
def scatter_1d(m: Any, t0: int, t1: int, tiles_h: int, tiles_w: int, ath: Any, atw: Any, y: Any) -> None:
    """scatter for a one-axis window: y's outputs under tile t = A^T M (past y's edge dropped)."""
    _, ho, wo, _ = y.shape
    mh, mw, ah, at = _long_axis(ath, atw)
    mo, a = at.shape
    for t in range(t0, t1):
        n, r0, c0 = origin(t, tiles_h, tiles_w, mh, mw)
        for p in range(mo):
            di, dj = _along(ah, p)
            if r0 + di >= ho or c0 + dj >= wo:
                continue
            out = y[n, r0 + di, c0 + dj]
            out[:] = 0
            for k in range(a):
                ak = at[p, k]
                if ak != 0:
                    axpy(out, ak, m[k, t - t0])


@njit
def gather_outputs_1d(dy: Any, t0: int, t1: int, tiles_h: int, tiles_w: int, ath: Any, atw: Any,
                      dm: Any) -> None:
    """gather_outputs for a one-axis window: dm[k, t - t0, :] = (A dY)[k, :] (zero past dy's edge)."""
    mh, mw, ah, at = _long_axis(ath, atw)
    for t in range(t0, t1):
        n, r0, c0 = origin(t, tiles_h, tiles_w, mh, mw)
        for k in range(at.shape[1]):
            _window_sum(dm[k, t - t0], at[:, k], dy, n, r0, c0, ah)


# The filter's transform (`_Plan.filter` and `filter_back`): columns (the filter's C*Co) in blocks of
# this many, so a block's float64 partial sums stay in L1/L2 between the two axes.
FILTER_COLUMNS = 512


@njit
def two_axis(src: Any, g0: Any, g1: Any, out: Any, j0: int, j1: int) -> None:
    """out[p * a1 + q, j] = sum over k of g1[q, k] (sum over i of g0[p, i] src[i, k, j]) for the
    columns j0:j1 of src (n0, n1, J) and out (a0 * a1, J): the first axis's sums first, each in
    order, in float64 (g0, g1 float64), out rounded once to its dtype. Every column is its own, so
    the bits do not depend on how the columns are shared out."""
    n0, n1 = src.shape[0], src.shape[1]
    a0, a1 = g0.shape[0], g1.shape[0]
    t = np.empty((n1, FILTER_COLUMNS))
    acc = np.empty(FILTER_COLUMNS)
    for b0 in range(j0, j1, FILTER_COLUMNS):
        nb = min(FILTER_COLUMNS, j1 - b0)
        for p in range(a0):
            for k in range(n1):
                tk = t[k]
                tk[:nb] = 0.0
                for i in range(n0):
                    g = g0[p, i]
                    s = src[i, k, b0:b0 + nb]
                    for j in range(nb):
                        tk[j] += g * s[j]
            for q in range(a1):
                acc[:nb] = 0.0
                for k in range(n1):
                    g = g1[q, k]
                    tk = t[k]
                    for j in range(nb):
                        acc[j] += g * tk[j]
                o = out[p * a1 + q, b0:b0 + nb]
                for j in range(nb):
                    o[j] = acc[j]
