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


class _Slot:
    def __init__(self, value: np.ndarray) -> None:
        self.value = value


_UPDATES = [
    ("ApplyGradientDescent", {}, 1),
    ("ApplyMomentum", {"momentum": 0.9, "nesterov": False}, 2),
    ("ApplyMomentum", {"momentum": 0.9, "nesterov": True}, 2),
    ("ApplyAdam", {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}, 3),
]


@pytest.mark.parametrize("op, attrs, nslots", _UPDATES)
def test_an_update_in_runs_on_the_threads_has_one_threads_bits(op, attrs, nslots, monkeypatch, rng):
    """The in-place updates' runs go to the intra-op threads in groups (training.PARALLEL_RUNS):
    the same bits at 1, 2 and 3 threads, and the out-of-place update's (§4.7's new array)."""
    from flowctl.kernels import intra, training
    from flowctl.kernels.registry import KERNELS

    monkeypatch.setattr(training, "_RUN", 1000)  # 23 runs, the last one short
    size = 22_345
    values = [rng.standard_normal(size).astype(np.float32)]
    values += [np.abs(rng.standard_normal(size)).astype(np.float32) for _ in range(nslots - 1)]
    grad, lr = rng.standard_normal(size).astype(np.float32), np.asarray(0.05, np.float32)
    got = []
    for threads in (1, 2, 3):
        slots = [_Slot(v.copy()) for v in values]
        before = [id(s.value) for s in slots]
        fn = KERNELS[(op, "cpu")](np, {"_resource": slots[0] if nslots == 1 else tuple(slots), **attrs})
        with intra.fixed(threads):
            fn(lr, grad)
        assert [id(s.value) for s in slots] == before  # in place
        got.append([s.value for s in slots])
    held = [_Slot(v.copy()) for v in values]
    seen = [s.value for s in held]  # a reader holds each array: the update makes new ones
    fn = KERNELS[(op, "cpu")](np, {"_resource": held[0] if nslots == 1 else tuple(held), **attrs})
    fn(lr, grad)
    assert held[0].value is not seen[0]
    for g in got[1:] + [[s.value for s in held]]:
        for a, b in zip(g, got[0]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_l2loss_over_blocks_on_the_threads_is_one_threads_sum(threads, monkeypatch, rng):
    from flowctl.kernels import intra, training
    from flowctl.kernels.registry import KERNELS

    monkeypatch.setattr(training, "_BLOCK", 1000)
    x = rng.standard_normal((37, 611)).astype(np.float32)  # 23 blocks, the last one short
    want = np.float64(0.0)
    for s in range(0, x.size, 1000):
        b = x.reshape(-1)[s:s + 1000]
        want += np.dot(b, b)
    with intra.fixed(threads):
        got = KERNELS[("L2Loss", "cpu")](np, {})(x)
    assert got.dtype == np.float32 and got == np.float32(want * 0.5)
    np.testing.assert_allclose(got, 0.5 * (x.astype(np.float64) ** 2).sum(), rtol=1e-6)
