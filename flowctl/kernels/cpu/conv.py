"""Convolutions on the CPU with compiled col2im, and FusedConv2D's compiled variants.

FusedConv2D (a convolution and the inference batch norm's ChannelAffine that reads it, made one
node by the CPU plan's pass, engine/conv_affine.py): the convolution the unfused Conv2D would run
(Winograd where its rule holds, else the GEMM pieces; 1x1 windows in the same pieces), with the
affine and ReLU applied to each piece of the output right after it is made, by the numba kernel
ChannelAffine's variant runs. The same bits as the pair, one pass over the output fewer and that
pass's reads from cache. Measured: see engine/conv_affine.py.

The direct variants (Conv2D and FusedConv2D, `direct`): inputs of at most DIRECT_CHANNELS channels
(Inception-v3's RGB stem), where im2col's K = kh*kw*C is too short for a GEMM: a compiled window
pass instead (kernels/cpu/window_jit.py says how), on AVX-512 targets, float32, output channels a
whole number of 16. Measured at batch 8, 2 threads, a 2-core Xeon: 299x299x3 -> 32 3x3 stride 2
VALID 9.4 -> 2.2 ms alone. Not the reference's bits (its GEMM sums in its own order): within
float32 rounding of it, tested, and the same bits at any thread count.

The col2im variant: the reference's algorithm (kernels/conv.py: pieces
of about GEMM_ROWS output positions, one BLAS GEMM per piece) with the input gradient's scatter
compiled -- a piece's per-tap columns added back onto the input's windows in one compiled pass
instead of kh*kw strided numpy additions over the whole piece (measured, batch 8, 2 threads:
71x71x192 -> 192 3x3 stride 2, 116 -> 77 ms; 35x35x288 -> 384, 56 -> 48). The gather (im2col)
stays numpy's copy from a strided view: a compiled loop over positions and taps measured 10-40%
slower. The GEMMs, the pieces and the order of every addition are the reference's, so the results
are the reference's bits.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from flowctl.kernels import intra
from flowctl.kernels.conv import GEMM_ROWS, Epilogue, Moves, conv2d_backprop_input, conv2d_forward, window
from flowctl.kernels.cpu import winograd
from flowctl.kernels.cpu.jit import available, compiled, floats_nhwc, njit, wide_registers
from flowctl.kernels.registry import variant

Fn = Callable[..., Any]


@compiled
def _kernels() -> Any:
    @njit
    def scatter_add(z: Any, dst: Any, b0: int, r0: int, sh: int, sw: int) -> None:
        """dst[b0 + b, (r0 + r)*sh + i, q*sw + j, :] += z[b, r, q, i, j, :], tap by tap over the whole
        piece as the reference adds them (an input position two windows share gets its additions
        in the same order)."""
        nb, nr, wo, kh, kw, c = z.shape
        for i in range(kh):
            for j in range(kw):
                for b in range(nb):
                    for r in range(nr):
                        row = (r0 + r) * sh + i
                        for q in range(wo):
                            col = q * sw + j
                            for ch in range(c):
                                dst[b0 + b, row, col, ch] += z[b, r, q, i, j, ch]

    @njit
    def affine_rows(y2: Any, a: int, b: int, k: Any, offset: Any, relu: bool) -> None:
        """Rows a:b of y2, in place: (y - 0) * k + offset, then max(t, 0) -- the arithmetic of
        batch norm's normalising kernel with a zero mean (x - 0 is x), element by element. One
        array read and written (that kernel given y2 twice cannot prove its reads and writes
        apart, and runs unvectorised: 30 against ~4 us for 768 x 64)."""
        c = y2.shape[1]
        for i in range(a, b):
            for j in range(c):
                t = y2[i, j] * k[j] + offset[j]
                if relu and t < 0:  # max(t, 0); a NaN stays NaN
                    t = 0
                y2[i, j] = t

    return scatter_add, affine_rows


class CompiledMoves(Moves):
    def scatter_add(self, xp: Any, z: Any, dst: Any, piece: tuple[int, int, int, int], kh: int, kw: int, sh: int,
                    sw: int, wo: int) -> None:
        _kernels()[0](z, dst, piece[0], piece[2], sh, sw)


COMPILED = CompiledMoves()


def _applies(positions: tuple[int, ...]) -> Callable[[dict[str, Any], Any], bool]:
    return lambda attrs, ins: floats_nhwc(ins, positions)


DIRECT_CHANNELS = 4


@compiled
def _direct_kernels() -> Any:
    from flowctl.kernels.cpu.gemm_jit import pack_panels
    from flowctl.kernels.cpu.window_jit import window_rows

    return pack_panels, window_rows


def direct_forward(x: Any, f: Any, strides: tuple, padding: str, epilogue: Epilogue | None = None) -> Any:
    """The window pass of x (N, H, W, C) with f (kh, kw, C, Co), Co a multiple of 16, float32: the
    output rows shared between the intra-op threads, each run's rows given to `epilogue` (kernels/
    conv.py's) right after they are made."""
    pack, rows = _direct_kernels()
    n, h, w, c = x.shape
    kh, kw, _, co = f.shape
    sh, sw = (int(s) for s in strides)
    ho, pt = window(h, kh, sh, padding)
    wo, pl = window(w, kw, sw, padding)
    width = max((wo - 1) * sw + kw, pl + w)  # the columns the windows read, padding included
    if pl == 0 and width == w:
        xp = np.ascontiguousarray(x)
    else:
        xp = np.zeros((n, h, width, c), x.dtype)
        xp[:, :, pl:pl + w] = x
    wp = np.empty((co // 16, kh * kw * c, 16), x.dtype)
    pack(np.ascontiguousarray(f).reshape(kh * kw * c, co), wp, 0, co // 16)
    out = np.empty((n, ho, wo, co), x.dtype)
    flat = out.reshape(n * ho * wo, co)

    def part(run: range) -> None:
        rows(xp, wp, out, kh, kw, sh, sw, pt, run.start, run.stop)
        if epilogue is not None:
            epilogue(flat, run.start * wo, run.stop * wo)

    intra.for_chunks(n * ho, part)
    return out


def _direct_rule(attrs: dict[str, Any], ins: Any) -> bool:
    """Rule: numba present, a target with AVX-512's registers, float32 NHWC x and filter, at most
    DIRECT_CHANNELS input channels, output channels a whole number of 16."""
    if not available() or not floats_nhwc(ins, (0, 1)):
        return False
    try:
        x, f = ins[0], ins[1]
        if x.dtype != "float32" or f.dtype != "float32" or any(d is None for d in f.shape):
            return False
        c, co = int(f.shape[2]), int(f.shape[3])
    except (IndexError, TypeError, AttributeError):
        return False
    return c <= DIRECT_CHANNELS and co % 16 == 0 and wide_registers()


@variant("Conv2D", "cpu", "direct", _direct_rule)
def conv2d_direct(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding = attrs["strides"], attrs["padding"]
    return lambda x, f: direct_forward(x, f, strides, padding)


@variant("Conv2DBackpropInput", "cpu", "numba", _applies((0, 1)))
def conv2d_backprop_input_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding = attrs["strides"], attrs["padding"]
    return lambda dy, f, like_x: conv2d_backprop_input(xp, dy, f, like_x.shape, strides, padding, GEMM_ROWS, COMPILED)



def _affine_rule(winograd_too: bool) -> Callable[[dict[str, Any], Any], bool]:
    """FusedConv2D's variants: x and the filter float NHWC, scale and shift of x's dtype (the rule
    of ChannelAffine's variant); `winograd_too`: and Winograd's rule for the Conv2D."""
    on_winograd = winograd.forward_rule

    def rule(attrs: dict[str, Any], ins: Any) -> bool:
        if not (floats_nhwc(ins, (0, 1)) and all(s.dtype == ins[0].dtype for s in ins[1:4])):
            return False
        return on_winograd(attrs, ins) if winograd_too else True

    return rule


def _affine(scale: Any, shift: Any, relu: bool, dtype: Any) -> Epilogue:
    """The epilogue: rows a:b of the output, in place, to ChannelAffine's variant's bits."""
    affine_rows = _kernels()[1]
    k, offset = np.asarray(scale, dtype=dtype), np.asarray(shift, dtype=dtype)
    return lambda y2, a, b: affine_rows(y2, a, b, k, offset, relu)


@variant("FusedConv2D", "cpu", "direct",
         lambda attrs, ins: _direct_rule(attrs, ins) and _affine_rule(False)(attrs, ins))
def fused_conv2d_direct(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding, relu = attrs["strides"], attrs["padding"], attrs["activation"] == "relu"
    return lambda x, f, scale, shift: direct_forward(x, f, strides, padding, _affine(scale, shift, relu, x.dtype))


@variant("FusedConv2D", "cpu", "winograd", _affine_rule(True))
def fused_conv2d_winograd(xp: Any, attrs: dict[str, Any]) -> Fn:
    padding, relu = attrs["padding"], attrs["activation"] == "relu"
    return winograd.by_tiles(
        "FusedConv2D", xp, attrs,
        lambda x, f, scale, shift: winograd.conv2d_forward(x, f, padding, _affine(scale, shift, relu, x.dtype)),
        lambda x, f, scale, shift: (x.shape[0], *winograd.window_sizes(x.shape, f.shape, padding)))


@variant("FusedConv2D", "cpu", "numba", _affine_rule(False))
def fused_conv2d_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding, relu = attrs["strides"], attrs["padding"], attrs["activation"] == "relu"
    return lambda x, f, scale, shift: conv2d_forward(np, x, f, strides, padding, GEMM_ROWS,
                                                     epilogue=_affine(scale, shift, relu, x.dtype))
