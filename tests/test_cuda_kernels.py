"""Our numba-cuda GPU kernels (flowctl/kernels/cuda/kernels.py, state.py, philox.py) run in numba's
CUDA simulator (conftest turns it on where there is no GPU) against the generic numpy kernels; the
gpu-marked tests run them on cupy."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

import flowctl.kernels  # noqa: E402,F401
from flowctl.engine.container import RngState  # noqa: E402
from flowctl.kernels import registry  # noqa: E402
from flowctl.kernels.cuda import jit, philox  # noqa: E402
from flowctl.kernels.registry import KERNELS, StepGuard  # noqa: E402

SIM = jit.simulated_module()
cuda = None  # numba.cuda, for the test kernels defined below (set where they are made)


@pytest.fixture(autouse=True)
def _simulator(request):
    """The simulator's tests need NUMBA_ENABLE_CUDASIM=1 when numba.cuda was first imported."""
    if "gpu" not in request.keywords and not jit.simulated():
        pytest.skip("numba's CUDA simulator is not enabled in this process")


class Slot:
    def __init__(self, name: str, value: np.ndarray) -> None:
        self.name = name
        self.value = value


def gpu(op: str, attrs: dict, xp=SIM):
    return KERNELS[(op, "gpu")](xp, attrs)


def cpu(op: str, attrs: dict):
    return KERNELS[(op, "cpu")](np, attrs)


def rand(rng, *shape, dtype="float32"):
    return rng.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------------------------- Philox
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def test_philox_known_answers():
    for ctr, key, want in KAT:
        assert tuple(int(w) for w in philox.philox4x32(np.array(ctr), np.array(key))) == want
    got = philox.philox4x32(np.array([c for c, _, _ in KAT]), np.array([k for _, k, _ in KAT]))
    assert got.dtype == np.uint32 and got.tolist() == [list(w) for _, _, w in KAT]


cuda = None  # numba.cuda, a global: the simulator swaps its module in for globals naming it


def test_philox_device_function_matches_numpy():
    global cuda
    cuda = jit.numba_cuda()
    dphilox = philox.device_functions().philox
    rng = np.random.default_rng(0)
    ctr = rng.integers(0, 2 ** 32, size=(64, 4), dtype=np.uint64)
    key = rng.integers(0, 2 ** 32, size=(64, 2), dtype=np.uint64)
    ctr[:3], key[:3] = [c for c, _, _ in KAT], [k for _, k, _ in KAT]

    @cuda.jit
    def run(ctr, key, out):
        i = cuda.grid(1)
        if i < ctr.shape[0]:
            w0, w1, w2, w3 = dphilox(ctr[i, 0], ctr[i, 1], ctr[i, 2], ctr[i, 3], key[i, 0], key[i, 1])
            out[i, 0], out[i, 1], out[i, 2], out[i, 3] = w0, w1, w2, w3

    out = np.zeros((64, 4), dtype=np.uint64)
    run[2, 32](ctr, key, out)
    assert (out == philox.philox4x32(ctr, key)).all()


def test_philox_stream_layout():
    seed, draw = 0x0123456789ABCDEF, 5
    u = philox.uniform(seed, draw, 10)
    block = philox.philox4x32(np.array([2, 0, draw, 0]), np.array([0x89ABCDEF, 0x01234567]))
    assert u.dtype == np.float32 and u[9] == np.float32((int(block[1]) >> 8) * 2.0 ** -24)
    assert ((u >= 0) & (u < 1)).all()


# ---------------------------------------------------------------------------------- Dropout
def _dropout(rate=0.3, seed=1234):
    st = RngState("drop", seed)
    return st, gpu("Dropout", {"rate": rate, "seed": 0, "_resource": st})


