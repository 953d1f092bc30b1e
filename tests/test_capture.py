"""The captured step's bookkeeping (engine/capture.py) on a CPU: warm-up, capture, replay, the
refusals, the step's guard on the device. The GPU's array module is stood in for by numpy with the
device module's extras (`jit.simulated_module`), and its capture by a backend whose "graph" runs
the plan again; test_capture_ledger.py replays a recorded tape instead, as a CUDA graph does
(variables given new arrays between steps, exact resume)."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.errors import NonFiniteError
from flowctl.engine.optimizers import SGD
from flowctl.kernels.cuda.jit import simulated_module
from flowctl.kernels.registry import override_array_module


class RerunGraph:
    def __init__(self, rerun):
        self.rerun, self.nodes, self.outputs = rerun, 1, None


class FakeCapture:
    """A capture backend over numpy: capturing sets a flag the module's is_capturing reads; the
    captured step is computed while it is recorded (ran_during_capture), a launch runs it again."""

    ran_during_capture = True

    def __init__(self, xp, log):
        self.xp, self.log = xp, log

    @contextlib.contextmanager
    def running(self):
        yield

    def begin(self):
        self.log.append("begin")
        self.xp.capturing = True

    def end(self, rerun):
        self.xp.capturing = False
        self.log.append("end")
        return RerunGraph(rerun)

    def abandon(self):
        self.xp.capturing = False
        self.log.append("abandon")

    def launch(self, graph):
        """Run the step again and write its results into the arrays the capture returned, as a
        replay writes into the graph's static buffers."""
        self.log.append("launch")
        for static, new in zip(graph.outputs, graph.rerun()):
            if static is not None and static is not new:
                static[...] = new

    def upload(self, graph):
        pass

    def copy_in(self, dst, value):
        dst[...] = value

    def synchronize(self):
        pass

    def held_bytes(self):
        return 0


def module(log):
    xp = simulated_module()
    xp.capturing = False
    xp.is_capturing = lambda: xp.capturing
    xp.capture_backend = lambda: FakeCapture(xp, log)
    return xp


def sgd_graph():
    g = fc.Graph(seed=3)
    with g.as_default():
        x = fc.placeholder("float32", (None, 4), name="x")
        y = fc.placeholder("int32", (None,), name="y")
        w = fc.variable(fc.truncated_normal((4, 3), stddev=0.5), name="w")
        loss = fc.reduce_mean(fc.sparse_softmax_cross_entropy(fc.matmul(x, w), y), name="loss")
        guard = fc.check_numerics(loss, message="the step's loss", name="loss_guard")
        train = SGD(0.5).minimize(loss)
        g.nodes[train.op.name].control_inputs.append(guard.node)
        init = fc.global_variables_initializer()
    return g, x, y, w, loss, train, init


def batches(n, rng):
    return [(rng.standard_normal((6, 4)).astype(np.float32), rng.integers(0, 3, 6).astype(np.int32))
            for _ in range(n)]


def losses(sess, x, y, loss, train, data):
    return [float(sess.run([loss, train], {x: a, y: b})[0]) for a, b in data]


def test_warm_up_then_capture_then_replays_give_the_uncaptured_losses(rng):
    g, x, y, w, loss, train, init = sgd_graph()
    data = batches(5, rng)
    ref = fc.Session(g, store=fc.ContainerStore())
    ref.run(init)
    expected = losses(ref, x, y, loss, train, data)
    log: list[str] = []
    with override_array_module("gpu", module(log)):
        sess = fc.Session(g, device="gpu:0", store=fc.ContainerStore())
        sess.run(init)
        got = losses(sess, x, y, loss, train, data)
        report = sess.capture_report()
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    step = max(report["plans"], key=lambda p: p["captured_steps"])
    assert step["captured"] and step["reason"] is None
    assert (step["eager_steps"], step["captured_steps"]) == (2, 3)  # warm-up, capture, two replays
    assert log.count("begin") == 1 and log.count("launch") == 2


def test_a_capture_that_fails_runs_the_step_eagerly_and_says_why(rng):
    g, x, y, w, loss, train, init = sgd_graph()
    data = batches(4, rng)
    ref = fc.Session(g, store=fc.ContainerStore())
    ref.run(init)
    expected = losses(ref, x, y, loss, train, data)
    log: list[str] = []
    xp = module(log)
    real_matmul = xp.matmul

    def refusing(a, b, *args, **kw):
        if xp.capturing:
            raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")
        return real_matmul(a, b, *args, **kw)

    xp.matmul = refusing
    with override_array_module("gpu", xp):
        sess = fc.Session(g, device="gpu:0", store=fc.ContainerStore())
        sess.run(init)
        got = losses(sess, x, y, loss, train, data)
        report = sess.capture_report()
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    step = max(report["plans"], key=lambda p: p["eager_steps"])
    assert not step["captured"] and "cuBLAS" in step["reason"]
    assert step["eager_steps"] == 4 and "abandon" in log


def test_a_non_finite_captured_step_raises_from_the_guard_and_changes_nothing(rng):
    g, x, y, w, loss, train, init = sgd_graph()
    data = batches(3, rng)
    with override_array_module("gpu", module([])):
        sess = fc.Session(g, device="gpu:0", store=fc.ContainerStore())
        sess.run(init)
        losses(sess, x, y, loss, train, data)  # captured by now
        before = sess.variable_values()["w"].copy()
        bad = data[0][0].copy()
        bad[0, 0] = np.nan
        with pytest.raises(NonFiniteError) as e:
            sess.run([loss, train], {x: bad, y: data[0][1]})
        assert e.value.node == "loss_guard"
        np.testing.assert_array_equal(sess.variable_values()["w"], before)
        losses(sess, x, y, loss, train, data[:1])  # the flag was reset: the next step runs


def test_a_step_with_control_flow_is_not_captured(rng):
    g = fc.Graph(seed=0)
    with g.as_default():
        p = fc.placeholder("bool", (), name="p")
        a = fc.placeholder("float32", (3,), name="a")
        out = fc.cond(p, lambda: a * 2.0, lambda: a + 1.0)
    with override_array_module("gpu", module([])):
        sess = fc.Session(g, device="gpu:0", store=fc.ContainerStore())
        for flag in (True, False, True):
            v = sess.run(out, {p: np.asarray(flag), a: np.ones(3, np.float32)})
            np.testing.assert_allclose(v, 2.0 if flag else 2.0)
        report = sess.capture_report()
    assert not report["plans"][0]["captured"] and "control flow" in report["plans"][0]["reason"]
