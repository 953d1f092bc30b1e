"""The same kernels on cupy: each graph run on gpu:0 must match the numpy run on the same inputs.
Skipped cleanly where cupy or a CUDA device is missing."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import flowctl as fc
from flowctl.spec.loader import load_text
from flowctl.training.trainer import Trainer
from precision import assert_fp32_close, fp32_rtol

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.gpu


def _both(build, feeds_np, tol=1e-5, k=None):
    """Each output on gpu:0 against numpy's: within `tol` where no product made it; where products
    of depth up to `k` did, within the tolerance of float32 products of that depth under the
    precision in use (tests/precision.py: TF32 by default), `tol` its floor."""
    g = fc.Graph(seed=5)
    with g.as_default():
        phs = {k: fc.placeholder(v.dtype.name, v.shape, name=k) for k, v in feeds_np.items()}
        outs = build(**phs)
    feeds = {phs[k]: v for k, v in feeds_np.items()}
    cpu = fc.Session(g, store=fc.ContainerStore()).run(outs, feeds)
    gpu = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(outs, feeds)
    for a, b in zip(cpu, gpu):
        assert isinstance(b, np.ndarray) or np.isscalar(b)
        if k is None:
            np.testing.assert_allclose(b, a, rtol=tol, atol=tol)
        else:
            assert_fp32_close(b, a, k, floor=tol)


def test_elementwise_and_gradients_match_numpy(rng):
    x = rng.standard_normal((8, 16)).astype(np.float32)
    y = rng.uniform(0.5, 2, (16,)).astype(np.float32)

    def build(x, y):
        z = fc.tanh(x) * y + fc.exp(-fc.square(x)) / y
        return [z] + fc.gradients(z, [x, y])

    _both(build, {"x": x, "y": y})


def test_mlp_step_matches_numpy(rng):
    x = rng.standard_normal((32, 20)).astype(np.float32)
    w = rng.standard_normal((20, 5)).astype(np.float32)
    labels = rng.integers(0, 5, 32).astype(np.int32)

    def build(x, w, labels):
        loss = fc.reduce_mean(fc.sparse_softmax_cross_entropy(fc.relu(fc.matmul(x, w)), labels))
        return [loss] + fc.gradients(loss, [x, w])

    _both(build, {"x": x, "w": w, "labels": labels}, k=32)  # x @ w: 20 deep; dw = x^T dy: the batch, 32


def test_conv_and_pool_match_numpy(rng):
    x = rng.standard_normal((2, 9, 9, 3)).astype(np.float32)
    f = rng.standard_normal((3, 3, 3, 4)).astype(np.float32)

    def build(x, f):
        y = fc.max_pool(fc.conv2d(x, f, strides=(2, 2), padding="SAME"), (2, 2), (1, 1), "VALID")
        return [y] + fc.gradients(y, [x, f])

    _both(build, {"x": x, "f": f}, tol=1e-4, k=50)  # conv: 3x3x3 = 27 deep; df: 2x5x5 = 50 positions


def test_random_ops_draw_the_same_numbers_on_both_devices():
    g = fc.Graph(seed=9)
    with g.as_default():
        r = fc.random_normal((4, 4), name="r")
    a = fc.Session(g, store=fc.ContainerStore()).run(r)
    b = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(r)
    np.testing.assert_array_equal(a, b)


def test_variables_move_between_host_and_gpu_sessions():
    """Sessions share variables by name (§4.7): initialised on the host, updated on the GPU, read
    back on the host, each read sees the last write wherever it was made."""
    g = fc.Graph(seed=3)
    with g.as_default():
        v = fc.variable(np.arange(6, dtype=np.float64).reshape(2, 3), name="v")
        bump = fc.assign_add(v, fc.constant(np.full((2, 3), 0.5)))
        doubled = v * 2.0
        init = fc.global_variables_initializer()
    store = fc.ContainerStore()
    host = fc.Session(g, store=store)
    gpu = fc.Session(g, device="gpu:0", store=store)
    host.run(init)
    gpu.run(bump)  # the host array moves to the GPU once, and is updated there
    np.testing.assert_array_equal(host.run(doubled), (np.arange(6).reshape(2, 3) + 0.5) * 2)
    host.run(bump)  # and back
    np.testing.assert_array_equal(gpu.run(v), np.arange(6).reshape(2, 3) + 1.0)


def test_a_spec_on_gpu_0_trains_there_and_matches_the_host(tmp_path):
    """`devices: [gpu:0]` puts the one-device step on the GPU (it once ran on the host). With IEEE
    float32 products (`training.allow_tf32: false`) its 20 losses follow the host's within float32
    rounding. With TF32 products (the default) the first loss -- the forward pass from the same
    initial weights -- is within the tolerance of its products (tests/precision.py: 64 deep, the
    batch through the bias and weight gradients); the later ones are not compared: Adam's
    normalised updates amplify the products' rounding from step to step (emulated: 2e-5 at the
    first step, 4e-3 by the fourteenth), which no bound on one product describes. Each GPU run
    records how its products ran; a CPU run records nothing."""
    from flowctl.kernels.registry import fp32_products, set_fp32_products

    text = (ROOT / "specs" / "demo.yaml").read_text().replace("steps: 600", "steps: 20")
    losses, recorded = {}, {}
    before = fp32_products()
    try:
        for name, dev, sets in (("cpu", "cpu:0", []), ("ieee", "gpu:0", ["training.allow_tf32=false"]),
                                ("tf32", "gpu:0", [])):
            run = tmp_path / name
            spec = text + f"devices: [{dev}]\n"
            t = Trainer(load_text(spec, filename="demo.yaml", overrides=sets), run)
            try:
                t.start_fresh(spec, "demo.yaml")
                assert t.session.device.endswith(dev)
                if name != "cpu":
                    assert fp32_products() == name
                t.train()
            finally:
                t.close()
            losses[name] = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
            recorded[name] = json.loads((run / "run.json").read_text()).get("fp32_products")
    finally:
        set_fp32_products(before)
    assert recorded == {"cpu": None, "ieee": "ieee", "tf32": "tf32"}
    assert len(losses["ieee"]) == len(losses["tf32"]) == 20
    np.testing.assert_allclose(losses["ieee"], losses["cpu"], rtol=1e-4)
    assert_fp32_close(losses["tf32"][0], losses["cpu"][0], k=64)
    from flowctl.kernels.registry import cupy_or_none

    if int(cupy_or_none().cuda.Device().compute_capability) >= 80:  # tensor cores with TF32 (Ampere on)
        assert losses["tf32"][0] != losses["ieee"][0]  # the switch switched something


def test_profiling_on_a_gpu_times_launches_and_kernels_apart():
    """The profiler times each GPU call two ways: the host's launch, and the kernels between CUDA
    events. What tells them apart on any GPU is how they scale: two products of 2048 and 8192
    square (64x the FLOPs, 17 and 1100 GFLOP) take 64x the stream time where the device is busy,
    while their launches are the same calls. So the stream time follows the work (at least 16x:
    the smaller product is still compute-bound on today's GPUs, whose dense TF32 rates of
    0.4-1.2 PFLOP/s give it 15-45 us against a few us of fixed cost) and the host time does not
    (less than 4x); the 1.1-TFLOP product keeps the stream longer than its launch holds the host
    (at least 1 ms at 1.1 PFLOP/s, against launches of 0.1-0.2 ms), and a 4-element add is the
    other way round. (A fixed 137-GFLOP product against 5x its launch did not hold: on an H200 in
    TF32 it ran 0.32 ms against a 0.18-ms launch.)"""
    from flowctl.engine.placement import MeasuredCostModel
    from flowctl.engine.placement.cost import STREAM
    from flowctl.engine.placement.profiler import profile
    from flowctl.training.program import cluster_for, step_config

    g = fc.Graph(seed=1)
    with g.as_default():
        a = fc.placeholder("float32", (2048, 2048), name="a")
        b = fc.placeholder("float32", (8192, 8192), name="b")
        small = fc.matmul(a, a, name="small")
        big = fc.matmul(b, b, name="big")
        tiny = fc.add(fc.constant(np.ones(4, np.float32)), fc.constant(np.ones(4, np.float32)), name="tiny")
    spec = load_text((ROOT / "specs" / "demo.yaml").read_text() + "devices: [gpu:0]\n", filename="d.yaml")
    cluster = cluster_for(step_config(spec))
    cost = MeasuredCostModel(cluster, batch=1)
    s = fc.Session(g, device="gpu:0", store=fc.ContainerStore())
    feeds = {a: np.ones((2048, 2048), np.float32), b: np.ones((8192, 8192), np.float32)}
    profile(cost, s, [small, big, tiny], feeds, repeat=5)
    dev = cluster.names[0]

    def times(name):
        key = cost.key_for(g, g.nodes[name], dev)
        return cost.records[key], cost.records[key + STREAM]  # (host, stream) seconds

    (host_small, kern_small), (host_big, kern_big), (host_tiny, kern_tiny) = map(times, ("small", "big", "tiny"))
    assert kern_big > 16 * kern_small  # the stream time follows the FLOPs (64x)...
    assert host_big < 4 * host_small  # ...the host's launch time does not
    assert kern_big > 2 * host_big
    assert kern_tiny < host_tiny
    assert kern_big < 1.0 and host_tiny < 1e-3


def test_a_spec_gpu_is_planned_as_the_gpu_this_machine_has():
    from flowctl.engine.cluster import detected_gpu_profile
    from flowctl.kernels.registry import cupy_or_none
    from flowctl.training.program import cluster_for, step_config

    cp = cupy_or_none()
    found = detected_gpu_profile(0)
    assert found is not None and found.type == "gpu"
    assert found.memory == cp.cuda.runtime.getDeviceProperties(0)["totalGlobalMem"]
    assert 1e12 < found.peak_flops < 1e15 and 1e11 < found.mem_bandwidth < 1e14
    spec = load_text((ROOT / "specs" / "demo.yaml").read_text() + "devices: [gpu:0, gpu:7]\n", filename="d.yaml")
    planned = cluster_for(step_config(spec))
    assert planned.devices[0].profile == found
    assert planned.devices[1].profile.name == "k40"  # no eighth GPU here: the documented default


@pytest.mark.parametrize("kind", ["sgd", "momentum", "adam", "assign_sub"])
def test_updates_on_a_gpu_write_in_place_to_the_bits_of_new_arrays(kind):
    """kernels/state.updatable_in_place on cupy arrays: once nothing else holds a variable's array,
    an update writes into it (its device address stays: a captured CUDA graph needs that, and no
    second copy of the state is held); the bits are those of the path that makes new arrays,
    taken where the caller holds every array."""
    from flowctl.engine.ops.training import apply_adam, apply_gradient_descent, apply_momentum

    rng = np.random.default_rng(4)
    w0 = rng.standard_normal((300, 250)).astype(np.float32)
    grads = [rng.standard_normal(w0.shape).astype(np.float32) for _ in range(3)]
    g = fc.Graph()
    with g.as_default():
        w = fc.variable(w0, name="w")
        s1 = fc.variable(np.zeros_like(w0), name="s1")
        s2 = fc.variable(np.full_like(w0, 0.5), name="s2")
        d = fc.placeholder("float32", w0.shape, name="d")
        lr = np.float32(0.01)
        step = {"sgd": lambda: apply_gradient_descent(w, lr, d),
                "momentum": lambda: apply_momentum(w, s1, lr, d, 0.8),
                "adam": lambda: apply_adam(w, s1, s2, lr, d, 0.85, 0.99, 1e-6),
                "assign_sub": lambda: fc.assign_sub(w, d * lr)}[kind]()
        init = fc.global_variables_initializer()
    names = {"sgd": ["w"], "momentum": ["w", "s1"], "adam": ["w", "s1", "s2"], "assign_sub": ["w"]}[kind]

    def run(hold: bool) -> list[np.ndarray]:
        store = fc.ContainerStore()
        sess = fc.Session(g, device="gpu:0", store=store)
        sess.run(init)
        sess.run(step, {d: grads[0]})  # replaces the initial values (the initializers' Consts hold those)
        slots = [store.get().slot(n) for n in names]
        held = []
        for gr in grads[1:]:
            ptrs = [s.value.data.ptr for s in slots]
            if hold:
                held.append([s.value for s in slots])  # the device arrays themselves
            sess.run(step, {d: gr})
            same = [s.value.data.ptr for s in slots] == ptrs
            assert same != hold, (kind, hold)
        return [np.asarray(s.value.get()) for s in slots]

    for a, b in zip(run(False), run(True)):
        np.testing.assert_array_equal(a, b)
