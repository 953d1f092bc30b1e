"""Sessions and executors: partial execution (§4.2), buffer release (§3.1), plan caching,
errors that name the node, containers (§4.7), and the two executors agreeing."""
from __future__ import annotations

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.graph import Graph, parse_ref


def two_branch_graph() -> tuple[fc.Graph, dict]:
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (3,), name="x")
        a = fc.exp(x, name="a")
        b = fc.tanh(a, name="b")
        c = fc.square(b, name="c")
        d = fc.neg(x, name="d")
        e = fc.sqrt(fc.abs_(d, name="abs_d"), name="e")
    return g, dict(x=x, a=a, b=b, c=c, d=d, e=e)


@pytest.mark.parametrize("executor", ["compiled", "dataflow"])
def test_feeding_an_intermediate_skips_everything_upstream(executor):
    g, t = two_branch_graph()
    s = fc.Session(g, store=fc.ContainerStore(), executor=executor)
    stats = fc.RunStats()
    out = s.run(t["c"], {t["b"]: np.array([1.0, 2.0, 3.0])}, stats=stats)
    np.testing.assert_allclose(out, [1.0, 4.0, 9.0])
    assert stats.nodes_run == ["c"]  # neither x, a nor b ran, and nothing of the other branch


@pytest.mark.parametrize("executor", ["compiled", "dataflow"])
def test_fetching_one_branch_never_runs_the_other(executor):
    g, t = two_branch_graph()
    s = fc.Session(g, store=fc.ContainerStore(), executor=executor)
    stats = fc.RunStats()
    s.run(t["e"], {t["x"]: np.array([1.0, 4.0, 9.0])}, stats=stats)
    assert set(stats.nodes_run) == {"d", "abs_d", "e"}
    s.run(t["c"], {t["x"]: np.ones(3)}, stats=stats)
    assert set(stats.nodes_run) == {"a", "b", "c"}


def test_fetch_of_a_fed_tensor_returns_the_feed():
    g, t = two_branch_graph()
    s = fc.Session(g, store=fc.ContainerStore())
    stats = fc.RunStats()
    out = s.run([t["a"], t["b"]], {t["a"]: np.zeros(3)}, stats=stats)
    np.testing.assert_array_equal(out[0], np.zeros(3))
    np.testing.assert_array_equal(out[1], np.zeros(3))
    assert stats.nodes_run == ["b"]


@pytest.mark.parametrize("executor", ["compiled", "dataflow"])
def test_buffers_are_released_at_last_use(executor):
    # A chain of 50 intermediates of 8 MB each: with release at last use, at most the input of the
    # running node and its output are live, never the sum of the chain (400 MB).
    n_elems = 1_000_000
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (n_elems,), name="x")
        h = x
        for i in range(50):
            h = fc.tanh(h, name=f"t{i}")
    s = fc.Session(g, store=fc.ContainerStore(), executor=executor)
    stats = fc.RunStats()
    out = s.run(h, {x: np.full(n_elems, 0.5)}, stats=stats)
    buf = n_elems * 8
    assert len(stats.nodes_run) == 50
    assert stats.peak_bytes <= 2 * buf, stats.peak_bytes / buf
    assert stats.peak_bytes >= buf
    ref = 0.5
    for _ in range(50):
        ref = np.tanh(ref)
    np.testing.assert_allclose(out[:3], ref)


def test_plans_are_cached_and_a_step_does_no_graph_work(monkeypatch):
    g, t = two_branch_graph()
    s = fc.Session(g, store=fc.ContainerStore())
    feeds = {t["x"]: np.ones(3)}
    first = s.run(t["c"], feeds)
    plan = s.plan_for(t["c"], feeds)

    def boom(*a, **k):
        raise AssertionError("graph work during a cached step")

    monkeypatch.setattr(Graph, "topo_order", boom)
    monkeypatch.setattr(Graph, "input_specs", boom)
    again = s.run(t["c"], {t["x"]: np.ones(3)})
    np.testing.assert_array_equal(first, again)
    assert s.plan_for(t["c"], feeds) is plan


