"""Winograd convolutions on the CPU: stride-1 3x3, 5x5, 1x7 and 7x1 windows with fewer
multiplications (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2016).

Along an axis with a window of r taps, F(m, r) computes m outputs from a = m + r - 1 inputs with
a products instead of m*r: y = A^T [(G g) * (B^T d)], B^T, G and A^T from Toom-Cook at the points
0, +-1, 1/2, -2 and infinity, F(3, 5) and F(3, 7) at points of their own (`OWN_POINTS`;
`transforms`, built exactly, checked against the direct sum by the tests). The 2-D window nests the
two axes: a 3x3 convolution runs F(4x4, 3x3), 36 products per 4x4 outputs instead of 144; a 5x5
F(3x3, 5x5), 49 per 3x3 instead of 225; a 1x7 or 7x1 F(3, 7) along its long axis and F(1, 1)
(nothing) along the other, 9 products per 3 outputs instead of 21. Per tile of outputs the input
patch goes through B^T on both axes (`gather`, compiled), the a*a transformed planes are
multiplied by the transformed filter as a*a GEMMs (BLAS), and A^T takes them back to outputs
(`scatter`). The gradients are the same steps transposed: the input gradient is the forward pass
over dy, zero-padded, with the filter flipped; the filter gradient multiplies the input's
transformed tiles by dy's tiles taken through A (`gather_outputs`, scatter's transpose), summed
over tiles, then G^T on both axes.

The transforms take two paths with the same bits: F(4x4, 3x3)'s six-point matrices written out
as straight-line float32 arithmetic over LANES channels at a time (zeros skipped, the lanes one
vector register), for interior tiles when the channels are a whole number of LANES; general loops
over the matrices for edge tiles, other channel counts and the other windows (tested tile by
tile, bit for bit). Measured, 2 threads, batch 8, fwd / dx / dW: 147x147x32 -> 64 39 / 37 / 37 ->
25 / 23 / 25 ms, 35x35x48 -> 64 5x5 (then F(2x2, 5x5), six points too) 7.6 / 7.7 / 8.0 -> 6.4 /
6.8 / 6.7; the wider layers (80 channels and more)
unchanged, where the general loops' long channel runs already vectorise; the Inception-v3 train
step at batch 8 2-3% faster.

Pieces: tiles in blocks of about BLOCK_BYTES of planes, fixed by the shapes; blocks go to the
intra-op threads, and the filter gradient sums them in FILTER_GROUPS fixed groups, so the bits never
depend on the thread count. float32 only: float64 keeps the GEMM kernels and their 1e-12. float32's
error here is a few times the GEMMs' (at most 4.3e-6 of the output's scale against the float64
reference on Inception-v3's 3x3 layers, up to 8.7e-6 on wider random ones and for F(3x3, 5x5): see
OWN_POINTS; the GEMMs 8e-7; the tests hold it to 1e-5).

Measured, 2 threads, batch 8, forward / input gradient / filter gradient, against the im2col + GEMM
pieces (kernels/conv.py): 73x73x80 -> 192 3x3 56 / 59 / 58 -> 25 / 30 / 28 ms; 35x35x96 -> 96 3x3
9.0 / 10.2 / 9.3 -> 4.4 / 4.5 / 5.4; 35x35x64 -> 96 3x3 6.1 / 6.6 / 6.3 -> 3.2 / 3.3 / 3.7;
147x147x32 -> 64 3x3 42 / 43 / 42 -> 36 / 33 / 36; 35x35x48 -> 64 5x5 8.7 / 9.2 / 9.0 -> 7.8 / 7.4 /
8.5. With the written-out transforms the narrow layers win too (the rule once asked one side for 64
channels): 149x149x32 -> 32 3x3 23 / 35 / 24 -> 13.5 / 15 / 14.5 ms, 149x149x40 -> 40 (the general
loops) 34 / 44 / 36 -> 29 / 31 / 31, 149x149x48 -> 48 47 / 63 / 46 -> 24 / 27 / 25, 35x35x32 -> 32
1.3 / 1.6 / 1.4 -> 1.0 / 1.1 / 1.1. Inception-v3's 17x17 1x7 and 7x1 layers on F(2, 7) (general
loops, along the long axis alone; F(3, 7) since, see OUT_TILE), batch 8: 1x7 128 -> 128 4.2-5.0 /
3.4-3.6 / 3.7-5.8 -> 2.9-3.3 / 3.1-3.5 / 3.5-3.8 ms, 7x1 192 -> 192 6.9-7.6 / 6.5-7.7 / 7.1-7.9 ->
5.7-5.9 / 5.9-6.1 / 6.2-7.3; batch 32 1.3-1.7x in every pass (7x1 192 -> 192 33.5 / 29.2 / 33.7 ->
20.0 / 20.5 / 21.9); the long axis alone rather than the general loops' two (one of them the
identity) saved 3-8% per pass. (An earlier prototype had measured even with the GEMMs; the general
loops, and OpenBLAS's idle threads, which spun beside the intra-op threads in some measuring
scripts, have changed since.) The 8x8 1x3 and 3x1 layers (F(4, 3) on one axis) measured 1.2-1.9x
slower at batch 8, 1.2-1.4x faster at 32, the three passes together; a graph's batch dimension is
unknown until it runs, so the forward pass and the input gradient now count their tiles when called
(MIN_TILES: Inception-v3's 8x8 1x3, 3x1 from batch 8, its 8x8 3x3 from 32; alternating in one
process against the GEMMs on them, the train step 0.987 at batch 32, 1.004 at 8, inference at 8
0.979). Not taken (MIN_CHANNELS, MIN_SIDE): where it measured slower; F(2x2, 3x3) 1.4x slower than
F(4x4, 3x3).
"""
from __future__ import annotations

