"""The compiled recurrent product (flowctl/kernels/cpu/recurrent.py, gemm_jit.py) against the
float64 product: every row block (the host's ROWS, 4, 2, 1) and column tail (16, 8, single columns), w as a row
slice of a wider kernel (how the LSTM layer hands it over), the same bits for any thread count,
and the rule: float32 only, on AVX-512 targets, BLAS's product past MAX_ROWS rows."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from flowctl.engine.shapes import TensorSpec  # noqa: E402
from flowctl.kernels import intra  # noqa: E402
from flowctl.kernels.cpu import recurrent  # noqa: E402
from flowctl.kernels.registry import bind, chosen  # noqa: E402


@pytest.mark.parametrize("m", [1, 3, 4, 10, 14, 20, 23])
@pytest.mark.parametrize("k,n", [(1, 16), (5, 7), (37, 24), (650, 2600), (64, 41)])
def test_the_product_is_the_float64_ones_to_float32_rounding(m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(m * 1000 + k + n)
    h = rng.standard_normal((m, k)).astype("float32")
    kernel = rng.standard_normal((k + 3, n)).astype("float32")
    w = kernel[3:]  # rows of a bigger matrix: contiguous rows, another start
    got = recurrent.matmul(h, w)
    want = h.astype("float64") @ w.astype("float64")
    assert got.dtype == np.float32 and got.shape == (m, n)
    bound = 1e-5 * np.sqrt(k) * float(np.abs(h).max() * np.abs(w).max())  # k terms, each rounded once
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=bound)
    with intra.fixed(1):
        one = recurrent.matmul(h, w)
    with intra.fixed(3):
        three = recurrent.matmul(h, w)
    np.testing.assert_array_equal(got, one)
    np.testing.assert_array_equal(got, three)


def test_past_max_rows_and_for_column_strided_w_it_is_the_blas_product() -> None:
    rng = np.random.default_rng(3)
    h = rng.standard_normal((recurrent.MAX_ROWS + 1, 20)).astype("float32")
    w = rng.standard_normal((20, 40)).astype("float32")
    np.testing.assert_array_equal(recurrent.matmul(h, w), h @ w)
    wt = np.asfortranarray(w)
    np.testing.assert_array_equal(recurrent.matmul(h[:4], wt), h[:4] @ wt)
    empty = np.zeros((4, 0), np.float32)
    np.testing.assert_array_equal(recurrent.matmul(empty, np.zeros((0, 5), np.float32)), np.zeros((4, 5), np.float32))


def test_the_rule_takes_float32_matrices_only() -> None:
    def picked(dtype: str) -> str | None:
        ins = [TensorSpec((None, 650), dtype), TensorSpec((650, 2600), dtype)]
        v = chosen("RecurrentMatMul", "cpu", {}, ins)
        return v.name if v is not None else None

    from flowctl.kernels.cpu.gemm_jit import wide_registers

    assert picked("float32") == ("numba" if wide_registers() else None)  # AVX2: the BLAS's product
    assert picked("float64") is None
    h = np.ones((2, 3), np.float32)
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    fn = bind("RecurrentMatMul", "cpu", {}, [TensorSpec((None, 3), "float32"), TensorSpec((3, 4), "float32")])
    np.testing.assert_array_equal(fn(h, w), h @ w)  # small integers: exact either way


@pytest.mark.parametrize("m", [7, 20, 23])
def test_a_rows_bits_do_not_depend_on_its_register_block(m: int) -> None:
    # The block size is the host's (gemm_jit.ROWS: 10 with AVX-512, else 6); a row alone goes
    # through the one-row block, so equal bits here mean equal bits on either kind of host.
    rng = np.random.default_rng(m)
    h = rng.standard_normal((m, 650)).astype("float32")
    w = rng.standard_normal((650, 200)).astype("float32")
    together = recurrent.matmul(h, w)
    for r in range(m):
        np.testing.assert_array_equal(together[r:r + 1], recurrent.matmul(h[r:r + 1], w))
