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
four fixed chains (summed in float32 lanes it drifted 2e-6 from the exact sum on lstm_lm's rows;
numpy's pairwise float32 sum is closer than that), so each row's bits are the same whichever thread
runs it. The loss is log(sum) - (x[label] - max) and the gradient softmax - one-hot, the
reference's formulas. float32 only (float64 keeps the reference and its 1e-12). Measured, lstm_lm's
700 x 10000 logits: 2.2 against 2.8-3.7 ns an element at one thread, 9.7-11.4 against 14.5-16 ms
at two.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from flowctl.kernels import intra
from flowctl.kernels.cpu.jit import LANES, available, compiled, njit
from flowctl.kernels.registry import variant

Fn = Callable[..., Any]

# Rows per piece on the intra-op threads (lstm_lm: 700 rows of 10000, 22 pieces).
ROWS = 32
# Cephes expf: ln 2 in two parts (C1 exact in few bits), the polynomial's coefficients.
_LOG2E, _C1, _C2 = 1.44269504088896341, 0.693359375, -2.12194440e-4
_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_LOWEST = -87.33654  # exp of anything below is subnormal in float32: taken as 0


@compiled
def _kernels() -> Any:
    log2e, c1, c2, lowest = (np.float32(v) for v in (_LOG2E, _C1, _C2, _LOWEST))
    p0, p1, p2, p3, p4, p5 = (np.float32(v) for v in _P)
    half, one, zero = np.float32(0.5), np.float32(1.0), np.float32(0.0)

    @njit(inline=True)
    def exp_parts(v: Any) -> tuple:
        """(m, n) with exp(v) = m * 2**n for v <= 0: m in [0.7, 1.42], or (0, 0) below `lowest`, or
        (NaN, 0) for a NaN."""
        w = v if v > lowest else lowest
        n = np.floor(w * log2e + half)
        r = w - n * c1 - n * c2
        p = ((((p0 * r + p1) * r + p2) * r + p3) * r + p4) * r + p5
        m = p * (r * r) + r + one
        k = np.int32(n)
        if v < lowest:
            m, k = zero, np.int32(0)
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
        """loss[r] and e[r] (softmax - one-hot) for rows r0:r1; e may be logits itself. Each
        pass its own loop over the row (one loop doing it all ran unvectorised: 3.7 against
        ~2 ns an element)."""
        c = logits.shape[1]
        body = c - c % LANES
        lanes = np.empty(LANES, np.float32)
        powers = np.empty(c, np.int32)
        for r in range(r0, r1):
            x, out = logits[r], e[r]
            bits = out.view(np.int32)
            label = labels[r]
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
                out[j] = m
                powers[j] = k << 23
            for j in range(c):
                bits[j] += powers[j]
            # the sum, in float64, in four chains (columns j % 4) added in order at the end
            s0 = s1 = s2 = s3 = 0.0
            quads = c - c % 4
            for j in range(0, quads, 4):
                s0 += out[j]
                s1 += out[j + 1]
                s2 += out[j + 2]
                s3 += out[j + 3]
            z = ((s0 + s1) + s2) + s3
            for j in range(quads, c):
                z += out[j]
            z32 = np.float32(z)
            for j in range(c):
                out[j] = out[j] / z32
            out[label] -= one
            loss[r] = np.float32(np.log(z)) - (picked - mx)

    return exp_nonpositive, rows


def exp_nonpositive(x: Any) -> Any:
    """exp(x) for float32 x <= 0, the compiled kernel's (for the tests)."""
    out = np.empty(x.shape, np.float32)
    _kernels()[0](np.ascontiguousarray(x, dtype=np.float32).reshape(-1), out.reshape(-1))
    return out


def sparse_xent(logits: Any, labels: Any, into: bool = False) -> tuple[Any, Any]:
    from flowctl.kernels.nn import _check_labels

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
