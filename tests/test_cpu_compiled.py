"""The compiled CPU kernels (flowctl/kernels/cpu, numba) against the array-module reference kernels
they stand in for: random shapes, float32 within 1e-5 and float64 within 1e-12 (relative to the
output's scale), gradients included; the same bits whatever the intra-op thread count; the
registry's rule picks them only where they apply, and `reference_kernels()` turns them off."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from flowctl.engine.shapes import TensorSpec  # noqa: E402
from flowctl.kernels import intra  # noqa: E402
from flowctl.kernels.registry import KERNELS, VARIANTS, bind, chosen, reference_kernels  # noqa: E402

TOL = {"float32": 1e-5, "float64": 1e-12}


def _specs(*arrays: np.ndarray) -> list[TensorSpec]:
    return [TensorSpec(tuple(a.shape), str(a.dtype)) for a in arrays]


def _pair(op: str, attrs: dict, *arrays: np.ndarray) -> tuple:
    """(compiled result, reference result) of op on arrays."""
    v = chosen(op, "cpu", attrs, _specs(*arrays))
    assert v is not None and v.name == "numba", f"{op}: the numba variant was not chosen"
    fast = bind(op, "cpu", dict(attrs), _specs(*arrays))(*arrays)
    ref = KERNELS[(op, "cpu")](np, dict(attrs))(*arrays)
    return fast, ref


def _close(fast, ref, dtype: str) -> None:
    fast = fast if isinstance(fast, tuple) else (fast,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    assert len(fast) == len(ref)
    for a, b in zip(fast, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        scale = max(float(np.max(np.abs(b))), 1e-30)
        np.testing.assert_allclose(a, b, rtol=TOL[dtype], atol=TOL[dtype] * scale)


BN_SHAPES = [(8, 7, 7, 32), (3, 5, 5, 3), (2, 17, 13, 64), (64, 10), (1, 35, 35, 288)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", BN_SHAPES)
@pytest.mark.parametrize("relu", [False, True])
def test_batch_norm_forward_and_gradient_match_the_reference(dtype: str, shape: tuple, relu: bool) -> None:
    rng = np.random.default_rng(hash((dtype, shape, relu)) % 2**32)
    c = shape[-1]
    # An offset mean well away from 0: a one-pass E[x^2] - E[x]^2 would lose digits here.
    x = (rng.standard_normal(shape) * 2 + 5).astype(dtype)
    scale = rng.uniform(0.5, 2, c).astype(dtype)
    offset = rng.standard_normal(c).astype(dtype)
    attrs = {"epsilon": 1e-3, "activation": "relu" if relu else "none"}
    fast, ref = _pair("FusedBatchNorm", attrs, x, scale, offset)
    _close(fast, ref, dtype)
    y, mean, var = ref
    dy = rng.standard_normal(shape).astype(dtype)
    rest = (y,) if relu else ()
    _close(*_pair("FusedBatchNormGrad", attrs, dy, x, scale, mean, var, *rest), dtype)
    # with the statistics' own gradients (the batch mean and variance used downstream)
    dmean, dvar = rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype)
    _close(*_pair("FusedBatchNormGrad", attrs, dy, x, scale, mean, var, *rest, dmean, dvar), dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("relu", [False, True])
def test_channel_affine_matches_the_reference(dtype: str, relu: bool) -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 9, 9, 48)).astype(dtype)
    scale, shift = rng.standard_normal(48).astype(dtype), rng.standard_normal(48).astype(dtype)
    fast, ref = _pair("ChannelAffine", {"activation": "relu" if relu else "none"}, x, scale, shift)
    np.testing.assert_array_equal(fast, ref)  # the same two roundings per element


POOLS = [((3, 3), (2, 2), "VALID", (2, 15, 15, 8)), ((3, 3), (1, 1), "SAME", (3, 9, 11, 5)),
         ((2, 2), (2, 2), "SAME", (2, 7, 7, 4)), ((8, 8), (1, 1), "VALID", (2, 8, 8, 16)),
         ((3, 3), (2, 2), "SAME", (1, 10, 6, 3)),
         # windows inside the input (MaxPool's separable passes): uneven windows and strides, and a
         # SAME that pads nothing
         ((3, 2), (1, 2), "VALID", (2, 9, 10, 6)), ((1, 3), (2, 1), "VALID", (3, 7, 8, 4)),
         ((3, 3), (3, 3), "SAME", (2, 9, 9, 4))]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("ksize,strides,padding,shape", POOLS)
def test_pools_and_their_gradients_match_the_reference(dtype, ksize, strides, padding, shape) -> None:
    rng = np.random.default_rng(7)
    # Values from a small set: ties inside a window, which MaxPoolGrad must route to the first maximum.
    x = rng.integers(-3, 4, shape).astype(dtype)
    attrs = {"ksize": ksize, "strides": strides, "padding": padding}
    fast, ref = _pair("MaxPool", attrs, x)
    np.testing.assert_array_equal(fast, ref)  # a max is exact
    dy = rng.standard_normal(ref.shape).astype(dtype)
    _close(*_pair("MaxPoolGrad", attrs, x, ref, dy), dtype)
    x = rng.standard_normal(shape).astype(dtype)
    fast, ref = _pair("AvgPool", attrs, x)
    _close(fast, ref, dtype)
    _close(*_pair("AvgPoolGrad", attrs, rng.standard_normal(ref.shape).astype(dtype), x), dtype)


CONVS = [((2, 9, 9, 6), (3, 3, 6, 5), (1, 1), "SAME"), ((2, 11, 10, 4), (3, 3, 4, 8), (2, 2), "VALID"),
         ((2, 8, 8, 5), (1, 7, 5, 6), (1, 1), "SAME"), ((1, 9, 9, 3), (5, 5, 3, 4), (1, 1), "SAME"),
         ((2, 12, 12, 4), (3, 3, 4, 4), (2, 2), "SAME"), ((3, 7, 7, 8), (7, 1, 8, 3), (1, 1), "SAME"),
         ((2, 48, 48, 3), (3, 3, 3, 4), (1, 1), "SAME"), ((2, 95, 95, 3), (3, 3, 3, 5), (2, 2), "VALID")]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("x_shape,f_shape,strides,padding", CONVS)
def test_the_input_gradient_with_a_compiled_col2im_is_the_references_bits(dtype, x_shape, f_shape, strides,
                                                                           padding) -> None:
    """The same pieces, GEMMs and order of additions as the reference: its bits exactly (the
    strided and Co > C cases take col2im, the others the transposed convolution)."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal(x_shape).astype(dtype)
    f = rng.standard_normal(f_shape).astype(dtype)
    attrs = {"strides": strides, "padding": padding}
    y = KERNELS[("Conv2D", "cpu")](np, dict(attrs))(x, f)
    dy = rng.standard_normal(y.shape).astype(dtype)
    np.testing.assert_array_equal(*_pair("Conv2DBackpropInput", attrs, dy, f, x))


