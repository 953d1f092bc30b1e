"""Convolution and pooling kernels (layout NHWC, filters HWIO), written once against `xp`.

Every convolution pass is GEMMs plus data movement; the only Python loops run over pieces of the
output and over the kh*kw taps of the window, never over pixels.

- 1x1: a reshape and one matmul, no copy at stride 1 (both backprops too).
- k x k forward and filter gradient: the windows of the padded input are gathered ("im2col") into
  ONE buffer, piece by piece (`bands`), and each piece is one GEMM: into its rows of the output
  (written in place, `out=`), or accumulated into the filter gradient. On CPU a piece is about
  GEMM_ROWS output positions, so the gathered columns are still in cache when the GEMM reads them;
  on GPU the whole batch is one piece.
- k x k input gradient: at stride 1 with Co not much above C (`_output_side`), the transposed
  convolution as a convolution (windows of zero-padded dy against the flipped filter, through the
  same buffer); otherwise (strided, or Co well above C, where the flipped filter's k*Co columns
  would be the wider side) col2im: one GEMM per piece into per-tap columns, each tap added onto
  its window of the input.

Windows are views (`as_strided`), so the gathered copy is the only pass over k*C per position.
Pools clip their windows to the unpadded input by `taps` instead of padding.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

from flowctl.kernels import intra
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


def _pad(xp: Any, x: Any, top: int, bottom: int, left: int, right: int) -> Any:
    if top == bottom == left == right == 0:
        return x
    n, h, w, c = x.shape
    out = xp.zeros((n, h + top + bottom, w + left + right, c), dtype=x.dtype)
    out[:, top:top + h, left:left + w] = x
    return out


def _after(size: int, k: int, s: int, before: int, out: int) -> int:
    """Padding after the input along one axis so every one of `out` windows lies inside it (SAME's
    after-padding is what the last window needs; VALID needs none, its unread tail stays unread)."""
    return max((out - 1) * s + k - size - before, 0)


def _pad_for_windows(xp: Any, x: Any, kh: int, kw: int, sh: int, sw: int, ph: int, pw: int, ho: int,
                     wo: int) -> Any:
    h, w = x.shape[1], x.shape[2]
    return _pad(xp, x, ph, _after(h, kh, sh, ph, ho), pw, _after(w, kw, sw, pw, wo))


@lru_cache(maxsize=512)
def bands(n: int, ho: int, wo: int, rows: int | None) -> tuple[tuple[int, int, int, int], ...]:
    """The output cut into pieces (b0, b1, r0, r1): images b0:b1, output rows r0:r1, of about `rows`
    output positions each (None: the whole batch at once). Each piece is contiguous in NHWC, so a
    GEMM writes it in place: whole images, or a run of rows inside one image."""
    if rows is None or rows >= n * ho * wo:
        return ((0, n, 0, ho),)
    if ho * wo > rows:  # even runs of rows, so no piece is left with a sliver of a GEMM
        step = -(-ho // -(-(ho * wo) // rows))
        return tuple((b, b + 1, r, min(ho, r + step)) for b in range(n) for r in range(0, ho, step))
    step = -(-n // -(-(n * ho * wo) // rows))
    return tuple((b, min(n, b + step), 0, ho) for b in range(0, n, step))


def _windows(xp: Any, src: Any, piece: tuple[int, int, int, int], kh: int, kw: int, sh: int, sw: int,
             wo: int) -> Any:
    """The windows of one piece of the output over the padded `src`, as a strided view
    (images, rows, Wo, kh, kw, C) that copies nothing (cupy has the same as_strided)."""
    b0, b1, r0, r1 = piece
    part = src[b0:b1, r0 * sh:]
    s0, s1, s2, s3 = part.strides
    return xp.lib.stride_tricks.as_strided(part, (b1 - b0, r1 - r0, wo, kh, kw, part.shape[3]),
                                           (s0, sh * s1, sw * s2, s1, s2, s3))


def _span(piece: tuple[int, int, int, int], ho: int, wo: int) -> slice:
    """The piece's rows in the output seen as (N*Ho*Wo, channels)."""
    b0, b1, r0, r1 = piece
    return slice((b0 * ho + r0) * wo, ((b1 - 1) * ho + r1) * wo)


