"""Buffer forwarding: an op whose OpDef lists `forward` inputs writes its output into one of their
buffers when the step owns it outright (TensorFlow's forward_input_or_allocate_output). It must
hold less, give the same bits, and never overwrite what anyone else may still read; the simulator
must count what the executors do."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import flowctl as fc
import flowctl.engine.executor as executor
from flowctl.engine.cluster import Cluster
from flowctl.engine.devices import canonical
from flowctl.engine.placement import simulate, step_nodes
from flowctl.engine.placement.cost import CostTable
from flowctl.engine.placement.simulator import held_at_peak, simulate_table
from flowctl.engine.runtime import DistributedSession
from flowctl.kernels.registry import INTO, KERNELS
from flowctl.engine.opdef import OPS
from test_memory_views import LM, ROOT, OneStep, cluster, table
from fixed_costs import FixedCosts

D0, D1 = canonical("cpu:0"), canonical("cpu:1")
KB4 = 4000
EXECUTORS = ["compiled", "dataflow"]


def chain() -> fc.Graph:
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (1000,), name="x")  # fed: never written
        a = fc.relu(x, name="a")  # a buffer of its own
        b = fc.add(a, fc.constant(np.full(1000, 0.5, np.float32)), name="b")  # into a
        c = fc.neg(b, name="c")  # into b (a's buffer)
        fc.reduce_sum(c, name="y")
    return g


@pytest.mark.parametrize("how", EXECUTORS)
def test_a_chain_of_forwarding_ops_holds_one_buffer(how: str, monkeypatch) -> None:
    xv = np.linspace(-1, 1, 1000, dtype=np.float32)
    peaks = {}
    for forward in (True, False):
        monkeypatch.setattr(executor, "FORWARD", forward)
        stats = fc.RunStats()
        y = fc.Session(chain(), executor=how).run("y:0", {"x:0": xv}, stats=stats)
        assert y == -(np.maximum(xv, 0) + np.float32(0.5)).sum(dtype=np.float32)
        peaks[forward] = stats.peak_bytes
    assert peaks == {True: KB4 + 4, False: 2 * KB4}
    # The simulator counts the same: a, then b and c in a's buffer (x and the constant resident).
    r = simulate(chain(), {n: D0 for n in chain().nodes}, cluster(), FixedCosts(cluster(), {}, 1e-3))
    assert r.device(D0).peak_memory - r.device(D0).resident == KB4 + 4
    t = table(chain())
    off = simulate_table(dataclasses.replace(t, forward=[]), [0] * len(t.names), cluster())
    assert off.device(D0).peak_memory - off.device(D0).resident == 2 * KB4


@pytest.mark.parametrize("how", EXECUTORS)
def test_nothing_another_reader_holds_is_overwritten(how: str, monkeypatch) -> None:
    # Every way a buffer may be shared: fetched, read twice, a Variable's, viewed by a live
    # Reshape, the same array under two names (Identity), and fed. Each result against numpy.
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (6, 5), name="x")
        w = fc.variable(np.arange(30, dtype=np.float32).reshape(6, 5), name="w")
        a = fc.relu(x, name="a")
        b = fc.add(a, fc.constant(np.ones((6, 5), np.float32)), name="b")  # a is fetched: no
        c = fc.mul(b, b, name="c")  # b read twice by one op: no
        d = fc.sub(c, b, name="d")  # b's last reader: into b is allowed, or c
        e = fc.add(w, d, name="e")  # w is a Variable's: into d only
        v = fc.reshape(e, [30], name="v")  # a view of e, alive until f2 below
        f = fc.neg(e, name="f")  # e's last reader, but v holds e's buffer: a new buffer
        f2 = fc.add(fc.reshape(f, [30]), v, name="f2")
        i = fc.identity(f2, name="i")
        fc.mul(i, fc.constant(np.float32(2.0)), name="out")
        init = fc.global_variables_initializer()
    xv = np.linspace(-2, 2, 30, dtype=np.float32).reshape(6, 5)
    results = {}
    for forward in (True, False):
        monkeypatch.setattr(executor, "FORWARD", forward)
        sess = fc.Session(g, store=fc.ContainerStore(), executor=how)
        sess.run(init)
        results[forward] = sess.run(["a:0", "out:0", "w:0", "x:0"], {"x:0": xv.copy()})
    an = np.maximum(xv, 0)
    bn = an + 1
    en = np.arange(30, dtype=np.float32).reshape(6, 5) + (bn * bn - bn)
    want = [an, (-en.reshape(30) + en.reshape(30)) * 2, np.arange(30, dtype=np.float32).reshape(6, 5), xv]
    for got in results.values():
        for g_, w_ in zip(got, want):
            np.testing.assert_array_equal(g_, w_)


def test_a_tensor_another_device_still_reads_is_not_overwritten(monkeypatch) -> None:
    # Two virtual CPU devices of one process share arrays (no copy): a on cpu:0 is sent to cpu:1,
    # and its last reader on cpu:0 forwards only if cpu:1 no longer holds it.
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (200, 200), name="x")
        a = fc.relu(x, name="a")
        b = fc.neg(a, name="b")  # a's last reader on cpu:0
        s = fc.matmul(a, a, name="s")  # reads a, slowly, on cpu:1
        t = fc.add(s, a, name="t")
        fc.add(fc.reduce_sum(b, name="sb"), fc.reduce_sum(t, name="st"), name="y")
    cl = Cluster.local(2)
    d0, d1 = cl.names
    placement = {n: d0 for n in g.nodes} | {"s": d1, "t": d1, "st": d1}
    xv = np.random.default_rng(0).standard_normal((200, 200)).astype(np.float32)
    an = np.maximum(xv, 0)
    want = (-an).sum(dtype=np.float32) + (an @ an + an).sum(dtype=np.float32)
    monkeypatch.setattr(executor, "FORWARD", True)
    with DistributedSession(g, cl, placement, store=fc.ContainerStore()) as sess:
        for _ in range(5):
            np.testing.assert_allclose(sess.run("y:0", {"x:0": xv}), want, rtol=1e-5)


def test_training_steps_give_the_same_bits_with_and_without_forwarding(tmp_path: Path, monkeypatch) -> None:
    # Forwarded kernels are exactly rounded element-wise operations (and the cross-entropy's own
    # passes) in the allocating kernels' order: the losses and weights agree to the bit.
    from flowctl.training.runs import load_training_spec
    from flowctl.training.trainer import Trainer

    out = {}
    for forward in (True, False):
        monkeypatch.setattr(executor, "FORWARD", forward)
        loaded, text, path = load_training_spec(str(ROOT / "specs" / "lstm_lm.yaml"), overrides=LM)
        tr = Trainer(loaded, tmp_path / f"run{forward}", steps=3, prefetch=0)
        tr.start_fresh(text, path)
        tr.train()
        out[forward] = tr.session.variable_values()
        tr.close()
    assert out[True].keys() == out[False].keys()
    for k in out[True]:
        np.testing.assert_array_equal(out[True][k], out[False][k], err_msg=k)


def test_the_cross_entropy_gradient_takes_the_logits_buffer() -> None:
    # logits = BiasAdd(MatMul) (into the MatMul's buffer), then Reshapes, then the cross-entropy,
    # whose gradient takes the logits' buffer through the whole-buffer views: one (n, c) buffer
    # of logits-sized memory at a time where there were three.
    n, c = 64, 500
    g = fc.Graph()
    with g.as_default():
        h = fc.placeholder("float32", (n, 32), name="h")
        labels = fc.placeholder("int32", (n,), name="labels")
        w = fc.variable(np.zeros((32, c), np.float32), name="w")
        bias = fc.variable(np.zeros((c,), np.float32), name="bias")
        logits = fc.bias_add(fc.matmul(h, w, name="mm"), bias, name="logits")
        folded = fc.reshape(fc.reshape(logits, [n // 8, 8, c], name="unfold"), [n, c], name="fold")
        loss = fc.sparse_softmax_cross_entropy(folded, labels, name="xent")
        fc.reduce_mean(loss, name="mean")
    t = table(g)
    for name in ("logits", "xent"):
        assert t.forward[t.index[name]] == (0,), name
    keep = step_nodes(g)
    on = simulate_table(t, [0] * len(t.names), cluster())
    off = simulate_table(dataclasses.replace(t, forward=[]), [0] * len(t.names), cluster())
    logits_bytes = n * c * 4
    step_on = on.device(D0).peak_memory - on.device(D0).resident
    step_off = off.device(D0).peak_memory - off.device(D0).resident
    assert step_off >= 2 * logits_bytes + n * 4  # logits beside the gradient, and the loss
    assert step_on <= logits_bytes + 4096  # one logits-sized buffer (and the bias's 2 KB initial value)
    held = held_at_peak(t, [0] * len(t.names), cluster())[0]
    assert sum(h.bytes for h in held) == on.device(D0).peak_memory
    assert keep  # the step is the whole graph


@pytest.mark.parametrize("how", EXECUTORS)
def test_the_cross_entropy_in_place_gives_the_same_loss_and_gradient(how: str, monkeypatch) -> None:
    rng = np.random.default_rng(1)
    n, c = 300, 1000  # more than one of the CPU kernel's blocks of rows
    hv = rng.standard_normal((n, 16)).astype(np.float32)
    wv = rng.standard_normal((16, c)).astype(np.float32)
    lv = rng.integers(0, c, n).astype(np.int32)
    res = {}
    for forward in (True, False):
        monkeypatch.setattr(executor, "FORWARD", forward)
        g = fc.Graph()
        with g.as_default():
            h = fc.placeholder("float32", (n, 16), name="h")
            labels = fc.placeholder("int32", (n,), name="labels")
            logits = fc.matmul(h, fc.constant(wv), name="logits")
            loss = fc.sparse_softmax_cross_entropy(fc.reshape(logits, [n, c]), labels, name="xent")
            grad = fc.gradients(fc.reduce_sum(loss), [logits])[0]
        stats = fc.RunStats()
        res[forward] = fc.Session(g, executor=how).run([loss, grad], {"h:0": hv, "labels:0": lv}, stats=stats)
        res[forward].append(stats.peak_bytes)
    for a, b in zip(res[True][:2], res[False][:2]):
        np.testing.assert_array_equal(a, b)
    z = hv.astype(np.float64) @ wv.astype(np.float64)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(res[True][0], -np.log(p[np.arange(n), lv]), rtol=1e-4, atol=1e-5)
    assert res[True][2] <= res[False][2] - n * c * 4 + 1024, (res[True][2], res[False][2])


def test_every_forwarding_op_has_an_in_place_kernel_wherever_it_has_a_kernel() -> None:
    forwarding = [name for name, d in OPS.items() if d.forward]
    assert {"Add", "Mul", "BiasAdd", "XentGrad", "SparseSoftmaxCrossEntropyWithLogits"} <= set(forwarding)
    for op in forwarding:
        for device_type in ("cpu", "gpu"):
            if (op, device_type) in KERNELS:
                assert (op, device_type) in INTO, (op, device_type)
    assert {op for op, _ in INTO} <= set(forwarding)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Maximum", "Minimum", "ReluGrad", "SigmoidGrad",
                                "TanhGrad", "AddN"])
def test_in_place_kernels_give_the_allocating_kernels_bits(op: str) -> None:
    from flowctl.kernels.registry import bind, bind_into

    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, 9)).astype(np.float32)
    y = rng.uniform(0.1, 0.9, (7, 9)).astype(np.float32)
    z = rng.standard_normal((7, 9)).astype(np.float32)
    args = (x, y, z) if op == "AddN" else (x, y)
    want = bind(op, "cpu", {})(*args)
    for k in (0, 1):
        copies = [a.copy() for a in args]
        got = bind_into(op, "cpu", {})(k, *copies)
        assert got is copies[k]  # written where it was asked to be
        np.testing.assert_array_equal(got, want)
    # Broadcasting to a larger shape than input k's: a buffer of its own, the same values.
    if op in ("Add", "Sub", "Mul", "Div", "Maximum", "Minimum"):
        row = y[:1].copy()
        got = bind_into(op, "cpu", {})(1, x, row)
        np.testing.assert_array_equal(got, bind(op, "cpu", {})(x, y[:1]))
        np.testing.assert_array_equal(row, y[:1])


def test_forwarding_off_by_environment(monkeypatch) -> None:
    monkeypatch.setattr(executor, "FORWARD", False)
    plan = fc.Session(chain()).plan_for("y:0", {"x:0": np.zeros(1000, np.float32)})
    assert not any(plan.forward)
    monkeypatch.setattr(executor, "FORWARD", True)
    plan = fc.Session(chain()).plan_for("y:0", {"x:0": np.zeros(1000, np.float32)})
    assert [plan.nodes[i].name for i, f in enumerate(plan.forward) if f] == ["b", "c"]
