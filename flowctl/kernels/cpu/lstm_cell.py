"""The LSTM cell and its gradient compiled for the CPU: one pass over a step's [batch, 4 * units]
gates each way, where the reference (kernels/recurrent.py) makes ~12 numpy passes forward and ~25
back, each a call of its own on lstm_lm's 20 x 2600 gates (10.2 and 11.8 ms of its step in 70 calls).

tanh is the one transcendental (sigmoid(z) = 0.5 tanh(z / 2) + 0.5, the reference's formula), and
numba has no vector tanh here (no SVML): a scalar libm call per element would be slower than numpy's
vector loops. So it is a 13/6-degree odd/even rational function of x, the
approximation TensorFlow's LSTMBlockCell gets from Eigen (`generic_fast_tanh_float`; clamped to
+-7.905 here): multiplies,
adds and one division, which LLVM vectorises. It is within 6.6 float32 ulp of tanh (4e-7
relative, never past +-1; numpy's float32 tanh 1.4 ulp; tests/test_cpu_compiled.py), so the cell agrees with the
reference to float32 rounding, as every compiled variant does. float32 only: float64 keeps the
reference (its tests hold 1e-12).

Measured (lstm_lm's 20 x 2600 gates, 2 threads): the cell 98 -> 35 us, its gradient 109 -> 14 us
alone, 43-55 in the step (its inputs colder); the step, alternating plans in one process, 348.7 ->
335.3 ms (0.961x).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from flowctl.kernels.cpu.jit import available, compiled, njit
from flowctl.kernels.registry import variant

Fn = Callable[..., Any]

# Eigen's coefficients (MathFunctionsImpl.h): numerator odd, alpha_1..alpha_13; denominator even.
_ALPHA = (4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05, 5.12229709037114e-08,
          -8.60467152213735e-11, 2.00018790482477e-13, -2.76076847742355e-16)
_BETA = (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04, 1.19825839466702e-06)
CLAMP = 7.90531110763549805  # Eigen's later bound: past it the function rounds to 1 (at 9 it reached 1 + 1 ulp)


@compiled
def _kernels() -> Any:
    a1, a3, a5, a7, a9, a11, a13 = (np.float32(v) for v in _ALPHA)
    b0, b2, b4, b6 = (np.float32(v) for v in _BETA)
    hi, lo = np.float32(CLAMP), np.float32(-CLAMP)
    half, one = np.float32(0.5), np.float32(1.0)

    @njit(inline=True)
    def tanh(x: Any) -> Any:
        x = hi if x > hi else (lo if x < lo else x)  # a NaN passes both tests and stays NaN
        x2 = x * x
        p = x2 * a13 + a11
        p = x2 * p + a9
        p = x2 * p + a7
        p = x2 * p + a5
        p = x2 * p + a3
        p = x2 * p + a1
        q = x2 * b6 + b4
        q = x2 * q + b2
        q = x2 * q + b0
        return (x * p) / q

    @njit(inline=True)
    def sigmoid(z: Any) -> Any:
        return tanh(z * half) * half + half

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
                dct = (one - tc * tc) * o * d + dcb[j]
                do[j] = d * tc * ((one - o) * o)
                di[j] = (one - i) * i * g * dct
                dg[j] = (one - g * g) * i * dct
                dcp[j] = dct  # scaled by f below, unless the first step
            if first:
                for j in range(u):
                    df[j] = 0
            else:
                cp = c_prev[b]
                for j in range(u):
                    f = af[j]
                    df[j] = (one - f) * f * cp[j] * dcp[j]
                    dcp[j] = dcp[j] * f

    return cell, cell_grad


def _f32(a: Any) -> Any:
    return np.ascontiguousarray(a, dtype=np.float32)


def lstm_cell(xw: Any, hw: Any, c_prev: Any, forget_bias: float) -> tuple[Any, Any, Any]:
    cell, _ = _kernels()
    n, u4 = xw.shape
    first = hw is None
    h, c = np.empty((n, u4 // 4), np.float32), np.empty((n, u4 // 4), np.float32)
    act = np.empty((n, u4), np.float32)
    dummy = h  # unread where `first`
    cell(_f32(xw), dummy if first else _f32(hw), dummy if first else _f32(c_prev), np.float32(forget_bias), first,
         h, c, act)
    return h, c, act


def lstm_cell_grad(dh: Any, dc: Any, act: Any, c: Any, c_prev: Any = None) -> Any:
    _, cell_grad = _kernels()
    first = c_prev is None
    dz = np.empty(act.shape, np.float32)
    dc_prev = np.empty(c.shape, np.float32)
    cell_grad(_f32(dh), _f32(dc), _f32(act), _f32(c), dc_prev if first else _f32(c_prev), first, dz, dc_prev)
    return dz if first else (dz, dc_prev)


def _applies(attrs: dict[str, Any], ins: Any) -> bool:
    """Rule: numba present, every input a float32 matrix."""
    if not available():
        return False
    try:
        return all(s.dtype == "float32" and len(s.shape) == 2 for s in ins)
    except (TypeError, AttributeError):
        return False


@variant("LSTMBlockCell", "cpu", "numba", _applies)
def lstm_block_cell_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    forget_bias = attrs["forget_bias"]
    return lambda xw, hw=None, c_prev=None: lstm_cell(xw, hw, c_prev, forget_bias)


@variant("LSTMBlockCellGrad", "cpu", "numba", _applies)
def lstm_block_cell_grad_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lstm_cell_grad