def test_max_pool_keeps_a_nan_as_the_reference_does() -> None:
    x = np.arange(2 * 4 * 4 * 2, dtype="float32").reshape(2, 4, 4, 2)
    x[0, 1, 1, 0] = np.nan
    attrs = {"ksize": (2, 2), "strides": (2, 2), "padding": "VALID"}
    fast, ref = _pair("MaxPool", attrs, x)
    np.testing.assert_array_equal(fast, ref)
    assert np.isnan(fast[0, 0, 0, 0])


def test_results_do_not_depend_on_the_thread_count() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 35, 35, 96)).astype("float32")  # 80 pieces: runs on the threads
    scale, offset = np.ones(96, "float32"), np.zeros(96, "float32")
    attrs = {"epsilon": 1e-3, "activation": "relu"}
    fn = bind("FusedBatchNorm", "cpu", attrs, _specs(x, scale, offset))
    pool = bind("MaxPoolGrad", "cpu", {"ksize": (3, 3), "strides": (1, 1), "padding": "SAME"},
                _specs(x, x, x))
    maxpool = bind("MaxPool", "cpu", {"ksize": (3, 3), "strides": (2, 2), "padding": "VALID"}, _specs(x))
    with intra.fixed(1):
        one = fn(x, scale, offset), pool(x, x, x), maxpool(x)
    with intra.fixed(2):
        two = fn(x, scale, offset), pool(x, x, x), maxpool(x)
    for a, b in zip([*one[0], *one[1:]], [*two[0], *two[1:]]):
        assert a.tobytes() == b.tobytes()


