"""Max and average pooling compiled for the CPU (NHWC), each direction one pass over its windows.

The reference (kernels/conv.py) works tap by tap: kh*kw strided numpy passes over the whole batch,
and MaxPoolGrad a compare, a mask and a scatter per tap. Here each output position visits its
clipped window once, channels innermost (contiguous); a MaxPool whose windows all lie inside the
input (no padding: Inception's) takes the max along each window row's columns, then along the
window rows, per output row (`pool_jit.max_pool_inside`: Inception's 147x147x64 3x3 stride 2 at
batch 8, one thread, 5.8 ms where the numpy passes it replaced took 17 and the per-window loop
28). MaxPoolGrad finds each window's FIRST maximum in row-major window order, as the reference
does (a tied window passes its gradient on once), by comparing x with the pooled y, so no argmax
need be saved by the forward pass.

Work is split by images, fixed by the shape (each image's output and gradient are its own), so any
thread count gives the same bits. Windows are clipped to the unpadded input: padding never wins a
max and is not counted in an average (TensorFlow's rule).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from flowctl.kernels import intra
from flowctl.kernels.conv import POOL_ELEMENTS, _geometry
from flowctl.kernels.cpu.jit import compiled, floats_nhwc
from flowctl.kernels.registry import variant

Fn = Callable[..., Any]


@compiled
def _kernels() -> Any:
    """The compiled loops (kernels/cpu/pool_jit.py), imported on first use."""
    from flowctl.kernels.cpu import pool_jit

    return pool_jit


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
        if which == "max_pool" and ph == pw == 0 and (ho - 1) * sh + kh <= h and (wo - 1) * sw + kw <= w:
            k = _kernels().max_pool_inside
            body = lambda a, b: k(x, a, b, kh, kw, sh, sw, y)  # noqa: E731
        else:
            k = getattr(_kernels(), which)
            body = lambda a, b: k(x, a, b, kh, kw, sh, sw, ph, pw, y)  # noqa: E731
        _by_images(x.shape[0], h * w * x.shape[3], body)
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
