"""Matrix kernels, written once against the array module `xp` (numpy or cupy).

Transposes are `.T` / swapaxes views, never copies: BLAS takes a transposed operand as a flag.
Measured on the 2-core dev box, numpy 2.4 float32 512x512: A@B, A^T@B, A@B^T and A^T@B^T all
1.19 ms, while copying A^T first costs 1.50 ms.
"""
from __future__ import annotations

from typing import Any, Callable

from flowctl.kernels import bf16
from flowctl.kernels.registry import kernel

Fn = Callable[..., Any]

# A GPU's xp.matmul is cuBLAS's GEMM (cuda/xp.py), which takes bfloat16 operands as they are:
# float32 accumulation, one rounding. On the CPU, numpy's bfloat16 matmul hands back float32,
# so there the product is widened (kernels/bf16.py).
bf16.native("MatMul", ["gpu"])
bf16.native("BatchMatMul", ["gpu"])


@kernel("MatMul")
def matmul(xp: Any, attrs: dict[str, Any]) -> Fn:
    ta, tb = attrs["transpose_a"], attrs["transpose_b"]
    mm = xp.matmul
    # One closure per case, chosen at plan time, so a step pays no branch on the flags.
    if ta and tb:
        return lambda a, b: mm(a.T, b.T)
    if ta:
        return lambda a, b: mm(a.T, b)
    if tb:
        return lambda a, b: mm(a, b.T)
    return mm


# ConcatMatMul (ops/matrix.py, made by engine/concat_products.py): each product written into its
# rows of the output by the array module's matmul, the same BLAS call MatMul's kernel makes (only
# the output's row stride differs, which no BLAS result depends on): the Concat's bits, a copy of
# the whole output fewer.
@kernel("ConcatMatMul")
def concat_matmul(xp: Any, attrs: dict[str, Any]) -> Fn:
    flags = list(zip(attrs["transpose_a"], attrs["transpose_b"]))

    def run(*ins: Any) -> Any:
        ops = [(a.T if ta else a, b.T if tb else b) for (a, b), (ta, tb) in zip(zip(ins[::2], ins[1::2]), flags)]
        out = xp.empty((sum(a.shape[0] for a, _ in ops), ops[0][1].shape[1]),
                       dtype=xp.result_type(ops[0][0].dtype, ops[0][1].dtype))
        row = 0
        for a, b in ops:
            xp.matmul(a, b, out=out[row:row + a.shape[0]])
            row += a.shape[0]
        return out

    return run


@kernel("BatchMatMul")
def batch_matmul(xp: Any, attrs: dict[str, Any]) -> Fn:
    adj_x, adj_y = attrs["adj_x"], attrs["adj_y"]
    mm, sw = xp.matmul, xp.swapaxes
    if adj_x and adj_y:
        return lambda a, b: mm(sw(a, -1, -2), sw(b, -1, -2))
    if adj_x:
        return lambda a, b: mm(sw(a, -1, -2), b)
    if adj_y:
        return lambda a, b: mm(a, sw(b, -1, -2))
    return mm  # xp.matmul broadcasts the leading dims itself


@kernel("MatrixInverse")
def matrix_inverse(xp: Any, attrs: dict[str, Any]) -> Fn:
    return xp.linalg.inv


@kernel("MatrixDeterminant")
def matrix_determinant(xp: Any, attrs: dict[str, Any]) -> Fn:
    # det of a single matrix is a numpy scalar; the node promises an array.
    return lambda x: xp.asarray(xp.linalg.det(x))


@kernel("MatrixDeterminantGrad")
def matrix_determinant_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    def run(dy: Any, det: Any, x: Any) -> Any:
        scale = (dy * det)[..., None, None]
        return scale * xp.swapaxes(xp.linalg.inv(x), -1, -2)

    return run


@kernel("Einsum")
def einsum(xp: Any, attrs: dict[str, Any]) -> Fn:
    # The equation as inference checked it; without '->' numpy's implicit output is the one inference
    # gave (the letters used once, sorted).
    equation = attrs["equation"].replace(" ", "")

    def run(*xs: Any) -> Any:
        dtype = xs[0].dtype
        # optimize: contract pairwise through BLAS rather than numpy's one nested loop. The result
        # is cast back because a contraction through tensordot may widen small integers.
        y = xp.einsum(equation, *xs, optimize=len(xs) > 1)
        return xp.asarray(y).astype(dtype, copy=False)

    return run
