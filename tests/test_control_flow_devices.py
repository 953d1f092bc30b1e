"""A while loop whose body is split over 2 virtual CPU devices (§4.4 across devices): each device
runs its own control loop, the predicate travels every iteration, and the rendezvous keys carry
frame and iteration. The result equals the single-device one exactly."""
from __future__ import annotations

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.cluster import Cluster
from flowctl.engine.control_flow import cond, while_loop
from flowctl.engine.errors import PlacementError
from flowctl.engine.partition import partition
from flowctl.engine.runtime import DistributedSession


def _loop(parallel: int) -> tuple[fc.Graph, fc.Tensor, list[fc.Tensor]]:
    rng = np.random.default_rng(0)
    w1, w2 = rng.standard_normal((4, 4)), rng.standard_normal((4, 4))
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (2, 4), name="x")
        W1, W2 = fc.constant(w1, name="w1"), fc.constant(w2, name="w2")

        def body(i, h):
            a = fc.tanh(fc.matmul(h, W1), name="a")
            b = fc.tanh(fc.matmul(h, W2, name="mm2"), name="b")
            return i + 1, cond(fc.greater(fc.reduce_sum(b, name="sum_b"), fc.constant(0.0, dtype="float64")),
                               lambda: a + b, lambda: a - b)

        out = while_loop(lambda i, h: fc.less(fc.reduce_sum(h * h, name="norm"), fc.constant(12.0, dtype="float64")),
                         body, [fc.constant(0, dtype="int32"), x * 0.3], parallel_iterations=parallel)
    return g, x, out


def _split(g: fc.Graph, cluster: Cluster) -> dict[str, str]:
    d0, d1 = cluster.names
    on_1 = {"w2", "mm2", "b", "sum_b", "Greater", "norm"}  # half the body, the cond's and the loop's predicates
    return {n: d1 if n.split("/")[-1] in on_1 else d0 for n in g.nodes}


@pytest.mark.parametrize("parallel", [1, 3])
def test_loop_body_on_two_devices_gives_the_single_device_result(parallel: int) -> None:
    g, x, out = _loop(parallel)
    x0 = np.random.default_rng(1).standard_normal((2, 4))
    want = fc.Session(g).run(out, {x: x0})
    assert int(want[0]) > 3  # the loop really iterates
    cluster = Cluster.local(2)
    placement = _split(g, cluster)
    parts = partition(g, placement)
    d0, d1 = cluster.names
    assert any(n.startswith("_loop/while/") for n in parts[d1].nodes)  # device 1's control loop
    assert any(n.startswith("_recv/") and "while" in n for n in parts[d1].nodes)
    with DistributedSession(g, cluster, placement, store=fc.ContainerStore()) as s:
        for _ in range(2):
            got = s.run(out, {x: x0})
            assert int(got[0]) == int(want[0])
            np.testing.assert_array_equal(got[1], want[1])


def test_a_loops_control_split_over_devices_is_refused() -> None:
    g, x, out = _loop(1)
    cluster = Cluster.local(2)
    placement = _split(g, cluster)
    placement["while/Switch_1"] = cluster.names[1]
    with pytest.raises(PlacementError, match="control nodes .* must share one device"):
        partition(g, placement)


DYNAMIC_LM = """\
version: 1
name: placed_lm
model:
  layers:
    - {name: tokens, type: input, shape: [6], dtype: int32, classes: 30}
    - {name: embedding, type: embedding, vocab: 30, dim: 8, init_scale: 0.1, inputs: [tokens]}
    - {name: lstm_1, type: lstm, units: 10, init_scale: 0.1, unroll: dynamic}
    - {name: lstm_2, type: lstm, units: 10, init_scale: 0.1, unroll: dynamic}
    - {name: softmax, type: dense, units: 30}
    - {name: targets, type: input, shape: [6], dtype: int32, classes: 30}
    - {name: loss, type: softmax_cross_entropy, inputs: [softmax, targets]}
devices: [cpu:0, cpu:1]
parallelism:
  groups:
    - {layers: [embedding, lstm_1], device: cpu:0}
    - {layers: [lstm_2, softmax, loss], device: cpu:1}
training: {optimizer: {type: momentum}, learning_rate: 0.1, batch_size: 4, seed: 4}
"""


@pytest.mark.parametrize("alg", ["expert", "greedy"])
def test_dynamic_lstm_training_placed_on_two_devices_equals_one(alg: str) -> None:
    from flowctl.engine.placement import StaticCostModel, place
    from flowctl.bench.spec import _feeds
    from flowctl.spec.loader import load_text
    from flowctl.spec.model import build_model
    from flowctl.training.program import build_step, step_config

    def losses(n_devices: int) -> tuple[list[float], dict]:
        loaded = load_text(DYNAMIC_LM)
        config = step_config(loaded)
        st = build_step(build_model(loaded), config)
        g = st.graph
        store = fc.ContainerStore()
        fc.Session(g, store=store).run(st.init.node)
        feeds = _feeds(st, loaded)
        feeds[st.lr] = np.float32(0.1)
        if n_devices == 1:
            sess = fc.Session(g, store=store)
        else:
            cluster = Cluster.local(2, threads=2)
            pl = place(g, cluster, StaticCostModel(cluster, batch=4), alg, targets=st.targets,
                       rules=config.expert_rules(), layers=st.model.layer_of())
            assert len(set(pl.assignment.values())) == 2
            sess = fc.DistributedSession(g, cluster, pl.assignment, store=store)
        out = [float(sess.run([st.train.loss, st.train.train_op], feeds)[0]) for _ in range(3)]
        if n_devices > 1:
            sess.close()
        return out, sess.variable_values()

    want, want_vars = losses(1)
    got, got_vars = losses(2)
    assert got == want
    for k in want_vars:
        np.testing.assert_array_equal(got_vars[k], want_vars[k], err_msg=k)


