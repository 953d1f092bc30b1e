"""Convolutions on the CPU with compiled col2im: the reference's algorithm (kernels/conv.py: pieces
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

from flowctl.kernels.conv import GEMM_ROWS, Moves, conv2d_backprop_input
from flowctl.kernels.cpu.jit import compiled, floats_nhwc, njit
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

    return scatter_add


class CompiledMoves(Moves):
    def scatter_add(self, xp: Any, z: Any, dst: Any, piece: tuple[int, int, int, int], kh: int, kw: int, sh: int,
                    sw: int, wo: int) -> None:
        _kernels()(z, dst, piece[0], piece[2], sh, sw)


COMPILED = CompiledMoves()


def _applies(positions: tuple[int, ...]) -> Callable[[dict[str, Any], Any], bool]:
    return lambda attrs, ins: floats_nhwc(ins, positions)


@variant("Conv2DBackpropInput", "cpu", "numba", _applies((0, 1)))
def conv2d_backprop_input_numba(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding = attrs["strides"], attrs["padding"]
    return lambda dy, f, like_x: conv2d_backprop_input(xp, dy, f, like_x.shape, strides, padding, GEMM_ROWS, COMPILED)