class Moves:
    """The data movement of the window passes, apart from their GEMMs: gathering one piece's
    windows into columns (im2col) and adding one piece's per-tap columns back onto the windows of
    the input (col2im). These are numpy's (strided views, one copy; kh*kw slice additions); a
    compiled CPU variant (kernels/cpu/conv.py) passes its own, so one convolution algorithm serves
    both and the variant differs only in how the bytes move."""

    def gather(self, xp: Any, src: Any, piece: tuple[int, int, int, int], kh: int, kw: int, sh: int, sw: int,
               wo: int, buf: Any) -> Any:
        view = _windows(xp, src, piece, kh, kw, sh, sw, wo)
        m = view.shape[0] * view.shape[1] * view.shape[2]
        cols = buf[:m]
        xp.copyto(cols.reshape(view.shape), view)
        return cols

    def scatter_add(self, xp: Any, z: Any, dst: Any, piece: tuple[int, int, int, int], kh: int, kw: int, sh: int,
                    sw: int, wo: int) -> None:
        """dst's windows of the piece += z (images, rows, Wo, kh, kw, C), tap by tap in order."""
        b0, b1, r0, r1 = piece
        for i in range(kh):
            for j in range(kw):
                dst[b0:b1, r0 * sh + i:(r1 - 1) * sh + i + 1:sh, j:(wo - 1) * sw + j + 1:sw] += z[:, :, :, i, j]


NUMPY_MOVES = Moves()


class _Columns:
    """One buffer for the gathered windows (im2col) of every piece of a pass: a piece's columns
    are copied in, multiplied, and overwritten by the next piece's, so they stay in cache."""

    def __init__(self, xp: Any, pieces: tuple, wo: int, k: int, dtype: Any, moves: Moves = NUMPY_MOVES) -> None:
        most = max((b1 - b0) * (r1 - r0) for b0, b1, r0, r1 in pieces) * wo
        self.xp, self.buf, self.moves = xp, xp.empty((most, k), dtype=dtype), moves

    def gather(self, src: Any, piece: tuple[int, int, int, int], kh: int, kw: int, sh: int, sw: int, wo: int) -> Any:
        return self.moves.gather(self.xp, src, piece, kh, kw, sh, sw, wo, self.buf)


# An epilogue: epilogue(out2, a, b) rewrites rows a:b of the output seen as (N*Ho*Wo, Co) in place,
# right after a piece's GEMM wrote them (while they are in cache): FusedConv2D's affine + ReLU.
Epilogue = Callable[[Any, int, int], None]


def _window_gemm(xp: Any, src: Any, wmat: Any, kh: int, kw: int, sh: int, sw: int, out: Any,
                 rows: int | None, moves: Moves = NUMPY_MOVES, epilogue: Epilogue | None = None) -> Any:
    """out (N, Ho, Wo, Co) = the windows of the padded `src` times wmat (kh*kw*C, Co), piece by
    piece: each piece's windows gathered once into a reused buffer, one GEMM into out (then the
    epilogue on its rows). Runs of pieces go to the intra-op threads, each with its own buffer
    (they write disjoint rows)."""
    n, ho, wo, co = out.shape
    flat = out.reshape(n * ho * wo, co)
    pieces = bands(n, ho, wo, rows)

    def part(run: range) -> None:
        mine = pieces[run.start:run.stop]
        cols = _Columns(xp, mine, wo, wmat.shape[0], src.dtype, moves)
        for piece in mine:
            span = _span(piece, ho, wo)
            xp.matmul(cols.gather(src, piece, kh, kw, sh, sw, wo), wmat, out=flat[span])
            if epilogue is not None:
                epilogue(flat, span.start, span.stop)

    intra.for_chunks(len(pieces), part, xp=xp, least=PARALLEL_PIECES)
    return out


