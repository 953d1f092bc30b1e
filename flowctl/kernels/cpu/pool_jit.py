"""The compiled loops of kernels/cpu/pool.py (its docstring says what they compute), module
globals so that numba's on-disk cache finds them again in the next process (winograd_jit.py's
docstring says why a closure over a helper would not). Imported on first use by `pool._kernels()`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flowctl.kernels.cpu.jit import njit


@njit
def span(o: int, s: int, p: int, k: int, size: int) -> tuple[int, int]:
    """The window of output position o along one axis, clipped to the unpadded input."""
    return max(o * s - p, 0), min(o * s - p + k, size)


@njit
def max_pool(x: Any, n0: int, n1: int, kh: int, kw: int, sh: int, sw: int, ph: int, pw: int, y: Any) -> None:
    h, w, c = x.shape[1], x.shape[2], x.shape[3]
    ho, wo = y.shape[1], y.shape[2]
    for n in range(n0, n1):
        for r in range(ho):
            i0, i1 = span(r, sh, ph, kh, h)
            for q in range(wo):
                j0, j1 = span(q, sw, pw, kw, w)
                for ch in range(c):
                    y[n, r, q, ch] = x[n, i0, j0, ch]
                for i in range(i0, i1):
                    for j in range(j0, j1):
                        for ch in range(c):
                            v = x[n, i, j, ch]
                            # numpy's maximum: a NaN wins
                            if v > y[n, r, q, ch] or v != v:
                                y[n, r, q, ch] = v


@njit
def max_pool_inside(x: Any, n0: int, n1: int, kh: int, kw: int, sh: int, sw: int, y: Any) -> None:
    """max_pool for windows that all lie inside x (no padding, none clipped), separably: for each
    output row, each window row's max along its window columns (the taps in order, an output
    position's channels contiguous), then those rows' max in order -- the order of the numpy
    passes it replaced, one read of each input row from memory where they made kw + kh."""
    ho, wo, c = y.shape[1], y.shape[2], y.shape[3]
    row = np.empty((wo, c), x.dtype)
    for n in range(n0, n1):
        for r in range(ho):
            yr = y[n, r]
            for a in range(kh):
                xi = x[n, r * sh + a]
                for q in range(wo):
                    rq = row[q]
                    x0 = xi[q * sw]
                    for ch in range(c):
                        rq[ch] = x0[ch]
                    for j in range(1, kw):
                        xj = xi[q * sw + j]
                        for ch in range(c):
                            u, v = rq[ch], xj[ch]
                            rq[ch] = u if (u >= v) | (u != u) else v  # numpy's maximum: a NaN wins
                for q in range(wo):
                    yq, rq = yr[q], row[q]
                    if a == 0:
                        for ch in range(c):
                            yq[ch] = rq[ch]
                    else:
                        for ch in range(c):
                            u, v = yq[ch], rq[ch]
                            yq[ch] = u if (u >= v) | (u != u) else v


@njit
def max_pool_grad(x: Any, y: Any, dy: Any, n0: int, n1: int, kh: int, kw: int, sh: int, sw: int, ph: int,
                  pw: int, dx: Any) -> None:
    h, w, c = x.shape[1], x.shape[2], x.shape[3]
    ho, wo = y.shape[1], y.shape[2]
    taken = np.zeros(c, dtype=np.bool_)
    for n in range(n0, n1):
        dx[n] = 0
        for r in range(ho):
            i0, i1 = span(r, sh, ph, kh, h)
            for q in range(wo):
                j0, j1 = span(q, sw, pw, kw, w)
                taken[:] = False
                for i in range(i0, i1):
                    for j in range(j0, j1):
                        for ch in range(c):
                            if not taken[ch] and x[n, i, j, ch] == y[n, r, q, ch]:
                                taken[ch] = True
                                dx[n, i, j, ch] += dy[n, r, q, ch]


@njit
def avg_pool(x: Any, n0: int, n1: int, kh: int, kw: int, sh: int, sw: int, ph: int, pw: int, y: Any) -> None:
    h, w, c = x.shape[1], x.shape[2], x.shape[3]
    ho, wo = y.shape[1], y.shape[2]
    for n in range(n0, n1):
        for r in range(ho):
            i0, i1 = span(r, sh, ph, kh, h)
            for q in range(wo):
                j0, j1 = span(q, sw, pw, kw, w)
                y[n, r, q, :] = 0
                for i in range(i0, i1):
                    for j in range(j0, j1):
                        for ch in range(c):
                            y[n, r, q, ch] += x[n, i, j, ch]
                count = (i1 - i0) * (j1 - j0)
                for ch in range(c):
                    y[n, r, q, ch] /= count


@njit
def avg_pool_grad(dy: Any, n0: int, n1: int, kh: int, kw: int, sh: int, sw: int, ph: int, pw: int,
                  dx: Any) -> None:
    h, w, c = dx.shape[1], dx.shape[2], dx.shape[3]
    ho, wo = dy.shape[1], dy.shape[2]
    g = np.empty(c, dtype=dy.dtype)
    for n in range(n0, n1):
        dx[n] = 0
        for r in range(ho):
            i0, i1 = span(r, sh, ph, kh, h)
            for q in range(wo):
                j0, j1 = span(q, sw, pw, kw, w)
                count = (i1 - i0) * (j1 - j0)
                for ch in range(c):
                    g[ch] = dy[n, r, q, ch] / count
                for i in range(i0, i1):
                    for j in range(j0, j1):
                        for ch in range(c):
                            dx[n, i, j, ch] += g[ch]
