"""The compiled loops of kernels/cpu/softmax.py (its docstring says what they compute), module
globals so that numba's on-disk cache finds them again in the next process (winograd_jit.py's
docstring says why a closure over a helper would not). Imported on first use by
`softmax._kernels()`.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

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


@intrinsic
def scaled(typingctx: Any, m: Any, k: Any) -> Any:
    """m * 2**k for `exp_parts`'s (m, k), made by adding k to m's exponent bits (a bit cast each
    way, which numba's own code cannot express: its loops wrote m and then added k << 23 to the
    stored bits in a second pass)."""
    sig = types.float32(types.float32, types.int32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        bits = builder.bitcast(args[0], ir.IntType(32))
        bits = builder.add(bits, builder.shl(args[1], ir.Constant(ir.IntType(32), 23)))
        return builder.bitcast(bits, ir.FloatType())

    return sig, codegen


@intrinsic
def lane_sum(typingctx: Any, arr: Any, n: Any) -> Any:
    """The float64 sum of a contiguous float32 vector's first n values: lane l of 16 adds values
    l, l + 16, ... of the first n - n % 16 in order (two 8-wide float64 vectors), the lanes are
    then added 0..15 in order, and the rest after them in order. numba leaves a loop over 16
    lanes of float64 sums scalar (0.28 ns a value, as four chains did); these vectors take
    a sixth of that."""
    sig = types.float64(arr, n)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i32, i64, f64 = ir.IntType(32), ir.IntType(64), ir.DoubleType()
        v16, v8d = ir.VectorType(ir.FloatType(), 16), ir.VectorType(f64, 8)
        n = context.cast(builder, args[1], signature.args[1], types.int64)
        chunks = builder.sdiv(n, ir.Constant(i64, 16))
        halves = [(cgutils.alloca_once_value(builder, ir.Constant(v8d, [0.0] * 8)),
                   ir.Constant(ir.VectorType(i32, 8), list(range(h * 8, h * 8 + 8)))) for h in range(2)]
        with cgutils.for_range(builder, chunks) as loop:
            at = builder.gep(data, [builder.mul(loop.index, ir.Constant(i64, 16))])
            values = builder.load(builder.bitcast(at, v16.as_pointer()), align=4)
            for acc, pick in halves:
                half = builder.fpext(builder.shuffle_vector(values, ir.Constant(v16, ir.Undefined), pick), v8d)
                builder.store(builder.fadd(builder.load(acc), half), acc)
        total = ir.Constant(f64, 0.0)
        for acc, _ in halves:
            lanes = builder.load(acc)
            for lane in range(8):
                total = builder.fadd(total, builder.extract_element(lanes, ir.Constant(i32, lane)))
        slot = cgutils.alloca_once_value(builder, total)
        start = builder.mul(chunks, ir.Constant(i64, 16))
        with cgutils.for_range(builder, builder.sub(n, start)) as loop:
            value = builder.fpext(builder.load(builder.gep(data, [builder.add(start, loop.index)])), f64)
            builder.store(builder.fadd(builder.load(slot), value), slot)
        return builder.load(slot)

    return sig, codegen


@njit
def exp_nonpositive(x: Any, out: Any) -> None:
    """out = exp(x) for a float32 vector x <= 0 (tests: against float64's)."""
    for j in range(x.shape[0]):
        m, k = exp_parts(x[j])
        out[j] = scaled(m, k)


@njit
def float64_sum(x: Any) -> float:
    """`lane_sum` of a float32 vector (for the tests)."""
    return lane_sum(x, x.shape[0])


@njit
def rows(logits: Any, labels: Any, e: Any, loss: Any, r0: int, r1: int) -> None:
    """loss[r] and e[r] (softmax - one-hot) for rows r0:r1; e may be logits itself."""
    c = logits.shape[1]
    lanes = np.empty(LANES, np.float32)
    exps = np.empty(c, np.float32)
    for r in range(r0, r1):
        loss[r] = _row(logits[r], labels[r], e[r], lanes, exps)


@njit
def rows_bias(x: Any, bias: Any, labels: Any, e: Any, loss: Any, r0: int, r1: int) -> None:
    """`rows` of the logits x + bias (each row's sum made in a scratch row, exactly BiasAdd's
    float32 sums), for rows r0:r1; e may be x itself."""
    c = x.shape[1]
    lanes = np.empty(LANES, np.float32)
    exps = np.empty(c, np.float32)
    biased = np.empty(c, np.float32)
    for r in range(r0, r1):
        xr = x[r]
        for j in range(c):
            biased[j] = xr[j] + bias[j]
        loss[r] = _row(biased, labels[r], e[r], lanes, exps)


@njit(inline=True)
def _row(x: Any, label: Any, out: Any, lanes: Any, exps: Any) -> Any:
    """One row's loss, and its softmax - one-hot written to `out` (which may be x). Each pass its
    own loop over the row (one loop doing it all ran unvectorised: 3.7 against ~2 ns an element),
    and none both reads x and writes the row it returns: out is x itself when the kernel runs in
    place, and a loop whose reads and writes may overlap runs unvectorised (LLVM's run-time check
    fails: 23-29 against 9-13 ms in lstm_lm's step). exp goes to a scratch row, which the last
    pass divides into out."""
    c = x.shape[0]
    body = c - c % LANES
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
    for j in range(c):
        m, k = exp_parts(x[j] - mx)
        exps[j] = scaled(m, k)
    z = lane_sum(exps, c)  # in float64, in fixed lanes
    z32 = np.float32(z)
    for j in range(c):
        out[j] = exps[j] / z32
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
