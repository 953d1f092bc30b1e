"""CollectiveAllReduce (issue 33: the all-reduce's transport from the distributed engine): N nodes,
one per replica device, meeting in the step's rendezvous. On CPU devices of one process (switched
on with `collective=True` / FLOWCTL_COLLECTIVE=on) the sum is rank 0 + rank 1 + ...: two replicas
give the Send/Recv exchange's bits, three the ring's to float rounding, and the replicas stay
bitwise identical; a failed step wakes the ranks that wait instead of hanging; the cost model
prices the wire. The NCCL kernel is checked on >= 2 GPUs only (the `gpu` test)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine import allreduce as ar
from flowctl.engine import checkpoint as ckpt
from flowctl.engine import strategies as st
from flowctl.engine.cluster import Cluster
from flowctl.engine.container import ContainerStore
from flowctl.engine.errors import ExecutionError, GraphError
from flowctl.engine.ops.communication import collective_all_reduce
from flowctl.engine.optimizers import SGD, Adam
from flowctl.engine.placement.cost import StaticCostModel, collective_transfer
from flowctl.engine.rendezvous import LocalRendezvous, RendezvousAborted
from flowctl.engine.runtime import DistributedSession, count_transfers

from test_allreduce import CPUS, batch, mlp

TIMEOUT = 60.0  # a hung step fails the test instead of hanging the suite (never a timing assert)


def in_time(fn, *args, **kw):
    """fn(*args) on a thread, joined within TIMEOUT: (returned value, raised exception)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(TIMEOUT)
    assert not t.is_alive(), f"no answer within {TIMEOUT} s: the step hangs"
    return out.get("value"), out.get("error")


def trained(replicas: int, collective: bool, opt: str = "adam", steps: int = 4, bucket: int | None = 200,
            check_numerics: bool = False):
    g, x, y, loss, variables = mlp()
    optimizer = {"adam": Adam(0.01), "sgd": SGD(0.1)}[opt]
    with g.as_default():
        step = st.sync_data_parallel(g, loss, {"x": x, "y": y}, variables, optimizer, CPUS[:replicas],
                                     reduce="allreduce", bucket_bytes=bucket, collective=collective)
        init = fc.global_variables_initializer(g)
    placement = st.complete_placement(g, step.placement, CPUS[0])
    s = DistributedSession(g, Cluster.local(replicas), placement, store=ContainerStore(),
                           check_numerics=check_numerics, step_timeout=TIMEOUT)
    s.run(init)
    X, Y = batch()
    losses = [float(s.run([step.loss, step.train_op], step.feeds({"x": X, "y": Y}))[0]) for _ in range(steps)]
    return s, step, losses


def collectives(graph: fc.Graph) -> list:
    return [n for n in graph.nodes.values() if n.op == "CollectiveAllReduce"]


def identical_replicas(s: DistributedSession, step) -> None:
    values = s.variable_values()
    for m, p in ckpt.mirrors(step.graph).items():
        np.testing.assert_array_equal(values[m], values[p], err_msg=m)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_two_replicas_give_the_exchanges_bits(opt):
    ring, _, ring_losses = trained(2, False, opt)
    s, step, losses = trained(2, True, opt)
    nodes = collectives(step.graph)
    assert nodes and len(nodes) % 2 == 0 and not collectives(trained(2, False, opt, steps=0)[1].graph)
    assert {n.attrs["rank"] for n in nodes} == {0, 1} and all(n.attrs["group_size"] == 2 for n in nodes)
    assert len({n.attrs["group_key"] for n in nodes}) == len(nodes) // 2  # one group per bucket, two ranks each
    assert losses == ring_losses and losses[-1] < losses[0]
    ref = ring.variable_values()
    for k, v in s.variable_values().items():
        np.testing.assert_array_equal(v, ref[k], err_msg=k)
    identical_replicas(s, step)


def test_three_replicas_agree_with_the_ring_to_float_rounding_and_stay_identical():
    ring, _, ring_losses = trained(3, False)
    s, step, losses = trained(3, True)
    assert {n.attrs["rank"] for n in collectives(step.graph)} == {0, 1, 2}
    np.testing.assert_allclose(losses, ring_losses, rtol=1e-6)
    ref = ring.variable_values()
    for k, v in s.variable_values().items():
        np.testing.assert_allclose(v, ref[k], rtol=1e-5, atol=1e-7, err_msg=k)
    identical_replicas(s, step)