# Pieces of one pass below which it runs on the calling thread with BLAS's own threads: a pass of
# two pieces or more goes to the intra-op threads (one-thread GEMMs, gathers in parallel). Measured,
# every Inception-v3 convolution at batch 8, 2 threads, forward / input / filter gradient: 591-699 /
# 620-765 / 610-714 ms with 16 here and pieces of 2048 positions, 500-503 / 512-513 / 510-512 with 2
# and 768, against 503-504 for same-FLOP GEMMs (an earlier measurement that favoured 16 was taken
# while OpenBLAS's idle threads still spun for ~0.1 s after each threaded GEMM: see flowctl/__init__.py).
PARALLEL_PIECES = 2
PARALLEL_POOL_CHUNKS = 4
# The filter gradient sums over every piece: its pieces are summed in this many fixed groups (each
# in order, then the groups in order), whatever the thread count, so the bits never depend on it.
FILTER_GROUPS = 4


def _window_gemm_t(xp: Any, src: Any, dy: Any, kh: int, kw: int, sh: int, sw: int,
                   rows: int | None, moves: Moves = NUMPY_MOVES) -> Any:
    """sum over output positions of window^T dy, (kh*kw*C, Co): the filter gradient as one GEMM per
    piece over a reused window buffer, accumulated in place within each of FILTER_GROUPS groups
    of pieces (the groups are what the intra-op threads share)."""
    n, ho, wo, co = dy.shape
    flat = xp.ascontiguousarray(dy).reshape(n * ho * wo, co)
    pieces = bands(n, ho, wo, rows)

    def group(run: range) -> Any:
        mine = pieces[run.start:run.stop]
        cols = _Columns(xp, mine, wo, kh * kw * src.shape[3], src.dtype, moves)
        dw = part = None
        for piece in mine:
            c = cols.gather(src, piece, kh, kw, sh, sw, wo)
            if dw is None:
                dw = xp.matmul(c.T, flat[_span(piece, ho, wo)])
            else:
                part = xp.matmul(c.T, flat[_span(piece, ho, wo)], out=part)
                dw += part
        return dw

    sums = intra.for_chunks(len(pieces), group, FILTER_GROUPS, xp=xp, least=PARALLEL_PIECES)
    total = sums[0]
    for more in sums[1:]:
        total += more
    return total


def _col2im(xp: Any, dy: Any, wt: Any, kh: int, kw: int, sh: int, sw: int, dst: Any,
            rows: int | None, moves: Moves = NUMPY_MOVES) -> Any:
    """Add each output position's dy @ wt (Co, kh*kw*C) back onto its window of the padded `dst`
    (the strided convolution's input gradient), piece by piece through a reused buffer. Windows
    of neighbouring pieces of one image overlap, which the additions handle in order; the intra-op
    threads take whole images, whose windows never meet."""
    n, ho, wo, co = dy.shape
    c = dst.shape[3]
    flat = xp.ascontiguousarray(dy).reshape(n * ho * wo, co)
    pieces = bands(n, ho, wo, rows)
    images = _by_image(pieces)

    def part(run: range) -> None:
        mine = [p for i in run for p in images[i]]
        cols = _Columns(xp, tuple(mine), wo, kh * kw * c, dy.dtype)
        for piece in mine:
            b0, b1, r0, r1 = piece
            m = (b1 - b0) * (r1 - r0) * wo
            z = xp.matmul(flat[_span(piece, ho, wo)], wt, out=cols.buf[:m]).reshape(b1 - b0, r1 - r0, wo, kh, kw, c)
            moves.scatter_add(xp, z, dst, piece, kh, kw, sh, sw, wo)

    if len(pieces) < PARALLEL_PIECES:
        part(range(len(images)))
    else:
        intra.for_chunks(len(images), part, xp=xp)
    return dst


