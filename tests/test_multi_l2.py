"""Sums of L2 losses as one node on a GPU (engine/multi_l2.py, kernels/training.py,
kernels/cuda/kernels.py): the pass's rewrite, the MultiL2Loss GPU kernel in numba's CUDA simulator
against the per-tensor GPU L2Loss kernels and AddN (bit for bit) and against numpy, and whole
training steps -- clip_by_global_norm's norm, an L2 penalty -- in a GPU session on the launch
ledger against the same session without the pass (bit for bit) and the CPU session."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

import flowctl as fc  # noqa: E402
import flowctl.kernels  # noqa: E402,F401
from flowctl.engine import multi_l2  # noqa: E402
from flowctl.engine.multi_l2 import fuse_l2_sums  # noqa: E402
from flowctl.engine.optimizers import Momentum  # noqa: E402
from flowctl.kernels.cuda import jit  # noqa: E402
from flowctl.kernels.cuda import kernels as cuda_kernels  # noqa: E402
from flowctl.kernels.ledger import Ledger  # noqa: E402
from flowctl.kernels.registry import KERNELS, override_array_module  # noqa: E402
from test_multi_apply import cnn_graph as multi_apply_net, data, run_steps as multi_apply_steps  # noqa: E402

SIM = jit.simulated_module()

# Mixed sizes: a scalar, an empty tensor, odd lengths, one over several blocks (the simulator's
# blocks are 32 threads: 130 values are 5, the last partly filled), conv kernels. The simulator runs
# a Python thread per thread, and a chunk's launch gives every tensor its largest one's grid, so
# the largest sets the test's time (1200 values, 38 blocks, took 25 s).
SHAPES = [(3, 3, 2, 4), (), (10, 13), (17,), (5,), (0,), (33,), (2, 2, 4, 3)]


@pytest.fixture
def simulator():
    if not jit.simulated():
        pytest.skip("numba's CUDA simulator is not enabled in this process")


def _tensors(rng, dtype):
    return [np.asarray(rng.standard_normal(s) * 3, dtype) for s in SHAPES]


def _exact(ts):
    return sum(float(np.sum(np.asarray(t, np.float64) ** 2)) for t in ts) / 2


# ---------------------------------------------------------------------------------- the kernel
# float32 across chunks of 3 in the default set (the offsets across chunks); the others, 25 s each in
# the simulator, in the slow set.
@pytest.mark.parametrize("dtype,chunk", [pytest.param("float32", 32, marks=pytest.mark.slow), ("float32", 3),
                                         pytest.param("float16", 32, marks=pytest.mark.slow)])
def test_the_kernel_gives_the_per_tensor_kernels_and_addns_bits(simulator, dtype, chunk, rng, monkeypatch):
    """Each tensor's half squared norm is its own GPU L2Loss launch's bits, the total is GPU AddN's
    sum of those, in one launch per K tensors (K = 3 here: the offsets across chunks, sorted by
    size) plus one; the total is the numpy reference's to float rounding."""
    monkeypatch.setattr(cuda_kernels, "_L2_CHUNK", chunk)
    ts = _tensors(rng, dtype)
    halves, total = cuda_kernels.multi_l2_parts(SIM, tuple(ts))
    single = [KERNELS[("L2Loss", "gpu")](SIM, {})(t) for t in ts]
    want = KERNELS[("AddN", "gpu")](SIM, {})(*single)
    assert halves.dtype == dtype and total.dtype == dtype and total.shape == ()
    assert np.array_equal(halves, np.array(single, dtype)), (halves, single)
    assert np.asarray(want).tobytes() == total.tobytes()
    ref = KERNELS[("MultiL2Loss", "cpu")](np, {})(*ts)
    assert np.asarray(ref).dtype == dtype
    rtol = 1e-6 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(float(total), _exact(ts), rtol=rtol)
    np.testing.assert_allclose(float(ref), _exact(ts), rtol=rtol)


