"""The Winograd convolutions (flowctl/kernels/cpu/winograd.py) against the direct ones: the Toom-Cook
transforms exact in float64, the three passes in float32 within 1e-5 of the output's scale of the
float64 reference (and of the float32 reference kernel), the same bits whatever the intra-op thread
count, and the registry's rule taking them only where they apply."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from flowctl.engine.shapes import TensorSpec  # noqa: E402
from flowctl.kernels import intra  # noqa: E402
from flowctl.kernels.cpu import winograd  # noqa: E402
from flowctl.kernels.registry import KERNELS, bind, chosen, reference_kernels  # noqa: E402

TOL = 1e-5


def _specs(*arrays: np.ndarray) -> list[TensorSpec]:
    return [TensorSpec(tuple(a.shape), str(a.dtype)) for a in arrays]


def _close(fast: np.ndarray, ref: np.ndarray) -> None:
    assert fast.shape == ref.shape and fast.dtype == np.float32
    scale = float(np.max(np.abs(ref)))
    np.testing.assert_allclose(fast, ref, rtol=TOL, atol=TOL * scale)


@pytest.mark.parametrize("m,r", [(2, 3), (4, 3), (2, 5), (3, 5), (2, 7), (3, 7), (1, 1)])
def test_the_transforms_compute_the_correlation_exactly(m: int, r: int) -> None:
    at, g, bt = winograd.transforms(m, r)
    a = m + r - 1
    assert at.shape == (m, a) and g.shape == (a, r) and bt.shape == (a, a)
    assert np.allclose(np.max(np.abs(bt), axis=1), 1.0)  # the data transform's rows scaled to largest entry 1
    rng = np.random.default_rng(m * 10 + r)
    for _ in range(20):
        taps, d = rng.standard_normal(r), rng.standard_normal(a)
        direct = np.array([taps @ d[i:i + r] for i in range(m)])
        np.testing.assert_allclose(at @ ((g @ taps) * (bt @ d)), direct, rtol=1e-12, atol=1e-12)


# (x shape, filter shape, padding): odd sizes (a last tile half outside the output), both paddings,
# more than one block of tiles, and a batch of one.
CASES = [((2, 19, 17, 48), (3, 3, 48, 64), "SAME"), ((1, 22, 18, 32), (3, 3, 32, 64), "SAME"), ((1, 21, 18, 70), (3, 3, 70, 48), "VALID"),
         ((2, 20, 23, 48), (5, 5, 48, 64), "SAME"), ((1, 22, 21, 64), (5, 5, 64, 48), "VALID"),
         ((3, 35, 35, 64), (3, 3, 64, 96), "SAME"), ((2, 21, 19, 32), (3, 3, 32, 32), "VALID"),
         ((1, 20, 18, 40), (3, 3, 40, 40), "SAME"),
         # F(3, 7) along one axis: Inception-v3's 17x17 shapes (17 outputs: the last tile a third out)
         ((2, 17, 17, 48), (1, 7, 48, 64), "SAME"), ((2, 17, 17, 64), (7, 1, 64, 48), "SAME"),
         ((1, 22, 25, 32), (1, 7, 32, 40), "VALID"), ((1, 25, 22, 40), (7, 1, 40, 32), "VALID"),
         # F(4, 3) along one axis (1x3, 3x1)
         ((2, 17, 18, 48), (1, 3, 48, 40), "SAME"), ((1, 19, 16, 40), (3, 1, 40, 48), "VALID")]


@pytest.mark.parametrize("x_shape,f_shape,padding", CASES)
def test_the_three_passes_match_the_direct_convolution(x_shape, f_shape, padding) -> None:
    rng = np.random.default_rng(sum(x_shape) + sum(f_shape))
    x = rng.standard_normal(x_shape).astype("float32")
    f = (rng.standard_normal(f_shape) / np.sqrt(np.prod(f_shape[:3]))).astype("float32")
    attrs = {"strides": (1, 1), "padding": padding}
    ref = {op: KERNELS[(op, "cpu")](np, dict(attrs)) for op in ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter")}
    y64 = ref["Conv2D"](x.astype("float64"), f.astype("float64"))
    dy = rng.standard_normal(y64.shape).astype("float32")

    fast = {}
    for op, ins in (("Conv2D", (x, f)), ("Conv2DBackpropInput", (dy, f, x)), ("Conv2DBackpropFilter", (x, dy, f))):
        v = chosen(op, "cpu", attrs, _specs(*ins))
        assert v is not None and v.name == "winograd", op
        fast[op] = bind(op, "cpu", dict(attrs), _specs(*ins))(*ins)

    _close(fast["Conv2D"], y64)
    _close(fast["Conv2D"], ref["Conv2D"](x, f))
    dx64 = ref["Conv2DBackpropInput"](dy.astype("float64"), f.astype("float64"), x)
    _close(fast["Conv2DBackpropInput"], dx64)
    dw64 = ref["Conv2DBackpropFilter"](x.astype("float64"), dy.astype("float64"), f)
    _close(fast["Conv2DBackpropFilter"], dw64)
    # and the gradients are those of sum(y * dy): a finite difference along one direction of f
    step = rng.standard_normal(f_shape)
    eps = 1e-6
    plus = ref["Conv2D"](x.astype("float64"), f + eps * step)
    minus = ref["Conv2D"](x.astype("float64"), f - eps * step)
    slope = float(np.sum((plus - minus) * dy) / (2 * eps))
    assert abs(float(np.sum(fast["Conv2DBackpropFilter"].astype("float64") * step)) - slope) <= 1e-4 * abs(slope) + 1e-3


def _transforms(kernels: tuple, plan, x: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, ...]:
    """(gather of x, scatter of m, gather_outputs of x) over all of plan's tiles with `kernels`."""
    gather, scatter, gather_outputs = kernels
    bth, btw, ath, atw = plan.matrices
    tiles = (plan.tiles_h, plan.tiles_w)
    c = x.shape[-1]
    v = np.zeros((plan.points, plan.tiles, c), "float32")
    gather(x, 0, plan.tiles, *tiles, plan.mh, plan.mw, plan.ph, plan.pw, bth, btw, v)
    y = np.zeros(x.shape, "float32")
    scatter(m, 0, plan.tiles, *tiles, ath, atw, y)
    dm = np.zeros((plan.points, plan.tiles, c), "float32")
    gather_outputs(x, 0, plan.tiles, *tiles, ath, atw, dm)
    return v, y, dm