def test_dropout_mask_matches_reference_and_advances():
    rate = 0.3
    st, fn = _dropout(rate)
    x = rand(np.random.default_rng(1), 50, 200)  # 10^4 elements, 2500 threads
    y, mask = fn(x)
    scale = np.float32(1.0 / (1.0 - rate))
    assert set(np.unique(mask)) <= {np.float32(0), scale}
    keep = mask != 0
    assert abs(keep.mean() - (1 - rate)) < 0.02
    ref = (philox.uniform(st.seed, 0, x.size) >= np.float32(rate)).reshape(x.shape).astype("float32") * scale
    assert np.array_equal(mask, ref)
    assert np.array_equal(y, x * ref)
    assert st.device_draws == 1 and int(st.device_counter(SIM)[0]) == 1

    _, mask2 = fn(x)
    assert not np.array_equal(mask, mask2)
    assert np.array_equal(mask2, (philox.uniform(st.seed, 1, x.size) >= np.float32(rate)).reshape(x.shape) * scale)

    state = st.get_state()
    assert state["device_draws"] == 2
    st.set_state({**state, "device_draws": 0})  # a restore rewinds the device counter
    _, again = fn(x)
    assert np.array_equal(again, mask)


def test_dropout_float16_and_odd_size():
    st, fn = _dropout(0.5, seed=2 ** 63 + 7)
    x = rand(np.random.default_rng(2), 7, 3, dtype="float16")
    y, mask = fn(x)
    ref = (philox.uniform(st.seed, 0, x.size) >= np.float32(0.5)).reshape(x.shape).astype("float16") * np.float16(2)
    assert y.dtype == mask.dtype == np.float16
    assert np.array_equal(mask, ref) and np.array_equal(y, x * ref)


def test_rng_state_device_draws_round_trip():
    st = RngState("r", 5)
    assert "device_draws" not in st.get_state()  # no GPU draws: the state as before
    st.set_state({**st.get_state(), "device_draws": 9})
    cell = st.device_counter(SIM)  # made after the restore: starts at the restored count
    assert int(cell[0]) == 9 and st.get_state()["device_draws"] == 9
    assert st.device_counter(SIM) is cell


# ---------------------------------------------------------------------------------- LSTM cell
@pytest.mark.parametrize("with_hw,with_c,bias", [(True, True, 1.0), (False, False, 0.0), (True, False, 0.5)])
def test_lstm_cell_matches_generic(with_hw, with_c, bias):
    rng = np.random.default_rng(3)
    b, u = 6, 20
    xw, hw, cp = rand(rng, b, 4 * u), rand(rng, b, 4 * u), rand(rng, b, u)
    args = (xw, hw if with_hw else None, cp if with_c else None)
    want = cpu("LSTMBlockCell", {"forget_bias": bias})(*args)
    got = gpu("LSTMBlockCell", {"forget_bias": bias})(*args)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-7)

    h, c, act = want
    dh, dc = rand(rng, b, u), rand(rng, b, u)
    gargs = (dh, dc, act, c, cp if with_c else None)
    want_g = cpu("LSTMBlockCellGrad", {})(*gargs)
    got_g = gpu("LSTMBlockCellGrad", {})(*gargs)
    if not with_c:
        want_g, got_g = (want_g,), (got_g,)
    assert len(got_g) == len(want_g)
    for g, w in zip(got_g, want_g):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-7)


