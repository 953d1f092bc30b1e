"""Batch norm (with its fused ReLU) compiled for the CPU: the statistics in one read of x, the
normalisation in one read and one write; the gradient's two reductions in one read of (dy, y, x)
and dx in one more. The reference (kernels/nn.py) makes three to four numpy passes each way, each
per-channel broadcast running at a third of a same-shape pass's speed.

Rows of x (every axis but the channel's) are cut into pieces of about BN_ELEMENTS values, fixed by
the shape. A piece's partial sums are accumulated in float64, the piece's mean and centred sum of
squares combined across pieces in piece order (Chan et al.'s pairwise update), so the statistics
are at least as accurate as the reference's and the same bits for any thread count. The
element-wise parts round in x's dtype in the reference's order: t = (x - mean) * a + offset, then
max(t, 0); dx = g*k + ((x - mean)*a + b).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from flowctl.kernels import intra
from flowctl.kernels.cpu.jit import FLOAT_TYPES, available, compiled, njit
from flowctl.kernels.nn import BN_ELEMENTS, PARALLEL_BN_PIECES, _bn_grad_args, _pieces, bn_grad_coefficients
from flowctl.kernels.registry import variant

Fn = Callable[..., Any]


@compiled
def _kernels() -> Any:
    @njit
    def stats(x2: Any, a: int, b: int, mean: Any, m2: Any) -> None:
        """Into float64 (C,) mean and m2: rows a:b's mean and sum of squared deviations."""
        c = x2.shape[1]
        s = np.zeros(c)
        for i in range(a, b):
            for j in range(c):
                s[j] += x2[i, j]
        n = b - a
        for j in range(c):
            s[j] /= n
        q = np.zeros(c)
        for i in range(a, b):
            for j in range(c):
                d = x2[i, j] - s[j]
                q[j] += d * d
        mean[:] = s
        m2[:] = q

    @njit
    def normalise(x2: Any, a: int, b: int, mean: Any, k: Any, offset: Any, relu: bool, y2: Any) -> None:
        c = x2.shape[1]
        for i in range(a, b):
            for j in range(c):
                t = (x2[i, j] - mean[j]) * k[j] + offset[j]
                if relu and t < 0:  # max(t, 0); a NaN stays NaN
                    t = 0
                y2[i, j] = t

    @njit
    def grad_sums(dy2: Any, y2: Any, x2: Any, a: int, b: int, mean: Any, relu: bool, g_sum: Any, gx_sum: Any) -> None:
        """float64 sums over rows a:b of g and g*(x - mean), g = dy masked where the ReLU clipped."""
        c = x2.shape[1]
        s = np.zeros(c)
        t = np.zeros(c)
        for i in range(a, b):
            for j in range(c):
                g = dy2[i, j]
                if relu:
                    g = g * np.sign(y2[i, j])
                s[j] += g
                t[j] += g * (x2[i, j] - mean[j])
        g_sum[:] = s
        gx_sum[:] = t

    @njit
    def grad_apply(dy2: Any, y2: Any, x2: Any, a: int, b: int, mean: Any, k: Any, ca: Any, cb: Any, relu: bool,
                   dx2: Any) -> None:
        c = x2.shape[1]
        for i in range(a, b):
            for j in range(c):
                g = dy2[i, j]
                if relu:
                    g = g * np.sign(y2[i, j])
                dx2[i, j] = g * k[j] + ((x2[i, j] - mean[j]) * ca[j] + cb[j])

    return stats, normalise, grad_sums, grad_apply


def _rows(x: Any) -> Any:
    return np.ascontiguousarray(x).reshape(-1, x.shape[-1])


def _run_pieces(pieces: list[slice], body: Callable[[slice], Any]) -> list[Any]:
    """body(piece) for every piece, on the intra-op threads when there are enough; in piece order."""
    def runs(r: range) -> list[Any]:
        return [body(pieces[i]) for i in r]

    return [v for part in intra.for_chunks(len(pieces), runs, least=PARALLEL_BN_PIECES) for v in part]


