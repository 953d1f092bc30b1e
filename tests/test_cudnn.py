"""The cuDNN kernels (flowctl/kernels/cuda/cudnn.py): their pure-Python parts and the fallback to the
generic kernels run anywhere; the comparisons with the generic cupy kernels need a GPU (`gpu`)."""
from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest

from flowctl.kernels import conv as gconv
from flowctl.kernels import nn as gnn
from flowctl.kernels.cuda import cudnn as cd
from flowctl.kernels.cuda.jit import simulated_module
from flowctl.kernels.registry import KERNELS, set_fp32_products, fp32_products


# ---------------------------------------------------------------------------- geometry
@pytest.mark.parametrize("size,k,s", list(itertools.product([1, 2, 5, 7, 8, 17, 35, 147, 299], [1, 3, 5, 7],
                                                              [1, 2, 3])))
@pytest.mark.parametrize("padding", ["SAME", "VALID"])
def test_padding_matches_generic_and_cudnn_formula(size: int, k: int, s: int, padding: str) -> None:
    if padding == "VALID" and size < k:
        with pytest.raises(ValueError):
            cd.conv_padding(size, k, s, padding)
        return
    out, pre, post = cd.conv_padding(size, k, s, padding)
    g_out, g_pre = gconv.window(size, k, s, padding)
    assert (out, pre) == (g_out, g_pre)
    assert pre >= 0 and post >= 0
    # cuDNN's output size (FE _conv_fprop_dims: (x + pre + post - eff) // stride + 1) is TensorFlow's.
    assert (size + pre + post - k) // s + 1 == out
    if padding == "SAME":
        total = max((out - 1) * s + k - size, 0)
        assert pre + post == total and pre == total // 2 and post - pre in (0, 1)
    else:
        assert pre == post == 0


def _offsets(dims: list[int], strides: list[int]) -> np.ndarray:
    """Element offset of every index of `dims` (in order) under `strides`."""
    grids = np.indices(dims)
    return sum(g * st for g, st in zip(grids, strides))


def test_nhwc_description() -> None:
    n, h, w, c = 2, 3, 4, 5
    x = np.arange(n * h * w * c).reshape(n, h, w, c)
    dims, strides = cd.nhwc(n, c, h, w)
    off = _offsets(dims, strides)  # indexed [n, c, h, w]
    assert np.array_equal(x.reshape(-1)[off], x.transpose(0, 3, 1, 2))


def test_filter_descriptions() -> None:
    kh, kw, c, co = 3, 2, 4, 5
    f = np.arange(kh * kw * c * co).reshape(kh, kw, c, co)  # HWIO
    want = f.transpose(3, 2, 0, 1)  # [K, C, R, S]
    dims, strides = cd.filter_hwio(kh, kw, c, co)
    assert dims == [co, c, kh, kw]
    assert np.array_equal(f.reshape(-1)[_offsets(dims, strides)], want)
    krsc = np.ascontiguousarray(f.transpose(3, 0, 1, 2))  # what the kernel copies
    dims, strides = cd.filter_krsc(kh, kw, c, co)
    assert np.array_equal(krsc.reshape(-1)[_offsets(dims, strides)], want)
    # ... and wgrad's KRSC result goes back to HWIO by transpose(1, 2, 3, 0).
    assert np.array_equal(np.ascontiguousarray(krsc.transpose(1, 2, 3, 0)), f)


@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 4, 5), (2, 3, 5), (2, 2, 2, 3, 5)])
def test_bn_description(shape: tuple) -> None:
    x = np.arange(math.prod(shape)).reshape(shape)
    dims, strides = cd.bn_dims(shape)
    c = shape[-1]
    assert dims[1] == c and math.prod(dims) == x.size
    got = x.reshape(-1)[_offsets(dims, strides)]  # [N, C, H, W]
    # Per channel, the same multiset of values as x[..., c]: what batch statistics reduce over.
    for ch in range(c):
        assert np.array_equal(np.sort(got[:, ch].reshape(-1)), np.sort(x[..., ch].reshape(-1)))