def test_kernel_errors_name_node_op_and_device():
    g = fc.Graph()
    with g.as_default():
        w = fc.variable(np.ones(2, np.float32), name="weights")
        y = fc.exp(w, name="y")
    s = fc.Session(g, store=fc.ContainerStore())
    with pytest.raises(fc.ExecutionError) as e:
        s.run(y)
    msg = str(e.value)
    assert "node 'weights' (Variable)" in msg and "device:cpu:0" in msg and "uninitialized" in msg
    assert e.value.node == "weights" and e.value.op == "Variable"


def test_unfed_placeholder_and_bad_feed_shape():
    g, t = two_branch_graph()
    s = fc.Session(g, store=fc.ContainerStore())
    with pytest.raises(fc.ExecutionError, match="placeholder 'x' must be fed"):
        s.run(t["c"])
    with pytest.raises(fc.ExecutionError, match=r"feed for 'x:0' has shape \(4,\).*\(3,\)"):
        s.run(t["c"], {t["x"]: np.ones(4)})
    with pytest.raises(fc.GraphError, match="did you mean 'abs_d'"):
        s.run("abs_e:0")


def test_check_numerics_names_the_first_non_finite_node():
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (2,), name="x")
        bad = fc.log(x, name="log_x")  # log(-1) = NaN
        out = fc.exp(bad * 2.0, name="later")
        guarded = fc.check_numerics(fc.sqrt(x, name="root"), "sqrt of input", name="guard")
    s = fc.Session(g, store=fc.ContainerStore(), check_numerics=True)
    with pytest.raises(fc.NonFiniteError, match="node 'log_x' \\(Log\\)"):
        s.run(out, {x: np.array([1.0, -1.0])})
    plain = fc.Session(g, store=fc.ContainerStore())
    with pytest.raises(fc.NonFiniteError, match="node 'guard' \\(CheckNumerics\\).*sqrt of input"):
        plain.run(guarded, {x: np.array([1.0, -1.0])})
    np.testing.assert_allclose(plain.run(guarded, {x: np.array([4.0, 9.0])}), [2.0, 3.0])


def test_variables_assign_and_fetch_structures():
    g = fc.Graph()
    with g.as_default():
        v = fc.variable(np.zeros(2), name="v", dtype="float64")
        inc = fc.assign_add(v, np.ones(2))
        init = fc.global_variables_initializer()
    s = fc.Session(g, store=fc.ContainerStore())
    assert s.run(init) is None
    for _ in range(3):
        s.run(inc)
    out = s.run({"v": v, "both": [v, (v,)]})
    np.testing.assert_array_equal(out["v"], [3.0, 3.0])
    assert isinstance(out["both"][1], tuple)


def test_containers_share_state_across_sessions_and_reset():
    store = fc.ContainerStore()
    g1, g2 = fc.Graph(), fc.Graph()
    with g1.as_default():
        a = fc.variable(np.full(2, 5.0), name="counter", container="shared")
        init = fc.global_variables_initializer()
    with g2.as_default():  # a disjoint graph naming the same shared variable
        b = fc.variable(np.zeros(2), name="counter", container="shared", dtype="float64")
        bump = fc.assign_add(b, np.ones(2))
    s1, s2 = fc.Session(g1, store=store), fc.Session(g2, store=store)
    s1.run(init)
    s2.run(bump)
    np.testing.assert_array_equal(s1.run(a), [6.0, 6.0])
    store.reset("shared")
    with pytest.raises(fc.ExecutionError, match="uninitialized"):
        s1.run(a)


def test_default_store_is_process_wide():
    g = fc.Graph()
    with g.as_default():
        v = fc.variable(np.ones(1), name="procwide_v", container="test_default_store", dtype="float64")
        init = fc.global_variables_initializer()
    fc.Session(g).run(init)
    np.testing.assert_array_equal(fc.Session(g).run(v), [1.0])
    fc.process_store().reset("test_default_store")