import functools
from fractions import Fraction
from typing import Any, Callable

import numpy as np

from flowctl.kernels import intra
from flowctl.kernels.conv import FILTER_GROUPS, Epilogue, window
from flowctl.kernels.cpu.jit import LANES, compiled, floats_nhwc
from flowctl.kernels.registry import KERNELS, VARIANTS, variant

Fn = Callable[..., Any]

# Finite Toom-Cook points, the first a - 1 of them (infinity is the last). With 1/2 and -2 rather
# than +-2, F(4, 3)'s float32 error fell from up to 1.3e-5 of the output's scale to 4.3e-6
# (73x73x80 -> 192, input gradient), F(2, 5)'s from 6e-6 to 2.4e-6. F(2, 7) takes all seven: its
# error on Inception-v3's 17x17 layers at most 2.6e-6 in every pass.
POINTS = (0, 1, -1, Fraction(1, 2), -2, Fraction(-1, 2), 2)
# Seven and nine points have sets of their own (`OWN_POINTS`: POINTS and one more gave F(3, 7) up
# to 1.1e-5). Each chosen by the float32 error of the pass against the float64 reference among 0,
# +-1 and pairs and one more from +-1/2, 2, 1/4, 4, 3/2, 2/3, 3, 1/3, 3/4, 4/3, 5/4, 4/5, then
# checked through the three passes: F(3, 7) at most 7.3e-6 of the output's scale (normal inputs,
# 3 seeds, 64-1024 channels; F(2, 7) 2.5e-6), F(3x3, 5x5) 8.7e-6 (48-192 channels; F(2x2, 5x5)
# 2.4e-6), the class of F(4x4, 3x3) here (8.7e-6 at 512 channels). F(4x4, 5x5) at eight points:
# up to 1.2e-5, not taken.
OWN_POINTS = {7: (0, 1, -1, 2, -2, Fraction(1, 3)),
              9: (0, 1, -1, Fraction(1, 2), Fraction(-1, 2), Fraction(4, 3), Fraction(-4, 3), -3)}
