"""Multi-tensor optimizer updates (engine/multi_apply.py, kernels/training.py, kernels/cuda/state.py):
one MultiApply* node per optimizer and dtype in a GPU plan, its kernel the per-variable kernels'
bits. The GPU kernel runs in numba's CUDA simulator; whole training steps run in a GPU session on
the launch ledger against the CPU session."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

import flowctl as fc  # noqa: E402
import flowctl.kernels  # noqa: E402,F401
from flowctl.engine.multi_apply import group_updates  # noqa: E402
from flowctl.engine.optimizers import SGD, Adam, AdamW, Momentum  # noqa: E402
from flowctl.kernels.cuda import jit  # noqa: E402
from flowctl.kernels.ledger import Ledger  # noqa: E402
from flowctl.kernels.registry import KERNELS, StepGuard, override_array_module, reference_kernels  # noqa: E402

SIM = jit.simulated_module()


class Slot:
    def __init__(self, name: str, value: np.ndarray) -> None:
        self.name = name
        self.value = value


MULTI = [
    ("MultiApplyGradientDescent", "ApplyGradientDescent", {}, 0),
    ("MultiApplyMomentum", "ApplyMomentum", {"momentum": 0.9, "nesterov": False}, 1),
    ("MultiApplyMomentum", "ApplyMomentum", {"momentum": 0.9, "nesterov": True}, 1),
    ("MultiApplyAdam", "ApplyAdam", {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}, 2),
]
# Shapes of a conv net's variables, more of them than one launch takes (K <= 16), odd sizes and a scalar
SHAPES = [(3, 3, 2, 4), (4,), (4,), (2, 2, 4, 3), (3,), (17,), (), (9, 2)] * 3


def _state(rng, k):
    vals = []
    for shape in SHAPES:
        vals.append(np.asarray(rng.standard_normal(shape), np.float32))
        vals += [np.asarray(np.abs(rng.standard_normal(shape)), np.float32) for _ in range(k)]
    grads = [np.asarray(rng.standard_normal(s), np.float32) for s in SHAPES]
    return vals, grads


def _run(factory, xp, vals, k, attrs, lrs, grads, guard=None):
    slots = [Slot(f"s{i}", xp.asarray(v.copy())) for i, v in enumerate(vals)]
    a = dict(attrs, slots=k, _resource=tuple(slots))
    if guard is not None:
        a["_guard"] = guard
    ids = [id(s.value) for s in slots]
    factory(xp, a)(*lrs, *grads)
    return [np.asarray(s.value) for s in slots], ids == [id(s.value) for s in slots]


@pytest.fixture
def simulator():
    if not jit.simulated():
        pytest.skip("numba's CUDA simulator is not enabled in this process")


@pytest.mark.parametrize("op,single,attrs,k", MULTI)
@pytest.mark.parametrize("flag", [None, 1, 0])
def test_the_multi_kernel_gives_the_per_variable_kernels_bits(simulator, op, single, attrs, k, flag, rng):
    """In the simulator, the GPU kernel (in chunks of <= K variables) against each variable's own GPU
    kernel and against the generic reference (the per-variable CPU kernels), with no guard and with
    the step's guard flag up (1) and down (0: nothing changes)."""
    vals, grads = _state(rng, k)
    lrs = [np.asarray(0.05, np.float32)] * (len(SHAPES) - 3) + [np.asarray(v, np.float32) for v in (0.1, 0.2, 0.3)]
    guard = None
    if flag is not None:
        guard = StepGuard("loss_guard")
        guard.flag(SIM)[...] = flag
    got, in_place = _run(KERNELS[(op, "gpu")], SIM, vals, k, attrs, lrs, grads, guard)
    assert in_place  # every variable written into its own array (a captured graph keeps the addresses)
    ref, _ = _run(KERNELS[(op, "cpu")], np, vals, k, attrs, lrs, grads)
    single_gpu = []
    for j, g in enumerate(grads):  # each variable through its own per-variable GPU kernel
        slots = [Slot(f"s{j}_{w}", vals[j * (k + 1) + w].copy()) for w in range(k + 1)]
        a = dict(attrs, _resource=slots[0] if k == 0 else tuple(slots))
        if guard is not None:
            a["_guard"] = guard
        KERNELS[(single, "gpu")](SIM, a)(lrs[j], g)
        single_gpu += [s.value for s in slots]
    want = vals if flag == 0 else ref
    for i, (a, b, c) in enumerate(zip(got, single_gpu, want)):
        assert np.array_equal(a, b) and np.array_equal(a, c), (op, i)


