"""Max and average pooling compiled for the CPU (NHWC), each direction one pass over its windows.

The reference (kernels/conv.py) works tap by tap: kh*kw strided numpy passes over the whole batch,
and MaxPoolGrad a compare, a mask and a scatter per tap. Here each output position visits its
clipped window once, channels innermost (contiguous). MaxPoolGrad finds each window's FIRST
maximum in row-major window order, as the reference does (a tied window passes its gradient on
once), by comparing x with the pooled y, so no argmax need be saved by the forward pass.

Work is split by images, fixed by the shape (each image's output and gradient are its own), so any
thread count gives the same bits. Windows are clipped to the unpadded input: padding never wins a
max and is not counted in an average (TensorFlow's rule).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from flowctl.kernels import intra
from flowctl.kernels.conv import POOL_ELEMENTS, _geometry
from flowctl.kernels.cpu.jit import compiled, floats_nhwc, njit
from flowctl.kernels.registry import variant

Fn = Callable[..., Any]


@compiled
def _kernels() -> Any:
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

    return SimpleNamespace(max_pool=max_pool, max_pool_grad=max_pool_grad, avg_pool=avg_pool,
                           avg_pool_grad=avg_pool_grad)


def _by_images(n: int, per_image: int, body: Callable[[int, int], None]) -> None:
    """body(n0, n1) over runs of whole images, on the intra-op threads when there are several."""
    step = max(1, POOL_ELEMENTS // max(1, per_image))
    pieces = [(a, min(n, a + step)) for a in range(0, n, step)]

    def runs(r: range) -> None:
        for i in r:
            body(*pieces[i])

    intra.for_chunks(len(pieces), runs, least=2)


def _pool(which: str, attrs: dict[str, Any]) -> Fn:
    (kh, kw), strides, padding = attrs["ksize"], attrs["strides"], attrs["padding"]

    def run(x: Any) -> Any:
        x = np.ascontiguousarray(x)
        sh, sw, ph, pw, h, w, ho, wo = _geometry(x.shape, kh, kw, strides, padding)
        y = np.empty((x.shape[0], ho, wo, x.shape[3]), dtype=x.dtype)
        k = getattr(_kernels(), which)
        _by_images(x.shape[0], h * w * x.shape[3], lambda a, b: k(x, a, b, kh, kw, sh, sw, ph, pw, y))
        return y

    return run


@variant("MaxPool", "cpu", "numba", lambda attrs, ins: floats_nhwc(ins))
def max_pool_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    return _pool("max_pool", attrs)


@variant("AvgPool", "cpu", "numba", lambda attrs, ins: floats_nhwc(ins))
def avg_pool_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    return _pool("avg_pool", attrs)


@variant("MaxPoolGrad", "cpu", "numba", lambda attrs, ins: floats_nhwc(ins, (0, 1, 2)))
def max_pool_grad_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    (kh, kw), strides, padding = attrs["ksize"], attrs["strides"], attrs["padding"]

    def run(x: Any, y: Any, dy: Any) -> Any:
        x, y, dy = (np.ascontiguousarray(a) for a in (x, y, dy))
        sh, sw, ph, pw, h, w, ho, wo = _geometry(x.shape, kh, kw, strides, padding)
        dx = np.empty(x.shape, dtype=dy.dtype)
        k = _kernels().max_pool_grad
        _by_images(x.shape[0], h * w * x.shape[3], lambda a, b: k(x, y, dy, a, b, kh, kw, sh, sw, ph, pw, dx))
        return dx

    return run


@variant("AvgPoolGrad", "cpu", "numba", lambda attrs, ins: floats_nhwc(ins))
def avg_pool_grad_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    (kh, kw), strides, padding = attrs["ksize"], attrs["strides"], attrs["padding"]

    def run(dy: Any, like_x: Any) -> Any:
        dy = np.ascontiguousarray(dy)
        x_shape = (dy.shape[0],) + tuple(like_x.shape[1:])
        sh, sw, ph, pw, h, w, ho, wo = _geometry(x_shape, kh, kw, strides, padding)
        dx = np.empty(x_shape, dtype=dy.dtype)
        k = _kernels().avg_pool_grad
        _by_images(dy.shape[0], h * w * dy.shape[3], lambda a, b: k(dy, a, b, kh, kw, sh, sw, ph, pw, dx))
        return dx

    return run