def test_conv_geometry() -> None:
    g = cd.conv_geometry((2, 8, 9, 3), (3, 3, 3, 4), (2, 2), "SAME")
    assert (g["ho"], g["wo"], g["pre"], g["post"], g["stride"]) == (4, 5, (0, 1), (1, 1), (2, 2))
    with pytest.raises(ValueError):
        cd.conv_geometry((2, 8, 9, 3), (3, 3, 2, 4), (1, 1), "SAME")


def test_cache_key_and_notes() -> None:
    before = fp32_products()
    try:
        set_fp32_products("tf32")
        k1 = cd.cache_key("Conv2D", ((2, 8, 8, 3), (3, 3, 3, 4)), "float32", (1, 1), "SAME")
        assert k1 == cd.cache_key("Conv2D", [[2, 8, 8, 3], [3, 3, 3, 4]], "float32", [1, 1], "SAME")
        assert k1 != cd.cache_key("Conv2D", ((2, 8, 8, 3), (3, 3, 3, 4)), "float32", (1, 1), "VALID")
        assert k1 != cd.cache_key("Conv2D", ((2, 8, 8, 3), (3, 3, 3, 4)), "float32", (2, 2), "SAME")
        assert k1 != cd.cache_key("Conv2D", ((2, 8, 8, 3), (3, 3, 3, 4)), "float16", (1, 1), "SAME")
        assert k1 != cd.cache_key("Conv2D", ((2, 8, 8, 3), (3, 3, 3, 4)), "float32", (1, 1), "SAME", device=1)
        assert k1 != cd.cache_key("Conv2DBackpropInput", ((2, 8, 8, 3), (3, 3, 3, 4)), "float32", (1, 1), "SAME")
        # a filter gradient's operands are x and dy: the filter's size must be in its key too
        g17 = cd.conv_geometry((4, 17, 17, 32), (1, 7, 32, 48), (1, 1), "SAME")
        g71 = cd.conv_geometry((4, 17, 17, 32), (7, 1, 32, 48), (1, 1), "SAME")
        assert cd.conv_geometry_key(g17) != cd.conv_geometry_key(g71)
        assert cd.precision_mode("float32") == "tf32" and cd.precision_mode("float16") == "float16"
        set_fp32_products("ieee")
        assert cd.cache_key("Conv2D", ((2, 8, 8, 3), (3, 3, 3, 4)), "float32", (1, 1), "SAME") != k1
        assert cd.deselected_notes("float32", "ieee", True) == ["NONDETERMINISTIC", "DOWN_CONVERT_INPUTS",
                                                                "TENSOR_CORE"]
        assert cd.deselected_notes("float32", "tf32", False) == ["DOWN_CONVERT_INPUTS"]
        assert cd.deselected_notes("float16", "float16", True) == ["NONDETERMINISTIC"]
    finally:
        set_fp32_products(before)


# ---------------------------------------------------------------------------- fallback
def test_registered_for_gpu_only() -> None:
    for op, fn in [("Conv2D", cd.conv2d_gpu), ("Conv2DBackpropInput", cd.conv2d_backprop_input_gpu),
                   ("Conv2DBackpropFilter", cd.conv2d_backprop_filter_gpu), ("FusedBatchNorm", cd.fused_batch_norm_gpu),
                   ("FusedBatchNormGrad", cd.fused_batch_norm_grad_gpu)]:
        assert KERNELS[(op, "gpu")] is fn
        assert KERNELS[(op, "cpu")] is not fn


def test_unavailable_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "simulated" in cd.unavailable(simulated_module())
    assert "not the GPU" in cd.unavailable(np)
    monkeypatch.setattr(cd, "ENABLED", False)
    assert "FLOWCTL_CUDNN=0" in cd.unavailable(SimpleNamespace(cupy=object()))


def test_missing_frontend_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cd._state, "cudnn", None)
    monkeypatch.setitem(cd._state, "import_error", "ModuleNotFoundError: No module named 'cudnn'")
    fake_gpu = SimpleNamespace(cupy=object(), simulated=False)
    assert "not importable" in cd.unavailable(fake_gpu)
    # The factory hands back the generic kernel (bound to the same xp and attrs; a bfloat16 call
    # widened to float32 on its way in, kernels/bf16.py).
    fn = cd.conv2d_gpu(fake_gpu, {"strides": (1, 1), "padding": "SAME"})
    assert getattr(fn, "__qualname__", "").startswith("conv2d_kernel")
    assert getattr(fn, "__wrapped__").__qualname__.startswith("conv2d_kernel")