def _by_image(pieces: tuple[tuple[int, int, int, int], ...]) -> list[list[tuple[int, int, int, int]]]:
    """The pieces in runs that share no image (a piece of whole images is a run of its own)."""
    out: list[list[tuple[int, int, int, int]]] = []
    for p in pieces:
        if out and out[-1][-1][1] > p[0]:
            out[-1].append(p)
        else:
            out.append([p])
    return out


# ---------------------------------------------------------------------------- convolution
def _output_side(sh: int, sw: int, kh: int, kw: int, c: int, co: int) -> bool:
    """Compute the input gradient on dy's side, as a convolution of padded dy with the flipped
    filter (k*Co columns), rather than by col2im (a GEMM into k*C columns, then k additions)?
    Only at stride 1: when Co <= C, or for a 2-D window with Co <= 1.5 C, where col2im's k
    additions cost more than the wider GEMM. Measured, one thread, batch 8, time / same-FLOP
    GEMM, col2im -> convolution: 73x73x80 -> 192 3x3 0.99 -> 1.29; 35x35x48 -> 64 5x5 1.34 ->
    1.03; 35x35x64 -> 96 3x3 1.08 -> 0.99; 17x17x128 -> 192 1x7 1.08 -> 1.18."""
    return sh == sw == 1 and (co <= c or (kh > 1 and kw > 1 and 2 * co <= 3 * c))


def conv2d_forward(xp: Any, x: Any, f: Any, strides: tuple, padding: str, rows: int | None = None,
                   moves: Moves = NUMPY_MOVES, epilogue: Epilogue | None = None) -> Any:
    """The convolution; with an `epilogue`, applied to each piece of the output as it is made (a 1x1
    window's: after its one GEMM)."""
    kh, kw, c, co = f.shape
    n = x.shape[0]
    sh, sw, ph, pw, h, w, ho, wo = _geometry(x.shape, kh, kw, strides, padding)
    if kh == kw == 1:
        # 1x1: a plain matmul over the (strided) pixels; no copy at stride 1.
        # (An epilogue then runs on the whole output: pieces of this GEMM measured 5-8% slower.)
        xs = x if sh == sw == 1 else xp.ascontiguousarray(x[:, ::sh, ::sw])
        y = xp.matmul(xs.reshape(-1, c), f.reshape(c, co)).reshape(n, ho, wo, co)
        if epilogue is not None:
            flat = y.reshape(-1, co)
            pieces = bands(n, ho, wo, rows)
            intra.for_chunks(len(pieces), lambda run: [epilogue(flat, _span(p, ho, wo).start, _span(p, ho, wo).stop)
                                                       for p in pieces[run.start:run.stop]],
                             xp=xp, least=PARALLEL_PIECES)
        return y
    y = xp.empty((n, ho, wo, co), dtype=x.dtype)
    src = _pad_for_windows(xp, x, kh, kw, sh, sw, ph, pw, ho, wo)
    return _window_gemm(xp, src, f.reshape(kh * kw * c, co), kh, kw, sh, sw, y, rows, moves, epilogue)