@pytest.mark.parametrize("shape", [(2, 19, 21, 32), (2, 18, 17, 48), (1, 16, 16, 16)])
def test_the_written_out_transforms_give_the_general_loops_bits(shape: tuple) -> None:
    """F(4x4, 3x3)'s straight-line path (interior tiles, channels a multiple of LANES) and the
    general loops (edge tiles, other channel counts) sum the same terms in the same order: the same
    bits, tile by tile, for all three transforms. One extra zero channel sends every tile the general
    way."""
    n, h, w, c = shape
    k = 3
    assert winograd.fast_path(6, c) and not winograd.fast_path(6, c + 1)
    rng = np.random.default_rng(k * 100 + c)
    plan = winograd._plan(n, h, w, k, k, k // 2, k // 2, c, c, 4)

    def wider(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a, np.zeros(a.shape[:-1] + (1,), a.dtype)], axis=-1)

    x = rng.standard_normal(shape).astype("float32")
    m = rng.standard_normal((plan.points, plan.tiles, c)).astype("float32")
    kernels = winograd._kernels(plan)
    outs = [[a[..., :c] for a in _transforms(kernels, plan, xx, mm)] for xx, mm in ((x, m), (wider(x), wider(m)))]
    for fast, general in zip(*outs):
        assert np.abs(fast).max() > 0
        np.testing.assert_array_equal(fast, general)
    # and the general loops are the matrices: B^T P B of an interior tile, in float64
    t = plan.tiles_w + 1  # second row, second column: inside for these sizes
    r0, c0 = plan.mh - plan.ph, plan.mw - plan.pw
    patch = x[0, r0:r0 + 6, c0:c0 + 6].astype("float64")
    want = np.einsum("ki,ijc,lj->klc", plan.bth, patch, plan.btw).reshape(plan.points, c)
    np.testing.assert_allclose(outs[0][0][:, t], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("kh,kw,shape", [(1, 7, (2, 17, 17, 48)), (7, 1, (2, 17, 19, 40)), (1, 7, (1, 16, 21, 32))])
def test_a_one_axis_window_gives_the_general_loops_bits(kh: int, kw: int, shape: tuple) -> None:
    """A 1x7 or 7x1 window's own loops (the long axis alone) against the general loops, which also
    run its identity axis: the same sums in the same order, so the same bits, edges and padding
    included, for all three transforms."""
    n, h, w, c = shape
    plan = winograd._plan(n, h, w, kh, kw, kh // 2, kw // 2, c, c, 4)
    assert plan.one_axis and plan.points == 9  # F(3, 7)
    one_axis, general = winograd._kernels(plan), winograd._compiled()[0]
    assert one_axis is not general
    rng = np.random.default_rng(kh * 10 + kw + c)
    x = rng.standard_normal(shape).astype("float32")
    m = rng.standard_normal((plan.points, plan.tiles, c)).astype("float32")
    for mine, theirs in zip(_transforms(one_axis, plan, x, m), _transforms(general, plan, x, m)):
        assert np.abs(mine).max() > 0
        np.testing.assert_array_equal(mine, theirs)


def test_the_bits_do_not_depend_on_the_thread_count() -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 35, 35, 64)).astype("float32")  # many blocks of tiles
    f = rng.standard_normal((3, 3, 64, 96)).astype("float32")
    dy = rng.standard_normal((4, 35, 35, 96)).astype("float32")
    runs = []
    for threads in (1, 2, 3):
        with intra.fixed(threads):
            runs.append((winograd.conv2d_forward(x, f, "SAME"), winograd.conv2d_backprop_input(dy, f, x.shape, "SAME"),
                         winograd.conv2d_backprop_filter(x, dy, f.shape, "SAME")))
    assert len(winograd._Plan(4, 35, 35, 3, 3, 1, 1, 64, 96, 4).blocks) > 4
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