def test_extend_adds_nodes_from_a_graphdef():
    g, t = two_branch_graph()
    s = fc.Session(g, store=fc.ContainerStore())
    other = fc.Graph.from_json(g.to_json())
    with other.as_default():
        fc.mul(other.tensor("c"), 2.0, name="c2")
    s.extend(other.to_json())
    np.testing.assert_allclose(s.run("c2:0", {"x:0": np.zeros(3)}), 2 * np.tanh(1.0) ** 2)


def test_session_refuses_a_node_pinned_elsewhere():
    g = fc.Graph()
    with g.as_default(), g.device("gpu:0"):
        x = fc.constant(1.0, name="pinned")
    with pytest.raises(fc.PlacementError, match="node 'pinned'.*gpu:0"):
        fc.Session(g, store=fc.ContainerStore()).run(x)


def random_graph(g: fc.Graph, rng: np.random.Generator, size: int) -> tuple[list[fc.Tensor], list[fc.Tensor]]:
    """Three float64 placeholders and `size` binary ops on random earlier tensors, in `g`'s
    default scope: (the placeholders, every tensor in creation order)."""
    xs = [fc.placeholder("float64", (4,), name=f"in{i}") for i in range(3)]
    pool = list(xs)
    ops = [fc.add, fc.mul, fc.sub, lambda a, b: fc.tanh(a) + b, fc.maximum]
    for i in range(size):
        a, b = (pool[j] for j in rng.choice(len(pool), 2))
        pool.append(ops[i % len(ops)](a, b))
    return xs, pool


def test_both_executors_agree_on_a_random_graph(rng):
    g = fc.Graph()
    with g.as_default():
        xs, pool = random_graph(g, rng, 60)
        fetches = pool[-5:]
    feeds = {x: rng.standard_normal(4) for x in xs}
    st_a, st_b = fc.RunStats(), fc.RunStats()
    a = fc.Session(g, store=fc.ContainerStore(), executor="compiled").run(fetches, feeds, stats=st_a)
    b = fc.Session(g, store=fc.ContainerStore(), executor="dataflow").run(fetches, feeds, stats=st_b)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    assert sorted(st_a.nodes_run) == sorted(st_b.nodes_run)


def graph_deps(g: fc.Graph) -> dict[str, set[str]]:
    """Each node's producers: data inputs and control inputs, by node name."""
    return {n.name: {parse_ref(ref)[0] for ref in n.inputs} | set(n.control_inputs)
            for n in g.nodes.values()}


def assert_dataflow_trace(stats: fc.RunStats, deps: dict[str, set[str]]) -> None:
    """`starts` and `finishes` are a consistent trace of the step that `nodes_run` lists: one start
    and one finish per node, in time order, each node finishing after it started, and starting only
    after every producer that ran in the step had finished (§3.1: a node is ready when its inputs are)."""
    assert stats.nodes_run
    start = dict(stats.starts)
    finish = dict(stats.finishes)
    assert len(start) == len(stats.starts) and len(finish) == len(stats.finishes)  # no node twice
    assert sorted(finish) == sorted(stats.nodes_run) == sorted(start)
    times = [t for _, t in stats.finishes]
    assert times == sorted(times)
    assert [t for _, t in stats.starts] == sorted(t for _, t in stats.starts)
    for n in stats.nodes_run:
        assert finish[n] >= start[n], n
        for p in deps.get(n, ()):
            if p in finish:  # fed and unneeded producers did not run
                assert start[n] >= finish[p], (p, n)
                assert finish[n] >= finish[p], (p, n)


def test_dataflow_stats_record_when_each_node_finished(rng):
    g = fc.Graph()
    with g.as_default():
        xs, pool = random_graph(g, rng, 40)
        with g.control_dependencies([pool[10]]):
            last = fc.exp(pool[3], name="after_ctrl")
        fetches = pool[-3:] + [last]
    feeds = {x: rng.standard_normal(4) for x in xs}
    s = fc.Session(g, store=fc.ContainerStore(), executor="dataflow")
    stats = fc.RunStats()
    s.run(fetches, feeds, stats=stats)
    assert pool[10].node in graph_deps(g)["after_ctrl"]  # the control edge is checked too
    assert_dataflow_trace(stats, graph_deps(g))
    # A second step with the same RunStats replaces the trace rather than appending to it.
    first_end = stats.finishes[-1][1]
    s.run(fetches, feeds, stats=stats)
    assert_dataflow_trace(stats, graph_deps(g))
    assert stats.starts[0][1] > first_end


