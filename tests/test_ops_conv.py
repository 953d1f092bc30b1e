"""Convolution and pooling: kernels against float64 references written as explicit loops over an
explicitly padded input (TensorFlow's SAME rule spelled out here, not imported), every op through
the finite-difference checker, unknown batch dimensions, shape errors and costs."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.gradcheck import check_gradients
from flowctl.engine.gradcheck import run_graph as run
from flowctl.engine.ops.conv import (
    avg_pool, avg_pool_grad, conv2d, conv2d_backprop_filter, conv2d_backprop_input, max_pool,
    max_pool_grad,
)
from flowctl.engine.opdef import get_op
from flowctl.engine.shapes import TensorSpec
from precision import TF32_ROUNDOFF, assert_fp32_close


# ---------------------------------------------------------------------------- references
def ref_padding(size, k, s, padding):
    """(output size, pad before, pad after) by TensorFlow's documented rule."""
    if padding == "VALID":
        return (size - k) // s + 1, 0, 0
    out = math.ceil(size / s)
    total = max((out - 1) * s + k - size, 0)
    return out, total // 2, total - total // 2


def ref_conv2d(x, f, strides, padding):
    n, h, w, c = x.shape
    kh, kw, _, co = f.shape
    ho, top, bottom = ref_padding(h, kh, strides[0], padding)
    wo, left, right = ref_padding(w, kw, strides[1], padding)
    xp = np.zeros((n, h + top + bottom, w + left + right, c))
    xp[:, top:top + h, left:left + w] = x
    y = np.zeros((n, ho, wo, co))
    for b, r, q in itertools.product(range(n), range(ho), range(wo)):
        for i, j in itertools.product(range(kh), range(kw)):
            for ci in range(c):
                y[b, r, q] += xp[b, r * strides[0] + i, q * strides[1] + j, ci] * f[i, j, ci]
    return y


def ref_pool(x, ksize, strides, padding, reduce):
    """Each window's unpadded elements, reduced by `reduce` (max, or mean over the valid ones)."""
    n, h, w, c = x.shape
    ho, top, _ = ref_padding(h, ksize[0], strides[0], padding)
    wo, left, _ = ref_padding(w, ksize[1], strides[1], padding)
    y = np.zeros((n, ho, wo, c))
    for b, r, q, ch in itertools.product(range(n), range(ho), range(wo), range(c)):
        vals = [x[b, hh, ww, ch]
                for hh in range(r * strides[0] - top, r * strides[0] - top + ksize[0])
                for ww in range(q * strides[1] - left, q * strides[1] - left + ksize[1])
                if 0 <= hh < h and 0 <= ww < w]
        y[b, r, q, ch] = reduce(vals)
    return y


def distinct(rng, shape):
    """Values at least 0.05 apart, so no max-pool window has a tie within finite-difference eps."""
    return (rng.permutation(int(np.prod(shape))).reshape(shape) * 0.05 - 1.0).astype(np.float64)


PADDINGS = ("SAME", "VALID")
STRIDES = ((1, 1), (2, 2))
KERNELS = ((3, 3), (1, 3), (3, 1), (2, 2))