def test_the_rule_takes_winograd_only_where_it_applies() -> None:
    def picked(x_shape, f_shape, strides=(1, 1), dtype="float32"):
        x, f = np.zeros(x_shape, dtype), np.zeros(f_shape, dtype)
        v = chosen("Conv2D", "cpu", {"strides": strides, "padding": "SAME"}, _specs(x, f))
        return v.name if v is not None else None

    assert picked((8, 35, 35, 64), (3, 3, 64, 96)) == "winograd"
    assert picked((8, 35, 35, 48), (5, 5, 48, 64)) == "winograd"
    assert picked((8, 35, 35, 64), (3, 3, 64, 96), strides=(2, 2)) is None  # strided
    assert picked((8, 35, 35, 64), (3, 3, 64, 96), dtype="float64") is None  # float64 keeps the GEMMs
    assert picked((8, 147, 147, 32), (3, 3, 32, 64)) == "winograd"
    assert picked((8, 149, 149, 32), (3, 3, 32, 32)) == "winograd"
    assert picked((8, 149, 149, 24), (3, 3, 24, 32)) is None  # too few channels
    assert picked((8, 35, 35, 24), (3, 3, 24, 96)) is None
    assert picked((8, 8, 8, 448), (3, 3, 448, 384)) == "winograd"  # its kernel counts the tiles
    assert picked((8, 7, 8, 448), (3, 3, 448, 384)) is None  # too small an image
    assert picked((8, 17, 17, 128), (1, 7, 128, 128)) == "winograd"
    assert picked((8, 17, 17, 160), (7, 1, 160, 192)) == "winograd"
    assert picked((8, 8, 8, 384), (1, 3, 384, 384)) == "winograd"
    assert picked((8, 17, 17, 128), (7, 7, 128, 128)) is None  # a window it does not take
    assert picked((8, 17, 17, 128), (1, 5, 128, 128)) is None
    filter_grad = {"strides": (1, 1), "padding": "SAME"}
    x, dy, f = np.zeros((8, 8, 8, 384), "float32"), np.zeros((8, 8, 8, 384), "float32"), np.zeros((1, 3, 384, 384), "float32")
    assert chosen("Conv2DBackpropFilter", "cpu", filter_grad, _specs(x, dy, f)) is None  # from MIN_SIDE only
    x, dy = np.zeros((8, 16, 16, 384), "float32"), np.zeros((8, 16, 16, 384), "float32")
    assert chosen("Conv2DBackpropFilter", "cpu", filter_grad, _specs(x, dy, f)).name == "winograd"
    with reference_kernels():
        assert picked((8, 35, 35, 64), (3, 3, 64, 96)) is None