def test_the_rule_picks_compiled_kernels_only_where_they_apply() -> None:
    attrs = {"epsilon": 1e-3, "activation": "none"}
    f32 = [TensorSpec((None, 4, 4, 8), "float32"), TensorSpec((8,), "float32"), TensorSpec((8,), "float32")]
    f16 = [TensorSpec((None, 4, 4, 8), "float16"), TensorSpec((8,), "float32"), TensorSpec((8,), "float32")]
    assert chosen("FusedBatchNorm", "cpu", attrs, f32).name == "numba"
    assert chosen("FusedBatchNorm", "cpu", attrs, f16) is None  # half precision stays on numpy
    assert chosen("FusedBatchNorm", "cpu", attrs, None) is None  # no specs: the reference
    assert chosen("FusedBatchNorm", "gpu", attrs, f32) is None
    with reference_kernels():
        assert chosen("FusedBatchNorm", "cpu", attrs, f32) is None
    assert {("FusedBatchNorm", "cpu"), ("MaxPoolGrad", "cpu")} <= set(VARIANTS)


_RUN_ONCE = """
import numpy as np
from flowctl.engine.shapes import TensorSpec
from flowctl.kernels.registry import bind
from flowctl.kernels.cpu import batchnorm
x = np.ones((2, 3, 3, 4), "float32"); s = np.ones(4, "float32")
specs = [TensorSpec(a.shape, "float32") for a in (x, s, s)]
bind("FusedBatchNorm", "cpu", {"epsilon": 1e-3, "activation": "relu"}, specs)(x, s, s)
from flowctl.kernels.cpu import lstm_cell, softmax
lstm_cell.lstm_cell_grad(*(np.ones((2, 3), "float32") for _ in range(2)), *lstm_cell.lstm_cell(
    np.ones((2, 12), "float32"), np.ones((2, 12), "float32"), np.ones((2, 3), "float32"), 1.0)[2:],
    np.ones((2, 3), "float32"), np.ones((2, 3), "float32"))
logits = np.zeros((3, 40), "float32"); labels = np.zeros(3, "int64")
bind("SparseSoftmaxCrossEntropyWithLogits", "cpu", {}, [TensorSpec((3, 40), "float32"), TensorSpec((3,), "int64")])(
    logits, labels)
from flowctl.kernels.cpu import dropout
dropout.dropout(np.ones(4, "float32"), np.random.Generator(np.random.Philox(1)), 0.5)
# (helpers that call other compiled helpers: the ones a closure-defined kernel used to miss on)
for k in (batchnorm._kernels()[0], *lstm_cell._kernels(), softmax._kernels()[1], dropout._kernel()):
    print(len(k.stats.cache_hits), len(k.stats.cache_misses))
"""


def test_a_second_process_loads_the_compiled_kernels_from_the_jit_cache(tmp_path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", _RUN_ONCE], env=env, capture_output=True, text=True, check=True)
            .stdout.split() for _ in range(2)]
    assert runs[0] == ["0", "1"] * 5  # compiled, and written to the cache
    assert runs[1] == ["1", "0"] * 5  # loaded from it: no compile
    assert any(p.suffix == ".nbi" for p in tmp_path.rglob("*"))