def test_no_gradient_crosses_through_send_and_recv():
    """The ring moves each bucket through Recv nodes; the collective moves none: what still
    crosses is the replicas' losses for the mean."""
    counts = {}
    for collective in (False, True):
        s, step, _ = trained(3, collective, steps=1)
        sp = s.step_plan([step.loss, step.train_op], step.feeds(dict(zip(("x", "y"), batch()))))
        recvs = [n.attrs["tensor_name"] for g in sp.partitions.values() for n in g.nodes.values() if n.op == "Recv"]
        counts[collective] = (sum(count_transfers(sp.partitions).values()), [r for r in recvs if "allreduce/" in r])
    assert counts[False][1] and not counts[True][1]
    assert counts[True][0] < counts[False][0]


def test_the_rendezvous_reduces_once_on_the_last_rank_in_rank_order():
    r = LocalRendezvous()
    got: dict[int, object] = {}
    calls = []

    def reduce(values):
        calls.append(threading.get_ident())
        return [sum(values)] * len(values)

    for rank in (2, 0):  # out of order: nothing happens until the last
        r.collective(("s", "g"), rank, 3, 10 ** rank, reduce, lambda v, e, rank=rank: got.setdefault(rank, (v, e)))
    assert got == {} and calls == []
    r.collective(("s", "g"), 1, 3, 10, reduce, lambda v, e: got.setdefault(1, (v, e)))
    assert calls == [threading.get_ident()] and got == {k: (111, None) for k in range(3)}
    errs = []
    r.collective(("s", "h"), 0, 2, 1, reduce, lambda v, e: errs.append(e))
    r.collective(("s", "h"), 0, 2, 1, reduce, lambda v, e: errs.append(e))
    assert len(errs) == 1 and "joined twice" in str(errs[0])


def test_an_abort_wakes_the_ranks_that_wait_and_fails_later_ones_at_once():
    r = LocalRendezvous()
    got = []
    r.collective(("s", "g"), 0, 2, 1.0, lambda v: v, lambda v, e: got.append(e))
    r.abort(ValueError("device 1 failed"))
    r.collective(("s", "g"), 1, 2, 1.0, lambda v: v, lambda v, e: got.append(e))
    assert len(got) == 2 and all(isinstance(e, RendezvousAborted) and "device 1 failed" in str(e) for e in got)


def test_a_non_finite_gradient_fails_the_step_without_hanging_and_the_session_recovers():
    s, step, _ = trained(3, True, steps=1, check_numerics=True)
    X, Y = batch()
    bad = X.copy()
    bad[-1, 0] = np.nan  # the last replica's share of the batch
    _, err = in_time(s.run, [step.loss, step.train_op], step.feeds({"x": bad, "y": Y}))
    assert isinstance(err, ExecutionError) and "replica_2/" in str(err), err
    before = s.variable_values()
    loss, err = in_time(s.run, [step.loss, step.train_op], step.feeds({"x": X, "y": Y}))
    assert err is None and np.isfinite(loss[0])
    identical_replicas(s, step)
    assert any(not np.array_equal(v, before[k]) for k, v in s.variable_values().items())


def two_rank_graph(fail_on_1: bool):
    """x0 on cpu:0 and x1 on cpu:1 all-reduced; rank 1's input made by a Gather whose ids the test
    feeds (an id out of range fails the step on cpu:1 while rank 0 waits)."""
    g = fc.Graph()
    devs = ["cpu:0", "cpu:1"]
    with g.as_default():
        x0 = fc.placeholder("float32", (4,), name="x0")
        table = fc.constant(np.arange(8, dtype=np.float32).reshape(2, 4), name="table")
        ids = fc.placeholder("int32", (), name="ids")
        x1 = fc.gather(table, ids, name="x1")
        outs = [collective_all_reduce(x, "g", 2, k, devs, name=f"sum{k}") for k, x in enumerate((x0, x1))]
    placement = {"x0": devs[0], "table": devs[1], "ids": devs[1], "x1": devs[1],
                 "sum0": devs[0], "sum1": devs[1]}
    s = DistributedSession(g, Cluster.local(2), placement, store=ContainerStore(), step_timeout=TIMEOUT)
    return s, x0, ids, outs


def test_an_aborted_step_wakes_the_waiting_rank():
    s, x0, ids, outs = two_rank_graph(True)
    a = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    (r0, r1), err = in_time(s.run, outs, {x0: a, ids: np.int32(1)})
    assert err is None
    np.testing.assert_array_equal(r0, a + np.arange(4, 8, dtype=np.float32))
    np.testing.assert_array_equal(r0, r1)
    _, err = in_time(s.run, outs, {x0: a, ids: np.int32(7)})
    assert isinstance(err, ExecutionError) and "x1" in str(err) and not isinstance(err, RendezvousAborted), err
    (r0, _), err = in_time(s.run, outs, {x0: a, ids: np.int32(0)})  # the next step starts clean
    assert err is None
    np.testing.assert_array_equal(r0, a + np.arange(4, dtype=np.float32))


