"""A convolution and the inference batch norm reading it as one node on the CPU (engine/conv_affine.py,
kernels/cpu/conv.py): the pass's rewrite and where it stays away, the compiled FusedConv2D against the
unfused pair's kernels (bit for bit: Winograd, the GEMM pieces, 1x1 windows, float64) and against the
float64 reference, whatever the intra-op thread count, and a whole inference model with and without
the pass."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

import flowctl as fc  # noqa: E402
from flowctl.engine import conv_affine  # noqa: E402
from flowctl.engine.shapes import TensorSpec  # noqa: E402
from flowctl.kernels import intra  # noqa: E402
from flowctl.kernels.registry import bind, chosen, reference_kernels  # noqa: E402

# (x shape, filter shape, strides, padding, dtype, the variant the rule takes)
CASES = [((2, 19, 17, 48), (3, 3, 48, 64), (1, 1), "SAME", "float32", "winograd"),
         ((3, 35, 35, 64), (3, 3, 64, 96), (1, 1), "SAME", "float32", "winograd"),  # many blocks of tiles
         ((2, 17, 17, 48), (1, 7, 48, 64), (1, 1), "SAME", "float32", "winograd"),  # F(3, 7), one axis
         ((2, 17, 17, 64), (7, 1, 64, 48), (1, 1), "VALID", "float32", "winograd"),
         ((2, 8, 8, 48), (1, 3, 48, 32), (1, 1), "SAME", "float32", "winograd"),  # too few tiles: the GEMMs
         ((16, 8, 8, 32), (3, 1, 32, 48), (1, 1), "SAME", "float32", "winograd"),  # enough: F(4, 3), one axis
         ((2, 23, 21, 16), (3, 3, 16, 24), (2, 2), "VALID", "float32", "numba"),  # GEMM pieces, strided
         ((2, 40, 40, 8), (3, 3, 8, 16), (1, 1), "SAME", "float32", "numba"),  # too few channels for Winograd
         ((2, 13, 11, 12), (3, 3, 12, 20), (1, 1), "SAME", "float64", "numba"),
         ((4, 35, 35, 40), (1, 1, 40, 24), (1, 1), "SAME", "float32", "numba"),  # 1x1
         ((2, 17, 17, 40), (1, 1, 40, 24), (2, 2), "SAME", "float64", "numba")]


def _specs(*arrays: np.ndarray) -> list[TensorSpec]:
    return [TensorSpec(tuple(a.shape), str(a.dtype)) for a in arrays]


def _inputs(x_shape, f_shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(dtype)
    f = (rng.standard_normal(f_shape) / np.sqrt(np.prod(f_shape[:3]))).astype(dtype)
    co = f_shape[3]
    scale, shift = rng.uniform(0.5, 2, co).astype(dtype), rng.standard_normal(co).astype(dtype)
    return x, f, scale, shift


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("x_shape,f_shape,strides,padding,dtype,name", CASES)
def test_the_fused_kernel_gives_the_pairs_bits(x_shape, f_shape, strides, padding, dtype, name, relu) -> None:
    """The variant the rule takes is the unfused Conv2D's kernel then ChannelAffine's, to the bit,
    at 1, 2 and 3 intra-op threads (the pair at each); both within float rounding of the float64 reference."""
    x, f, scale, shift = _inputs(x_shape, f_shape, dtype, sum(x_shape) + sum(f_shape))
    conv = {"strides": strides, "padding": padding}
    act = {"activation": "relu" if relu else "none"}
    ins = _specs(x, f, scale, shift)
    assert chosen("FusedConv2D", "cpu", {**conv, **act}, ins).name == name
    for threads in (1, 2, 3):  # the pair at the same count: at one intra-op thread a one-piece
        # pass keeps BLAS's own threads, and OpenBLAS's threaded GEMM has other bits than its
        # one-thread GEMM on some hosts (M = 3200, N = 16 on a 2-core AMD EPYC)
        with intra.fixed(threads):
            y = bind("Conv2D", "cpu", conv, ins[:2])(x, f)
            want = bind("ChannelAffine", "cpu", act, _specs(y, scale, shift))(y, scale, shift)
            got = bind("FusedConv2D", "cpu", {**conv, **act}, ins)(x, f, scale, shift)
        assert got.dtype == x.dtype
        np.testing.assert_array_equal(got, want)
    with reference_kernels():
        ref = bind("FusedConv2D", "cpu", {**conv, **act}, _specs(*(a.astype("float64") for a in (x, f, scale, shift))))(
            *(a.astype("float64") for a in (x, f, scale, shift)))
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * float(np.abs(ref).max()))
    if relu:
        assert (got == 0).any() and (got > 0).any()


def test_a_winograd_row_of_tiles_two_threads_share_is_finished_once() -> None:
    """Blocks of tiles that end inside a row of tiles (35x35 in 4x4 tiles: 9 tiles a row): each row
    gets the affine exactly once (twice would show: relu(x*2 + 1) applied again is not itself)."""
    from flowctl.kernels.cpu import winograd

    x, f, _, _ = _inputs((3, 35, 35, 64), (3, 3, 64, 96), "float32", 3)
    plan = winograd._Plan(3, 35, 35, 3, 3, 1, 1, 64, 96, 4)
    assert any(t0 % plan.tiles_w for t0, _ in plan.blocks[1:])  # some block starts mid-row
    plain = winograd.conv2d_forward(x, f, "SAME")
    seen = np.zeros(plain.shape[:3], dtype=int)

    def count(y2, a, b):
        seen.reshape(-1)[a:b] += 1

    for threads in (1, 2, 3):
        seen[:] = 0
        with intra.fixed(threads):
            np.testing.assert_array_equal(winograd.conv2d_forward(x, f, "SAME", count), plain)
        assert (seen == 1).all(), threads


def _net(training: bool, fetch_conv: bool = False, second_reader: bool = False):
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (None, 18, 18, 32), name="x")
        f = fc.constant(np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype("float32") * 0.1)
        y = fc.conv2d(x, f, name="conv")
        c = y.shape[-1]
        mm, mv = fc.variable(np.full(c, 0.1, "float32"), name="mm"), fc.variable(np.full(c, 2.0, "float32"), name="mv")
        scale, offset = fc.constant(np.full(c, 1.5, "float32")), fc.constant(np.full(c, -0.2, "float32"))
        out, _ = fc.batch_norm(y, scale, offset, mm, mv, training=training, activation="relu")
        fetches = [out] + ([y] if fetch_conv else []) + ([y * 2.0] if second_reader else [])
    return g, x, fetches


def _plan_ops(session, fetches, feeds):
    return [n.op for n in session.plan_for(fetches, feeds).nodes]


def test_the_pass_fuses_an_inference_batch_norm_and_keeps_the_bits(monkeypatch) -> None:
    g, x, fetches = _net(training=False)
    xv = {x: np.random.default_rng(1).standard_normal((2, 18, 18, 32)).astype("float32")}
    s = fc.Session(g, store=fc.ContainerStore())
    s.run(fc.global_variables_initializer(g))
    got = s.run(fetches, xv)
    ops = _plan_ops(s, fetches, xv)
    assert "FusedConv2D" in ops and "Conv2D" not in ops and "ChannelAffine" not in ops
    monkeypatch.setattr(conv_affine, "ENABLED", False)
    s2 = fc.Session(g, store=s.store)
    want = s2.run(fetches, xv)
    assert "Conv2D" in _plan_ops(s2, fetches, xv)
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("case", ["training", "fetched", "second_reader"])
def test_the_pass_leaves_a_convolution_that_is_needed_elsewhere(case) -> None:
    g, x, fetches = _net(training=case == "training", fetch_conv=case == "fetched",
                         second_reader=case == "second_reader")
    xv = {x: np.zeros((2, 18, 18, 32), "float32")}
    ops = _plan_ops(fc.Session(g, store=fc.ContainerStore()), fetches, xv)
    assert "FusedConv2D" not in ops and "Conv2D" in ops