# ---------------------------------------------------------------------------- Conv2D
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("strides", STRIDES + ((1, 2),))
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("channels", [(2, 3), (3, 2), (1, 3)])  # each kernel path (see _output_side)
def test_conv2d_matches_loop_reference(padding, strides, kernel, channels, rng):
    x = rng.standard_normal((2, 5, 7, channels[0]))
    f = rng.standard_normal(kernel + channels)
    got = run(lambda x, f: conv2d(x, f, strides, padding), x=x, f=f)
    np.testing.assert_allclose(got, ref_conv2d(x, f, strides, padding), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("strides", STRIDES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_conv2d_gradients(padding, strides, kernel, rng):
    x = rng.standard_normal((2, 5, 6, 2))
    f = rng.standard_normal(kernel + (2, 3))
    check_gradients(lambda x, f: conv2d(x, f, strides, padding), {"x": x, "f": f}, max_elements=40)


@pytest.mark.parametrize("channels", [(3, 1), (1, 3)])
@pytest.mark.parametrize("strides", STRIDES)
def test_conv2d_gradients_on_the_other_kernel_paths(channels, strides, rng):
    x = rng.standard_normal((2, 6, 5, channels[0]))
    f = rng.standard_normal((3, 2) + channels)
    for padding in PADDINGS:
        check_gradients(lambda x, f: conv2d(x, f, strides, padding), {"x": x, "f": f}, max_elements=40)


def test_one_by_one_conv_and_gradients(rng):
    x, f = rng.standard_normal((2, 5, 4, 3)), rng.standard_normal((1, 1, 3, 2))
    for strides in ((1, 1), (2, 2), (2, 3)):
        for padding in PADDINGS:
            got = run(lambda x, f: conv2d(x, f, strides, padding), x=x, f=f)
            np.testing.assert_allclose(got, ref_conv2d(x, f, strides, padding), rtol=1e-12)
        check_gradients(lambda x, f: conv2d(x, f, strides), {"x": x, "f": f}, max_elements=30)


def test_backprops_are_differentiable(rng):
    """Second derivatives: both backprops are linear in each argument and have gradients."""
    x, f = rng.standard_normal((2, 5, 4, 2)), rng.standard_normal((3, 2, 2, 3))
    dy = rng.standard_normal((2, 3, 2, 3))
    check_gradients(lambda dy, f, x: conv2d_backprop_input(dy, f, x, 2, "SAME"),
                    {"dy": dy, "f": f, "x": x}, wrt=["dy", "f"], max_elements=30)
    check_gradients(lambda x, dy, f: conv2d_backprop_filter(x, dy, f, 2, "SAME"),
                    {"x": x, "dy": dy, "f": f}, wrt=["x", "dy"], max_elements=30)


def test_float32_stays_float32(rng):
    x = rng.standard_normal((2, 6, 5, 4)).astype(np.float32)
    f = rng.standard_normal((3, 3, 4, 2)).astype(np.float32)

    def build(x, f):
        y = conv2d(x, f)
        return [y, max_pool(y, 2, 2, "SAME"), avg_pool(y, 3, 1, "SAME")] + fc.gradients(
            max_pool(y, 2, 2, "SAME") * avg_pool(y, 2, 2, "SAME"), [x, f])

    outs = run(build, x=x, f=f)
    assert all(o.dtype == np.float32 for o in outs)
    np.testing.assert_allclose(outs[0], ref_conv2d(x.astype(np.float64), f.astype(np.float64), (1, 1),
                                                   "SAME"), rtol=1e-4, atol=1e-5)


def test_unknown_batch_dimension(rng):
    x, f = rng.standard_normal((3, 6, 5, 2)), rng.standard_normal((3, 3, 2, 4))
    g = fc.Graph()
    with g.as_default():
        px = fc.placeholder("float64", (None, 6, 5, 2), name="x")
        pf = fc.placeholder("float64", f.shape, name="f")
        y = conv2d(px, pf, 2, "SAME")
        p = avg_pool(max_pool(y, 2, 1, "SAME"), 2, 1, "VALID")
        assert y.shape == (None, 3, 3, 4) and p.shape == (None, 2, 2, 4)
        dx, df = fc.gradients(p, [px, pf])
        assert dx.shape == (None, 6, 5, 2) and df.shape == (3, 3, 2, 4)
    sess = fc.Session(g, store=fc.ContainerStore())
    for batch in (3, 1):
        yv, dxv, dfv = sess.run([y, dx, df], {px: x[:batch], pf: f})
        np.testing.assert_allclose(yv, ref_conv2d(x[:batch], f, (2, 2), "SAME"), rtol=1e-12)
        assert dxv.shape == (batch, 6, 5, 2) and dfv.shape == f.shape


def test_channel_mismatch_names_both_inputs():
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (None, 8, 8, 3), name="images")
        w = fc.placeholder("float32", (3, 3, 4, 16), name="kernel")
        with pytest.raises(fc.GraphError, match=r"3 channels.*expects 4.*'images:0'.*'kernel:0'"):
            conv2d(x, w, name="conv")


@pytest.mark.parametrize("bad, match", [
    (dict(padding="FULL"), "padding must be 'SAME' or 'VALID'"),
    (dict(strides=(0, 1)), "strides must be two positive ints"),
])
def test_bad_attributes_are_graph_errors(bad, match):
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (1, 8, 8, 3), name="x")
        w = fc.placeholder("float32", (3, 3, 3, 2), name="w")
        with pytest.raises(fc.GraphError, match=match):
            conv2d(x, w, **bad)
        with pytest.raises(fc.GraphError, match="does not fit"):
            conv2d(x, fc.placeholder("float32", (9, 3, 3, 2)), padding="VALID")
        with pytest.raises(fc.GraphError, match="dtypes differ"):
            conv2d(x, fc.placeholder("float64", (3, 3, 3, 2)))