# Outputs per tile along an axis, by window size: F(4, 3) at a = 6 points, F(3, 5) at 7, F(3, 7)
# at 9; a window of one tap is F(1, 1), no transform (the other axis of a 1x7 or 7x1 window).
# F(3, 7) makes 3 outputs from 9 products where F(2, 7) made 2 from 8, and on a 17-wide image both
# tile 18 outputs: measured, 2 threads, 17x17, forward / input gradient / filter gradient, 7x1
# 192 -> 192 at batch 8 5.2 / 5.5 / 8.4 -> 4.5 / 4.3 / 7.1 ms, 1x7 5.6 / 6.0 / 8.2 -> 4.0 / 4.5 /
# 7.1, 7x1 128 -> 128 2.9 / 3.1 / 3.7 -> 2.5 / 2.6 / 2.6, at batch 32 7x1 192 -> 192 19.9 / 20.2 /
# 22-23 -> 16-17 / 17 / 17-19. F(3x3, 5x5), 49 products per 9 outputs against F(2x2, 5x5)'s 36 per
# 4, 35x35x48 -> 64 (medians of 24, alternating): batch 8 6.8 / 6.5 / 6.9 -> 4.8 / 4.6 / 5.8 ms,
# batch 32 23.9 / 25.5 / 25.4 -> 18.3 / 20.1 / 18.7 (F(4x4, 5x5) 4.2 / 4.5 / 5.1, 15.3 / 16.4 / 17.1).
OUT_TILE = {1: 1, 3: 4, 5: 3, 7: 3}
WINDOWS = {(3, 3), (5, 5), (1, 3), (3, 1), (1, 7), (7, 1)}
# Tiles per block: about this many bytes of transformed input and product planes, so a block's
# planes stay in a core's L2 between the transform, the GEMMs and the transform back. Measured,
# 2 threads, batch 8, 73x73x80 -> 192 3x3 forward: 36 ms with 1 MiB, 39 with 0.5 or 2, 49 with 12.
BLOCK_BYTES = 1 << 20
# Where it is taken (`_applies`): both channel counts at least MIN_CHANNELS and an image at least
# MIN_SIDE on each side. Below, the transforms and the filter's transform cost more than the
# products save on few tiles: measured, 8x8x448 -> 384 3x3 at batch 8, 9 -> 18 ms. The forward pass
# and the input gradient take images of SMALL_SIDE to MIN_SIDE too when they make MIN_TILES tiles
# or more (a rule on the shape the kernel is called with, so the same shapes take the same kernel
# on a resume; the batch is unknown when a plan binds): 2 threads, forward / input gradient,
# GEMM pieces -> Winograd, ms: 8x8x384 -> 384 1x3 at batch 4 (64 tiles) 1.5 / 1.8 -> 1.6 / 2.2, at
# 8 (128) 3.0 / 3.4 -> 2.3 / 2.8, 16 5.4 / 6.0 -> 4.3 / 5.1, 32 14.1 / 19.9 -> 12.9 / 7.1; 3x1 alike;
# 8x8x448 -> 384 3x3 at 16 (64 tiles) 18.1 / 20.2 -> 23.0 / 23.9, at 32 (128) 45.3 / 46.6 -> 34.1 /
# 35.5. The filter gradient stays at MIN_SIDE: its sums over few tiles measured slower at every
# batch to 16 (1x3: 2.9 -> 6.3 ms at 8, 5.9 -> 10.8 at 16).
MIN_CHANNELS = 32
MIN_SIDE = 16
SMALL_SIDE = 8
MIN_TILES = 128
# The filter's transform (`_Plan.filter`, `filter_back`: compiled, winograd_jit.two_axis) goes to the
# intra-op threads in pieces of this many of the filter's C*Co columns.
FILTER_PIECE = 4096