@pytest.mark.parametrize("strides,padding,kshape", [((1, 1), "SAME", (3, 3)), ((2, 2), "VALID", (3, 3)),
                                                    ((2, 2), "SAME", (1, 1)), ((1, 1), "SAME", (1, 7))])
def test_simulated_xp_falls_back_to_generic_conv(rng: np.random.Generator, strides: tuple, padding: str,
                                                 kshape: tuple) -> None:
    xp = simulated_module()
    attrs = {"strides": strides, "padding": padding}
    x = rng.standard_normal((2, 9, 8, 3)).astype(np.float32)
    f = rng.standard_normal(kshape + (3, 4)).astype(np.float32)
    y = cd.conv2d_gpu(xp, attrs)(x, f)
    np.testing.assert_array_equal(y, gconv.conv2d_forward(np, x, f, strides, padding))
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx = cd.conv2d_backprop_input_gpu(xp, attrs)(dy, f, x)
    np.testing.assert_array_equal(dx, gconv.conv2d_backprop_input(np, dy, f, x.shape, strides, padding))
    df = cd.conv2d_backprop_filter_gpu(xp, attrs)(x, dy, f)
    np.testing.assert_array_equal(df, gconv.conv2d_backprop_filter(np, x, dy, f.shape, strides, padding))


@pytest.mark.parametrize("activation", ["none", "relu"])
def test_simulated_xp_falls_back_to_generic_batch_norm(rng: np.random.Generator, activation: str) -> None:
    xp = simulated_module()
    attrs = {"epsilon": 1e-3, "activation": activation}
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    scale = rng.standard_normal(5).astype(np.float32)
    offset = rng.standard_normal(5).astype(np.float32)
    y, mean, var = cd.fused_batch_norm_gpu(xp, attrs)(x, scale, offset)
    wy, wmean, wvar = gnn.batch_norm_forward(np, x, scale, offset, 1e-3, activation == "relu")
    for a, b in ((y, wy), (mean, wmean), (var, wvar)):
        np.testing.assert_array_equal(a, b)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    extra = (y,) if activation == "relu" else ()
    got = cd.fused_batch_norm_grad_gpu(xp, attrs)(dy, x, scale, mean, var, *extra)
    want = gnn.batch_norm_grad(np, dy, x, scale, mean, var, y if extra else None, (), 1e-3)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------- FE graph construction
class _FakeCupy:
    """Enough of cupy for building a graph's IR on a CPU (no validate, no plans)."""
    float32 = np.float32
    uint8 = np.uint8

    @staticmethod
    def empty(shape: object, dtype: object = None) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    @staticmethod
    def zeros(shape: object, dtype: object = None) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)


@pytest.fixture
def fe_ir_only(monkeypatch: pytest.MonkeyPatch) -> object:
    """The real frontend's builders up to (not including) validate(): checks every keyword this module
    passes to FE against the installed version, without a GPU."""
    cudnn = pytest.importorskip("cudnn")
    monkeypatch.setitem(cd._state, "cudnn", cudnn)
    seen = []

    def finish(cudnn_: object, cp: object, g: object, dtype: str, precision: str) -> tuple:
        seen.append(g)
        return np.empty(256, np.uint8), {"deselected_notes": cd.deselected_notes(dtype, precision, True)}

    monkeypatch.setattr(cd, "_finish", finish)
    monkeypatch.setattr(cd, "_handle", lambda cp: None)
    # numpy arrays have no .data.ptr: give the plan's scratch buffers one.
    monkeypatch.setattr(_FakeCupy, "zeros", staticmethod(lambda shape, dtype=None: SimpleNamespace(
        data=SimpleNamespace(ptr=0), nbytes=4)))
    return seen


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_conv_graph_ir_builds_with_installed_frontend(fe_ir_only: list, kind: str) -> None:
    geom = cd.conv_geometry((2, 9, 9, 8), (3, 1, 8, 16), (2, 1), "SAME")
    plan = cd._build_conv(kind, _FakeCupy, geom, "float32", "tf32")
    assert plan.info["filter_layout"] == "hwio"
    out = plan.slots["out"]
    want = {"fprop": [2, 16, 5, 9], "dgrad": [2, 8, 9, 9], "wgrad": [16, 8, 3, 1]}[kind]
    assert list(out.dim) == want
    node = fe_ir_only[0].nodes[0]
    assert node.params["pre_padding"] == [1, 0] and node.params["post_padding"] == [1, 0]


