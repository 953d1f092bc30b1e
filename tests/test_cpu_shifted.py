"""The shifted-GEMM forward pass of one-column and one-row windows (flowctl/kernels/cpu/shifted.py)
against the reference convolution: float64 to 1e-12, float32 within 1e-5 of the output's scale,
the same bits at one BLAS thread and at two, and the registry's rule taking it only where it
applies (the gradients keep their own kernels)."""
from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from flowctl.engine.shapes import TensorSpec
from flowctl.kernels.cpu import shifted
from flowctl.kernels.registry import KERNELS, bind, chosen

# (x shape, filter shape, padding): both orientations, both paddings, odd sizes, 5 and 7 taps, and
# an image narrower than the window along the other axis.
CASES = [((2, 17, 17, 24), (7, 1, 24, 32), "SAME"), ((2, 17, 17, 24), (1, 7, 24, 16), "SAME"),
         ((1, 13, 9, 8), (7, 1, 8, 12), "VALID"), ((1, 9, 13, 8), (1, 7, 8, 12), "VALID"),
         ((3, 11, 6, 5), (5, 1, 5, 7), "SAME"), ((3, 6, 11, 5), (1, 5, 5, 7), "SAME"),
         ((1, 4, 3, 2), (1, 7, 2, 3), "SAME")]


def _specs(*arrays: np.ndarray) -> list[TensorSpec]:
    return [TensorSpec(tuple(a.shape), str(a.dtype)) for a in arrays]


@pytest.mark.parametrize("x_shape,f_shape,padding", CASES)
def test_the_forward_pass_matches_the_reference(x_shape, f_shape, padding) -> None:
    rng = np.random.default_rng(sum(x_shape) + sum(f_shape))
    x = rng.standard_normal(x_shape)
    f = rng.standard_normal(f_shape) / np.sqrt(np.prod(f_shape[:3]))
    attrs = {"strides": (1, 1), "padding": padding}
    ref = KERNELS[("Conv2D", "cpu")](np, dict(attrs))(x, f)
    for dtype, tol in (("float64", 1e-12), ("float32", 1e-5)):
        xs, fs = x.astype(dtype), f.astype(dtype)
        v = chosen("Conv2D", "cpu", attrs, _specs(xs, fs))
        assert v is not None and v.name == "shifted"
        y = bind("Conv2D", "cpu", dict(attrs), _specs(xs, fs))(xs, fs)
        assert y.shape == ref.shape and y.dtype == dtype and y.flags.c_contiguous
        np.testing.assert_allclose(y, ref, rtol=tol, atol=tol * float(np.max(np.abs(ref))))


def test_the_bits_do_not_depend_on_blas_threads() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 17, 17, 64)).astype("float32")
    for f_shape in ((7, 1, 64, 96), (1, 7, 64, 96)):
        f = rng.standard_normal(f_shape).astype("float32")
        runs = []
        for threads in (1, 2):
            with threadpool_limits(limits=threads, user_api="blas"):
                runs.append(shifted.conv2d_forward(x, f, "SAME"))
        np.testing.assert_array_equal(runs[0], runs[1])


def test_the_rule_takes_it_only_where_it_applies() -> None:
    x = np.zeros((2, 17, 17, 8), "float32")

    def name(f_shape, strides=(1, 1), xx=x, op="Conv2D") -> str | None:
        f = np.zeros(f_shape, "float32")
        ins = (xx, f) if op == "Conv2D" else (xx, f, xx)
        v = chosen(op, "cpu", {"strides": strides, "padding": "SAME"}, _specs(*ins))
        return v.name if v is not None else None

    assert name((7, 1, 8, 8)) == name((1, 7, 8, 8)) == name((1, 5, 8, 8)) == "shifted"
    assert name((3, 1, 8, 8)) != "shifted" and name((1, 3, 8, 8)) != "shifted"  # below MIN_TAPS
    assert name((7, 1, 8, 8), strides=(2, 2)) != "shifted"
    assert name((3, 3, 8, 8)) != "shifted" and name((7, 7, 8, 8)) != "shifted"
    assert name((7, 1, 8, 8), xx=x.astype("float16")) != "shifted"  # fp16 stays on the numpy path
    assert name((7, 1, 8, 8), op="Conv2DBackpropInput") != "shifted"  # the gradients keep theirs