def test_a_collective_needs_a_rendezvous():
    s, x0, ids, outs = two_rank_graph(False)
    with pytest.raises(ExecutionError, match="needs a step context"):
        fc.Session(s.graph, store=ContainerStore()).run(outs[0], {x0: np.zeros(4, np.float32)})


def test_the_choice_of_transport():
    gpus = ["gpu:0", "gpu:1"]
    assert ar.use_collective(gpus) and ar.use_collective(gpus, "on") and not ar.use_collective(gpus, "off")
    assert not ar.use_collective(CPUS[:2]) and ar.use_collective(CPUS[:2], "on")
    assert not ar.use_collective(["worker0/gpu:0", "worker1/gpu:0"], "on")  # Ray workers: the ring
    assert not ar.use_collective(["gpu:0", "gpu:0"]) and not ar.use_collective(["gpu:0"])
    with pytest.raises(GraphError, match="auto, on or off"):
        ar.use_collective(gpus, "nccl")


def test_the_env_switch_turns_it_on_for_cpus(monkeypatch):
    monkeypatch.setenv(ar.COLLECTIVE_ENV, "on")
    g, x, y, loss, variables = mlp()
    with g.as_default():
        step = st.sync_data_parallel(g, loss, {"x": x, "y": y}, variables, SGD(0.1), CPUS[:2], reduce="allreduce")
    assert collectives(step.graph)


def test_the_cost_model_prices_the_ring_traffic_over_the_link():
    cluster = Cluster.from_spec("4xgpu:h100")
    devs = cluster.names
    g = fc.Graph()
    with g.as_default():
        xs = [fc.placeholder("float32", (1 << 20,), name=f"x{k}") for k in range(4)]
        outs = [collective_all_reduce(x, "g", 4, k, devs, name=f"sum{k}") for k, x in enumerate(xs)]
    model = StaticCostModel(cluster)
    node = g.nodes[outs[1].node]
    wire = collective_transfer(model, g, node)
    assert wire == model.transfer_time(int(4 * (1 << 20) * 2 * 3 / 4), devs[1], devs[2]) > 0
    flops, nbytes = model.estimate(g, node)
    assert model.op_time(g, node, devs[1]) == pytest.approx(model.time_of(flops, nbytes, devs[1]) + wire)
    from flowctl.engine.placement.simulator import simulate

    sim = simulate(g, {**{f"x{k}": devs[k] for k in range(4)}, **{o.node: devs[k] for k, o in enumerate(outs)}},
                   cluster, model)
    assert sim.step_time >= wire


@pytest.mark.gpu
def test_nccl_all_reduce_on_two_gpus():
    cp = pytest.importorskip("cupy")
    pytest.importorskip("cupy.cuda.nccl")
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two CUDA devices")
    from flowctl.engine.cluster import Device, PROFILES
    from flowctl.engine.devices import canonical

    devs = [canonical("gpu:0"), canonical("gpu:1")]
    cluster = Cluster([Device(d, PROFILES["h100"]) for d in devs])
    g = fc.Graph()
    with g.as_default():
        xs = [fc.placeholder("float32", (1000,), name=f"x{k}") for k in range(2)]
        outs = [collective_all_reduce(fc.mul(x, 2.0, name=f"twice{k}"), "g", 2, k, devs, name=f"sum{k}")
                for k, x in enumerate(xs)]
    placement = {n: devs[int(n[-1])] for n in g.nodes if n[-1] in "01"}
    placement.update({n: devs[0] for n in g.nodes if n not in placement})
    s = DistributedSession(g, cluster, placement, store=ContainerStore(), step_timeout=TIMEOUT)
    rng = np.random.default_rng(0)
    a, b = (rng.normal(size=1000).astype(np.float32) for _ in range(2))
    for _ in range(3):  # several steps: the clique is made once
        (r0, r1), err = in_time(s.run, outs, {xs[0]: a, xs[1]: b})
        assert err is None, err
        np.testing.assert_array_equal(r0, r1)  # identical on every rank
        np.testing.assert_allclose(r0, 2 * a + 2 * b, rtol=1e-6)  # NCCL's order, not bitwise numpy's
