"""The compiled loops of kernels/cpu/lstm_cell.py (its docstring says what they compute), module
globals so that numba's on-disk cache finds them again in the next process (winograd_jit.py's
docstring says why a closure over a helper would not: defined inside a function, these two compiled
afresh in every process, ~2 s of lstm_lm's first step on a 2-core AMD EPYC, and each added an entry
to the cache). Imported on first use by `lstm_cell._kernels()`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flowctl.kernels.cpu.jit import njit

# Eigen's coefficients (MathFunctionsImpl.h): numerator odd, alpha_1..alpha_13; denominator even.
_ALPHA = (4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05, 5.12229709037114e-08,
          -8.60467152213735e-11, 2.00018790482477e-13, -2.76076847742355e-16)
_BETA = (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04, 1.19825839466702e-06)
CLAMP = 7.90531110763549805  # Eigen's later bound: past it the function rounds to 1 (at 9 it reached 1 + 1 ulp)

A1, A3, A5, A7, A9, A11, A13 = (np.float32(v) for v in _ALPHA)
B0, B2, B4, B6 = (np.float32(v) for v in _BETA)
HI, LO = np.float32(CLAMP), np.float32(-CLAMP)
HALF, ONE = np.float32(0.5), np.float32(1.0)


@njit(inline=True)
def tanh(x: Any) -> Any:
    x = HI if x > HI else (LO if x < LO else x)  # a NaN passes both tests and stays NaN
    x2 = x * x
    p = x2 * A13 + A11
    p = x2 * p + A9
    p = x2 * p + A7
    p = x2 * p + A5
    p = x2 * p + A3
    p = x2 * p + A1
    q = x2 * B6 + B4
    q = x2 * q + B2
    q = x2 * q + B0
    return (x * p) / q


@njit(inline=True)
def sigmoid(z: Any) -> Any:
    return tanh(z * HALF) * HALF + HALF


# Each loop runs over one row of one gate through 1-D views: indexing the [batch, 4u] matrices
# at j, u + j, ... in one loop leaves LLVM unable to vectorise it (279 against 32 us, measured).
@njit
def cell(xw: Any, hw: Any, c_prev: Any, forget_bias: Any, first: bool, h: Any, c: Any, act: Any) -> None:
    """act = the activated gates i, f, g, o; c = i g + f c_prev; h = o tanh(c). `first`: the
    zero state (hw and c_prev unread)."""
    n, u = h.shape
    for b in range(n):
        xi, xf, xg, xo = xw[b, :u], xw[b, u:2 * u], xw[b, 2 * u:3 * u], xw[b, 3 * u:]
        ai, af, ag, ao = act[b, :u], act[b, u:2 * u], act[b, 2 * u:3 * u], act[b, 3 * u:]
        cb, hb = c[b], h[b]
        if first:
            for j in range(u):
                i, g, o = sigmoid(xi[j]), tanh(xg[j]), sigmoid(xo[j])
                ai[j] = i
                af[j] = sigmoid(xf[j] + forget_bias)
                ag[j] = g
                ao[j] = o
                cc = i * g
                cb[j] = cc
                hb[j] = tanh(cc) * o
        else:
            hi_, hf, hg, ho = hw[b, :u], hw[b, u:2 * u], hw[b, 2 * u:3 * u], hw[b, 3 * u:]
            cp = c_prev[b]
            for j in range(u):
                i, f = sigmoid(xi[j] + hi_[j]), sigmoid(xf[j] + hf[j] + forget_bias)
                g, o = tanh(xg[j] + hg[j]), sigmoid(xo[j] + ho[j])
                ai[j] = i
                af[j] = f
                ag[j] = g
                ao[j] = o
                cc = i * g + f * cp[j]
                cb[j] = cc
                hb[j] = tanh(cc) * o


@njit
def cell_grad(dh: Any, dc: Any, act: Any, c: Any, c_prev: Any, first: bool, dz: Any, dc_prev: Any) -> None:
    """dz (before the gates' nonlinearities) and dc_prev, in the reference's order of operations."""
    n, u = c.shape
    for b in range(n):
        ai, af, ag, ao = act[b, :u], act[b, u:2 * u], act[b, 2 * u:3 * u], act[b, 3 * u:]
        di, df, dg, do = dz[b, :u], dz[b, u:2 * u], dz[b, 2 * u:3 * u], dz[b, 3 * u:]
        dhb, dcb, cb, dcp = dh[b], dc[b], c[b], dc_prev[b]
        for j in range(u):
            i, g, o = ai[j], ag[j], ao[j]
            tc = tanh(cb[j])
            d = dhb[j]
            dct = (ONE - tc * tc) * o * d + dcb[j]
            do[j] = d * tc * ((ONE - o) * o)
            di[j] = (ONE - i) * i * g * dct
            dg[j] = (ONE - g * g) * i * dct
            dcp[j] = dct  # scaled by f below, unless the first step
        if first:
            for j in range(u):
                df[j] = 0
        else:
            cp = c_prev[b]
            for j in range(u):
                f = af[j]
                df[j] = (ONE - f) * f * cp[j] * dcp[j]
                dcp[j] = dcp[j] * f