def test_the_reference_is_the_per_tensor_kernels_then_addn(rng):
    """float64 (which the GPU kernel hands to the per-tensor kernels) and float32 on the CPU: the
    reference kernel's bits are the unfused graph's, and float64's the exact sum to 1e-12."""
    for dtype in ("float64", "float32"):
        ts = _tensors(rng, dtype)
        single = [KERNELS[("L2Loss", "cpu")](np, {})(t) for t in ts]
        want = KERNELS[("AddN", "cpu")](np, {})(*single)
        got = KERNELS[("MultiL2Loss", "cpu")](np, {})(*ts)
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    ts = _tensors(rng, "float64")
    np.testing.assert_allclose(float(KERNELS[("MultiL2Loss", "gpu")](SIM, {})(*ts)), _exact(ts), rtol=1e-12)


def test_a_ledger_counts_two_launches_for_a_sum_of_many(simulator, rng):
    """On the launch ledger: 2N + (N - 1) launches unfused (each L2Loss two, the generic AddN's adds;
    a plan runs a one-launch variant of AddN where it applies), 2 fused, with the unfused bits
    (the registered kernel: multi_l2_parts behind its dtype check). Five of SHAPES (a scalar, an
    empty one, several blocks): the simulator's time."""
    ts = _tensors(rng, "float32")[1:6]
    led = Ledger()
    dev = [led.asarray(t) for t in ts]
    led.reset_counts()
    single = [KERNELS[("L2Loss", "gpu")](led, {})(t) for t in dev]
    unfused = KERNELS[("AddN", "gpu")](led, {})(*single)
    before = dict(led.counts)
    led.reset_counts()
    fused = KERNELS[("MultiL2Loss", "gpu")](led, {})(*dev)
    after = dict(led.counts)
    n = len(ts)
    assert (before["launches"], before["custom"]) == (3 * n - 1, 2 * n)
    assert (after["launches"], after["custom"], after["syncs"], after["h2d"]) == (2, 2, 0, 0)
    assert led.host(fused).tobytes() == np.asarray(led.host(unfused)).tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_on_a_gpu_the_kernel_gives_the_per_tensor_kernels_and_addns_bits(dtype):
    """On cupy (numba-cuda compiled, 256 threads a block): more tensors than one launch takes (the
    padded chunk), one past 1024 blocks (its grid-stride loop), a scalar and an empty one."""
    if jit.simulated():
        pytest.skip("this process runs numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    from flowctl.kernels import registry

    xp = registry.array_module("gpu")
    cp = xp.cupy
    rng = np.random.default_rng(5)
    shapes = [(3, 3, 64, 96), (), (0,), (1_000_003,), (2048,), (17,)] + [(int(n),) for n in rng.integers(1, 5000, 40)]
    ts = [np.asarray(rng.standard_normal(s) * 0.5, dtype) for s in shapes]
    dev = [cp.asarray(t) for t in ts]
    halves, total = cuda_kernels.multi_l2_parts(xp, tuple(dev))
    single = [KERNELS[("L2Loss", "gpu")](xp, {})(t) for t in dev]
    want = KERNELS[("AddN", "gpu")](xp, {})(*single)
    assert np.array_equal(halves.get(), np.array([float(h.get()) for h in single], dtype))
    assert total.get().tobytes() == want.get().tobytes()
    np.testing.assert_allclose(float(total.get()), _exact(ts), rtol=1e-5 if dtype == "float32" else 2e-3)


# ---------------------------------------------------------------------------------- the pass
def _plain_graph(form):
    """Three float32 L2 losses summed as `form`; an extra term read elsewhere for the odd cases."""
    g = fc.Graph(seed=1)
    with g.as_default():
        ws = [fc.variable(np.full(s, 0.5, np.float32), name=f"w{i}") for i, s in enumerate([(3, 2), (4,), ()])]
        ls = [fc.l2_loss(w, name=f"l2_{i}") for i, w in enumerate(ws)]
        if form == "add_n":
            total = fc.add_n(ls, name="total")
        elif form == "adds":
            total = fc.add(fc.add(ls[0], ls[1]), ls[2], name="total")
        elif form == "right":  # l0 + (l1 + l2): AddN's order only inside the parentheses
            total = fc.add(ls[0], fc.add(ls[1], ls[2], name="inner"), name="total")
        elif form == "read":  # l0 also read by another node
            total = fc.add_n(ls, name="total")
            fc.identity(ls[0] * 2.0, name="other")
        init = fc.global_variables_initializer()
    return g, total, init


@pytest.mark.parametrize("form", ["add_n", "adds"])
def test_the_pass_makes_one_node_named_as_the_sum(form):
    g, total, _ = _plain_graph(form)
    fused = fuse_l2_sums(g, [total.name], [], [])
    assert fused is not g and "total" in g.nodes and g.nodes["total"].op == ("AddN" if form == "add_n" else "Add")
    node = fused.nodes["total"]
    assert node.op == "MultiL2Loss" and node.inputs == ["w0:0", "w1:0", "w2:0"]
    assert not any(n.op in ("L2Loss", "Add", "AddN") for n in fused.nodes.values())
    assert node.outputs[0].shape == () and node.outputs[0].dtype == "float32"


def test_the_pass_leaves_what_others_read_alone():
    g, total, _ = _plain_graph("read")
    assert fuse_l2_sums(g, [total.name, "other:0"], [], []) is g  # l2_0 is read by `other`
    g, total, _ = _plain_graph("add_n")
    assert fuse_l2_sums(g, [total.name, "l2_1:0"], [], []) is g  # fetched
    g, total, _ = _plain_graph("right")
    fused = fuse_l2_sums(g, [total.name], [], [])
    assert fused.nodes["inner"].op == "MultiL2Loss" and fused.nodes["total"].op == "Add"
    assert fused.nodes["total"].inputs == ["l2_0:0", "inner:0"]


def test_only_a_gpu_plan_fuses_and_the_switch_turns_it_off(simulator, monkeypatch):
    g, total, init = _plain_graph("add_n")

    def ops(device):
        with override_array_module("gpu", Ledger()):
            sess = fc.Session(g, device=device, store=fc.ContainerStore(), capture=False)
            sess.run(init)
            value = sess.run(total)
            return {n.op for n in sess.plan_for(total).nodes}, value

    cpu_ops, cpu_value = ops("cpu:0")
    gpu_ops, gpu_value = ops("gpu:0")
    assert "MultiL2Loss" not in cpu_ops and "L2Loss" in cpu_ops
    assert "MultiL2Loss" in gpu_ops and "L2Loss" not in gpu_ops
    assert float(cpu_value) == float(gpu_value) == pytest.approx(0.25 * 11 / 2)
    monkeypatch.setattr(multi_l2, "ENABLED", False)
    assert "MultiL2Loss" not in ops("gpu:0")[0]


# ---------------------------------------------------------------------------------- whole steps
def cnn_graph(clip=None, penalty=None):
    """tests/test_multi_apply.py's small Inception-like net (16 variables, biases from 0.1), under
    momentum, with gradient clipping and/or an L2 penalty on its kernels and biases (an AddN of
    L2Loss nodes, or a chain of Adds)."""
    return multi_apply_net(Momentum(0.05, 0.9), clip, guard=False, penalty=penalty, bias=0.1)


def run_steps(g, x, y, loss, train, init, batches, device="cpu:0", led=None):
    """(losses, variables, per-step ledger counts, the plan's op names); captured on the ledger"""
    out, values, counts, plan = multi_apply_steps(g, x, y, loss, train, init, batches, device, led,
                                                  capture=led is not None)
    return out, values, counts, [n.op for n in plan.nodes]


# clip 0.05: the norm (~0.4) is over it, so every update is scaled by clip / norm and the norm's
# bits reach the variables
# (clipping, as both GPU rows' specs clip, in the default set: each case is a minute or more in the
# simulator, both sums in one step twice that)
# (All in the slow set: the clipping case alone took 105 s of the default set's 2-core budget; the
# kernel's bits and the pass's rewrite are in the default set above.)
CASES = [pytest.param(0.05, None, marks=pytest.mark.slow), pytest.param(None, "add_n", marks=pytest.mark.slow),
         pytest.param(None, "adds", marks=pytest.mark.slow), pytest.param(0.05, "add_n", marks=pytest.mark.slow)]


@pytest.mark.parametrize("clip,penalty", CASES)
def test_a_captured_gpu_step_fuses_the_sum_keeps_the_bits_and_launches_less(simulator, clip, penalty, rng,
                                                                           monkeypatch):
    """A captured GPU session on the ledger, with and without the pass: the same losses and
    variables to the bit; the CPU session's to float32 rounding (the GPU's L2Loss sums in float32
    trees, the CPU's in float64 blocks); for 16 L2 terms, 32 L2Loss launches and the sum's become 2
    a step, eager and in the captured graph, and one graph launch a step."""
    batches = data(rng, 4)  # eager, eager, captured, replayed
    graph = cnn_graph(clip, penalty)
    cpu_losses, cpu_vars, _, cpu_ops = run_steps(*graph, batches)
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(multi_l2, "ENABLED", on)
        led = Ledger()
        with override_array_module("gpu", led):
            runs[on] = run_steps(*graph, batches, device="gpu:0", led=led)
    sums = (clip is not None) + (penalty is not None)
    assert cpu_ops.count("L2Loss") == 16 * sums and "MultiL2Loss" not in cpu_ops
    assert runs[False][3].count("L2Loss") == 16 * sums and "MultiL2Loss" not in runs[False][3]
    assert runs[True][3].count("MultiL2Loss") == sums and "L2Loss" not in runs[True][3]
    (off_losses, off_vars, off, _), (on_losses, on_vars, on, _) = runs[False], runs[True]
    assert on_losses == off_losses
    for name in off_vars:
        assert np.array_equal(on_vars[name], off_vars[name]), name
    np.testing.assert_allclose(on_losses, cpu_losses, rtol=1e-6)
    for name in cpu_vars:
        np.testing.assert_allclose(on_vars[name], cpu_vars[name], rtol=1e-5, atol=1e-7, err_msg=name)
    # the sum: an AddN of 16 float32 inputs is one generated launch on a GPU (kernels/cuda/fused.py's
    # single-op variant), a chain of Adds 15
    saved = sum(32 + n - 2 for n in ([1] if clip is not None else []) + ([] if penalty is None else
                                                                          [1 if penalty == "add_n" else 15]))
    assert [c["launches"] for c in off[:3]] == [c["launches"] + saved for c in on[:3]]
    assert off[3]["graph_nodes"] - on[3]["graph_nodes"] == saved
    for c in on[3:]:
        assert (c["launches"], c["allocations"], c["graph_launches"]) == (0, 0, 1)


def test_fusion_leaves_the_sum_of_l2_losses_to_multi_l2(simulator):
    """training.fuse's pass fuses what reads clipping's global norm (its Mul, Sqrt, Maximum, Div)
    but not the AddN of L2Loss terms, so a fused step's GPU plan still sums them in one
    MultiL2Loss; before, the fused tree absorbed the AddN and every L2Loss kept its own launches."""
    from flowctl.engine.fusion import fuse
    from flowctl.engine.graph import parse_ref

    g, x, y, loss, train, _ = cnn_graph(clip=1.0)
    fused = fuse(g.copy(), keep=[loss.op.name, train.op.name, "x", "y"])
    sums = [n for n in fused.nodes.values() if n.op == "AddN"
            and all(fused.nodes[parse_ref(r)[0]].op == "L2Loss" for r in n.inputs)]
    assert len(sums) == 1 and len(sums[0].inputs) == 16  # the 16 variables' norms
    readers = [n for n in fused.nodes.values() if f"{sums[0].name}:0" in n.inputs]
    assert [n.op for n in readers] == ["FusedElementwise"]  # the norm's scale, one node
    with override_array_module("gpu", Ledger()):
        sess = fc.Session(fused, device="gpu:0", store=fc.ContainerStore(), capture=False)
        ops = [n.op for n in sess.plan_for([loss.name, train.op.name], {"x:0": None, "y:0": None}).nodes]
    assert ops.count("MultiL2Loss") == 1 and "L2Loss" not in ops