def batch_norm_forward(x: Any, scale: Any, offset: Any, eps: float, relu: bool) -> tuple[Any, Any, Any]:
    stats, normalise, _, _ = _kernels()
    x2 = _rows(x)
    m, c = x2.shape
    pieces = _pieces(m, c, BN_ELEMENTS)

    def piece_stats(p: slice) -> tuple[int, Any, Any]:
        mean, m2 = np.empty(c), np.empty(c)
        stats(x2, p.start, p.stop, mean, m2)
        return p.stop - p.start, mean, m2

    n, mean, m2 = 0, np.zeros(c), np.zeros(c)
    for n_p, mean_p, m2_p in _run_pieces(pieces, piece_stats):  # Chan's update, in piece order
        delta = mean_p - mean
        total = n + n_p
        mean = mean + delta * (n_p / total)
        m2 = m2 + m2_p + delta * delta * (n * n_p / total)
        n = total
    dt = x.dtype
    mean_x, var_x = mean.astype(dt), (m2 / m).astype(dt)
    k = (scale / np.sqrt(var_x + eps)).astype(dt)
    y = np.empty(x.shape, dtype=dt)
    y2 = y.reshape(-1, c)
    offset_x = np.asarray(offset, dtype=dt)
    _run_pieces(pieces, lambda p: normalise(x2, p.start, p.stop, mean_x, k, offset_x, relu, y2))
    return y, mean_x, var_x


def batch_norm_grad(dy: Any, x: Any, scale: Any, mean: Any, var: Any, y: Any | None, stat_grads: tuple,
                    eps: float) -> tuple[Any, Any, Any]:
    _, _, grad_sums, grad_apply = _kernels()
    x2, dy2 = _rows(x), _rows(dy)
    relu = y is not None
    y2 = _rows(y) if relu else dy2
    m, c = x2.shape
    pieces = _pieces(m, c, BN_ELEMENTS)
    dt = dy.dtype
    mean_x = np.asarray(mean, dtype=dt)

    def piece_sums(p: slice) -> tuple[Any, Any]:
        s, t = np.empty(c), np.empty(c)
        grad_sums(dy2, y2, x2, p.start, p.stop, mean_x, relu, s, t)
        return s, t

    g_sum, gx_sum = np.zeros(c), np.zeros(c)
    for s, t in _run_pieces(pieces, piece_sums):
        g_sum += s
        gx_sum += t
    doffset, dot = g_sum.astype(dt), gx_sum.astype(dt)
    dscale, k, ca, cb = bn_grad_coefficients(np, scale, var, eps, m, dot, doffset, stat_grads)
    dx = np.empty(x.shape, dtype=dt)
    dx2 = dx.reshape(-1, c)
    ca, cb, k = (np.asarray(v, dtype=dt) for v in (ca, cb, k))
    _run_pieces(pieces, lambda p: grad_apply(dy2, y2, x2, p.start, p.stop, mean_x, k, ca, cb, relu, dx2))
    return dx, dscale, doffset


def _applies(attrs: dict[str, Any], ins: Any) -> bool:
    """x (input 0) a float32/float64 tensor of rank 2 or more; numba present."""
    try:
        x = ins[0]
        return available() and x.dtype in FLOAT_TYPES and len(x.shape) >= 2 and all(
            s.dtype == x.dtype for s in ins[1:3])
    except (IndexError, TypeError):
        return False


@variant("FusedBatchNorm", "cpu", "numba", _applies)
def fused_batch_norm_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    eps, relu = attrs["epsilon"], attrs["activation"] == "relu"
    return lambda x, scale, offset: batch_norm_forward(x, scale, offset, eps, relu)


@variant("FusedBatchNormGrad", "cpu", "numba", _applies)
def fused_batch_norm_grad_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    eps, relu = attrs["epsilon"], attrs["activation"] == "relu"

    def run(dy: Any, x: Any, scale: Any, mean: Any, var: Any, *rest: Any) -> tuple[Any, Any, Any]:
        y, stat_grads = _bn_grad_args(relu, rest)
        return batch_norm_grad(dy, x, scale, mean, var, y, stat_grads, eps)

    return run


def channel_affine(x: Any, scale: Any, shift: Any, relu: bool) -> Any:
    """relu?(x * scale + shift) per channel (inference's batch norm), one read and one write: the
    normalising kernel with a zero mean (x - 0 is x exactly)."""
    _, normalise, _, _ = _kernels()
    x2 = _rows(x)
    m, c = x2.shape
    y = np.empty(x.shape, dtype=x.dtype)
    y2 = y.reshape(-1, c)
    zero = np.zeros(c, dtype=x.dtype)
    scale, shift = np.asarray(scale, dtype=x.dtype), np.asarray(shift, dtype=x.dtype)
    _run_pieces(_pieces(m, c, BN_ELEMENTS), lambda p: normalise(x2, p.start, p.stop, zero, scale, shift, relu, y2))
    return y


@variant("ChannelAffine", "cpu", "numba", _applies)
def channel_affine_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    relu = attrs["activation"] == "relu"
    return lambda x, scale, shift: channel_affine(x, scale, shift, relu)