@functools.cache
def transforms(m: int, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A^T (m x a), G (a x r), B^T (a x a)) in float64 for F(m, r), a = m + r - 1: for inputs d (a)
    and taps g (r), y_i = sum_j g_j d_(i+j) = (A^T [(G g) * (B^T d)])_i. Built exactly (fractions):
    the correlation is the transpose of the polynomial product g(x) h(x) evaluated at the points
    and interpolated back; each row of B^T is scaled to largest entry 1, G's row by the same."""
    a = m + r - 1
    pts = [Fraction(p) for p in OWN_POINTS.get(a, POINTS[:a - 1])]
    if len(pts) != a - 1:
        raise ValueError(f"no Winograd points for F({m}, {r})")

    def evaluation(cols: int) -> list[list[Fraction]]:
        rows = [[p ** j for j in range(cols)] for p in pts]
        return rows + [[Fraction(int(j == cols - 1)) for j in range(cols)]]  # infinity: the leading coefficient

    vand = evaluation(a)
    inv = _inverse(vand)  # coefficients of the product from its values
    bt = [[inv[j][k] for j in range(a)] for k in range(a)]  # (V^-1)^T
    g = evaluation(r)
    at = [list(col) for col in zip(*evaluation(m))]
    for k in range(a):
        s = max(abs(v) for v in bt[k])
        bt[k] = [v / s for v in bt[k]]
        g[k] = [v * s for v in g[k]]
    as_array = lambda rows: np.array([[float(v) for v in row] for row in rows])  # noqa: E731
    return as_array(at), as_array(g), as_array(bt)


def _inverse(rows: list[list[Fraction]]) -> list[list[Fraction]]:
    n = len(rows)
    aug = [list(row) + [Fraction(int(i == j)) for j in range(n)] for i, row in enumerate(rows)]
    for col in range(n):
        pivot = next(i for i in range(col, n) if aug[i][col] != 0)
        aug[col], aug[pivot] = aug[pivot], aug[col]
        lead = aug[col][col]
        aug[col] = [v / lead for v in aug[col]]
        for i in range(n):
            if i != col and aug[i][col] != 0:
                f = aug[i][col]
                aug[i] = [v - f * w for v, w in zip(aug[i], aug[col])]
    return [row[n:] for row in aug]


def fast_path(a: int, c: int) -> bool:
    """Do the transforms take their straight-line path (interior tiles)? Six points on both axes
    (F(4x4, 3x3)) and channels a whole number of LANES; otherwise every tile goes the general way
    (the same sums in the same order, so the same bits: tested)."""
    return a == 6 and c % LANES == 0


@compiled
def _compiled() -> Any:
    from flowctl.kernels.cpu import winograd_jit as jit

    return ((jit.gather, jit.scatter, jit.gather_outputs), (jit.gather_1d, jit.scatter_1d, jit.gather_outputs_1d),
            jit.two_axis)


def _kernels(plan: "_Plan") -> Any:
    """(gather, scatter, gather_outputs) for `plan`, compiled (kernels/cpu/winograd_jit.py): a
    one-axis window's take the long axis alone (the other's transforms are the identity)."""
    return _compiled()[plan.one_axis]