def test_costs_count_flops():
    f32 = "float32"
    x, f, y = (None, 35, 35, 288), (3, 3, 288, 64), (None, 35, 35, 64)
    flops = 2 * 8 * 35 * 35 * 3 * 3 * 288 * 64
    attrs = {"strides": (1, 1), "padding": "SAME"}
    spec = lambda s: TensorSpec(s, f32)  # noqa: E731
    assert get_op("Conv2D").estimate([spec(x), spec(f)], [spec(y)], attrs, batch=8)[0] == flops
    backprop_input, backprop_filter = get_op("Conv2DBackpropInput"), get_op("Conv2DBackpropFilter")
    assert backprop_input.estimate([spec(y), spec(f), spec(x)], [spec(x)], attrs, 8)[0] == flops
    assert backprop_filter.estimate([spec(x), spec(y), spec(f)], [spec(f)], attrs, 8)[0] == flops
    pool = {"ksize": (3, 3), "strides": (2, 2), "padding": "VALID"}
    assert get_op("MaxPool").estimate([spec((2, 9, 9, 4))], [spec((2, 4, 4, 4))], pool)[0] == 2 * 16 * 4 * 9


# ---------------------------------------------------------------------------- pooling
POOLS = [((2, 2), (2, 2)), ((3, 3), (2, 2)), ((3, 2), (1, 1)), ((2, 3), (1, 2))]


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("ksize, strides", POOLS)
def test_pools_match_loop_reference_and_gradients(padding, ksize, strides, rng):
    x = distinct(rng, (2, 5, 6, 2))
    mx, av = run(lambda x: [max_pool(x, ksize, strides, padding), avg_pool(x, ksize, strides, padding)], x=x)
    np.testing.assert_array_equal(mx, ref_pool(x, ksize, strides, padding, max))
    mean = ref_pool(x, ksize, strides, padding, lambda v: sum(v) / len(v))
    np.testing.assert_allclose(av, mean, rtol=1e-12)
    check_gradients(lambda x: max_pool(x, ksize, strides, padding), {"x": x}, max_elements=40)
    check_gradients(lambda x: avg_pool(x, ksize, strides, padding), {"x": x}, max_elements=40)


def test_avg_pool_same_divides_by_valid_elements():
    x = np.ones((1, 3, 3, 1))
    out = run(lambda x: avg_pool(x, 3, 1, "SAME"), x=x)
    np.testing.assert_allclose(out, np.ones((1, 3, 3, 1)))  # a zero-padded mean would give 4/9 at corners
    grad = run(lambda x: fc.gradients(avg_pool(x, 3, 1, "SAME"), [x])[0], x=x)
    # d(sum of outputs)/dx: each output window divides by its own count (4, 6 or 9).
    corner, edge, centre = 1 / 4 + 2 / 6 + 1 / 9, 2 / 4 + 3 / 6 + 1 / 9, 4 / 4 + 4 / 6 + 1 / 9
    np.testing.assert_allclose(grad[0, :, :, 0], [[corner, edge, corner], [edge, centre, edge],
                                                  [corner, edge, corner]])


def test_max_pool_ties_go_to_the_first_maximum():
    x = np.array([[3.0, 5.0, 1.0], [5.0, 2.0, 5.0], [0.0, 5.0, 5.0]]).reshape(1, 3, 3, 1)
    dy = np.array([[1.0, 10.0], [100.0, 1000.0]]).reshape(1, 2, 2, 1)
    dx = run(lambda x, dy: max_pool_grad(x, max_pool(x, 2, 1, "VALID"), dy, 2, 1, "VALID"), x=x, dy=dy)
    # Every window's max is 5; each routes to its first 5 in row-major order (the top two to the same one).
    np.testing.assert_array_equal(dx[0, :, :, 0], [[0, 1 + 10, 0], [100, 0, 1000], [0, 0, 0]])


