"""Convolution and pooling kernels (layout NHWC, filters HWIO), written once against `xp`.

Every convolution pass is ONE large GEMM plus data movement; the only Python loops run over the
kh*kw taps of the window, never over pixels. A k-tap convolution between an input X (M rows of C
channels) and an output Y (rows of Co channels) can widen either side into a GEMM:

- input side ("im2col"): copy the k shifted windows of the input into columns (rows x k*C), one
  GEMM against the (k*C, Co) filter matrix. Extra traffic: k*M*C. Works for any stride.
- output side: one GEMM of the narrow matrix against all taps at once (rows x k*Co), then k shifted
  slice additions (or, for the backward passes, columns of shifted dy). Extra traffic: k*M*Co.

Each pass picks a side from the channel counts (`_output_side`, with the measurements behind it),
deterministically, so a run is reproducible. 1x1 convolutions are a reshape and a matmul. The cpu
kernels run a few images at a time so the columns stay in cache (`GEMM_ROWS`); gpu takes the batch
whole.

Windows are clipped to the unpadded input by `taps`, so the only zero-padded copies are the two
column builders (windows of x, windows of dy), which need a rectangular source for a strided view.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

from flowctl.kernels.registry import kernel

Fn = Callable[..., Any]
# One tap of a window: (tap index i*kw+j, output rows, output cols, input rows, input cols,
# whether it reaches every output position, whether it reads every input position).
Tap = tuple[int, slice, slice, slice, slice, bool, bool]


def window(size: int, k: int, s: int, padding: str) -> tuple[int, int]:
    """(output size, padding before) along one spatial axis, by TensorFlow's rule: SAME gives
    ceil(size/s) outputs with max((out-1)*s + k - size, 0) padding, the smaller half before;
    VALID gives floor((size-k)/s) + 1 and no padding. (Kept in step with the shape function in
    flowctl/engine/ops/conv.py; kernels may not import the engine.)"""
    if padding == "SAME":
        out = -(-size // s)
        return out, max((out - 1) * s + k - size, 0) // 2
    if padding == "VALID":
        out = (size - k) // s + 1
        if out < 1:
            raise ValueError(f"VALID window of {k} with stride {s} does not fit an input of size {size}")
        return out, 0
    raise ValueError(f"padding must be 'SAME' or 'VALID', got {padding!r}")


def _axis(i: int, s: int, p: int, size: int, out: int) -> tuple[slice, slice, bool, bool] | None:
    """Output positions o whose input o*s + i - p lies in [0, size), as (output slice, input slice,
    covers all outputs, covers all inputs); None when tap i only ever sees padding."""
    o0 = max(0, -(-(p - i) // s))
    o1 = min(out, (size - 1 - i + p) // s + 1)
    if o1 <= o0:
        return None
    a = o0 * s + i - p
    full_in = a == 0 and o1 - o0 == size and (s == 1 or size == 1)
    return slice(o0, o1), slice(a, a + (o1 - o0 - 1) * s + 1, s), o0 == 0 and o1 == out, full_in


@lru_cache(maxsize=512)
def taps(kh: int, kw: int, sh: int, sw: int, ph: int, pw: int, h: int, w: int, ho: int,
         wo: int) -> tuple[Tap, ...]:
    """The window's taps in row-major order (MaxPoolGrad's first-max rule relies on the order),
    each clipped to the unpadded input; taps that only see padding are left out."""
    rows = [_axis(i, sh, ph, h, ho) for i in range(kh)]
    cols = [_axis(j, sw, pw, w, wo) for j in range(kw)]
    out = [(i * kw + j, r[0], c[0], r[1], c[1], r[2] and c[2], r[3] and c[3])
           for i, r in enumerate(rows) if r is not None for j, c in enumerate(cols) if c is not None]
    return tuple(out)


def _geometry(x_shape: tuple, kh: int, kw: int, strides: tuple, padding: str) -> tuple[int, ...]:
    """(sh, sw, ph, pw, H, W, Ho, Wo) for an NHWC input."""
    sh, sw = strides
    h, w = int(x_shape[1]), int(x_shape[2])
    ho, ph = window(h, kh, sh, padding)
    wo, pw = window(w, kw, sw, padding)
    return sh, sw, ph, pw, h, w, ho, wo


def _output_side(step: str, sh: int, sw: int, c: int, co: int) -> bool:
    """Widen the output side (k*Co columns) rather than the input side (k*C) for `step`
    ("forward", "input" or "filter")? Only at stride 1: at stride s the output side would compute
    s*s times the needed products. Measured on 2 cores with OpenBLAS, batch 8, 3x3, with the cpu
    batch chunks (ms, input side / output side):
    - 35x35x288 -> 64: forward 29 / 18 (the GEMM (M, 288) @ (288, 576) runs at ~170 GFLOP/s where
      the im2col one (M, 2592) @ (2592, 64) runs at ~140, and the copy is 4.5x narrower).
    - Co = C (35x35x64, 147x147x32, 35x35x288): forward 4.1 / 7.3, 36 / 52, 72 / 80; backprop
      input 6.8 / 4.1, 54 / 36, 74 / 75 (the input side is col2im, whose k additions of M*C read
      twice and write once); backprop filter 3.9 / 4.1, 45 / 31, 71 / 70.
    - Co > C: 35x35x64 -> 96 forward 6.3 / 11.8; 73x73x64 -> 80 backprop input 26 / 34."""
    if sh != 1 or sw != 1:
        return False
    return co < c if step == "forward" else co <= c


def _pad(xp: Any, x: Any, top: int, bottom: int, left: int, right: int) -> Any:
    if top == bottom == left == right == 0:
        return x
    n, h, w, c = x.shape
    out = xp.zeros((n, h + top + bottom, w + left + right, c), dtype=x.dtype)
    out[:, top:top + h, left:left + w] = x
    return out


def _pad_for_windows(xp: Any, x: Any, kh: int, kw: int, sh: int, sw: int, ph: int, pw: int, ho: int,
                     wo: int) -> Any:
    """x zero-padded so every window of the output lies inside it (SAME's after-padding is what the
    last window needs; VALID needs none, its unread trailing rows stay unread)."""
    h, w = x.shape[1], x.shape[2]
    return _pad(xp, x, ph, max((ho - 1) * sh + kh - h - ph, 0), pw, max((wo - 1) * sw + kw - w - pw, 0))


def _columns(xp: Any, xpad: Any, kh: int, kw: int, sh: int, sw: int, ho: int, wo: int) -> Any:
    """im2col: a (N*Ho*Wo, kh*kw*C) contiguous copy of every window of the padded input, built from
    a strided view so the copy is a single pass in C (cupy has the same as_strided)."""
    n, _, _, c = xpad.shape
    s0, s1, s2, s3 = xpad.strides
    view = xp.lib.stride_tricks.as_strided(xpad, (n, ho, wo, kh, kw, c),
                                           (s0, sh * s1, sw * s2, s1, s2, s3))
    return xp.ascontiguousarray(view).reshape(n * ho * wo, kh * kw * c)


def _dy_columns(xp: Any, dy: Any, kh: int, kw: int, ph: int, pw: int, h: int, w: int) -> Any:
    """Stride 1 only: columns (N*H*W, kh*kw*Co) with column block (i', j') at input position (a, b)
    holding dy[a + i' - (kh-1) + ph, b + j' - (kw-1) + pw] (zero outside dy), i.e. the windows of a
    zero-padded dy over the *flipped* filter. Shared by the backward passes on the output side."""
    ho, wo = dy.shape[1], dy.shape[2]
    top, left = kh - 1 - ph, kw - 1 - pw
    padded = _pad(xp, dy, top, h - ho + ph, left, w - wo + pw)
    return _columns(xp, padded, kh, kw, 1, 1, h, w)


def _scatter_taps(xp: Any, dst_shape: tuple, dtype: Any, src: Any, table: tuple[Tap, ...],
                  to_input: bool) -> Any:
    """Sum src[..., t, :] over the taps into a new array of dst_shape: into the input grid
    (col2im, to_input) or into the output grid (forward on the output side). A tap that fills the
    whole destination is copied first, which saves a zero fill and one addition pass."""
    full = next((tap for tap in table if tap[6 if to_input else 5]), None)
    if full is not None:
        t, r, c, ir, ic = full[:5]
        dst = xp.array(src[:, r, c, t] if to_input else src[:, ir, ic, t], dtype=dtype)
    else:
        dst = xp.zeros(dst_shape, dtype=dtype)
    for t, r, c, ir, ic, _, _ in table:
        if full is not None and t == full[0]:
            continue
        if to_input:
            dst[:, ir, ic] += src[:, r, c, t]
        else:
            dst[:, r, c] += src[:, ir, ic, t]
    return dst


# ---------------------------------------------------------------------------- convolution
def conv2d_forward(xp: Any, x: Any, f: Any, strides: tuple, padding: str) -> Any:
    kh, kw, c, co = f.shape
    n = x.shape[0]
    sh, sw, ph, pw, h, w, ho, wo = _geometry(x.shape, kh, kw, strides, padding)
    if kh == kw == 1:
        # 1x1: a plain matmul over the (strided) pixels; no copy at stride 1.
        xs = x if sh == sw == 1 else xp.ascontiguousarray(x[:, ::sh, ::sw])
        return (xs.reshape(-1, c) @ f.reshape(c, co)).reshape(n, ho, wo, co)
    if _output_side("forward", sh, sw, c, co):
        w_all = xp.ascontiguousarray(f.transpose(2, 0, 1, 3)).reshape(c, kh * kw * co)
        z = (xp.ascontiguousarray(x).reshape(-1, c) @ w_all).reshape(n, h, w, kh * kw, co)
        table = taps(kh, kw, sh, sw, ph, pw, h, w, ho, wo)
        return _scatter_taps(xp, (n, ho, wo, co), x.dtype, z, table, to_input=False)
    cols = _columns(xp, _pad_for_windows(xp, x, kh, kw, sh, sw, ph, pw, ho, wo), kh, kw, sh, sw, ho, wo)
    return (cols @ f.reshape(kh * kw * c, co)).reshape(n, ho, wo, co)


def conv2d_backprop_input(xp: Any, dy: Any, f: Any, x_shape: tuple, strides: tuple,
                          padding: str) -> Any:
    kh, kw, c, co = f.shape
    n = dy.shape[0]
    x_shape = (n,) + tuple(x_shape[1:])
    sh, sw, ph, pw, h, w, ho, wo = _geometry(x_shape, kh, kw, strides, padding)
    if kh == kw == 1:
        g = (xp.ascontiguousarray(dy).reshape(-1, co) @ f.reshape(c, co).T).reshape(n, ho, wo, c)
        if sh == sw == 1:
            return g
        dx = xp.zeros(x_shape, dtype=dy.dtype)
        dx[:, ::sh, ::sw] = g
        return dx
    if _output_side("input", sh, sw, c, co):
        # The transposed convolution as a convolution: windows of padded dy against the flipped
        # filter, so the GEMM writes dx directly (no k*M*C scatter).
        f_flip = xp.ascontiguousarray(f[::-1, ::-1].transpose(0, 1, 3, 2)).reshape(kh * kw * co, c)
        return (_dy_columns(xp, dy, kh, kw, ph, pw, h, w) @ f_flip).reshape(x_shape)
    # col2im: one GEMM into per-tap columns, then each tap added into its (strided) input slice.
    z = (xp.ascontiguousarray(dy).reshape(-1, co) @ f.reshape(kh * kw * c, co).T)
    z = z.reshape(n, ho, wo, kh * kw, c)
    table = taps(kh, kw, sh, sw, ph, pw, h, w, ho, wo)
    return _scatter_taps(xp, x_shape, dy.dtype, z, table, to_input=True)


def conv2d_backprop_filter(xp: Any, x: Any, dy: Any, f_shape: tuple, strides: tuple,
                           padding: str) -> Any:
    kh, kw, c, co = (int(d) for d in f_shape)
    sh, sw, ph, pw, h, w, ho, wo = _geometry(x.shape, kh, kw, strides, padding)
    dy2 = xp.ascontiguousarray(dy).reshape(-1, co)
    if kh == kw == 1:
        xs = x if sh == sw == 1 else xp.ascontiguousarray(x[:, ::sh, ::sw])
        return (xs.reshape(-1, c).T @ dy2).reshape(1, 1, c, co)
    if _output_side("filter", sh, sw, c, co):
        # dW[i, j] = sum_a x[a]^T dy[a - i + ph]: x against the flipped-tap columns of dy.
        r = xp.ascontiguousarray(x).reshape(-1, c).T @ _dy_columns(xp, dy, kh, kw, ph, pw, h, w)
        r = r.reshape(c, kh, kw, co)[:, ::-1, ::-1]
        return xp.ascontiguousarray(r.transpose(1, 2, 0, 3))
    cols = _columns(xp, _pad_for_windows(xp, x, kh, kw, sh, sw, ph, pw, ho, wo), kh, kw, sh, sw, ho, wo)
    return (cols.T @ dy2).reshape(kh, kw, c, co)


@kernel("Conv2D")
def conv2d_kernel(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding = attrs["strides"], attrs["padding"]
    return lambda x, f: conv2d_forward(xp, x, f, strides, padding)


@kernel("Conv2DBackpropInput")
def conv2d_backprop_input_kernel(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding = attrs["strides"], attrs["padding"]
    return lambda dy, f, like_x: conv2d_backprop_input(xp, dy, f, like_x.shape, strides, padding)


@kernel("Conv2DBackpropFilter")
def conv2d_backprop_filter_kernel(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding = attrs["strides"], attrs["padding"]
    return lambda x, dy, like_f: conv2d_backprop_filter(xp, x, dy, like_f.shape, strides, padding)


# ---------------------------------------------------------------------------- cpu: batch chunks
# On CPU the column copies and tap additions are memory-bound, so the cpu kernels work on a few
# images at a time, keeping the columns in cache. A chunk keeps at least GEMM_ROWS rows, below
# which OpenBLAS loses efficiency. Measured, batch 8 (fwd + both backprops, ms, whole batch ->
# chunks): 35x35x64 -> 96 3x3: 24.3 -> 17.5; 73x73x64 -> 80 3x3: 97.7 -> 74.5; 35x35x288 -> 64 3x3:
# 50.1 -> 48.5; 17x17x768 -> 192 1x7 (289 rows an image) stays whole: 66 ms (two images a chunk: 71).
GEMM_ROWS = 2048
# Pooling is all memory traffic: chunks of at most POOL_ELEMENTS outputs. Measured, batch 8,
# 3x3 MaxPoolGrad: 35x35x288 stride 1 24 -> 13 ms; 147x147x64 stride 2 54 -> 26 ms.
POOL_ELEMENTS = 1 << 18


def _by_images(xp: Any, n: int, step: int, part: Callable[[slice], Any]) -> Any:
    """part(images) for consecutive chunks of `step` images, stacked along the batch."""
    if step >= n:
        return part(slice(0, n))
    out = None
    for b in range(0, n, step):
        sl = slice(b, min(b + step, n))
        y = part(sl)
        if out is None:
            out = xp.empty((n,) + tuple(y.shape[1:]), dtype=y.dtype)
        out[sl] = y
    return out


def _conv_step(x_shape: tuple, f_shape: tuple, strides: tuple) -> int:
    """Images per chunk: enough for GEMM_ROWS output rows; 1x1 convolutions copy nothing, so
    they run whole."""
    if f_shape[0] == f_shape[1] == 1:
        return int(x_shape[0])
    rows = max(1, (int(x_shape[1]) // strides[0]) * (int(x_shape[2]) // strides[1]))
    return -(-GEMM_ROWS // rows)


@kernel("Conv2D", device_types=("cpu",))
def conv2d_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding = attrs["strides"], attrs["padding"]

    def run(x: Any, f: Any) -> Any:
        return _by_images(xp, x.shape[0], _conv_step(x.shape, f.shape, strides),
                          lambda sl: conv2d_forward(xp, x[sl], f, strides, padding))

    return run


@kernel("Conv2DBackpropInput", device_types=("cpu",))
def conv2d_backprop_input_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding = attrs["strides"], attrs["padding"]

    def run(dy: Any, f: Any, like_x: Any) -> Any:
        return _by_images(xp, dy.shape[0], _conv_step(like_x.shape, f.shape, strides),
                          lambda sl: conv2d_backprop_input(xp, dy[sl], f, like_x.shape, strides, padding))

    return run


@kernel("Conv2DBackpropFilter", device_types=("cpu",))
def conv2d_backprop_filter_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding = attrs["strides"], attrs["padding"]

    def run(x: Any, dy: Any, like_f: Any) -> Any:
        n, step = x.shape[0], _conv_step(x.shape, like_f.shape, strides)
        dw = None
        for b in range(0, n, step):
            part = conv2d_backprop_filter(xp, x[b:b + step], dy[b:b + step], like_f.shape, strides, padding)
            dw = part if dw is None else xp.add(dw, part, out=dw)
        return dw

    return run


# ---------------------------------------------------------------------------- pooling
def _pool_table(x_shape: tuple, ksize: tuple, strides: tuple, padding: str) -> tuple:
    kh, kw = ksize
    sh, sw, ph, pw, h, w, ho, wo = _geometry(x_shape, kh, kw, strides, padding)
    return taps(kh, kw, sh, sw, ph, pw, h, w, ho, wo), (x_shape[0], ho, wo, x_shape[3])


def max_pool(xp: Any, x: Any, ksize: tuple, strides: tuple, padding: str) -> Any:
    table, y_shape = _pool_table(x.shape, ksize, strides, padding)
    # Padding never wins (TensorFlow pads with -inf): clipped taps simply skip it.
    full = next((tap for tap in table if tap[5]), None)
    if full is not None:
        y = xp.array(x[:, full[3], full[4]])
    else:
        y = xp.full(y_shape, -xp.inf, dtype=x.dtype)
    for t, r, c, ir, ic, _, _ in table:
        if full is not None and t == full[0]:
            continue
        xp.maximum(y[:, r, c], x[:, ir, ic], out=y[:, r, c])
    return y


def max_pool_grad(xp: Any, x: Any, y: Any, dy: Any, ksize: tuple, strides: tuple, padding: str) -> Any:
    """Each window's gradient goes to its FIRST maximum in row-major window order, so a window whose
    maximum is tied still passes its gradient on exactly once."""
    table, _ = _pool_table(x.shape, ksize, strides, padding)
    dx = xp.zeros(x.shape, dtype=dy.dtype)
    taken = xp.zeros(y.shape, dtype=bool)
    bits = xp.dtype(f"i{dy.dtype.itemsize}")
    for _, r, c, ir, ic, _, _ in table:
        hit = (x[:, ir, ic] == y[:, r, c]) > taken[:, r, c]  # a maximum, and the window's first
        taken[:, r, c] |= hit
        # dy where hit, else 0, as dy's bits AND 0 or ~0: exact (a non-finite dy stays at its own
        # window's maximum) and, measured, 4x faster than xp.where on numpy, which dominated.
        dx[:, ir, ic] += (dy[:, r, c].view(bits) & -hit.astype(bits)).view(dy.dtype)
    return dx


def _avg_counts(xp: Any, table: tuple[Tap, ...], y_shape: tuple, dtype: Any) -> Any:
    """How many unpadded inputs each window holds (TensorFlow's AvgPool divisor), shape (Ho, Wo, 1)."""
    counts = xp.zeros(y_shape[1:3], dtype=dtype)
    for _, r, c, _, _, _, _ in table:
        counts[r, c] += 1
    return counts[:, :, None]


class _TapView:
    """x seen as a (N, H, W, taps, C) source whose every tap is x itself, so pooling shares
    `_scatter_taps` with the convolution (src[:, rows, cols, t] is x[:, rows, cols])."""

    def __init__(self, x: Any) -> None:
        self.x = x

    def __getitem__(self, key: tuple) -> Any:
        return self.x[key[:3]]


def avg_pool(xp: Any, x: Any, ksize: tuple, strides: tuple, padding: str) -> Any:
    table, y_shape = _pool_table(x.shape, ksize, strides, padding)
    total = _scatter_taps(xp, y_shape, x.dtype, _TapView(x), table, to_input=False)
    return total / _avg_counts(xp, table, y_shape, x.dtype)


def avg_pool_grad(xp: Any, dy: Any, x_shape: tuple, ksize: tuple, strides: tuple, padding: str) -> Any:
    x_shape = (dy.shape[0],) + tuple(x_shape[1:])
    table, y_shape = _pool_table(x_shape, ksize, strides, padding)
    g = dy / _avg_counts(xp, table, y_shape, dy.dtype)
    return _scatter_taps(xp, x_shape, dy.dtype, _TapView(g), table, to_input=True)


@kernel("MaxPool")
def max_pool_kernel(xp: Any, attrs: dict[str, Any]) -> Fn:
    k, s, p = attrs["ksize"], attrs["strides"], attrs["padding"]
    return lambda x: max_pool(xp, x, k, s, p)


@kernel("MaxPoolGrad")
def max_pool_grad_kernel(xp: Any, attrs: dict[str, Any]) -> Fn:
    k, s, p = attrs["ksize"], attrs["strides"], attrs["padding"]
    return lambda x, y, dy: max_pool_grad(xp, x, y, dy, k, s, p)


@kernel("AvgPool")
def avg_pool_kernel(xp: Any, attrs: dict[str, Any]) -> Fn:
    k, s, p = attrs["ksize"], attrs["strides"], attrs["padding"]
    return lambda x: avg_pool(xp, x, k, s, p)


@kernel("AvgPoolGrad")
def avg_pool_grad_kernel(xp: Any, attrs: dict[str, Any]) -> Fn:
    k, s, p = attrs["ksize"], attrs["strides"], attrs["padding"]
    return lambda dy, like_x: avg_pool_grad(xp, dy, like_x.shape, k, s, p)


def _pool_step(shape: tuple) -> int:
    return max(1, POOL_ELEMENTS // max(1, int(shape[1]) * int(shape[2]) * int(shape[3])))


@kernel("MaxPool", device_types=("cpu",))
def max_pool_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    k, s, p = attrs["ksize"], attrs["strides"], attrs["padding"]
    return lambda x: _by_images(xp, x.shape[0], _pool_step(x.shape), lambda b: max_pool(xp, x[b], k, s, p))


@kernel("MaxPoolGrad", device_types=("cpu",))
def max_pool_grad_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    k, s, p = attrs["ksize"], attrs["strides"], attrs["padding"]
    return lambda x, y, dy: _by_images(xp, x.shape[0], _pool_step(y.shape),
                                       lambda b: max_pool_grad(xp, x[b], y[b], dy[b], k, s, p))


@kernel("AvgPool", device_types=("cpu",))
def avg_pool_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    k, s, p = attrs["ksize"], attrs["strides"], attrs["padding"]
    return lambda x: _by_images(xp, x.shape[0], _pool_step(x.shape), lambda b: avg_pool(xp, x[b], k, s, p))


@kernel("AvgPoolGrad", device_types=("cpu",))
def avg_pool_grad_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    k, s, p = attrs["ksize"], attrs["strides"], attrs["padding"]
    return lambda dy, like_x: _by_images(xp, dy.shape[0], _pool_step(dy.shape),
                                         lambda b: avg_pool_grad(xp, dy[b], like_x.shape, k, s, p))