def test_alap_receive_scheduling_leaves_loop_receives_to_their_frame() -> None:
    g, x, out = _loop(2)
    x0 = np.random.default_rng(2).standard_normal((2, 4))
    want = fc.Session(g).run(out, {x: x0})
    cluster = Cluster.local(2)
    with DistributedSession(g, cluster, _split(g, cluster), store=fc.ContainerStore(), recv_schedule="alap") as s:
        got = s.run(out, {x: x0})
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("taken", [True, False])
def test_alap_never_delays_a_receive_behind_a_branch_that_may_not_run(taken: bool) -> None:
    """§5.2 with §4.4: the node ALAP would pick to delay the Recv of `z` (it finishes just before
    `c` needs `z`) is the last op of a cond branch; when that branch is not taken it is dead, and a
    dead control input would make the Recv, and `c`, dead. Only nodes that are never dead qualify."""
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (3,), name="x")
        p = fc.placeholder("bool", (), name="p")

        def long() -> fc.Tensor:
            h = x
            for k in range(4):
                h = fc.tanh(h, name=f"t{k}")
            return h

        r = cond(p, long, lambda: x * 3.0)
        z = x
        for k in range(5):  # finishes on device 1 as the long branch's last op does on device 0
            z = fc.sin(z, name=f"z{k}")
        c = fc.add(x, z, name="c")
    cluster = Cluster.local(2)
    d0, _ = cluster.names
    placement = {n: cluster.names[1] if n.startswith("z") else d0 for n in g.nodes}
    parts = partition(g, placement, recv_schedule="alap")
    (recv,) = [n for n in parts[d0].nodes.values() if n.op == "Recv"]
    assert recv.control_inputs and not any(c.startswith("cond/") for c in recv.control_inputs)
    feeds = {x: np.array([0.5, -1.0, 2.0]), p: np.bool_(taken)}
    want = fc.Session(g).run([c, r], feeds)
    with DistributedSession(g, cluster, placement, store=fc.ContainerStore(), recv_schedule="alap") as s:
        got = s.run([c, r], feeds)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_control_loops_of_two_tasks_with_the_same_local_device_get_distinct_names() -> None:
    g, x, out = _loop(1)
    owner, *others = [f"/job:worker/task:{k}/device:cpu:0" for k in range(3)]
    placement = {n: others[0] if n.endswith("/a") else others[1] if n.endswith("/b") else owner for n in g.nodes}
    parts = partition(g, placement)
    for d, short in zip(others, ["worker1_cpu0", "worker2_cpu0"]):
        assert f"_loop/while/{short}/merge" in parts[d].nodes


@pytest.mark.parametrize("trips", [1, 10])
def test_the_simulator_charges_a_value_made_in_a_loop_once_per_iteration_it_crosses(trips: int) -> None:
    """A loop body split over two devices sends its value every iteration (the runtime's Send and
    Recv run in the frame); an invariant entering the loop crosses once, an Exit's value once."""
    from flowctl.engine.placement import StaticCostModel
    from flowctl.engine.placement.simulator import simulate

    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (64, 64), name="x")
        w = fc.constant(np.ones((64, 64), np.float32), name="w")
        out = while_loop(lambda i, h: fc.less(i, fc.constant(np.int32(trips))),
                         lambda i, h: (i + 1, fc.tanh(fc.matmul(h, w, name="mm"), name="act")),
                         [fc.constant(np.int32(0)), x], expected_iterations=trips)
        y = fc.reduce_sum(out[1], name="y")
    cluster = Cluster.from_spec("2xgpu:k40")
    a, b = cluster.names
    placement = {n: a for n in g.nodes}
    placement["while/act"] = b  # the body's matmul on one GPU, its tanh on the other
    res = simulate(g, placement, cluster, StaticCostModel(cluster, batch=64), targets=[y.node])
    moved = {(ls.src, ls.dst): ls.bytes for ls in res.links}
    per = 64 * 64 * 4
    assert moved[(a, b)] == trips * per  # mm's output, every iteration
    assert moved[(b, a)] == trips * per  # act's output back to the loop's NextIteration/Merge
    # The list schedulers (greedy, HEFT) cost a crossing by the same table: per iteration too.
    from flowctl.engine.placement import prepare

    pb = prepare(g, cluster, StaticCostModel(cluster, batch=64), [y.node])
    t = pb.table
    mm, ysum = t.names.index("while/mm"), t.names.index("y")
    assert t.crossing(mm, 0, 0, 1) == pytest.approx(trips * t.transfer(per, 0, 1))
    assert t.crossing(ysum, 0, 0, 1) == pytest.approx(t.transfer(4, 0, 1))