def conv2d_backprop_input(xp: Any, dy: Any, f: Any, x_shape: tuple, strides: tuple, padding: str,
                          rows: int | None = None, moves: Moves = NUMPY_MOVES) -> Any:
    kh, kw, c, co = f.shape
    n = dy.shape[0]
    x_shape = (n,) + tuple(x_shape[1:])
    sh, sw, ph, pw, h, w, ho, wo = _geometry(x_shape, kh, kw, strides, padding)
    if kh == kw == 1:
        g = xp.matmul(xp.ascontiguousarray(dy).reshape(-1, co), f.reshape(c, co).T).reshape(n, ho, wo, c)
        if sh == sw == 1:
            return g
        dx = xp.zeros(x_shape, dtype=dy.dtype)
        dx[:, ::sh, ::sw] = g
        return dx
    if _output_side(sh, sw, kh, kw, c, co):
        # The transposed convolution is a convolution: the windows of dy, zero-padded so each input
        # position sees every output that read it, against the flipped filter with in and out swapped.
        src = _pad(xp, dy, kh - 1 - ph, h - ho + ph, kw - 1 - pw, w - wo + pw)
        f_flip = xp.ascontiguousarray(f[::-1, ::-1].transpose(0, 1, 3, 2)).reshape(kh * kw * co, c)
        return _window_gemm(xp, src, f_flip, kh, kw, 1, 1, xp.empty(x_shape, dtype=dy.dtype), rows, moves)
    after_h, after_w = _after(h, kh, sh, ph, ho), _after(w, kw, sw, pw, wo)
    dst = xp.zeros((n, ph + h + after_h, pw + w + after_w, c), dtype=dy.dtype)
    _col2im(xp, dy, f.reshape(kh * kw * c, co).T, kh, kw, sh, sw, dst, rows, moves)
    if ph == pw == after_h == after_w == 0:
        return dst
    return xp.ascontiguousarray(dst[:, ph:ph + h, pw:pw + w])


def conv2d_backprop_filter(xp: Any, x: Any, dy: Any, f_shape: tuple, strides: tuple, padding: str,
                           rows: int | None = None, moves: Moves = NUMPY_MOVES) -> Any:
    kh, kw, c, co = (int(d) for d in f_shape)
    sh, sw, ph, pw, h, w, ho, wo = _geometry(x.shape, kh, kw, strides, padding)
    if kh == kw == 1:
        xs = x if sh == sw == 1 else xp.ascontiguousarray(x[:, ::sh, ::sw])
        return xp.matmul(xs.reshape(-1, c).T, xp.ascontiguousarray(dy).reshape(-1, co)).reshape(1, 1, c, co)
    src = _pad_for_windows(xp, x, kh, kw, sh, sw, ph, pw, ho, wo)
    return _window_gemm_t(xp, src, dy, kh, kw, sh, sw, rows, moves).reshape(kh, kw, c, co)


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


# ---------------------------------------------------------------------------- cpu: pieces in cache
# On CPU each pass works on pieces of about GEMM_ROWS output positions, so a piece's gathered
# windows stay in cache between the copy and the GEMM; gpu takes the batch whole. Measured, one
# thread, OpenBLAS: a (M, 288) @ (288, 64) GEMM runs at ~140 GFLOP/s for M of 512 to 2048 and at
# ~95 with M = 172,872 (147x147 batch 8 at once), whose operand streams from memory. Every
# Inception-v3 convolution at batch 8, forward and both backprops, one thread: 1.09x the time of
# same-FLOP GEMMs gathering whole images (the previous kernels), 1.00x with pieces of 512, 1024 or
# 2048 positions, 1.03x with 4096. At 2 threads, with the passes of two pieces or more on the
# intra-op threads (PARALLEL_PIECES): the three passes together 1.05-1.06x the GEMMs' time with 256, 1.03x
# with 512, 1.01x with 768, 1.09x with 1024, 1.08x with 2048 (one thread: 512 and 2048 equal).
GEMM_ROWS = 768
# Pooling is all memory traffic: chunks of at most POOL_ELEMENTS outputs. Measured, batch 8,
# 3x3 MaxPoolGrad: 35x35x288 stride 1 24 -> 13 ms; 147x147x64 stride 2 54 -> 26 ms.
POOL_ELEMENTS = 1 << 18