@pytest.mark.parametrize("n,f_shape,tiled", [(2, (1, 3, 48, 32), False), (8, (1, 3, 48, 32), True),
                                             (2, (3, 3, 32, 48), False), (32, (3, 3, 32, 48), True)])
def test_a_small_image_takes_winograd_from_min_tiles_on(n, f_shape, tiled) -> None:
    """Below MIN_SIDE the forward pass and the input gradient bound to Winograd's variant count the
    tiles of the shape they are called with: from MIN_TILES on Winograd's bits, below the GEMM
    kernel's (the compiled variant the rule would take without Winograd; the reference for Conv2D);
    both within float32 rounding of the float64 reference."""
    from flowctl.kernels.cpu import conv  # noqa: F401 -- the GEMM pieces' variants

    x_shape = (n, 8, 8, f_shape[2])
    assert winograd.enough_tiles(n, 8, 8, f_shape[0], f_shape[1]) == tiled
    rng = np.random.default_rng(n)
    x = rng.standard_normal(x_shape).astype("float32")
    f = (rng.standard_normal(f_shape) / np.sqrt(np.prod(f_shape[:3]))).astype("float32")
    dy = rng.standard_normal(x_shape[:3] + (f_shape[3],)).astype("float32")
    attrs = {"strides": (1, 1), "padding": "SAME"}
    y = bind("Conv2D", "cpu", dict(attrs), _specs(x, f))(x, f)
    dx = bind("Conv2DBackpropInput", "cpu", dict(attrs), _specs(dy, f, x))(dy, f, x)
    if tiled:
        want_y, want_dx = winograd.conv2d_forward(x, f, "SAME"), winograd.conv2d_backprop_input(dy, f, x.shape, "SAME")
    else:
        want_y = KERNELS[("Conv2D", "cpu")](np, dict(attrs))(x, f)
        want_dx = winograd.otherwise("Conv2DBackpropInput", np, dict(attrs))(dy, f, x)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(dx, want_dx)
    ref = {op: KERNELS[(op, "cpu")](np, dict(attrs)) for op in ("Conv2D", "Conv2DBackpropInput")}
    _close(y, ref["Conv2D"](x.astype("float64"), f.astype("float64")))
    _close(dx, ref["Conv2DBackpropInput"](dy.astype("float64"), f.astype("float64"), x))


# tests/tiny_specs.py's convolution model, widened so its second convolution (48 -> 64, 3x3, 18x18)
# takes the Winograd kernels in all three passes
WIDE_CONV = ["model.layers.x.shape=[18, 18, 2]", "model.layers.c1.filters=48", "model.layers.c2.filters=64"]


def test_training_through_winograd_resumes_bitwise(tmp_path, monkeypatch) -> None:
    """N steps == k steps + resume + N-k steps, bitwise, with c2's three passes on the Winograd
    kernels (counted: the rule is a rule, so the resumed run binds them again)."""
    from tiny_specs import TINY_CONV

    from flowctl.spec.loader import load_text
    from flowctl.training.trainer import Trainer

    calls = {"forward": 0, "input": 0, "filter": 0}
    for name, key in (("conv2d_forward", "forward"), ("conv2d_backprop_input", "input"),
                      ("conv2d_backprop_filter", "filter")):
        real = getattr(winograd, name)

        def counted(*args, _real=real, _key=key):
            calls[_key] += 1
            return _real(*args)
        monkeypatch.setattr(winograd, name, counted)

    def train(run_dir, steps, resume=False):
        t = Trainer(load_text(TINY_CONV, filename="tiny_conv.yaml", overrides=WIDE_CONV), run_dir, steps=steps)
        try:
            t.restore() if resume else t.start_fresh("spec", "tiny_conv.yaml")
            t.train()
        finally:
            t.close()
        return t.session.variable_values()

    full = train(tmp_path / "full", 6)
    assert calls["forward"] >= 6 and calls["input"] >= 6 and calls["filter"] >= 6  # c2 on every one of 6 steps
    train(tmp_path / "split", 3)
    again = train(tmp_path / "split", 6, resume=True)
    assert sorted(full) == sorted(again)
    assert all(np.array_equal(full[k], again[k]) for k in full)
