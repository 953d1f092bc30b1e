"""The forward pass of stride-1 convolutions whose window is one column or one row of 5+ taps
(Inception-v3's 7x1 and 1x7) as k shifted GEMMs, with no im2col.

In NHWC a k x 1 window's taps are whole image rows apart: with the input padded along H and each
image flattened to (rows * W, C), tap t of every output is row block t*W onward of that matrix, a
strided view. So y = sum over t of A_t @ F[t], each A_t a view, each product a plain GEMM with
K = C, summed in tap order. A 1 x k window runs as a k x 1 one on the images transposed (H and W
swapped in the padded copy, the output swapped back).

Measured, batch 8, 2 threads, every 7x1/1x7 forward pass of Inception-v3 (17x17, 128-192
channels) against the im2col + GEMM pieces (kernels/conv.py), alternating, best of two: 265 -> 158
ms in all (192 -> 192 7x1 12.9 -> 6.8 ms). Not taken (MIN_TAPS): the 8x8 3x1/1x3 windows (384
channels), 2.5 -> 2.7 ms; nor the gradients: the input gradient (the same correlation over dy)
measured even with the GEMM pieces, the filter gradient (k products over every image) 152 -> 195.

The sum runs in tap order and BLAS's threads split only a product's rows and columns, so the bits
do not depend on the thread count (tested).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from flowctl.kernels.conv import window
from flowctl.kernels.cpu.jit import FLOAT_TYPES
from flowctl.kernels.registry import variant

Fn = Callable[..., Any]

MIN_TAPS = 5  # a window of fewer taps stays with the im2col pieces (measured slower here: module doc)


def _padded(x: Any, before: int, rows: int) -> Any:
    """x (N, H, W, C) inside `rows` rows along H, `before` zero rows above it, zeros after."""
    n, h, w, c = x.shape
    out = np.empty((n, rows, w, c), x.dtype)
    out[:, :before] = 0
    out[:, before:before + h] = x
    out[:, before + h:] = 0
    return out


def _columns(x: Any, f: Any, before: int, out_h: int) -> Any:
    """y (N, out_h, W, Co) = sum over t of xpad[:, i + t] @ f[t] for a k x 1 window f (k, C, Co)."""
    n, _, w, _ = x.shape
    k = f.shape[0]
    a = _padded(x, before, out_h + k - 1).reshape(n, -1, x.shape[3])
    m = out_h * w
    y = np.matmul(a[:, :m], f[0])
    part = np.empty_like(y)
    for t in range(1, k):
        np.matmul(a[:, t * w:t * w + m], f[t], out=part)
        y += part
    return y.reshape(n, out_h, w, f.shape[2])


def _swap(x: Any) -> Any:
    return x.transpose(0, 2, 1, 3)


def conv2d_forward(x: Any, f: Any, padding: str) -> Any:
    kh, kw = f.shape[:2]
    if kw == 1:
        ho, ph = window(x.shape[1], kh, 1, padding)
        return _columns(x, f[:, 0], ph, ho)
    wo, pw = window(x.shape[2], kw, 1, padding)
    return np.ascontiguousarray(_swap(_columns(_swap(x), f[0], pw, wo)))


def applies(attrs: dict[str, Any], ins: Any) -> bool:
    """Rule: stride 1, float32/float64 NHWC x and filter, a window of one column or one row of at
    least MIN_TAPS taps."""
    if tuple(attrs.get("strides", (0, 0))) != (1, 1):
        return False
    try:
        if not all(ins[i].dtype in FLOAT_TYPES and len(ins[i].shape) == 4 for i in (0, 1)):
            return False
        kh, kw = (int(d) for d in ins[1].shape[:2])
        return min(kh, kw) == 1 and max(kh, kw) >= MIN_TAPS
    except (IndexError, TypeError, ValueError):
        return False


@variant("Conv2D", "cpu", "shifted", applies)
def conv2d_shifted(xp: Any, attrs: dict[str, Any]) -> Fn:
    padding = attrs["padding"]
    return lambda x, f: conv2d_forward(x, f, padding)