@pytest.mark.parametrize("relu", [False, True])
def test_bn_graph_ir_builds_with_installed_frontend(fe_ir_only: list, relu: bool) -> None:
    plan = cd._build_bn(_FakeCupy, (2, 5, 5, 16), "float16", 1e-3, relu, "float16")
    assert plan.info["relu_in_graph"] == relu and plan.info["scalars"] == "graph"
    assert list(plan.slots["y"].dim) == [2, 16, 5, 5]
    grad = cd._build_bn_grad(_FakeCupy, (2, 5, 5, 16), "float32", relu, "tf32")
    assert grad.info["relu_in_graph"] == relu and ("y" in grad.slots) == relu
    assert list(grad.slots["dx"].dim) == [2, 16, 5, 5]


# ---------------------------------------------------------------------------- GPU: against generic cupy
def _gpu() -> object:
    from flowctl.kernels.registry import array_module

    return array_module("gpu")


def _rel(a: object, b: object) -> float:
    import cupy as cp

    a, b = cp.asarray(a, dtype=cp.float32), cp.asarray(b, dtype=cp.float32)
    return float(cp.abs(a - b).max() / max(float(cp.abs(b).max()), 1e-30))


def _tol(k: int, dtype: str = "float32") -> float:
    """Max error relative to the largest value: TF32 rounding (2**-11) grows like sqrt(K) over a
    K-term sum; both the cuDNN and the generic (cuBLAS TF32) result carry it. bfloat16 adds its
    one rounding of each output (2**-9 relative, on both sides): the sums run in float32."""
    if dtype == "bfloat16":
        return 2.0 ** -8 + 2.0 ** -11 * math.sqrt(k) * 4
    unit = 2.0 ** -11 if dtype == "float32" else 2.0 ** -10
    return unit * math.sqrt(k) * 4 + 1e-6


