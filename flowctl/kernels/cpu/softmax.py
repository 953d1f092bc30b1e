"""The sparse softmax cross-entropy compiled for the CPU: each row of the logits in a few
vectorised passes while it sits in the core's cache (its max; exp(x - max); the sum; the division),
rows shared out over the intra-op threads.

The reference (kernels/nn.py's CPU kernel) makes five numpy passes per block of rows, and numpy's
float32 exp runs at ~2.5 ns an element on hosts without AVX-512 (no vector path for AVX2 in the
numpy 2.x wheels: measured 2.5 against 0.2 for an add on a 2-core AMD EPYC; PyTorch's 4.7): on
lstm_lm's 700 x 10000 logits that exp alone is ~18 ms of a step. numba has no vector exp here (no
SVML), so `exp_parts` is the Cephes single-precision one (range reduction by ln 2 in two parts, a
degree-5 polynomial, the power of two then added to the exponent bits), which LLVM vectorises:
~0.9 ns an element, within 1 ulp of exp (tests: against float64's). It is for x <= 0, all a
shifted softmax row holds: below -87.34 (where float32 goes subnormal) it gives 0, a NaN stays NaN.

The max runs in LANES fixed lanes (lane l takes columns l, l + LANES, ...), the sum in float64 in
16 fixed lanes (`softmax_jit.lane_sum`, vector code of our own: numba left such lanes scalar; summed
in float32 lanes it drifted 2e-6 from the exact sum on lstm_lm's rows, numpy's pairwise float32
sum is closer than that), so each row's bits are the same whichever thread runs it. The loss is
log(sum) - (x[label] - max) and the gradient softmax - one-hot, the reference's formulas. float32
only (float64 keeps the reference and its 1e-12). Measured, lstm_lm's 700 x 10000 logits: 2.2
against 2.8-3.7 ns an element at one thread, 9.7-11.4 against 14.5-16 ms at two; then with the
exp's power of two added in the register (`scaled`) and the vector sum, 1.4-2.1 -> 1.4-1.6 ns an
element alone with the bias, 5.63 -> 5.08 ms in the step (alternating in one process).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from flowctl.kernels import intra
from flowctl.kernels.cpu.jit import available, compiled
from flowctl.kernels.nn import _check_labels
from flowctl.kernels.registry import variant

Fn = Callable[..., Any]

# Rows per piece on the intra-op threads (lstm_lm: 700 rows of 10000, 22 pieces).
ROWS = 32


@compiled
def _kernels() -> Any:
    """(exp_nonpositive, rows, rows_bias, grad_bias), compiled (kernels/cpu/softmax_jit.py), imported
    on first use."""
    from flowctl.kernels.cpu import softmax_jit as jit

    return jit.exp_nonpositive, jit.rows, jit.rows_bias, jit.grad_bias


def exp_nonpositive(x: Any) -> Any:
    """exp(x) for float32 x <= 0, the compiled kernel's (for the tests)."""
    out = np.empty(x.shape, np.float32)
    _kernels()[0](np.ascontiguousarray(x, dtype=np.float32).reshape(-1), out.reshape(-1))
    return out


def sparse_xent(logits: Any, labels: Any, into: bool = False) -> tuple[Any, Any]:
    n, c = logits.shape
    _check_labels(np, labels, c)
    logits = np.ascontiguousarray(logits)
    e = logits if into else np.empty_like(logits)
    loss = np.empty(n, logits.dtype)
    if n and c:
        kernel = _kernels()[1]
        ids = np.ascontiguousarray(labels, dtype=np.int64)
        intra.for_chunks(-(-n // ROWS), lambda run: kernel(logits, ids, e, loss, run.start * ROWS,
                                                           min(n, run.stop * ROWS)), least=2)
    return loss, e


def sparse_xent_bias(x: Any, bias: Any, labels: Any, into: bool = False) -> tuple[Any, Any]:
    """sparse_xent(x + bias, labels) without writing x + bias: each row biased in a scratch row
    (engine/xent_bias.py). `into`: the gradient written over x."""
    n, c = x.shape
    _check_labels(np, labels, c)
    x = np.ascontiguousarray(x)
    bias = np.ascontiguousarray(bias, dtype=np.float32)
    e = x if into else np.empty_like(x)
    loss = np.empty(n, x.dtype)
    if n and c:
        kernel = _kernels()[2]
        ids = np.ascontiguousarray(labels, dtype=np.int64)
        intra.for_chunks(-(-n // ROWS), lambda run: kernel(x, bias, ids, e, loss, run.start * ROWS,
                                                           min(n, run.stop * ROWS)), least=2)
    return loss, e


# Columns per piece of XentGradBias on the intra-op threads (lstm_lm: 10000 columns, 10 pieces):
# each piece walks every row, so its sums are made in one fixed order whoever runs it.
COLUMNS = 1024


def xent_grad_bias(dy: Any, m: Any, into: bool = False) -> tuple[Any, Any]:
    """(dy[:, None] * m, its column sums) in one pass over m (engine/xent_bias.py). `into`: the
    product written over m."""
    n, c = m.shape
    m = np.ascontiguousarray(m)
    dy = np.ascontiguousarray(dy, dtype=np.float32)
    g = m if into else np.empty_like(m)
    db = np.empty(c, m.dtype) if n else np.zeros(c, m.dtype)  # (the kernel writes row 0's products first)
    if n and c:
        kernel = _kernels()[3]
        intra.for_chunks(-(-c // COLUMNS), lambda run: kernel(dy, m, g, db, run.start * COLUMNS,
                                                              min(c, run.stop * COLUMNS)), least=2)
    return g, db


def _applies(attrs: dict[str, Any], ins: Any) -> bool:
    """Rule: numba present, float32 logits (a matrix), integer labels (a vector)."""
    if not available():
        return False
    try:
        logits, labels = ins[0], ins[1]
        return (logits.dtype == "float32" and len(logits.shape) == 2 and len(labels.shape) == 1
                and str(labels.dtype).startswith(("int", "uint")))
    except (IndexError, TypeError, AttributeError):
        return False


def _into(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda k, logits, labels: sparse_xent(logits, labels, into=True)


@variant("SparseSoftmaxCrossEntropyWithLogits", "cpu", "numba", _applies, into=_into)
def sparse_xent_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    return sparse_xent


def _applies_bias(attrs: dict[str, Any], ins: Any) -> bool:
    """Rule: numba present, float32 logits (a matrix) and bias, integer labels (a vector)."""
    try:
        return _applies(attrs, [ins[0], ins[2]]) and ins[1].dtype == "float32"
    except (IndexError, TypeError, AttributeError):
        return False


@variant("BiasSparseXent", "cpu", "numba", _applies_bias,
         into=lambda xp, attrs: lambda k, x, b, labels: sparse_xent_bias(x, b, labels, into=True))
def sparse_xent_bias_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    return sparse_xent_bias


def _applies_grad(attrs: dict[str, Any], ins: Any) -> bool:
    """Rule: numba present, float32 dy (a vector) and m (a matrix)."""
    if not available():
        return False
    try:
        dy, m = ins[0], ins[1]
        return dy.dtype == "float32" and m.dtype == "float32" and len(m.shape) == 2 and len(dy.shape) == 1
    except (IndexError, TypeError, AttributeError):
        return False


@variant("XentGradBias", "cpu", "numba", _applies_grad,
         into=lambda xp, attrs: lambda k, dy, m: xent_grad_bias(dy, m, into=True))
def xent_grad_bias_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    return xent_grad_bias