def test_avg_pool_grad_is_differentiable(rng):
    dy, x = rng.standard_normal((2, 3, 3, 2)), rng.standard_normal((2, 5, 6, 2))
    check_gradients(lambda dy, x: avg_pool_grad(dy, x, 3, 2, "SAME"), {"dy": dy, "x": x}, wrt=["dy"],
                    max_elements=30)


def test_cpu_batch_chunks_match_whole_batch(monkeypatch, rng):
    """The cpu kernels work a few images at a time; with chunks of one image they must agree with
    the loop references and the gradient checker all the same."""
    from flowctl.kernels import conv as kernels

    monkeypatch.setattr(kernels, "GEMM_ROWS", 1)
    monkeypatch.setattr(kernels, "POOL_ELEMENTS", 1)
    x, f = rng.standard_normal((3, 5, 6, 2)), rng.standard_normal((3, 2, 2, 3))
    y, mx = run(lambda x, f: [conv2d(x, f, 2, "SAME"), max_pool(x, 3, 2, "SAME")], x=x, f=f)
    np.testing.assert_allclose(y, ref_conv2d(x, f, (2, 2), "SAME"), rtol=1e-12)
    np.testing.assert_array_equal(mx, ref_pool(x, (3, 3), (2, 2), "SAME", max))
    check_gradients(lambda x, f: conv2d(x, f, 1, "SAME"), {"x": x, "f": f}, max_elements=30)
    xd = distinct(rng, (3, 5, 6, 2))
    check_gradients(lambda x: max_pool(x, 3, 2, "SAME") + avg_pool(x, 3, 2, "SAME"), {"x": xd},
                    max_elements=30)


def _clear_maxima(feeds):
    """Whether every 2x2 max-pool window of the test's second convolution (float64, every stride
    and padding) has its largest value clear of the next: by 8 TF32 roundoffs of the output's rms.
    Computed in TF32 the convolution is off by about 0.8 of one (emulated), so two of its values
    by about 1.1: a window closer than about 7 of those could pick another maximum on a GPU than
    on the host, and route the gradient elsewhere -- a difference of the gradients' own size."""
    def gap(vals):
        top = sorted(vals)[-2:]
        return top[1] - top[0] if len(top) == 2 else np.inf

    x, f, g = (feeds[k].astype(np.float64) for k in ("x", "f", "g"))
    for strides, padding in itertools.product(STRIDES, PADDINGS):
        z = ref_conv2d(ref_conv2d(x, f, strides, padding), g, (1, 1), padding)
        if ref_pool(z, (2, 2), strides, padding, gap).min() < 8 * TF32_ROUNDOFF * np.sqrt(np.mean(z ** 2)):
            return False
    return True


@pytest.mark.gpu
def test_gpu_kernels_match_numpy(rng):
    while True:  # about 8 draws: a window within the margin turns up every few hundred
        feeds_np = {"x": rng.standard_normal((2, 11, 13, 5)).astype(np.float32),
                    "f": rng.standard_normal((3, 2, 5, 4)).astype(np.float32),
                    "g": rng.standard_normal((1, 3, 4, 2)).astype(np.float32)}
        if _clear_maxima(feeds_np):
            break
    g = fc.Graph()
    with g.as_default():
        phs = {k: fc.placeholder("float32", v.shape, name=k) for k, v in feeds_np.items()}
        outs = []
        for strides, padding in itertools.product(STRIDES, PADDINGS):
            y = conv2d(phs["x"], phs["f"], strides, padding)
            z = conv2d(y, phs["g"], 1, padding)
            p = max_pool(z, 2, strides, padding) * avg_pool(z, 2, strides, padding)
            outs += [y, p] + fc.gradients(p, [phs["x"], phs["f"], phs["g"]])
    feeds = {phs[k]: v for k, v in feeds_np.items()}
    cpu = fc.Session(g, store=fc.ContainerStore()).run(outs, feeds)
    gpu = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(outs, feeds)
    # The convolutions' products run as TF32 on a GPU by default (tests/precision.py): the first
    # conv alone differs by 7e-3 (a sum of 30 products of order one). The deepest products are the
    # filter gradients, summed over the 2 x 11 x 13 = 286 output positions; 1e-4 stays the floor
    # (an IEEE run's chained products and pools).
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        assert_fp32_close(b, a, k=2 * 11 * 13, floor=1e-4, err_msg=f"output {i}")
