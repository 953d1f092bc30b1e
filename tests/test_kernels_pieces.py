"""The cpu kernels that work piece by piece (convolutions over runs of output rows or whole images,
batch norm over runs of rows) against the same kernels taking the batch whole, and against float64
references, for piece sizes that split images unevenly."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from flowctl.kernels import conv as kc
from tests.test_ops_conv import ref_conv2d


def _whole_and_pieces(fn):
    """fn(rows) for the whole batch at once (None) and for pieces of several sizes."""
    return fn(None), [fn(rows) for rows in (1, 7, 13, 40, 10_000)]


@pytest.mark.parametrize("strides, padding", [((1, 1), "SAME"), ((1, 1), "VALID"), ((2, 2), "SAME"),
                                              ((2, 1), "VALID")])
@pytest.mark.parametrize("kernel, channels", [((3, 3), (3, 2)), ((3, 3), (2, 3)), ((2, 3), (2, 4)),
                                              ((3, 1), (2, 2))])
def test_convolution_pieces_match_whole_batch_and_reference(strides, padding, kernel, channels, rng):
    c, co = channels
    x = rng.standard_normal((3, 7, 6, c))
    f = rng.standard_normal(kernel + channels)
    y_ref = ref_conv2d(x, f, strides, padding)
    dy = rng.standard_normal(y_ref.shape)
    whole, pieces = _whole_and_pieces(lambda rows: kc.conv2d_forward(np, x, f, strides, padding, rows))
    np.testing.assert_allclose(whole, y_ref, rtol=1e-12, atol=1e-12)
    # <dy, conv(x, f)> is bilinear: its gradients are the two backprops, checked here through the
    # adjoint identities <dy, conv(x, f)> = <backprop_input(dy), x> = <backprop_filter(x, dy), f>.
    inner = float((dy * y_ref).sum())
    dxs = [kc.conv2d_backprop_input(np, dy, f, x.shape, strides, padding, rows) for rows in (None, 1, 7, 40)]
    dfs = [kc.conv2d_backprop_filter(np, x, dy, f.shape, strides, padding, rows) for rows in (None, 1, 7, 40)]
    for p in pieces:
        np.testing.assert_allclose(p, whole, rtol=1e-12, atol=1e-12)
    for dx, df in itertools.zip_longest(dxs, dfs):
        assert dx.shape == x.shape and df.shape == f.shape
        np.testing.assert_allclose(float((dx * x).sum()), inner, rtol=1e-10)
        np.testing.assert_allclose(float((df * f).sum()), inner, rtol=1e-10)
        np.testing.assert_allclose(dx, dxs[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(df, dfs[0], rtol=1e-12, atol=1e-12)


def test_pieces_cover_the_output_once_and_are_contiguous():
    for n, ho, wo, rows in [(8, 35, 35, 2048), (8, 17, 17, 2048), (1, 147, 147, 2048), (3, 5, 6, 1),
                            (5, 4, 4, 40), (2, 9, 3, 7)]:
        seen = np.zeros((n, ho), dtype=int)
        for b0, b1, r0, r1 in kc.bands(n, ho, wo, rows):
            assert b1 - b0 == 1 or (r0, r1) == (0, ho)  # contiguous in NHWC
            seen[b0:b1, r0:r1] += 1
        assert (seen == 1).all()


@pytest.mark.parametrize("axis", [1, 2, -1])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_large_concatenation_in_runs_of_the_first_axis_is_numpys(axis, threads, monkeypatch, rng):
    from flowctl.kernels import array, intra
    from flowctl.kernels.registry import bind

    monkeypatch.setattr(array, "CONCAT_PIECES_BYTES", 1)  # every concatenation in runs
    xs = [rng.standard_normal((5, 4, 3, 2)).astype(dt) for dt in ("float32", "float64", "float32")]
    kernel = bind("Concat", "cpu", {"axis": axis})
    with intra.fixed(threads):
        got = kernel(*xs)
    want = np.concatenate(xs, axis=axis)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_a_concatenation_of_shapes_that_do_not_fit_says_numpys_message(monkeypatch, rng):
    from flowctl.kernels import array
    from flowctl.kernels.registry import bind

    monkeypatch.setattr(array, "CONCAT_PIECES_BYTES", 1)
    with pytest.raises(ValueError, match="must match exactly"):
        bind("Concat", "cpu", {"axis": 2})(np.zeros((4, 3, 2)), np.zeros((4, 2, 2)))