def _by_images(xp: Any, n: int, step: int, part: Callable[[slice], Any]) -> Any:
    """part(images) for consecutive chunks of `step` images, stacked along the batch; the chunks
    after the first (which fixes the output's shape) go to the intra-op threads."""
    if step >= n:
        return part(slice(0, n))
    first = part(slice(0, step))
    out = xp.empty((n,) + tuple(first.shape[1:]), dtype=first.dtype)
    out[:step] = first
    starts = range(step, n, step)

    def fill(run: range) -> None:
        for i in run:
            sl = slice(starts[i], min(starts[i] + step, n))
            out[sl] = part(sl)

    intra.for_chunks(len(starts), fill, xp=xp, least=PARALLEL_POOL_CHUNKS)
    return out


@kernel("Conv2D", device_types=("cpu",))
def conv2d_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding = attrs["strides"], attrs["padding"]
    return lambda x, f: conv2d_forward(xp, x, f, strides, padding, GEMM_ROWS)


@kernel("Conv2DBackpropInput", device_types=("cpu",))
def conv2d_backprop_input_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding = attrs["strides"], attrs["padding"]
    return lambda dy, f, like_x: conv2d_backprop_input(xp, dy, f, like_x.shape, strides, padding, GEMM_ROWS)


@kernel("Conv2DBackpropFilter", device_types=("cpu",))
def conv2d_backprop_filter_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding = attrs["strides"], attrs["padding"]
    return lambda x, dy, like_f: conv2d_backprop_filter(xp, x, dy, like_f.shape, strides, padding, GEMM_ROWS)


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


def _along(axis: int, sl: slice) -> tuple:
    return (slice(None),) * axis + (sl,)


def _window_sums(xp: Any, x: Any, axis: int, k: int, s: int, p: int, out: int, to_input: bool,
                 size: int) -> Any:
    """Window sums along one spatial axis (1 or 2) of x, clipped to the unpadded input: from the
    input grid to `out` outputs, or (to_input) the transpose, from outputs back onto `size` inputs.
    A window sum over kh x kw is the two one-axis sums in turn: kh + kw slice additions instead
    of kh * kw. A tap that fills the whole destination is copied first (no zero fill)."""
    dst_size = size if to_input else out
    table = [t for t in (_axis(i, s, p, size, out) for i in range(k)) if t is not None]
    shape = list(x.shape)
    shape[axis] = dst_size
    # (source slice, destination slice) of each tap: outputs -> inputs when going back.
    pairs = [((o, i) if to_input else (i, o), full_in if to_input else full_out)
             for o, i, full_out, full_in in table]
    full = next((sd for sd, whole in pairs if whole), None)
    dst = xp.array(x[_along(axis, full[0])]) if full is not None else xp.zeros(shape, dtype=x.dtype)
    for sd, _ in pairs:
        if sd is not full:
            dst[_along(axis, sd[1])] += x[_along(axis, sd[0])]
    return dst


def avg_pool(xp: Any, x: Any, ksize: tuple, strides: tuple, padding: str) -> Any:
    table, y_shape = _pool_table(x.shape, ksize, strides, padding)
    sh, sw, ph, pw, h, w, ho, wo = _geometry(x.shape, ksize[0], ksize[1], strides, padding)
    rows = _window_sums(xp, x, 1, ksize[0], sh, ph, ho, False, h)
    total = _window_sums(xp, rows, 2, ksize[1], sw, pw, wo, False, w)
    total /= _avg_counts(xp, table, y_shape, x.dtype)
    return total


def avg_pool_grad(xp: Any, dy: Any, x_shape: tuple, ksize: tuple, strides: tuple, padding: str) -> Any:
    x_shape = (dy.shape[0],) + tuple(x_shape[1:])
    table, y_shape = _pool_table(x_shape, ksize, strides, padding)
    sh, sw, ph, pw, h, w, ho, wo = _geometry(x_shape, ksize[0], ksize[1], strides, padding)
    g = dy / _avg_counts(xp, table, y_shape, dy.dtype)
    cols = _window_sums(xp, g, 2, ksize[1], sw, pw, wo, True, w)
    return _window_sums(xp, cols, 1, ksize[0], sh, ph, ho, True, h)


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