CONV_CASES = [
    # (x shape NHWC, filter HWIO, strides, padding)
    ((4, 17, 17, 32), (3, 3, 32, 48), (1, 1), "SAME"),
    ((4, 17, 17, 32), (3, 3, 32, 48), (2, 2), "VALID"),
    ((4, 16, 16, 24), (3, 3, 24, 32), (2, 2), "SAME"),  # asymmetric padding (0 before, 1 after)
    ((4, 17, 17, 64), (1, 1, 64, 96), (1, 1), "SAME"),
    ((4, 17, 17, 64), (1, 1, 64, 32), (2, 2), "VALID"),
    ((4, 17, 17, 32), (1, 7, 32, 48), (1, 1), "SAME"),
    ((4, 17, 17, 32), (7, 1, 32, 48), (1, 1), "SAME"),
    ((2, 35, 35, 3), (3, 3, 3, 32), (2, 2), "VALID"),  # 3 input channels (the stem)
    ((2, 8, 8, 2048), (1, 1, 2048, 320), (1, 1), "SAME"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gpu_conv_matches_generic(case: tuple, dtype: str) -> None:
    """cuDNN against the generic kernel (for bfloat16: the generic kernel in float32, rounded --
    the reference every bfloat16 kernel answers to, kernels/bf16.py)."""
    import cupy as cp

    from flowctl.kernels.bf16 import computed_in_float32

    xp = _gpu()
    ref = computed_in_float32 if dtype == "bfloat16" else (lambda fn: fn)
    x_shape, f_shape, strides, padding = case
    attrs = {"strides": strides, "padding": padding}
    rs = np.random.default_rng(0)
    x = cp.asarray(rs.standard_normal(x_shape).astype(dtype))
    f = cp.asarray((rs.standard_normal(f_shape) / math.sqrt(f_shape[0] * f_shape[1] * f_shape[2])).astype(dtype))
    y = cd.conv2d_gpu(xp, attrs)(x, f)
    want = ref(gconv.conv2d_kernel(xp, attrs))(x, f)
    assert y.shape == want.shape and y.dtype == want.dtype
    k = f_shape[0] * f_shape[1] * f_shape[2]
    assert _rel(y, want) < _tol(k, dtype)
    dy = cp.asarray(rs.standard_normal(y.shape).astype(dtype))
    dx = cd.conv2d_backprop_input_gpu(xp, attrs)(dy, f, x)
    want = ref(gconv.conv2d_backprop_input_kernel(xp, attrs))(dy, f, x)
    assert dx.shape == want.shape
    assert _rel(dx, want) < _tol(f_shape[0] * f_shape[1] * f_shape[3], dtype)
    df = cd.conv2d_backprop_filter_gpu(xp, attrs)(x, dy, f)
    want = ref(gconv.conv2d_backprop_filter_kernel(xp, attrs))(x, dy, f)
    assert df.shape == want.shape == f.shape
    assert _rel(df, want) < _tol(y.shape[0] * y.shape[1] * y.shape[2], dtype)
    # A second call reuses the graph (and gives the same bits: deterministic engines).
    np.testing.assert_array_equal(cp.asnumpy(cd.conv2d_backprop_filter_gpu(xp, attrs)(x, dy, f)), cp.asnumpy(df))


@pytest.mark.gpu
def test_gpu_conv_uses_cudnn() -> None:
    """Fails with cuDNN's reasons when a convolution fell back (the numeric tests pass either way)."""
    import cupy as cp

    cd.reset()
    xp = _gpu()
    attrs = {"strides": (1, 1), "padding": "SAME"}
    x = cp.ones((2, 9, 9, 16), cp.float32)
    f = cp.ones((3, 3, 16, 32), cp.float32)
    y = cd.conv2d_gpu(xp, attrs)(x, f)
    cd.conv2d_backprop_input_gpu(xp, attrs)(y, f, x)
    cd.conv2d_backprop_filter_gpu(xp, attrs)(x, y, f)
    st = cd.status()
    print(st)
    assert not st["failed"] and not st["fallbacks"], st
    assert len(st["graphs"]) == 3, st


BN_SHAPES = [(2, 5, 5, 32), (8, 17, 17, 64), (4, 35, 35, 48), (64, 96)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", BN_SHAPES)
@pytest.mark.parametrize("activation", ["none", "relu"])
def test_gpu_batch_norm_matches_generic(shape: tuple, activation: str) -> None:
    import cupy as cp

    xp = _gpu()
    attrs = {"epsilon": 1e-3, "activation": activation}
    rs = np.random.default_rng(1)
    c = shape[-1]
    x = cp.asarray((rs.standard_normal(shape) * 2 + 0.5).astype(np.float32))
    scale = cp.asarray(rs.uniform(0.5, 1.5, c).astype(np.float32))
    offset = cp.asarray(rs.standard_normal(c).astype(np.float32))
    got = cd.fused_batch_norm_gpu(xp, attrs)(x, scale, offset)
    want = gnn.fused_batch_norm(xp, attrs)(x, scale, offset)
    for name, a, b in zip(("y", "mean", "var"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert _rel(a, b) < 2e-5, name  # var: biased (at M=50 the unbiased one is 2% off)
    y = got[0]
    dy = cp.asarray(rs.standard_normal(shape).astype(np.float32))
    extra = (y,) if activation == "relu" else ()
    got = cd.fused_batch_norm_grad_gpu(xp, attrs)(dy, x, scale, got[1], got[2], *extra)
    want = gnn.fused_batch_norm_grad(xp, attrs)(dy, x, scale, want[1], want[2], *((want[0],) if extra else ()))
    for name, a, b in zip(("dx", "dscale", "doffset"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert _rel(a, b) < 1e-4, name


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["none", "relu"])
def test_gpu_batch_norm_on_bfloat16_matches_the_widened_reference(activation: str) -> None:
    """bf16 training's batch norm: bfloat16 x, y, dy, dx through cuDNN beside float32 parameters
    and statistics, against the generic kernel in float32 with y and dx rounded (kernels/bf16.py)."""
    import cupy as cp

    from flowctl.kernels.bf16 import computed_in_float32

    xp = _gpu()
    attrs = {"epsilon": 1e-3, "activation": activation}
    rs = np.random.default_rng(4)
    shape = (8, 7, 7, 32)
    x = cp.asarray((rs.standard_normal(shape) * 2 + 0.5).astype("bfloat16"))
    scale = cp.asarray(rs.uniform(0.5, 1.5, 32).astype(np.float32))
    offset = cp.asarray(rs.standard_normal(32).astype(np.float32))
    got = cd.fused_batch_norm_gpu(xp, attrs)(x, scale, offset)
    ref = computed_in_float32(gnn.fused_batch_norm(xp, attrs), (True, False, False))
    want = ref(x, scale, offset)
    assert [str(a.dtype) for a in got] == ["bfloat16", "float32", "float32"]
    for name, a, b, tol in zip(("y", "mean", "var"), got, want, (2.0 ** -7, 2e-5, 2e-5)):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert _rel(a, b) < tol, name
    dy = cp.asarray(rs.standard_normal(shape).astype("bfloat16"))
    extra = (got[0],) if activation == "relu" else ()
    grads = cd.fused_batch_norm_grad_gpu(xp, attrs)(dy, x, scale, got[1], got[2], *extra)
    gref = computed_in_float32(gnn.fused_batch_norm_grad(xp, attrs), (True, False, False))
    want = gref(dy, x, scale, got[1], got[2], *extra)
    assert [str(a.dtype) for a in grads] == ["bfloat16", "float32", "float32"]
    for name, a, b in zip(("dx", "dscale", "doffset"), grads, want):
        assert _rel(a, b) < 2.0 ** -7, name


@pytest.mark.gpu
def test_gpu_batch_norm_with_stat_grads_falls_back() -> None:
    import cupy as cp

    xp = _gpu()
    attrs = {"epsilon": 1e-3, "activation": "none"}
    x = cp.asarray(np.random.default_rng(2).standard_normal((4, 3, 3, 8)).astype(np.float32))
    one = cp.ones(8, cp.float32)
    y, mean, var = cd.fused_batch_norm_gpu(xp, attrs)(x, one, one * 0)
    got = cd.fused_batch_norm_grad_gpu(xp, attrs)(x, x, one, mean, var, one, one)
    want = gnn.fused_batch_norm_grad(xp, attrs)(x, x, one, mean, var, one, one)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(cp.asnumpy(a), cp.asnumpy(b))


@pytest.mark.gpu
def test_gpu_batch_norm_uses_cudnn() -> None:
    """Fails with cuDNN's reasons when float32 batch norm fell back (the numeric tests pass either way)."""
    import cupy as cp

    cd.reset()
    xp = _gpu()
    for act in ("none", "relu"):
        attrs = {"epsilon": 1e-3, "activation": act}
        x = cp.ones((2, 5, 5, 32), cp.float32)
        one = cp.ones(32, cp.float32)
        y, m, v = cd.fused_batch_norm_gpu(xp, attrs)(x, one, one)
        cd.fused_batch_norm_grad_gpu(xp, attrs)(x, x, one, m, v, *((y,) if act == "relu" else ()))
    st = cd.status()
    print(st)
    assert not st["failed"] and not st["fallbacks"], st


@pytest.mark.gpu
def test_gpu_conv_inside_capture_replays() -> None:
    """Build eagerly, then capture the same call on a stream and replay it: same output."""
    import cupy as cp

    xp = _gpu()
    attrs = {"strides": (1, 1), "padding": "SAME"}
    rs = np.random.default_rng(3)
    x = cp.asarray(rs.standard_normal((2, 9, 9, 16)).astype(np.float32))
    f = cp.asarray(rs.standard_normal((3, 3, 16, 32)).astype(np.float32))
    fn = cd.conv2d_gpu(xp, attrs)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        ref = fn(x, f)  # eager warm-up builds the graph
        s.synchronize()
        s.begin_capture()
        y = fn(x, f)
        graph = s.end_capture()
        graph.launch()
        s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(y), cp.asnumpy(ref))