class _Plan:
    """The tiling of one stride-1 window pass: the output (N, Ho, Wo) in tiles of mh x mw, the
    input read from (-ph, -pw), and the tiles in blocks. Built once per shape (`_plan`)."""

    def __init__(self, n: int, ho: int, wo: int, kh: int, kw: int, ph: int, pw: int, c: int, co: int,
                 itemsize: int) -> None:
        self.mh, self.mw = OUT_TILE[kh], OUT_TILE[kw]
        self.ath, self.gh, self.bth = transforms(self.mh, kh)
        self.atw, self.gw, self.btw = transforms(self.mw, kw)
        self.points = self.bth.shape[0] * self.btw.shape[0]
        self.one_axis = min(self.bth.shape[0], self.btw.shape[0]) == 1
        self.tiles_h, self.tiles_w = -(-ho // self.mh), -(-wo // self.mw)
        self.ph, self.pw = ph, pw
        self.tiles = n * self.tiles_h * self.tiles_w
        per_tile = self.points * (c + co) * itemsize
        count = max(1, -(-self.tiles * per_tile // BLOCK_BYTES))
        count += count % 2 if count > 1 else 0  # an even count shares out evenly over two threads
        size = -(-self.tiles // count)
        self.blocks = [(t, min(self.tiles, t + size)) for t in range(0, self.tiles, size)]
        # the transforms the compiled kernels take, in the arrays' dtype (float32: see `_applies`)
        self.matrices = tuple(np.ascontiguousarray(m, dtype=np.float32)
                              for m in (self.bth, self.btw, self.ath, self.atw))
        self.gh_t, self.gw_t = np.ascontiguousarray(self.gh.T), np.ascontiguousarray(self.gw.T)

    def filter(self, f: Any) -> Any:
        """G_h f G_w^T per (c, co), in float64 rounded once: (points, C, Co)."""
        kh, kw, c, co = f.shape
        u = np.empty((self.points, c, co), f.dtype)
        _two_axis(np.ascontiguousarray(f).reshape(kh, kw, c * co), self.gh, self.gw, u.reshape(self.points, c * co))
        return u

    def filter_back(self, du: Any, f_shape: tuple, dtype: Any) -> Any:
        """The transpose of `filter`: G_h^T dU G_w, in float64 rounded once."""
        kh, kw, c, co = f_shape
        ah, aw = self.bth.shape[0], self.btw.shape[0]
        out = np.empty((kh, kw, c, co), dtype)
        _two_axis(np.ascontiguousarray(du).reshape(ah, aw, c * co), self.gh_t, self.gw_t, out.reshape(kh * kw, c * co))
        return out


def _two_axis(src: Any, g0: Any, g1: Any, out: Any) -> None:
    """out = the two-axis transform of src (winograd_jit.two_axis), its columns in pieces on the
    intra-op threads (each column its own: the bits do not depend on the pieces)."""
    two_axis = _compiled()[2]
    cols = src.shape[2]
    step = FILTER_PIECE
    pieces = -(-cols // step)
    intra.for_chunks(pieces, lambda run: two_axis(src, g0, g1, out, run.start * step, min(cols, run.stop * step)),
                     least=2)


@functools.lru_cache(maxsize=256)
def _plan(n: int, ho: int, wo: int, kh: int, kw: int, ph: int, pw: int, c: int, co: int, itemsize: int) -> _Plan:
    return _Plan(n, ho, wo, kh, kw, ph, pw, c, co, itemsize)


def _forward(x: Any, u: Any, plan: _Plan, y: Any, epilogue: Epilogue | None = None) -> Any:
    """y = the window pass of x (implicitly zero-padded by plan.ph, plan.pw) with the transformed
    filter u, block by block on the intra-op threads. An `epilogue` (kernels/conv.py) rewrites each
    row of tiles once its last tile is out: by the thread that made the whole row, right after;
    a row two threads shared, after both."""
    gather, scatter, _ = _kernels(plan)
    bth, btw, ath, atw = plan.matrices
    c, co = u.shape[1], u.shape[2]
    n, ho, wo, _ = y.shape
    flat = y.reshape(n * ho * wo, co)
    tw = plan.tiles_w

    def finish(row: int) -> None:  # tile row -> its output rows, (N*Ho*Wo, Co) rows a:b
        b, i = divmod(row, plan.tiles_h)
        assert epilogue is not None
        epilogue(flat, (b * ho + i * plan.mh) * wo, (b * ho + min(ho, (i + 1) * plan.mh)) * wo)

    def part(run: range) -> range:
        mine = plan.blocks[run.start:run.stop]
        most = max(t1 - t0 for t0, t1 in mine)
        v = np.empty((plan.points, most, c), x.dtype)
        m = np.empty((plan.points, most, co), x.dtype)
        first = row = -(-mine[0][0] // tw)  # the first tile row this run makes whole
        for t0, t1 in mine:
            k = t1 - t0
            gather(x, t0, t1, plan.tiles_h, plan.tiles_w, plan.mh, plan.mw, plan.ph, plan.pw, bth, btw, v)
            np.matmul(v[:, :k], u, out=m[:, :k])
            scatter(m, t0, t1, plan.tiles_h, plan.tiles_w, ath, atw, y)
            if epilogue is not None:
                while row < t1 // tw:
                    finish(row)
                    row += 1
        return range(first, row)

    done = intra.for_chunks(len(plan.blocks), part, least=2)
    if epilogue is not None:
        whole = set().union(*done)
        for row in range(plan.tiles // tw):
            if row not in whole:
                finish(row)
    return y


def window_sizes(x_shape: tuple, f_shape: tuple, padding: str) -> tuple[int, int, int, int]:
    """(Ho, Wo, kh, kw) of a stride-1 pass of a kh x kw filter over x."""
    kh, kw = int(f_shape[0]), int(f_shape[1])
    return window(int(x_shape[1]), kh, 1, padding)[0], window(int(x_shape[2]), kw, 1, padding)[0], kh, kw


def conv2d_forward(x: Any, f: Any, padding: str, epilogue: Epilogue | None = None) -> Any:
    kh, kw, c, co = f.shape
    n, h, w, _ = x.shape
    ho, ph = window(h, kh, 1, padding)
    wo, pw = window(w, kw, 1, padding)
    plan = _plan(n, ho, wo, kh, kw, ph, pw, c, co, x.dtype.itemsize)
    # (x may be a view of channels, a Split's output: engine/conv_siblings.py)
    return _forward(np.ascontiguousarray(x), plan.filter(f), plan, np.empty((n, ho, wo, co), x.dtype), epilogue)


def conv2d_backprop_input(dy: Any, f: Any, x_shape: tuple, padding: str) -> Any:
    """The forward pass over dy zero-padded by (k-1-p) before, with the filter flipped and its
    channels swapped: every input position sees each output that read it."""
    kh, kw, c, co = f.shape
    n, h, w = dy.shape[0], int(x_shape[1]), int(x_shape[2])
    ph, pw = window(h, kh, 1, padding)[1], window(w, kw, 1, padding)[1]
    plan = _plan(n, h, w, kh, kw, kh - 1 - ph, kw - 1 - pw, co, c, dy.dtype.itemsize)
    flipped = np.ascontiguousarray(f[::-1, ::-1].transpose(0, 1, 3, 2))
    return _forward(np.ascontiguousarray(dy), plan.filter(flipped), plan, np.empty((n, h, w, c), dy.dtype))


def conv2d_backprop_filter(x: Any, dy: Any, f_shape: tuple, padding: str) -> Any:
    """sum over tiles of (B^T x B)^T (A dY A^T) per point, in FILTER_GROUPS fixed groups of blocks,
    then G^T on both axes."""
    kh, kw, c, co = (int(d) for d in f_shape)
    n, h, w, _ = x.shape
    ho, ph = window(h, kh, 1, padding)
    wo, pw = window(w, kw, 1, padding)
    plan = _plan(n, ho, wo, kh, kw, ph, pw, c, co, x.dtype.itemsize)
    gather, _, gather_outputs = _kernels(plan)
    bth, btw, ath, atw = plan.matrices
    dy = np.ascontiguousarray(dy)

    def group(run: range) -> Any:
        mine = plan.blocks[run.start:run.stop]
        most = max(t1 - t0 for t0, t1 in mine)
        v = np.empty((plan.points, most, c), x.dtype)
        dm = np.empty((plan.points, most, co), x.dtype)
        total = part = None
        for t0, t1 in mine:
            k = t1 - t0
            gather(x, t0, t1, plan.tiles_h, plan.tiles_w, plan.mh, plan.mw, plan.ph, plan.pw, bth, btw, v)
            gather_outputs(dy, t0, t1, plan.tiles_h, plan.tiles_w, ath, atw, dm)
            if total is None:
                total = np.matmul(v[:, :k].transpose(0, 2, 1), dm[:, :k])
            else:
                part = np.matmul(v[:, :k].transpose(0, 2, 1), dm[:, :k], out=part)
                total += part
        return total

    sums = intra.for_chunks(len(plan.blocks), group, FILTER_GROUPS, least=2)
    du = sums[0]
    for more in sums[1:]:
        du += more
    return plan.filter_back(du, (kh, kw, c, co), x.dtype)


def _applies(positions: tuple[int, int], filter_at: int, tiled: int,
             min_side: int = MIN_SIDE) -> Callable[[dict[str, Any], Any], bool]:
    """Rule: numba present, stride 1, float32 NHWC inputs at `positions`, a window in WINDOWS with at
    least MIN_CHANNELS channels on both sides (the filter input's shape), and the image the tiles
    cover (input `tiled`'s spatial size) at least `min_side` on each side."""
    def rule(attrs: dict[str, Any], ins: Any) -> bool:
        if tuple(attrs.get("strides", (0, 0))) != (1, 1) or not floats_nhwc(ins, positions):
            return False
        try:
            if ins[positions[0]].dtype != "float32":
                return False
            kh, kw, c, co = ins[filter_at].shape
            h, w = ins[tiled].shape[1:3]
            return ((int(kh), int(kw)) in WINDOWS and min(int(c), int(co)) >= MIN_CHANNELS
                    and min(int(h), int(w)) >= min_side)
        except (IndexError, TypeError, ValueError):
            return False
    return rule


forward_rule = _applies((0, 1), 1, 0, SMALL_SIDE)  # also FusedConv2D's (kernels/cpu/conv.py)


def enough_tiles(n: int, h: int, w: int, kh: int, kw: int) -> bool:
    """Does a forward pass (or input gradient) making an n x h x w image with a kh x kw window take
    Winograd here? Always from MIN_SIDE on; below, from MIN_TILES tiles."""
    return min(h, w) >= MIN_SIDE or n * -(-h // OUT_TILE[kh]) * -(-w // OUT_TILE[kw]) >= MIN_TILES


def otherwise(op: str, xp: Any, attrs: dict[str, Any]) -> Fn:
    """The kernel of `op` that runs where Winograd's makes too few tiles: the GEMM pieces, its
    compiled variant where it has one (named "numba", kernels/cpu/conv.py), else its reference."""
    found = [v for v in VARIANTS.get((op, "cpu"), ()) if v.name == "numba"]
    return (found[0].factory if found else KERNELS[(op, "cpu")])(xp, attrs)


def by_tiles(op: str, xp: Any, attrs: dict[str, Any], fast: Fn, sizes: Callable[..., tuple]) -> Fn:
    """A Winograd variant's kernel for images that may be small: `fast` where the call makes enough
    tiles (`enough_tiles(*sizes(*inputs))`: n, Ho, Wo, kh, kw), else `otherwise(op)`'s kernel."""
    gemm = otherwise(op, xp, attrs)
    return lambda *ins: (fast if enough_tiles(*sizes(*ins)) else gemm)(*ins)


@variant("Conv2D", "cpu", "winograd", forward_rule)
def conv2d_winograd(xp: Any, attrs: dict[str, Any]) -> Fn:
    padding = attrs["padding"]
    return by_tiles("Conv2D", xp, attrs, lambda x, f: conv2d_forward(x, f, padding),
                    lambda x, f: (x.shape[0], *window_sizes(x.shape, f.shape, padding)))


@variant("Conv2DBackpropInput", "cpu", "winograd", _applies((0, 1), 1, 2, SMALL_SIDE))
def conv2d_backprop_input_winograd(xp: Any, attrs: dict[str, Any]) -> Fn:
    padding = attrs["padding"]
    return by_tiles("Conv2DBackpropInput", xp, attrs,
                    lambda dy, f, like_x: conv2d_backprop_input(dy, f, like_x.shape, padding),
                    lambda dy, f, like_x: (dy.shape[0], like_x.shape[1], like_x.shape[2], f.shape[0], f.shape[1]))


@variant("Conv2DBackpropFilter", "cpu", "winograd", _applies((0, 1), 2, 1))
def conv2d_backprop_filter_winograd(xp: Any, attrs: dict[str, Any]) -> Fn:
    padding = attrs["padding"]
    return lambda x, dy, like_f: conv2d_backprop_filter(x, dy, like_f.shape, padding)
