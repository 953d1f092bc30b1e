"""The direct window pass for inputs of few channels (kernels/cpu/conv.py's `direct` variants,
kernels/cpu/window_jit.py): within float32 rounding of the float64 convolution, the same bits at any
intra-op thread count, FusedConv2D's epilogue on every row, and the registry's rule taking it only
where it applies (a target with AVX-512's registers: elsewhere the rule is tested to decline)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from flowctl.engine.shapes import TensorSpec  # noqa: E402
from flowctl.kernels import intra  # noqa: E402
from flowctl.kernels.cpu import conv  # noqa: E402
from flowctl.kernels.cpu.gemm_jit import wide_registers  # noqa: E402
from flowctl.kernels.registry import KERNELS, bind, chosen  # noqa: E402

WIDE = wide_registers()
needs_wide = pytest.mark.skipif(not WIDE, reason="the direct pass runs on AVX-512 targets only")


def _specs(*arrays: np.ndarray) -> list[TensorSpec]:
    return [TensorSpec(tuple(a.shape), str(a.dtype)) for a in arrays]


def _reference64(x: np.ndarray, f: np.ndarray, strides: tuple, padding: str) -> np.ndarray:
    attrs = {"strides": strides, "padding": padding}
    return KERNELS[("Conv2D", "cpu")](np, attrs)(x.astype("float64"), f.astype("float64"))


# (x shape, filter shape, strides, padding): the stem's shape at a small size, both paddings, odd
# sizes, a last row of windows half outside, 1-4 channels, one, two and three panels of outputs,
# widths that leave blocks of 12, 4 and 1 positions
CASES = [((2, 31, 29, 3), (3, 3, 3, 32), (2, 2), "VALID"), ((1, 17, 23, 3), (3, 3, 3, 32), (2, 2), "SAME"),
         ((2, 13, 14, 1), (5, 5, 1, 16), (1, 1), "SAME"), ((1, 9, 30, 4), (1, 7, 4, 48), (1, 1), "SAME"),
         ((1, 30, 9, 2), (7, 1, 2, 32), (1, 1), "SAME"), ((3, 8, 8, 3), (2, 2, 3, 16), (2, 2), "VALID"),
         ((1, 12, 17, 3), (3, 3, 3, 48), (1, 2), "SAME"), ((1, 5, 5, 4), (1, 1, 4, 64), (1, 1), "VALID")]


@needs_wide
@pytest.mark.parametrize("x_shape,f_shape,strides,padding", CASES)
def test_the_direct_pass_is_the_convolution_to_float32_rounding(x_shape, f_shape, strides, padding) -> None:
    rng = np.random.default_rng(sum(x_shape) + sum(f_shape))
    x = rng.standard_normal(x_shape).astype("float32")
    f = rng.standard_normal(f_shape).astype("float32")
    attrs = {"strides": strides, "padding": padding}
    assert chosen("Conv2D", "cpu", attrs, _specs(x, f)).name == "direct"
    got = bind("Conv2D", "cpu", attrs, _specs(x, f))(x, f)
    want = _reference64(x, f, strides, padding)
    assert got.dtype == np.float32 and got.shape == want.shape
    k = int(np.prod(f_shape[:3]))  # terms in a sum, each rounded once
    bound = 1e-6 * np.sqrt(k) * float(np.abs(x).max() * np.abs(f).max()) * 4
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=bound)
    runs = []
    for threads in (1, 2, 3):
        with intra.fixed(threads):
            runs.append(conv.direct_forward(x, f, strides, padding))
    for other in runs[1:]:
        np.testing.assert_array_equal(runs[0], other)
    np.testing.assert_array_equal(runs[0], got)


@needs_wide
@pytest.mark.parametrize("relu", [False, True])
def test_the_fused_direct_pass_applies_the_affine_to_every_row(relu) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 23, 21, 3)).astype("float32")
    f = rng.standard_normal((3, 3, 3, 32)).astype("float32")
    scale = rng.uniform(0.5, 2.0, 32).astype("float32")
    shift = rng.standard_normal(32).astype("float32")
    attrs = {"strides": (2, 2), "padding": "VALID", "activation": "relu" if relu else "none"}
    ins = _specs(x, f, scale, shift)
    assert chosen("FusedConv2D", "cpu", attrs, ins).name == "direct"
    got = bind("FusedConv2D", "cpu", attrs, ins)(x, f, scale, shift)
    y = conv.direct_forward(x, f, (2, 2), "VALID")
    want = y * scale + shift
    if relu:
        want = np.maximum(want, 0)
    np.testing.assert_array_equal(got, want)  # ChannelAffine's arithmetic, element by element


def test_the_rule_takes_the_direct_pass_only_where_it_applies() -> None:
    def picked(x_shape, f_shape, dtype="float32", strides=(2, 2)):
        x, f = np.zeros(x_shape, dtype), np.zeros(f_shape, dtype)
        v = chosen("Conv2D", "cpu", {"strides": strides, "padding": "VALID"}, _specs(x, f))
        return v.name if v is not None else None

    stem = picked((8, 299, 299, 3), (3, 3, 3, 32))
    assert stem == ("direct" if WIDE else None)
    assert picked((8, 35, 35, 8), (3, 3, 8, 32)) is None  # more channels: a GEMM's K is long enough
    assert picked((8, 35, 35, 3), (3, 3, 3, 24)) is None  # not a whole number of 16 outputs
    assert picked((8, 35, 35, 3), (3, 3, 3, 32), dtype="float64") is None  # float64 keeps the reference
