"""The compiled loops of kernels/cpu/softmax.py (its docstring says what they compute), module
globals so that numba's on-disk cache finds them again in the next process (winograd_jit.py's
docstring says why a closure over a helper would not). Imported on first use by
`softmax._kernels()`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flowctl.kernels.cpu.jit import LANES, njit

# Cephes expf: ln 2 in two parts (C1 exact in few bits), the polynomial's coefficients.
_LOG2E, _C1, _C2 = 1.44269504088896341, 0.693359375, -2.12194440e-4
_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_LOWEST = -87.33654  # exp of anything below is subnormal in float32: taken as 0

LOG2E, C1, C2, LOWEST = (np.float32(v) for v in (_LOG2E, _C1, _C2, _LOWEST))
P0, P1, P2, P3, P4, P5 = (np.float32(v) for v in _P)
HALF, ONE, ZERO = np.float32(0.5), np.float32(1.0), np.float32(0.0)


@njit(inline=True)
def exp_parts(v: Any) -> tuple:
    """(m, n) with exp(v) = m * 2**n for v <= 0: m in [0.7, 1.42], or (0, 0) below LOWEST, or
    (NaN, 0) for a NaN."""
    w = v if v > LOWEST else LOWEST
    n = np.floor(w * LOG2E + HALF)
    r = w - n * C1 - n * C2
    p = ((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + P5
    m = p * (r * r) + r + ONE
    k = np.int32(n)
    if v < LOWEST:
        m, k = ZERO, np.int32(0)
    if v != v:
        m, k = v, np.int32(0)
    return m, k


@njit
def exp_nonpositive(x: Any, out: Any) -> None:
    """out = exp(x) for a float32 vector x <= 0 (tests: against float64's)."""
    bits = out.view(np.int32)
    for j in range(x.shape[0]):
        m, k = exp_parts(x[j])
        out[j] = m
        bits[j] += k << 23


@njit
def rows(logits: Any, labels: Any, e: Any, loss: Any, r0: int, r1: int) -> None:
    """loss[r] and e[r] (softmax - one-hot) for rows r0:r1; e may be logits itself."""
    c = logits.shape[1]
    lanes = np.empty(LANES, np.float32)
    powers = np.empty(c, np.int32)
    mant = np.empty(c, np.float32)
    for r in range(r0, r1):
        loss[r] = _row(logits[r], labels[r], e[r], lanes, powers, mant)


@njit
def rows_bias(x: Any, bias: Any, labels: Any, e: Any, loss: Any, r0: int, r1: int) -> None:
    """`rows` of the logits x + bias (each row's sum made in a scratch row, exactly BiasAdd's
    float32 sums), for rows r0:r1; e may be x itself."""
    c = x.shape[1]
    lanes = np.empty(LANES, np.float32)
    powers = np.empty(c, np.int32)
    mant = np.empty(c, np.float32)
    biased = np.empty(c, np.float32)
    for r in range(r0, r1):
        xr = x[r]
        for j in range(c):
            biased[j] = xr[j] + bias[j]
        loss[r] = _row(biased, labels[r], e[r], lanes, powers, mant)


@njit(inline=True)
def _row(x: Any, label: Any, out: Any, lanes: Any, powers: Any, mant: Any) -> Any:
    """One row's loss, and its softmax - one-hot written to `out` (which may be x). Each pass its
    own loop over the row (one loop doing it all ran unvectorised: 3.7 against ~2 ns an element),
    and none both reads x and writes the row it returns: out is x itself when the kernel runs in
    place, and a loop whose reads and writes may overlap runs unvectorised (LLVM's run-time check
    fails: 23-29 against 9-13 ms in lstm_lm's step). exp goes to a scratch row, which the last
    pass divides into out."""
    c = x.shape[0]
    body = c - c % LANES
    bits = mant.view(np.int32)
    picked = x[label]  # before `out` may overwrite it
    # the max, NaN winning as numpy's does
    mx = x[0]
    if body:
        for l in range(LANES):
            lanes[l] = x[l]
        for j0 in range(LANES, body, LANES):
            for l in range(LANES):
                v, a = x[j0 + l], lanes[l]
                lanes[l] = v if (v > a) | (v != v) else a
        for l in range(LANES):
            v = lanes[l]
            mx = v if (v > mx) | (v != v) else mx
    for j in range(body, c):
        v = x[j]
        mx = v if (v > mx) | (v != v) else mx
    # exp(x - max): the mantissa part written, its power of two then added to the exponent
    for j in range(c):
        m, k = exp_parts(x[j] - mx)
        mant[j] = m
        powers[j] = k << 23
    for j in range(c):
        bits[j] += powers[j]
    # the sum, in float64, in four chains (columns j % 4) added in order at the end
    s0 = s1 = s2 = s3 = 0.0
    quads = c - c % 4
    for j in range(0, quads, 4):
        s0 += mant[j]
        s1 += mant[j + 1]
        s2 += mant[j + 2]
        s3 += mant[j + 3]
    z = ((s0 + s1) + s2) + s3
    for j in range(quads, c):
        z += mant[j]
    z32 = np.float32(z)
    for j in range(c):
        out[j] = mant[j] / z32
    out[label] -= ONE
    return np.float32(np.log(z)) - (picked - mx)


@njit
def grad_bias(dy: Any, m: Any, g: Any, db: Any, c0: int, c1: int) -> None:
    """g = dy[:, None] * m and db = g summed over the rows, row after row from the first (numpy's
    order for a C-ordered matrix's axis-0 sum: the same bits), for columns c0:c1; g may be m. The
    products go to a scratch row first, so no loop both reads m and writes g (see `_row`); every
    loop indexes a slice from 0 (an index c0 + j could be negative for all numba knows, and its
    wrap-around test kept the loop scalar: 10 against 2.6 ms on lstm_lm's logits, one thread)."""
    n = m.shape[0]
    w = c1 - c0
    row = np.empty(w, np.float32)
    acc = db[c0:c1]
    for i in range(n):
        s = dy[i]
        mi = m[i, c0:c1]
        for j in range(w):
            row[j] = s * mi[j]
        gi = g[i, c0:c1]
        if i == 0:
            for j in range(w):
                gi[j] = row[j]
                acc[j] = row[j]
        else:
            for j in range(w):
                gi[j] = row[j]
                acc[j] += row[j]