# ---------------------------------------------------------------------------- the LSTM cell
def test_the_cells_tanh_is_within_a_few_float32_ulp_of_tanh() -> None:
    """kernels/cpu/lstm_cell.py's rational tanh over [-12, 12] (past the clamp, and around 0): at
    most 6.6 ulp measured (near |x| = 6-8, where tanh is 1 - a few ulp; numpy's 1.4), never past +-1."""
    from flowctl.kernels.cpu import lstm_cell

    x = np.concatenate([np.linspace(-12, 12, 400_001), np.geomspace(1e-30, 1e-2, 1001)]).astype("float32")
    xw = np.zeros((1, 4 * x.size), "float32")
    xw[0, 2 * x.size:3 * x.size] = x  # the g gate: act's third quarter is tanh(xw's) at the first step
    _, _, act = lstm_cell.lstm_cell(xw, None, None, 0.0)
    got = act[0, 2 * x.size:3 * x.size].astype(np.float64)
    want = np.tanh(x.astype(np.float64))
    ulp = np.spacing(np.abs(want).astype("float32")).astype(np.float64)
    assert np.max(np.abs(got - want) / ulp) <= 8, np.max(np.abs(got - want) / ulp)
    assert np.all(np.abs(got) <= 1.0) and np.all(np.sign(got) == np.sign(want))


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("batch,units", [(20, 650), (3, 5), (1, 17)])
def test_the_lstm_cell_and_its_gradient_match_the_reference(batch, units, first) -> None:
    rng = np.random.default_rng(batch * 100 + units + first)
    xw = (rng.standard_normal((batch, 4 * units)) * 2).astype("float32")
    hw = rng.standard_normal((batch, 4 * units)).astype("float32")
    c_prev = rng.standard_normal((batch, units)).astype("float32")
    ins = (xw,) if first else (xw, hw, c_prev)
    fast, ref = _pair("LSTMBlockCell", {"forget_bias": 1.0}, *ins)
    _close(fast, ref, "float32")
    h, c, act = ref
    dh, dc = rng.standard_normal((2, batch, units)).astype("float32")
    grads = (dh, dc, act, c) if first else (dh, dc, act, c, c_prev)
    fast, ref = _pair("LSTMBlockCellGrad", {}, *grads)
    _close(fast, ref, "float32")


def test_the_compiled_cells_gradient_is_the_derivative_of_the_compiled_cell() -> None:
    """Central differences in float64 of the float32 cell's loss <dh, h> + <dc, c> against the
    compiled gradient, through xw, hw and c_prev (a few random directions)."""
    from flowctl.kernels.cpu import lstm_cell

    rng = np.random.default_rng(5)
    b, u = 4, 9
    xw, hw = (rng.standard_normal((b, 4 * u)) * 0.7 for _ in range(2))
    c_prev = rng.standard_normal((b, u))
    dh, dc = rng.standard_normal((2, b, u))

    def loss(xw, hw, c_prev):
        h, c, _ = lstm_cell.lstm_cell(xw.astype("float32"), hw.astype("float32"), c_prev.astype("float32"), 0.5)
        return float(np.sum(dh * h) + np.sum(dc * c))

    _, c, act = lstm_cell.lstm_cell(xw.astype("float32"), hw.astype("float32"), c_prev.astype("float32"), 0.5)
    dz, dc_prev = lstm_cell.lstm_cell_grad(dh.astype("float32"), dc.astype("float32"), act, c,
                                           c_prev.astype("float32"))
    eps = 1e-2
    for _ in range(4):
        v, w = rng.standard_normal((b, 4 * u)), rng.standard_normal((b, u))
        fd = (loss(xw + eps * v, hw + eps * v, c_prev + eps * w) - loss(xw - eps * v, hw - eps * v, c_prev - eps * w)) / (2 * eps)
        analytic = 2 * float(np.sum(dz * v)) + float(np.sum(dc_prev * w))  # z = xw + hw moved by 2v
        np.testing.assert_allclose(analytic, fd, rtol=2e-3)