def test_a_variable_the_launch_cannot_take_runs_its_own_kernel(simulator, rng):
    """A variable whose array is seen elsewhere (a reader holds it) gets new arrays (it and its slot),
    as the per-variable kernel gives them, while the others are updated in place; the held one keeps
    its bits."""
    vals, grads = _state(rng, 1)
    slots = [Slot(f"s{i}", v.copy()) for i, v in enumerate(vals)]
    held = slots[2].value  # variable 1's value
    before = held.copy()
    ids = [id(s.value) for s in slots]
    lr = np.asarray(0.05, np.float32)
    KERNELS[("MultiApplyMomentum", "gpu")](SIM, {"momentum": 0.9, "nesterov": False, "slots": 1,
                                                 "_resource": tuple(slots)})(*[lr] * len(grads), *grads)
    ref, _ = _run(KERNELS[("MultiApplyMomentum", "cpu")], np, vals, 1, {"momentum": 0.9, "nesterov": False},
                  [lr] * len(grads), grads)
    assert np.array_equal(held, before) and slots[2].value is not held
    assert [i for i, (s, before_id) in enumerate(zip(slots, ids)) if id(s.value) != before_id] == [2, 3]
    for s, r in zip(slots, ref):
        assert np.array_equal(s.value, r)


# ---------------------------------------------------------------------------------- whole steps
def cnn_graph(optimizer, clip=None, guard=True, penalty=None, bias=0.0):
    """A small Inception-like net: two branches of convolutions with biases (initialised to `bias`),
    joined, then a dense layer: many variables, several shapes. `penalty` adds an L2 penalty on
    every variable: "add_n" of their L2Loss nodes, or a chain of Adds ("adds")."""
    g = fc.Graph(seed=7)
    with g.as_default():
        x = fc.placeholder("float32", (None, 8, 8, 3), name="x")
        y = fc.placeholder("int32", (None,), name="y")
        params = []

        def conv(h, cin, cout, size, name):
            w = fc.variable(fc.truncated_normal((size, size, cin, cout), stddev=0.2), name=f"{name}/kernel")
            b = fc.variable(np.full(cout, bias, np.float32), name=f"{name}/bias")
            params.extend([w, b])
            return fc.relu(fc.conv2d(h, w, strides=1, padding="SAME") + b)

        h = conv(x, 3, 4, 3, "stem")
        branches = [conv(conv(h, 4, 4, 1, f"b{i}/reduce"), 4, 4, 3, f"b{i}/conv") for i in range(3)]
        h = fc.concat(branches, axis=3)
        h = fc.reshape(fc.reduce_mean(h, axis=[1, 2]), (-1, 12))
        w = fc.variable(fc.truncated_normal((12, 5), stddev=0.3), name="dense/kernel")
        b = fc.variable(np.full(5, bias, np.float32), name="dense/bias")
        params.extend([w, b])
        loss = fc.reduce_mean(fc.sparse_softmax_cross_entropy(fc.matmul(h, w) + b, y),
                              name="loss" if penalty is None else "ce")
        if penalty is not None:
            l2s = [fc.l2_loss(p) for p in params]
            if penalty == "add_n":
                reg = fc.add_n(l2s, name="l2_penalty")
            else:
                reg = l2s[0]
                for t in l2s[1:]:
                    reg = reg + t
            loss = fc.add(loss, reg * 1e-2, name="loss")
        train = optimizer.minimize(loss, clip_norm=clip)
        if guard:
            check = fc.check_numerics(loss, message="the step's loss", name="loss_guard")
            for n in g.nodes.values():
                if n.op.startswith("Apply"):
                    n.control_inputs.append(check.node)
        init = fc.global_variables_initializer()
    return g, x, y, loss, train, init


def data(rng, n=3):
    return [(rng.standard_normal((3, 8, 8, 3)).astype(np.float32), rng.integers(0, 5, 3).astype(np.int32))
            for _ in range(n)]


def run_steps(g, x, y, loss, train, init, batches, device="cpu:0", led=None, capture=False):
    """(losses, variables, per-step ledger counts, the session's plan)"""
    sess = fc.Session(g, device=device, store=fc.ContainerStore(), capture=capture)
    sess.run(init)
    out, counts = [], []
    for a, b in batches:
        if led is not None:
            led.reset_counts()
        out.append(float(sess.run([loss, train], {x: a, y: b})[0]))
        if led is not None:
            counts.append(dict(led.counts))
    plan = sess.plan_for([loss, train], {x: batches[0][0], y: batches[0][1]})
    return out, sess.variable_values(), counts, plan


# (clipped: each SGD update's step size is its own lr * scale node; Adam's gradients are scaled products)
# (30 s each in the simulator, its L2Loss kernels: the slow set)
OPTIMIZERS = [(lambda: SGD(0.1), None), pytest.param(lambda: SGD(0.1), 0.5, marks=pytest.mark.slow),
              (lambda: Momentum(0.05, 0.9), None), (lambda: Momentum(0.05, 0.9, nesterov=True), None),
              (lambda: Adam(0.01), None), pytest.param(lambda: Adam(0.01), 0.5, marks=pytest.mark.slow),
              (lambda: AdamW(0.01, weight_decay=0.1), None)]