def test_dataflow_stats_finishes_follow_partial_execution():
    g, t = two_branch_graph()
    s = fc.Session(g, store=fc.ContainerStore(), executor="dataflow")
    stats = fc.RunStats()
    s.run([t["c"], t["e"]], {t["a"]: np.ones(3), t["x"]: np.ones(3)}, stats=stats)
    assert {n for n, _ in stats.finishes} == {"b", "c", "d", "abs_d", "e"}  # a was fed: not run
    assert_dataflow_trace(stats, graph_deps(g))
    order = [n for n, _ in stats.finishes]
    assert order.index("b") < order.index("c") and order.index("d") < order.index("abs_d") < order.index("e")


def test_compiled_executor_records_no_trace():
    g, t = two_branch_graph()
    stats = fc.RunStats()
    fc.Session(g, store=fc.ContainerStore(), executor="compiled").run(t["c"], {t["x"]: np.ones(3)}, stats=stats)
    assert stats.nodes_run == ["a", "b", "c"]
    assert stats.starts == [] and stats.finishes == []


def test_a_device_this_machine_lacks_is_a_placement_error_not_a_traceback():
    from flowctl.kernels.registry import gpu_count

    if gpu_count():
        pytest.skip("this machine has a GPU")
    g = fc.Graph()
    with g.as_default():
        fc.constant(1.0, name="c")
    with pytest.raises(fc.PlacementError, match="device /job:localhost/task:0/device:gpu:0 is not on this machine"):
        fc.Session(g, device="gpu:0")
    from flowctl.engine.cluster import Cluster

    with pytest.raises(fc.PlacementError, match=r"device:gpu:\d is not on this machine"):
        fc.DistributedSession(g, Cluster.from_spec("2xgpu:k40"), {"c": "gpu:1"})


def test_a_variable_moves_to_the_device_of_the_kernel_that_reads_it():
    """The store is shared between sessions on different devices: a read moves the value once to
    the reading kernel's device and the slot keeps it there (cupy's part is played by a stand-in
    with cupy's two entry points, `asarray` in and `.get()` out)."""
    from types import SimpleNamespace

    from flowctl.kernels.state import _resident

    class DeviceArray:
        def __init__(self, host: np.ndarray) -> None:
            self.host = host

        def get(self) -> np.ndarray:
            return self.host.copy()

    device_xp = SimpleNamespace(asarray=DeviceArray)
    slot = SimpleNamespace(value=np.arange(3.0))
    moved = _resident(device_xp, slot)
    assert isinstance(moved, DeviceArray) and slot.value is moved
    assert _resident(device_xp, slot) is moved  # already there: no second copy
    back = _resident(np, slot)
    assert isinstance(back, np.ndarray) and slot.value is back
    np.testing.assert_array_equal(back, [0.0, 1.0, 2.0])
    assert _resident(np, slot) is back
    assert _resident(np, SimpleNamespace(value=None)) is None


def test_a_steps_floating_point_warnings_stay_inside_it():
    """numpy's "divide by zero" from inside a compiled plan is not printed: a non-finite value is
    the step guard's and check_numerics' to report, naming the node."""
    import warnings

    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (2,), name="x")
        y = x / fc.constant(np.zeros(2, np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for executor in ("compiled", "dataflow"):
            out = fc.Session(g, store=fc.ContainerStore(), executor=executor).run(y, {x: np.ones(2, np.float32)})
            assert np.isinf(out).all()
    with pytest.raises(fc.NonFiniteError, match="node"):
        fc.Session(g, store=fc.ContainerStore(), check_numerics=True).run(y, {x: np.ones(2, np.float32)})