def test_lstm_cell_float16():
    rng = np.random.default_rng(4)
    xw, hw, cp = rand(rng, 4, 32, dtype="float16"), rand(rng, 4, 32, dtype="float16"), rand(rng, 4, 8, dtype="float16")
    got = gpu("LSTMBlockCell", {"forget_bias": 1.0})(xw, hw, cp)
    ref = cpu("LSTMBlockCell", {"forget_bias": 1.0})(*(a.astype("float32") for a in (xw, hw, cp)))
    for g, w in zip(got, ref):
        assert g.dtype == np.float16
        np.testing.assert_allclose(g.astype("float32"), w, rtol=2e-3, atol=2e-3)
    dh, dc = rand(rng, 4, 8, dtype="float16"), rand(rng, 4, 8, dtype="float16")
    dz, dcp = gpu("LSTMBlockCellGrad", {})(dh, dc, got[2], got[1], cp)
    rz, rcp = cpu("LSTMBlockCellGrad", {})(*(a.astype("float32") for a in (dh, dc, got[2], got[1], cp)))
    assert dz.dtype == dcp.dtype == np.float16
    np.testing.assert_allclose(dz.astype("float32"), rz, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(dcp.astype("float32"), rcp, rtol=2e-3, atol=2e-3)


def test_bfloat16_bit_patterns_convert_as_ml_dtypes_does():
    """cuda/bfloat16.py's device conversions against ml_dtypes: widening every 5th bfloat16 pattern
    (all classes: normal, subnormal, zeros, infinities), and rounding float32 values of every kind
    (random bit patterns, exact ties between two bfloat16 values, subnormals, overflow)."""
    import ml_dtypes

    from flowctl.kernels.cuda import bfloat16

    global cuda  # a module global: the simulator swaps its own module in for those while a kernel runs
    cuda = jit.numba_cuda()
    d = bfloat16.device_functions()
    widen, narrow = d.widen, d.narrow

    @cuda.jit
    def to_bits(src, out):
        i = cuda.grid(1)
        if i < src.size:
            out[i] = narrow(src[i])

    @cuda.jit
    def from_bits(src, out):
        i = cuda.grid(1)
        if i < src.size:
            out[i] = widen(src[i])

    bf = np.dtype(ml_dtypes.bfloat16)
    pats = np.concatenate([np.arange(0, 2 ** 16, 5), [0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x7F7F]])
    pats = pats.astype(np.uint16)
    pats = pats[~np.isnan(pats.view(bf).astype(np.float32))]
    wide = np.zeros(pats.size, np.float32)
    from_bits[(pats.size + 31) // 32, 32](pats, wide)
    np.testing.assert_array_equal(wide.view(np.uint32), pats.view(bf).astype(np.float32).view(np.uint32))

    rng = np.random.default_rng(0)
    some = rng.integers(0, 2 ** 16, 300).astype(np.uint16).view(bf).astype(np.float32)
    x = np.concatenate([rng.integers(0, 2 ** 32, 1500, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        (some.view(np.uint32) | np.uint32(0x8000)).view(np.float32),  # halfway: ties
                        np.float32([0.0, -0.0, np.inf, -np.inf, 3.3895314e38, 3.4e38, -3.39e38, 1e-40, -1e-40,
                                    1.1754942e-38, 1e-45, 2.0 ** -133, 2.0 ** -134, 3 * 2.0 ** -134])])
    x = x[~np.isnan(x)].astype(np.float32)
    bits = np.zeros(x.size, np.uint16)
    to_bits[(x.size + 31) // 32, 32](x, bits)
    np.testing.assert_array_equal(bits, x.astype(bf).view(np.uint16))


def test_lstm_cell_bfloat16_is_the_float32_kernel_rounded():
    """The cell and its gradient on bfloat16 (as bit patterns, one launch each): bitwise the float32
    kernels on the widened inputs with each output rounded (kernels/bf16.py's rule)."""
    import ml_dtypes

    bf = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(5)
    b, u = 5, 12
    xw, hw, cp = (rand(rng, *shape).astype(bf) for shape in ((b, 4 * u), (b, 4 * u), (b, u)))
    low = gpu("LSTMBlockCell", {"forget_bias": 1.0})(xw, hw, cp)
    ref = gpu("LSTMBlockCell", {"forget_bias": 1.0})(*(a.astype(np.float32) for a in (xw, hw, cp)))
    for g, w in zip(low, ref):
        assert g.dtype == bf and g.tobytes() == w.astype(bf).tobytes()
    h, c, act = low
    dh, dc = rand(rng, b, u).astype(bf), rand(rng, b, u).astype(bf)
    dz, dcp = gpu("LSTMBlockCellGrad", {})(dh, dc, act, c, cp)
    rz, rcp = gpu("LSTMBlockCellGrad", {})(*(a.astype(np.float32) for a in (dh, dc, act, c, cp)))
    assert dz.dtype == dcp.dtype == bf
    assert dz.tobytes() == rz.astype(bf).tobytes() and dcp.tobytes() == rcp.astype(bf).tobytes()
    first = gpu("LSTMBlockCellGrad", {})(dh, dc, act, c)  # the first step: no c_prev
    assert first.tobytes() == gpu("LSTMBlockCellGrad", {})(
        *(a.astype(np.float32) for a in (dh, dc, act, c))).astype(bf).tobytes()


# ---------------------------------------------------------------------------------- updates
def _guard(ok: bool) -> StepGuard:
    g = StepGuard("loss_guard")
    g.flag(SIM)[...] = 1 if ok else 0
    return g


def _run_update(op, attrs_of, values, args, guard=None, lr_as=None):
    """(gpu result arrays, cpu result arrays): each kernel on its own copies of `values`."""
    out = []
    for side in ("gpu", "cpu"):
        slots = [Slot(f"s{i}", v.copy()) for i, v in enumerate(values)]
        attrs = attrs_of(slots if len(slots) > 1 else slots[0])
        if side == "gpu" and guard is not None:
            attrs["_guard"] = guard
        fn = gpu(op, attrs) if side == "gpu" else cpu(op, attrs)
        a0 = args[0] if lr_as is None else lr_as
        ids = [id(s.value) for s in slots]
        fn(a0 if side == "gpu" else args[0], *args[1:])
        if side == "gpu":  # the GPU kernel wrote into the slots' arrays
            assert [id(s.value) for s in slots] == ids
        out.append([s.value for s in slots])
    return out


UPDATES = [
    ("ApplyGradientDescent", lambda s: {"_resource": s}, 1),
    ("ApplyMomentum", lambda s: {"_resource": tuple(s), "momentum": 0.9, "nesterov": False}, 2),
    ("ApplyMomentum", lambda s: {"_resource": tuple(s), "momentum": 0.9, "nesterov": True}, 2),
    ("ApplyAdam", lambda s: {"_resource": tuple(s), "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}, 3),
]


@pytest.mark.parametrize("op,attrs_of,nslots", UPDATES)
@pytest.mark.parametrize("lr_kind", ["array", "float"])
def test_updates_match_generic_in_place(op, attrs_of, nslots, lr_kind):
    rng = np.random.default_rng(5)
    values = [rand(rng, 7, 9)] + [np.abs(rand(rng, 7, 9)) for _ in range(nslots - 1)]
    grad = rand(rng, 7, 9)
    lr = np.asarray(0.05, dtype="float32") if lr_kind == "array" else 0.05
    got, want = _run_update(op, attrs_of, values, (lr, grad))
    for g, w in zip(got, want):
        assert np.array_equal(g, w), op  # the same operations in the same order: the same bits


@pytest.mark.parametrize("op,attrs_of,nslots", UPDATES)
def test_updates_skip_when_guard_is_down(op, attrs_of, nslots):
    rng = np.random.default_rng(6)
    values = [rand(rng, 5, 4) for _ in range(nslots)]
    values[1:] = [np.abs(v) for v in values[1:]]
    got, _ = _run_update(op, attrs_of, values, (np.asarray(0.1, dtype="float32"), rand(rng, 5, 4)),
                         guard=_guard(False))
    for g, v in zip(got, values):
        assert np.array_equal(g, v)
    got, want = _run_update(op, attrs_of, values, (np.asarray(0.1, dtype="float32"), rand(rng, 5, 4)),
                            guard=_guard(True))
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_update_falls_back_when_the_array_is_seen():
    rng = np.random.default_rng(7)
    slot = Slot("v", rand(rng, 3, 3))
    held = slot.value  # a reader still holds it: a new array, the held one unchanged
    before = held.copy()
    fn = gpu("ApplyGradientDescent", {"_resource": slot})
    out = fn(np.asarray(0.5, dtype="float32"), np.ones((3, 3), "float32"))
    assert out is slot.value and out is not held and np.array_equal(held, before)
    assert np.array_equal(out, before - np.float32(0.5))


@pytest.mark.parametrize("op", ["AssignAdd", "AssignSub"])
def test_assign_ops(op):
    rng = np.random.default_rng(8)
    v = rand(rng, 4, 6)
    for value in (rand(rng, 4, 6), np.asarray(1.5, dtype="float32"), 2.5):
        got, want = _run_update(op, lambda s: {"_resource": s}, [v], (value,))
        assert np.array_equal(got[0], want[0])
    got, _ = _run_update(op, lambda s: {"_resource": s}, [v], (rand(rng, 4, 6),), guard=_guard(False))
    assert np.array_equal(got[0], v)
    step = np.asarray(41, dtype="int64")  # a step counter
    got, want = _run_update(op, lambda s: {"_resource": s}, [step], (1,))
    assert got[0].dtype == np.int64 and np.array_equal(got[0], want[0])


# ---------------------------------------------------------------------------------- CheckNumerics
class _Capturing:
    """The simulated module, reporting that a capture is under way."""

    def __getattr__(self, name):
        return getattr(SIM, name)

    @staticmethod
    def is_capturing():
        return True


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_check_numerics_in_capture_sets_flag(dtype):
    xp = _Capturing()
    guard = StepGuard("g")
    fn = gpu("CheckNumerics", {"message": "loss", "_guard": guard}, xp=xp)
    x = rand(np.random.default_rng(9), 300, dtype=dtype)
    assert fn(x) is x and int(guard.flag(xp)[0]) == 1
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[123] = bad
        assert fn(y) is y and int(guard.flag(xp)[0]) == 0  # no raise
        assert fn(x) is x and int(guard.flag(xp)[0]) == 0  # sticky: a finite step does not raise it again
        guard.reset()  # the host, having read it
        assert fn(x) is x and int(guard.flag(xp)[0]) == 1
    assert gpu("CheckNumerics", {"message": "loss"}, xp=xp)(y) is y  # no guard: nothing to write


def test_check_numerics_uncaptured_raises_like_generic():
    guard = StepGuard("g")
    guard.flag(SIM)[...] = 0
    fn = gpu("CheckNumerics", {"message": "the loss", "_guard": guard})
    x = np.array([1.0, np.nan, np.inf, 2.0], dtype="float32")
    with pytest.raises(FloatingPointError) as got:
        fn(x)
    with pytest.raises(FloatingPointError) as want:
        cpu("CheckNumerics", {"message": "the loss"})(x)
    assert str(got.value) == str(want.value)
    ok = np.ones(3, "float32")
    assert fn(ok) is ok and int(guard.flag(SIM)[0]) == 0  # sticky until the host resets it
    guard.reset()
    assert fn(ok) is ok and int(guard.flag(SIM)[0]) == 1


# ---------------------------------------------------------------------------------- sparse rows
def test_gather_grad_rows_fixed_size_and_sparse_update():
    rng = np.random.default_rng(10)
    vocab, dim = 12, 5
    indices = np.array([[3, -1, 3, 0], [11, 7, -9, 3]], dtype="int64")  # -1 is 11, -9 is 3
    dy = rand(rng, 2, 4, dim)
    like = rand(rng, vocab, dim)
    ids, rows = gpu("GatherGradRows", {})(dy, indices, like)
    assert ids.shape == (8,) and ids.dtype == np.int64 and rows.shape == (8, dim)
    flat = indices.reshape(-1) % vocab
    order = np.argsort(flat, kind="stable")
    assert np.array_equal(ids, flat[order])
    cids, crows = cpu("GatherGradRows", {})(dy, indices, like)
    first = np.concatenate(([True], ids[1:] != ids[:-1]))
    assert np.array_equal(ids[first], cids) and np.array_equal(rows[first], crows)  # bitwise: same order
    assert not rows[~first].any()

    var0 = rand(rng, vocab, dim)
    for alpha in (np.asarray(0.25, dtype="float32"), 0.25):
        gslot, cslot = Slot("e", var0.copy()), Slot("e", var0.copy())
        gpu("SparseApplyGradientDescent", {"_resource": gslot})(alpha, ids, rows)
        cpu("SparseApplyGradientDescent", {"_resource": cslot})(alpha, cids, crows)
        assert np.array_equal(gslot.value, cslot.value)
    gslot = Slot("e", var0.copy())
    gpu("SparseApplyGradientDescent", {"_resource": gslot, "_guard": _guard(False)})(0.25, ids, rows)
    assert np.array_equal(gslot.value, var0)
    gslot = Slot("e", var0.copy())
    held = gslot.value  # seen elsewhere: a copy is updated
    gpu("SparseApplyGradientDescent", {"_resource": gslot})(0.25, ids, rows)
    assert np.array_equal(held, var0) and np.array_equal(gslot.value, cslot.value)


# ---------------------------------------------------------------------------------- L2Loss
# (the simulator's blocks are 32 threads, each a Python thread: 300 values are 10 blocks, the last
# partly filled; 3,000 took 11 s)
@pytest.mark.parametrize("shape,dtype", [((300,), "float32"), ((7, 11), "float32"), ((13, 11), "float16"),
                                         ((0,), "float32")])
def test_l2_loss(shape, dtype):
    x = rand(np.random.default_rng(11), *shape, dtype=dtype)
    got = gpu("L2Loss", {})(x)
    want = 0.5 * np.sum(x.astype("float64") ** 2)
    assert got.shape == () and got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(float(got), want, rtol=1e-5 if dtype == "float32" else 1e-3)
    again = gpu("L2Loss", {})(x)
    assert np.array_equal(got, again)  # a fixed order: the same bits


# ---------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
def test_gpu_kernels_on_cupy_against_numpy():
    """Each kernel on cupy (numba-cuda compiled) against numpy's kernel or the reference."""
    if jit.simulated():
        pytest.skip("this process runs numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    xp = registry.array_module("gpu")
    cp = xp.cupy
    rng = np.random.default_rng(12)
    dev = lambda a: cp.asarray(a)  # noqa: E731

    st = RngState("drop", 99)
    fn = gpu("Dropout", {"rate": 0.25, "seed": 0, "_resource": st}, xp=xp)
    x = rand(rng, 333, 77)
    for draw in range(2):
        y, mask = fn(dev(x))
        ref = (philox.uniform(st.seed, draw, x.size) >= np.float32(0.25)).reshape(x.shape).astype("float32") \
            * np.float32(1 / 0.75)
        assert np.array_equal(mask.get(), ref) and np.array_equal(y.get(), x * ref)
    x16 = rand(rng, 33, 7, dtype="float16")
    y, mask = fn(dev(x16))
    ref = (philox.uniform(st.seed, 2, x16.size) >= np.float32(0.25)).reshape(x16.shape).astype("float16") \
        * np.float16(1 / 0.75)
    assert np.array_equal(mask.get(), ref) and np.array_equal(y.get(), x16 * ref)

    for dtype, tol, atol in (("float32", 2e-6, 2e-7), ("float16", 2e-3, 2e-3)):
        xw, hw, cprev = rand(rng, 16, 128, dtype=dtype), rand(rng, 16, 128, dtype=dtype), rand(rng, 16, 32, dtype=dtype)
        got = gpu("LSTMBlockCell", {"forget_bias": 1.0}, xp=xp)(dev(xw), dev(hw), dev(cprev))
        want = cpu("LSTMBlockCell", {"forget_bias": 1.0})(*(a.astype("float32") for a in (xw, hw, cprev)))
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.get().astype("float32"), w, rtol=tol, atol=atol)
        dh, dc = rand(rng, 16, 32, dtype=dtype), rand(rng, 16, 32, dtype=dtype)
        act, c = got[2].get(), got[1].get()
        gz = gpu("LSTMBlockCellGrad", {}, xp=xp)(dev(dh), dev(dc), dev(act), dev(c), dev(cprev))
        wz = cpu("LSTMBlockCellGrad", {})(*(a.astype("float32") for a in (dh, dc, act, c, cprev)))
        for g, w in zip(gz, wz):
            np.testing.assert_allclose(g.get().astype("float32"), w, rtol=tol, atol=atol)

    for op, attrs_of, nslots in UPDATES:
        values = [rand(rng, 300, 7)] + [np.abs(rand(rng, 300, 7)) for _ in range(nslots - 1)]
        grad = rand(rng, 300, 7)
        cslots = [Slot(f"s{i}", v.copy()) for i, v in enumerate(values)]
        cpu(op, attrs_of(cslots if nslots > 1 else cslots[0]))(np.float32(0.05), grad)
        for guard_ok in (True, False):
            g = StepGuard("g")
            g.flag(xp)[...] = int(guard_ok)
            gslots = [Slot(f"s{i}", cp.asarray(v)) for i, v in enumerate(values)]
            attrs = attrs_of(gslots if nslots > 1 else gslots[0])
            attrs["_guard"] = g
            gpu(op, attrs, xp=xp)(cp.asarray(np.float32(0.05)), dev(grad))
            for gs, cs, v in zip(gslots, cslots, values):
                assert np.array_equal(gs.value.get(), cs.value if guard_ok else v), op
    for op in ("AssignAdd", "AssignSub"):
        v, d = rand(rng, 50, 3), rand(rng, 50, 3)
        gs, cs = Slot("a", cp.asarray(v)), Slot("a", v.copy())
        gpu(op, {"_resource": gs}, xp=xp)(dev(d))
        cpu(op, {"_resource": cs})(d)
        assert np.array_equal(gs.value.get(), cs.value)

    guard = StepGuard("g")
    check = gpu("CheckNumerics", {"message": "loss", "_guard": guard}, xp=xp)
    bad = rand(rng, 1000)
    bad[517] = np.nan
    with pytest.raises(FloatingPointError):
        check(dev(bad))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        bad_d, ok_d = dev(bad), dev(np.ones(1000, "float32"))
        stream.synchronize()
        graph_ok = None
        stream.begin_capture()
        check(bad_d)
        graph_bad = stream.end_capture()
        stream.begin_capture()
        check(ok_d)
        graph_ok = stream.end_capture()
        graph_bad.launch(stream)
        stream.synchronize()
        assert not guard.ok()
        graph_ok.launch(stream)
        stream.synchronize()
        assert not guard.ok()  # sticky: a finite step does not raise it again
        guard.reset()
        graph_ok.launch(stream)
        stream.synchronize()
        assert guard.ok()

    indices = rng.integers(-50, 50, size=(20, 30))
    dy, like = rand(rng, 20, 30, 8), rand(rng, 50, 8)
    ids, rows = gpu("GatherGradRows", {}, xp=xp)(dev(dy), dev(indices), dev(like))
    cids, crows = cpu("GatherGradRows", {})(dy, indices, like)
    ids_h, rows_h = ids.get(), rows.get()
    first = np.concatenate(([True], ids_h[1:] != ids_h[:-1]))
    assert np.array_equal(ids_h[first], cids) and np.array_equal(rows_h[first], crows)
    gs, cs = Slot("e", cp.asarray(like)), Slot("e", like.copy())
    gpu("SparseApplyGradientDescent", {"_resource": gs}, xp=xp)(cp.asarray(np.float32(0.1)), ids, rows)
    cpu("SparseApplyGradientDescent", {"_resource": cs})(np.float32(0.1), cids, crows)
    assert np.array_equal(gs.value.get(), cs.value)

    for n in (1, 1000, 3_000_001):
        t = rand(rng, n)
        got = gpu("L2Loss", {}, xp=xp)(dev(t))
        np.testing.assert_allclose(float(got.get()), 0.5 * np.sum(t.astype("float64") ** 2), rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gather_grad_rows_long_runs_bitwise(dtype):
    """Runs longer than numpy's 8- and 128-element pairwise blocks sum to the CPU kernel's bits."""
    rng = np.random.default_rng(13)
    indices = np.concatenate([np.full(300, 2), np.full(9, 5), np.full(17, 0), np.arange(6)])
    indices = indices[rng.permutation(indices.size)]
    dy, like = rand(rng, indices.size, 2, dtype=dtype), rand(rng, 8, 2, dtype=dtype)
    ids, rows = gpu("GatherGradRows", {})(dy, indices, like)
    cids, crows = cpu("GatherGradRows", {})(dy, indices, like)
    first = np.concatenate(([True], ids[1:] != ids[:-1]))
    assert np.array_equal(ids[first], cids) and np.array_equal(rows[first], crows)
