"""The GPU's products go to cuBLAS through ctypes (kernels/cuda/blas.py). A GPU is not needed to
check what they ask of it: the (op, leading dimension) mapping from row-major numpy/cupy layouts to
cuBLAS's column-major GEMM is checked here against a column-major GEMM written in numpy over the
operands' raw memory, for C-ordered, transposed and sliced operands. The product itself runs in the
gpu-marked test."""
from __future__ import annotations

import numpy as np
import pytest

from flowctl.kernels.cuda import blas


def column_major_gemm(transa, transb, m, n, k, A, lda, B, ldb, ldc):
    """What cublasGemmEx computes: C (m x n, column-major, ld ldc) = op(A) op(B), A and B read as
    column-major matrices from flat memory with leading dimensions lda, ldb."""
    def matrix(flat, rows, cols, ld):
        return np.array([[flat[i + j * ld] for j in range(cols)] for i in range(rows)])

    opA = matrix(A, k, m, lda).T if transa else matrix(A, m, k, lda)
    opB = matrix(B, n, k, ldb).T if transb else matrix(B, k, n, ldb)
    C = opA @ opB
    out = np.zeros(ldc * n)
    for j in range(n):
        out[j * ldc:j * ldc + m] = C[:, j]
    return out


def flat(x):
    """The memory a view starts at, as a flat vector from its first element."""
    base = x
    while base.base is not None:
        base = base.base
    offset = (x.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // x.itemsize
    return base.reshape(-1)[offset:]


LAYOUTS = {
    "c": lambda r, c, rng: rng.standard_normal((r, c)),
    "transposed": lambda r, c, rng: rng.standard_normal((c, r)).T,
    "row_slice": lambda r, c, rng: rng.standard_normal((r, c + 5))[:, 2:2 + c],
    "transposed_slice": lambda r, c, rng: rng.standard_normal((c + 3, r))[1:1 + c].T,
}


@pytest.mark.parametrize("la", sorted(LAYOUTS))
@pytest.mark.parametrize("lb", sorted(LAYOUTS))
@pytest.mark.parametrize("mkn", [(3, 4, 5), (1, 4, 2), (4, 1, 3), (5, 3, 1)])
def test_the_gemm_arguments_compute_the_row_major_product(la, lb, mkn, rng):
    m, k, n = mkn
    a, b = LAYOUTS[la](m, k, rng), LAYOUTS[lb](k, n, rng)
    transa, transb, rows, cols, inner, lda, ldb, ldc = blas.gemm_args(a, b)
    got = column_major_gemm(transa, transb, rows, cols, inner, flat(b), lda, flat(a), ldb, ldc)
    # column-major (n x m) with ld n is the row-major (m x n) product
    np.testing.assert_allclose(got.reshape(m, n), a @ b, rtol=1e-12)


def test_an_operand_cublas_cannot_read_is_refused_so_the_caller_copies_it(rng):
    x = rng.standard_normal((6, 6))[::2, ::2]
    with pytest.raises(ValueError):
        blas._operand(x)


def test_fp32_products_are_tf32_unless_set_to_ieee():
    before = blas.fp32_products()
    try:
        blas.set_fp32_products("tf32")
        assert blas._compute("float32")[0] == blas._COMPUTE_32F_FAST_TF32
        blas.set_fp32_products("ieee")
        assert blas._compute("float32")[0] == blas._COMPUTE_32F
        assert blas._compute("float16")[0] == blas._COMPUTE_32F  # half products accumulate in float32
        with pytest.raises(ValueError):
            blas.set_fp32_products("fast")
    finally:
        blas.set_fp32_products(before)


@pytest.mark.gpu
def test_gemm_on_the_gpu_matches_numpy_at_the_precision_in_use(rng):
    from flowctl.kernels.registry import array_module

    xp = array_module("gpu")
    for la in LAYOUTS:
        for lb in LAYOUTS:
            a, b = LAYOUTS[la](64, 96, rng).astype(np.float32), LAYOUTS[lb](96, 48, rng).astype(np.float32)
            ref = a.astype(np.float64) @ b.astype(np.float64)
            # the same layouts on the device, built from device arrays
            dev_a = {"c": lambda: xp.asarray(a), "transposed": lambda: xp.asarray(np.ascontiguousarray(a.T)).T,
                     "row_slice": lambda: xp.asarray(np.pad(a, ((0, 0), (2, 3))))[:, 2:2 + a.shape[1]],
                     "transposed_slice": lambda: xp.asarray(np.pad(a.T, ((1, 2), (0, 0))))[1:1 + a.shape[1]].T}[la]()
            dev_b = {"c": lambda: xp.asarray(b), "transposed": lambda: xp.asarray(np.ascontiguousarray(b.T)).T,
                     "row_slice": lambda: xp.asarray(np.pad(b, ((0, 0), (2, 3))))[:, 2:2 + b.shape[1]],
                     "transposed_slice": lambda: xp.asarray(np.pad(b.T, ((1, 2), (0, 0))))[1:1 + b.shape[1]].T}[lb]()
            got = xp.host(xp.matmul(dev_a, dev_b))
            # TF32 keeps 10 mantissa bits of each product input: unit roundoff 2**-11 each, sqrt(K) of them
            unit = 2.0 ** -11 if blas.fp32_products() == "tf32" else 2.0 ** -24
            err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert err < 4 * unit * np.sqrt(96), (la, lb, err)


@pytest.mark.gpu
def test_a_bfloat16_gemm_on_the_gpu_is_the_float32_product_rounded_once(rng):
    """cuBLAS on bfloat16 operands (CUDA_R_16BF, float32 compute): within bfloat16's one rounding
    of the float32 product of the same values (kernels/bf16.py's reference for MatMul)."""
    import ml_dtypes

    from flowctl.kernels.registry import array_module

    xp = array_module("gpu")
    a = rng.standard_normal((64, 96)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((96, 48)).astype(ml_dtypes.bfloat16)
    got = xp.host(xp.matmul(xp.asarray(a), xp.asarray(b)))
    assert got.dtype == a.dtype
    ref = a.astype(np.float64) @ b.astype(np.float64)
    err = np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max()
    assert err < 2.0 ** -8 + 4 * 2.0 ** -24 * np.sqrt(96), err