def test_the_compiled_exp_is_within_an_ulp_of_float64s_and_keeps_its_edges() -> None:
    from flowctl.kernels.cpu.softmax import exp_nonpositive

    x = -np.concatenate([np.linspace(0, 87.3, 20_001), np.random.default_rng(5).uniform(0, 87.3, 20_000)])
    x = x.astype(np.float32)
    got, want = exp_nonpositive(x), np.exp(x.astype(np.float64))
    assert got.dtype == np.float32
    assert np.all(np.abs(got - want) <= np.spacing(want.astype(np.float32)))  # 1 ulp
    edges = exp_nonpositive(np.array([0.0, -0.0, -87.4, -100.0, -np.inf, np.nan], np.float32))
    assert edges[0] == 1 and edges[1] == 1 and list(edges[2:5]) == [0, 0, 0] and np.isnan(edges[5])


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 10_000, 10_007])
def test_the_softmax_sum_adds_in_float64_in_its_fixed_lanes(n: int) -> None:
    """kernels/cpu/softmax_jit.py's lane_sum: the same bits as its order written out in Python."""
    from flowctl.kernels.cpu.softmax_jit import float64_sum

    x = (np.random.default_rng(n).random(n) * 10).astype(np.float32)
    body, lanes = n - n % 16, [0.0] * 16
    for j in range(body):
        lanes[j % 16] += float(x[j])
    want = 0.0
    for lane in lanes:
        want += lane
    for j in range(body, n):
        want += float(x[j])
    assert float64_sum(x) == want
    assert abs(float64_sum(x) - float(np.sum(x, dtype=np.float64))) <= 1e-12 * max(want, 1.0)
    if n:
        x[n // 2] = np.nan
        assert np.isnan(float64_sum(x))


XENT_SHAPES = [(7, 5), (33, 100), (300, 3000), (5, 17), (2, 1)]


def _xent(logits: np.ndarray, labels: np.ndarray) -> tuple:
    op = "SparseSoftmaxCrossEntropyWithLogits"
    v = chosen(op, "cpu", {}, _specs(logits, labels))
    assert v is not None and v.name == "numba"
    return bind(op, "cpu", {}, _specs(logits, labels))(logits, labels)


@pytest.mark.parametrize("shape", XENT_SHAPES)
def test_sparse_xent_matches_the_reference_and_float64(shape: tuple) -> None:
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    logits = (4 * rng.standard_normal(shape)).astype(np.float32)
    labels = rng.integers(0, shape[1], shape[0]).astype(np.int32)
    fast, ref = _xent(logits, labels), KERNELS[("SparseSoftmaxCrossEntropyWithLogits", "cpu")](np, {})(logits, labels)
    _close(fast, ref, "float32")
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(1, keepdims=True))
    z = p.sum(1, keepdims=True)
    rows = np.arange(shape[0])
    np.testing.assert_allclose(fast[0], np.log(z[:, 0]) - (x[rows, labels] - x.max(1)), rtol=1e-6, atol=1e-6)
    p /= z
    p[rows, labels] -= 1
    np.testing.assert_allclose(fast[1], p, rtol=1e-6, atol=1e-7)


def test_sparse_xent_bits_do_not_depend_on_threads_and_into_writes_over_the_logits() -> None:
    from flowctl.kernels.registry import bind_into

    rng = np.random.default_rng(11)
    logits = (3 * rng.standard_normal((301, 517))).astype(np.float32)
    labels = rng.integers(0, 517, 301)
    runs = []
    for threads in (1, 2, 3):
        with intra.fixed(threads):
            runs.append(_xent(logits, labels))
    for loss, grad in runs[1:]:
        np.testing.assert_array_equal(loss, runs[0][0])
        np.testing.assert_array_equal(grad, runs[0][1])
    op = "SparseSoftmaxCrossEntropyWithLogits"
    own = logits.copy()
    loss, grad = bind_into(op, "cpu", {}, _specs(logits, labels))(0, own, labels)
    assert grad is own
    np.testing.assert_array_equal(loss, runs[0][0])
    np.testing.assert_array_equal(grad, runs[0][1])


