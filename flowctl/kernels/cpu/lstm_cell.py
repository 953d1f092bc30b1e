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

from flowctl.kernels.cpu.jit import available, compiled
from flowctl.kernels.registry import variant

Fn = Callable[..., Any]


@compiled
def _kernels() -> Any:
    """(cell, cell_grad), compiled (kernels/cpu/lstm_cell_jit.py), imported on first use."""
    from flowctl.kernels.cpu import lstm_cell_jit as jit

    return jit.cell, jit.cell_grad


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