@pytest.mark.parametrize("make,clip", OPTIMIZERS)
def test_a_gpu_step_on_the_ledger_updates_with_one_node_and_the_cpus_bits(simulator, make, clip, rng):
    """The GPU plan holds MultiApply nodes instead of the per-variable ones, the CPU plan does not,
    and the GPU session's losses and variables (on the ledger, kernels in the simulator) are the CPU
    session's bits: every step the same operations in the same order. The variables' names (the
    checkpoint's keys) are the same. (The CPU's reference kernels: its compiled variants, such as
    the softmax cross-entropy's, agree with them to float32 rounding, not to the bit.)"""
    batches = data(rng)
    graph = cnn_graph(make(), clip)
    with reference_kernels():
        cpu_losses, cpu_vars, _, cpu_plan = run_steps(*graph, batches)
    with override_array_module("gpu", Ledger()):
        gpu_losses, gpu_vars, _, gpu_plan = run_steps(*graph, batches, device="gpu:0")
    assert not any(n.op.startswith("MultiApply") for n in cpu_plan.nodes)
    singles = [n for n in cpu_plan.nodes if n.op in ("ApplyGradientDescent", "ApplyMomentum", "ApplyAdam")]
    multis = [n for n in gpu_plan.nodes if n.op.startswith("MultiApply")]
    assert len(singles) >= 14 and 1 <= len(multis) <= 2  # AdamW: its decays, then its Adam steps
    assert not any(n.op in ("ApplyGradientDescent", "ApplyMomentum", "ApplyAdam") for n in gpu_plan.nodes)
    assert sorted(cpu_vars) == sorted(gpu_vars)
    assert cpu_losses == gpu_losses
    for name in cpu_vars:
        assert np.array_equal(cpu_vars[name], gpu_vars[name]), name


def test_the_guard_still_stops_a_non_finite_step_and_changes_nothing(simulator, rng):
    from flowctl.engine.errors import NonFiniteError

    g, x, y, loss, train, init = cnn_graph(Momentum(0.05, 0.9))
    with override_array_module("gpu", Ledger()):
        sess = fc.Session(g, device="gpu:0", store=fc.ContainerStore(), capture=False)
        sess.run(init)
        a, b = data(rng, 1)[0]
        before = sess.variable_values()
        bad = a.copy()
        bad[0, 0, 0, 0] = np.nan
        with pytest.raises(NonFiniteError):
            sess.run([loss, train], {x: bad, y: b})
        after = sess.variable_values()
    for name in before:
        assert np.array_equal(before[name], after[name]), name


def test_the_pass_leaves_fetched_updates_and_other_dtypes_alone(rng):
    g, x, y, loss, train, init = cnn_graph(Momentum(0.05, 0.9), guard=False)
    updates = sorted(n.name for n in g.nodes.values() if n.op == "ApplyMomentum")
    fetched = f"{updates[0]}:0"
    grouped = group_updates(g, [loss.name, fetched], [x.name, y.name], [train.op.name])
    assert grouped is not g and updates[0] in grouped.nodes
    multi = [n for n in grouped.nodes.values() if n.op == "MultiApplyMomentum"]
    assert len(multi) == 1 and len(multi[0].attrs["variables"]) == 2 * (len(updates) - 1)
    assert set(g.nodes) - set(grouped.nodes) == set(updates[1:])  # the graph itself is untouched
    assert all(n.name in g.nodes for n in g.nodes.values())
    target = grouped.nodes[train.op.name]
    assert target.control_inputs == [multi[0].name] and target.inputs == [fetched]


def test_a_captured_step_on_the_ledger_launches_far_fewer_kernels(simulator, rng, monkeypatch):
    """Launches of the eager warm-up step and nodes of the captured graph, with and without the pass."""
    import flowctl.engine.multi_apply as multi_apply

    batches = data(rng, 5)
    graph = cnn_graph(Momentum(0.05, 0.9))
    counts = {}
    for on in (False, True):
        monkeypatch.setattr(multi_apply, "ENABLED", on)
        led = Ledger()
        with override_array_module("gpu", led):
            losses, values, steps, _ = run_steps(*graph, batches, device="gpu:0", led=led, capture=True)
        counts[on] = (steps, losses, values)
    off, on = counts[False][0], counts[True][0]
    assert counts[False][1] == counts[True][1]
    assert all(np.array_equal(counts[False][2][k], counts[True][2][k]) for k in counts[False][2])
    n_vars = 16
    # The first step's updates make new arrays (the initial values are seen elsewhere); from the
    # second on, one numba launch per variable before, one per <= 16 variables after, and the
    # captured graph holds that many nodes fewer. (Both also launch the same generated kernels of the
    # element-wise ops' GPU variants, cuda/fused.py: one per ReluGrad node and per AddN of 3.)
    from flowctl.kernels.registry import chosen

    g = graph[0]
    generated = sum(chosen(n.op, "gpu", n.attrs, g.input_specs(n)) is not None for n in g.nodes.values())
    assert generated > 0
    assert (off[1]["custom"], on[1]["custom"]) == (n_vars + generated, 1 + generated)
    assert off[1]["launches"] - on[1]["launches"] == n_vars - 1
    assert off[3]["graph_nodes"] - on[3]["graph_nodes"] == n_vars - 1
    for c in on[3:]:
        assert (c["launches"], c["allocations"], c["graph_launches"]) == (0, 0, 1)