def test_sparse_xent_edges_nan_rows_masked_logits_bad_labels_and_float64() -> None:
    logits = np.array([[0.0, 1.0, np.nan, 2.0], [1.0, -np.inf, 3.0, -np.inf]], np.float32)
    loss, grad = _xent(logits, np.array([0, 2]))
    assert np.all(np.isnan(grad[0])) and np.isnan(loss[0])
    assert grad[1, 1] == 0 and grad[1, 3] == 0  # a masked class gets exactly nothing
    q = np.exp(-2) / (1 + np.exp(-2))  # class 0 against class 2, two apart
    np.testing.assert_allclose(grad[1, [0, 2]], [q, (1 - q) - 1], rtol=1e-6)
    with pytest.raises(ValueError, match="label 4 .example 1. is out of range for 4 classes"):
        _xent(logits, np.array([0, 4]))
    wide = logits.astype(np.float64)
    assert chosen("SparseSoftmaxCrossEntropyWithLogits", "cpu", {}, _specs(wide, np.array([0, 2]))) is None


def test_a_jit_cache_that_cannot_be_written_costs_a_line_not_the_step(capsys, monkeypatch) -> None:
    """numba saves a kernel's machine code after compiling it, inside the kernel's first call: a
    full disk there (EFBIG, ENOSPC) must not fail the step that called it."""
    import contextlib
    import errno
    from types import SimpleNamespace

    from numba.core import caching

    from flowctl.kernels.cpu import jit

    jit._cache_writes_may_fail()
    monkeypatch.setitem(jit._said, "cache", False)

    def full(sig, data):
        raise OSError(errno.EFBIG, "File too large")

    cache = SimpleNamespace(_guard_against_spurious_io_errors=contextlib.nullcontext, _save_overload=full)
    caching.Cache.save_overload(cache, None, None)
    caching.Cache.save_overload(cache, None, None)
    err = capsys.readouterr().err
    assert err.count("could not be written (File too large)") == 1, err

    def broken(sig, data):
        raise ValueError("not an I/O error")

    with pytest.raises(ValueError):
        caching.Cache.save_overload(SimpleNamespace(_guard_against_spurious_io_errors=contextlib.nullcontext,
                                                    _save_overload=broken), None, None)


# ---------------------------------------------------------------------------- Dropout
@pytest.mark.parametrize("dtype,rate", [("float32", 0.5), ("float32", 0.1), ("float64", 0.3)])
def test_dropout_gives_the_references_bits_and_leaves_its_generator_as_the_reference_does(monkeypatch, dtype,
                                                                                          rate) -> None:
    """Even sizes take the compiled pass over the generator's raw words, odd ones (and the even draw
    after one, a half word pending) the reference; the masks, outputs and generator states (as a
    checkpoint records them) are the reference's bit for bit either way."""
    from flowctl.engine.container import RngState
    from flowctl.kernels.cpu import dropout as cpu_dropout

    fast_rng, ref_rng = RngState("d", 11), RngState("d", 11)
    specs = [TensorSpec((None, 650), dtype)]
    assert chosen("Dropout", "cpu", {"rate": rate}, specs).name == "numba"
    fast = bind("Dropout", "cpu", {"rate": rate, "_resource": fast_rng}, specs)
    ref = KERNELS[("Dropout", "cpu")](np, {"rate": rate, "_resource": ref_rng})
    compiled = []
    monkeypatch.setattr(cpu_dropout, "dropout", lambda *a, f=cpu_dropout.dropout: compiled.append(1) or f(*a))
    rng = np.random.default_rng(3)
    sizes = [(20, 650), (3, 35, 650), (9, 3), (20, 650), (20, 650), (1,), (2,)]
    for shape in sizes:
        x = rng.standard_normal(shape).astype(dtype)
        x[0] = np.nan  # a NaN times a dropped 0 stays NaN in both
        for a, b in zip(fast(x), ref(x)):
            assert a.dtype == b.dtype == np.dtype(dtype) and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
        assert repr(fast_rng.get_state()) == repr(ref_rng.get_state())
    assert len(compiled) == 3  # the first two and (2,): from (9, 3) a half word is pending until (1,) takes it
    y, mask = fast(np.ones((400, 500), dtype))
    kept = np.dtype(dtype).type(1 / (1 - rate))
    assert abs(float(np.mean(mask == 0)) - rate) < 0.01 and set(np.unique(mask)) == {0, kept}
