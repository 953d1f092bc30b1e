"""The multi-device runtime (whitepaper §3.2.2, §3.3, §5.3, §5.5): the same model trains to the same
numbers on 1, 2 and 4 virtual CPU devices; an error on one device aborts the step everywhere and
names the node; a waiting Recv does not hold its device's thread; control edges order work across
devices; state and randomness are shared with the single-device Session's rules."""
from __future__ import annotations

import re
import threading
import time
from typing import Any, Callable

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.cluster import Cluster
from flowctl.engine.devices import canonical
from flowctl.engine.opdef import MOVEMENT, OPS, register_op
from flowctl.engine.optimizers import SGD
from flowctl.engine.runtime import DistributedSession, count_transfers
from flowctl.kernels.registry import _SPECIFIC, KERNELS, kernel

DIM, HIDDEN, CLASSES, BATCH, LAYERS = 12, 16, 5, 32, 3

# ----------------------------------------------------------------------------- test-only ops
# Gate waits (up to 10 s) for an Event that Signal sets: deterministic proof that one device kept
# running while another node on it was waiting. Sleep delays a value. All three pass their input on.
# They are registered for this module only and removed afterwards.
EVENTS: dict[str, threading.Event] = {}
TEST_OPS = ("TestGate", "TestSignal", "TestSleep")


def _same(ins: list, attrs: dict) -> list:
    return [ins[0]]


def _gate(xp: Any, attrs: dict) -> Callable[[Any], Any]:
    def run(x: Any) -> Any:
        if not EVENTS[attrs["key"]].wait(10.0):
            raise TimeoutError(f"gate {attrs['key']} was never opened")
        return x
    return run


def _signal(xp: Any, attrs: dict) -> Callable[[Any], Any]:
    def run(x: Any) -> Any:
        EVENTS[attrs["key"]].set()
        return x
    return run


def _sleep(xp: Any, attrs: dict) -> Callable[[Any], Any]:
    def run(x: Any) -> Any:
        time.sleep(attrs["seconds"])
        return x
    return run


@pytest.fixture(scope="module", autouse=True)
def test_ops() -> Any:
    for op, factory in zip(TEST_OPS, (_gate, _signal, _sleep)):
        register_op(op, _same, num_inputs=1, attrs={"key": ("str", ""), "seconds": ("float", 0.0)},
                    group=MOVEMENT, stateful=True, differentiable=False)
        kernel(op, device_types=("cpu",))(factory)
    yield
    for op in TEST_OPS:
        del OPS[op]
        KERNELS.pop((op, "cpu"), None)
        _SPECIFIC.discard((op, "cpu"))


def _test_op(op: str, x: fc.Tensor, name: str, **attrs: Any) -> fc.Tensor:
    node = x.graph.add_node(op, [x], attrs, name=name)
    return fc.Tensor(x.graph, node.name, 0)


# ----------------------------------------------------------------------------- the model
def build_mlp(seed: int = 7) -> tuple[fc.Graph, dict[str, fc.Tensor]]:
    g = fc.Graph(seed=seed)
    with g.as_default():
        x = fc.placeholder("float32", (None, DIM), name="x")
        y = fc.placeholder("int32", (None,), name="labels")
        h, width = x, DIM
        for k in range(LAYERS):
            out = CLASSES if k == LAYERS - 1 else HIDDEN
            with g.name_scope(f"layer{k}"):
                w = fc.variable(fc.truncated_normal((width, out), stddev=(2.0 / width) ** 0.5), name="w")
                b = fc.variable(fc.random_uniform((out,), -0.1, 0.1), name="b")
                h = fc.bias_add(fc.matmul(h, w), b)
                if k < LAYERS - 1:
                    h = fc.relu(h)
            width = out
        loss = fc.reduce_mean(fc.sparse_softmax_cross_entropy(h, y), name="loss")
        train = SGD(0.5).minimize(loss)
        init = fc.global_variables_initializer()
    return g, {"x": x, "y": y, "loss": loss, "train": train, "init": init}


def _data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {"x": rng.standard_normal((BATCH, DIM)).astype(np.float32),
            "y": rng.integers(0, CLASSES, BATCH).astype(np.int32)}


def _groups(g: fc.Graph) -> list[list[str]]:
    """Colocation groups (§4.3): colocate_with lists and reference edges (an Assign and its
    Variable), merged by union-find, in graph order."""
    parent = {n: n for n in g.nodes}

    def find(a: str) -> str:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for n in g.nodes.values():
        for other in n.colocate_with + [n.inputs[i].rpartition(":")[0] for i in n.opdef.ref_inputs]:
            parent[find(other)] = find(n.name)
    out: dict[str, list[str]] = {}
    for n in g.nodes:
        out.setdefault(find(n), []).append(n)
    return list(out.values())


def round_robin(g: fc.Graph, n: int) -> dict[str, str]:
    return {m: canonical(f"cpu:{i % n}") for i, grp in enumerate(_groups(g)) for m in grp}


def layer_wise(g: fc.Graph, n: int) -> dict[str, str]:
    """Layer k (forward, its gradients and its updates) on device k % n; the rest (inputs, loss,
    the training step's Group) on the last device."""
    def layer(name: str) -> int | None:
        m = re.search(r"(?:^|/)layer(\d+)/", name)
        return int(m[1]) if m else None

    out = {}
    for grp in _groups(g):
        ks = [layer(m) for m in grp if layer(m) is not None]
        dev = ks[0] % n if ks else n - 1
        for m in grp:
            out[m] = canonical(f"cpu:{dev}")
    return out


def _train(sess: fc.Session, t: dict[str, fc.Tensor], steps: int = 3) -> tuple[list[float], dict]:
    d = _data()
    sess.run(t["init"])
    losses = [float(sess.run([t["loss"], t["train"]], {t["x"]: d["x"], t["y"]: d["y"]})[0])
              for _ in range(steps)]
    return losses, sess.variable_values()


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict]:
    g, t = build_mlp()
    return _train(fc.Session(g, store=fc.ContainerStore()), t)


# ----------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("placer", [round_robin, layer_wise])
def test_same_loss_and_variables_as_one_device(reference, devices, placer):
    g, t = build_mlp()
    placement = placer(g, devices)
    assert len(set(placement.values())) == devices
    with DistributedSession(g, Cluster.local(devices), placement, store=fc.ContainerStore()) as s:
        losses, variables = _train(s, t)
        sp = s.step_plan([t["loss"], t["train"]], {t["x"]: 0, t["y"]: 0})
        assert sum(count_transfers(sp.partitions).values()) > 0  # the model really is split
    ref_losses, ref_vars = reference
    assert ref_losses[-1] < ref_losses[0]  # it trains
    # Bitwise: every kernel is deterministic and runs on the same inputs wherever it is placed;
    # transfers within one process hand over the same array.
    assert losses == ref_losses
    assert variables.keys() == ref_vars.keys()
    for name in ref_vars:
        np.testing.assert_array_equal(variables[name], ref_vars[name], err_msg=name)


def test_compressed_transfers_stay_within_tolerance(reference):
    g, t = build_mlp()
    with DistributedSession(g, Cluster.local(2), round_robin(g, 2), store=fc.ContainerStore(),
                            compress=True) as s:
        losses, variables = _train(s, t)
    ref_losses, ref_vars = reference
    # Each float32 transfer keeps 8 significant bits (relative error < 2**-7 = 0.8%). Round-robin
    # cuts the most edges (weights, activations and gradients all travel); measured after three SGD
    # steps at lr 0.5: loss within 0.56% and variables within 0.016 absolute (|w| <= 0.86). The
    # bounds below are about 2.5x those.
    np.testing.assert_allclose(losses, ref_losses, rtol=1.5e-2)
    assert losses != ref_losses  # compression really happened
    for name in ref_vars:
        np.testing.assert_allclose(variables[name], ref_vars[name], atol=4e-2, err_msg=name)


def test_random_ops_draw_the_same_numbers_wherever_placed():
    g = fc.Graph(seed=3)
    with g.as_default():
        a = fc.random_normal((4, 3), name="a")
        b = fc.random_uniform((4, 3), name="b")
        fc.add(a, b, name="c")
    single = fc.Session(g, store=fc.ContainerStore())
    want = [single.run(["a:0", "b:0", "c:0"]) for _ in range(2)]
    pl = {"a": canonical("cpu:1"), "b": canonical("cpu:0"), "c": canonical("cpu:1")}
    with DistributedSession(g, Cluster.local(2), pl, store=fc.ContainerStore()) as s:
        got = [s.run(["a:0", "b:0", "c:0"]) for _ in range(2)]
    for w, v in zip(want, got):
        for x, y in zip(w, v):
            np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------- failure
def _flowctl_threads() -> int:
    return sum(1 for th in threading.enumerate() if th.name.startswith("flowctl-"))


def test_error_on_one_device_aborts_the_step_and_names_the_node():
    g, t = build_mlp()
    placement = layer_wise(g, 2)
    assert placement["layer1/w"] == canonical("cpu:1")
    before = _flowctl_threads()
    d = _data()
    feeds = {t["x"]: d["x"], t["y"]: d["y"]}
    with DistributedSession(g, Cluster.local(2), placement, store=fc.ContainerStore()) as s:
        with pytest.raises(fc.ExecutionError) as info:
            s.run([t["loss"], t["train"]], feeds)  # no initialisation: variables hold nothing
        err = info.value
        assert err.device in (canonical("cpu:0"), canonical("cpu:1"))
        assert re.search(r"node 'layer\d/[wb]' \(Variable\) on /job:localhost/task:0/device:cpu:\d: "
                         r"variable 'layer\d/[wb]' is uninitialized", str(err)), str(err)
        # Every device's Run has returned: the device threads are idle, none was added or lost.
        assert _flowctl_threads() == before + 2
        s.run(t["init"])
        loss, _ = s.run([t["loss"], t["train"]], feeds)
        assert np.isfinite(loss)
    assert _flowctl_threads() == before


def test_failure_on_the_receiving_side_wakes_the_waiting_devices():
    """cpu:0 waits in a Recv for a tensor cpu:1 will never send (cpu:1 fails first)."""
    g = fc.Graph()
    with g.as_default():
        v = fc.variable(np.ones(3, np.float32), name="v")  # never initialised
        bad = fc.exp(v, name="bad")
        fc.add(bad, fc.constant(np.ones(3, np.float32), name="one"), name="out")
    pl = {n: canonical("cpu:1") for n in g.nodes}
    pl.update({"out": canonical("cpu:0"), "one": canonical("cpu:0")})
    with DistributedSession(g, Cluster.local(2), pl, store=fc.ContainerStore(), step_timeout=20) as s:
        t0 = time.perf_counter()
        with pytest.raises(fc.ExecutionError, match=r"node 'v' \(Variable\) on .*cpu:1"):
            s.run("out:0")
        assert time.perf_counter() - t0 < 5  # aborted, not timed out


# ----------------------------------------------------------------------------- asynchrony
def test_a_waiting_recv_does_not_block_its_device():
    """cpu:1 holds two chains: one waits on a Recv from cpu:0, whose producer is gated until the
    *other* cpu:1 chain opens the gate. If the Recv held cpu:1's thread, the step would deadlock
    (the gate times out after 10 s and the test fails)."""
    key = "recv-does-not-block"
    EVENTS[key] = threading.Event()
    g = fc.Graph()
    with g.as_default():
        src = fc.constant(np.arange(4, dtype=np.float32), name="src")
        slow = _test_op("TestGate", src, "slow_producer", key=key)
        waiting = fc.exp(slow, name="waiting_consumer")
        h = fc.constant(np.ones(4, np.float32), name="h")
        for k in range(3):
            h = fc.tanh(h, name=f"busy{k}")
        opened = _test_op("TestSignal", h, "open_gate", key=key)
        fc.add(waiting, opened, name="out")
    pl = {n: canonical("cpu:1") for n in g.nodes}
    pl.update({"src": canonical("cpu:0"), "slow_producer": canonical("cpu:0")})
    with DistributedSession(g, Cluster.local(2), pl, store=fc.ContainerStore()) as s:
        st = fc.RunStats()
        out = s.run("out:0", stats=st)
    np.testing.assert_allclose(out, np.exp(np.arange(4)) + np.tanh(np.tanh(np.tanh(1.0))), rtol=1e-6)
    order = [n for n, _ in st.devices[canonical("cpu:1")].starts]
    recv = next(n for n in order if n.startswith("_recv/"))
    assert order.index(recv) < order.index("busy0") < order.index("open_gate") < order.index("waiting_consumer")


def _traced(g: fc.Graph, pl: dict[str, str], fetches: list[str]) -> tuple[list[Any], dict[str, list[str]]]:
    """Run `fetches` on two local CPU devices; the values and each device's nodes in starting order."""
    with DistributedSession(g, Cluster.local(2), pl, store=fc.ContainerStore()) as s:
        st = fc.RunStats()
        out = s.run(fetches, stats=st)
    return out, {d[-5:]: [n for n, _ in ds.starts] for d, ds in st.devices.items()}


def _backlog(x: Any) -> list[str]:
    """Eight independent ops on `x`, built now: compute queued on its device."""
    return [fc.tanh(x, name=f"backlog{k}").node for k in range(8)]


def test_a_send_starts_before_compute_already_queued_on_its_device():
    """cpu:0 has a backlog of independent ops queued when `produced` finishes; its Send to cpu:1
    must go next (the simulator starts a transfer when its producer ends), not behind the backlog.
    The FIFO the executor had before ran all eight `backlog` ops first."""
    g = fc.Graph()
    with g.as_default():
        x = fc.constant(np.arange(4, dtype=np.float32), name="x")
        produced = fc.exp(x, name="produced")
        backlog = _backlog(x)
        fc.tanh(produced, name="remote")
    pl = {n: canonical("cpu:0") for n in g.nodes}
    pl["remote"] = canonical("cpu:1")
    out, starts = _traced(g, pl, ["remote:0"] + [f"{b}:0" for b in backlog])
    np.testing.assert_allclose(out[0], np.tanh(np.exp(np.arange(4))), rtol=1e-6)
    order = starts["cpu:0"]
    send = next(n for n in order if n.startswith("_send/"))
    assert order.index(send) == order.index("produced") + 1, order
    assert all(order.index(send) < order.index(f"backlog{k}") for k in range(1, 8)), order


def test_ready_compute_runs_in_build_order_and_a_sends_producer_ahead_of_it():
    """cpu:1 sleeps 300 ms in `slow`; cpu:0's value arrives after about 50 ms. When `slow` ends,
    its successor `local_next` and the arrival's consumer `remote_next` are both ready: the one
    built first runs first (the plan's order; ready order ran `remote_next` first). On cpu:0,
    `produced` is built after eight independent ops but feeds a Send, so it runs first of all."""
    g = fc.Graph()
    with g.as_default():
        x = fc.constant(np.arange(4, dtype=np.float32), name="x")
        backlog = _backlog(x)
        sent = _test_op("TestSleep", x, "sent", seconds=0.05)
        h = fc.constant(np.ones(4, np.float32), name="h")
        slow = _test_op("TestSleep", h, "slow", seconds=0.3)
        fc.tanh(slow, name="local_next")
        fc.exp(sent, name="remote_next")
    pl = {n: canonical("cpu:1") for n in g.nodes}
    pl.update({n: canonical("cpu:0") for n in ["x", "sent", *backlog]})
    out, starts = _traced(g, pl, ["local_next:0", "remote_next:0"] + [f"{b}:0" for b in backlog])
    np.testing.assert_allclose(out[1], np.exp(np.arange(4)), rtol=1e-6)
    order = starts["cpu:1"]
    assert order.index("slow") < order.index("local_next") < order.index("remote_next"), order
    order = starts["cpu:0"]
    assert order.index("sent") < min(order.index(b) for b in backlog), order
    assert [n for n in order if n.startswith("backlog")] == backlog, order


def test_the_scalars_a_send_needs_run_ahead_however_far_back():
    """On cpu:0, `mean` and `vec` are each three edges before a Send (past the two that always
    run promptly), both ready once `wide` ran, both built after eight independent ops. `mean`
    makes a scalar (as a replicas' mean loss and its guard do): it runs at once. `vec` makes a
    vector: it waits its turn in the plan's order."""
    g = fc.Graph()
    with g.as_default():
        x = fc.constant(np.arange(4, dtype=np.float32), name="x")
        wide = fc.exp(x, name="wide")
        backlog = _backlog(x)
        mean = fc.reduce_mean(wide, name="mean")
        fc.tanh(fc.exp(fc.tanh(mean, name="m1"), name="m2"), name="remote")
        vec = fc.exp(wide, name="vec")
        fc.tanh(fc.tanh(fc.tanh(vec, name="v1"), name="v2"), name="remote_vec")
    pl = {n: canonical("cpu:0") for n in g.nodes}
    pl.update({"remote": canonical("cpu:1"), "remote_vec": canonical("cpu:1")})
    out, starts = _traced(g, pl, ["remote:0", "remote_vec:0"] + [f"{b}:0" for b in backlog])
    np.testing.assert_allclose(out[0], np.tanh(np.exp(np.tanh(np.exp(np.arange(4)).mean()))), rtol=1e-6)
    order = starts["cpu:0"]
    w = order.index("wide")
    assert order[w:w + 4] == ["wide", "mean", "m1", "m2"] and w < order.index(backlog[0]), order
    assert order.index("vec") > order.index(backlog[-1]), order


def test_step_trace_records_every_finish_on_both_devices_in_dataflow_order():
    g, t = build_mlp()
    placement = layer_wise(g, 2)
    d = _data()
    feeds = {t["x"]: d["x"], t["y"]: d["y"]}
    with DistributedSession(g, Cluster.local(2), placement, store=fc.ContainerStore()) as s:
        s.run(t["init"])
        st = fc.RunStats()
        s.run([t["loss"], t["train"]], feeds, stats=st)
        parts = s.step_plan([t["loss"], t["train"]], feeds).partitions
    assert set(st.devices) == {canonical("cpu:0"), canonical("cpu:1")} == set(parts)
    # Producers of each node: its own partition's edges (Send/Recv included), and the original
    # graph's edges across devices (a consumer starts only after its producer on the other device
    # finished, the Send and Recv between them).
    deps: dict[str, set[str]] = {}
    for graph in [g, *parts.values()]:
        for n in graph.nodes.values():
            deps.setdefault(n.name, set()).update([ref.rpartition(":")[0] for ref in n.inputs], n.control_inputs)
    for dev, ds in st.devices.items():
        names = [n for n, _ in ds.finishes]
        assert names and sorted(names) == sorted(ds.nodes_run) == sorted(n for n, _ in ds.starts), dev
        assert all(n in parts[dev].nodes for n in names), dev  # each device reports its own nodes
        assert any(n.startswith("_recv/") for n in names) or any(n.startswith("_send/") for n in names), dev
        times = [tm for _, tm in ds.finishes]
        assert times == sorted(times), dev
    # The aggregate: both devices' finishes, merged in time order, one per node that ran.
    finish, start = dict(st.finishes), dict(st.starts)
    assert len(finish) == len(st.finishes) == len(st.nodes_run)
    assert sorted(st.finishes) == sorted(f for ds in st.devices.values() for f in ds.finishes)
    assert [tm for _, tm in st.finishes] == sorted(tm for _, tm in st.finishes)
    assert set(finish) == set(start) == set(st.nodes_run)
    for n in st.nodes_run:
        assert finish[n] >= start[n], n
        for p in deps.get(n, ()):
            if p in finish:
                assert start[n] >= finish[p], (p, n)
                assert finish[n] >= finish[p], (p, n)
    # The model really is split: layer0 ran on cpu:0, layer1 on cpu:1, and both are in the trace.
    assert any(n.startswith("layer0/") for n, _ in st.devices[canonical("cpu:0")].finishes)
    assert any(n.startswith("layer1/") for n, _ in st.devices[canonical("cpu:1")].finishes)


def test_cross_device_control_edge_orders_the_devices():
    """A read on cpu:1 with a control input from a (slow) increment on cpu:0 always sees it."""
    g = fc.Graph()
    with g.as_default():
        writer = fc.variable(np.zeros((), np.float32), name="writer", shared_name="counter")
        slow_one = _test_op("TestSleep", fc.constant(np.ones((), np.float32), name="one"), "slow", seconds=0.05)
        inc = fc.assign_add(writer, slow_one, name="inc")
        with g.control_dependencies([inc]):
            reader = fc.variable(np.zeros((), np.float32), name="reader", shared_name="counter")
        fc.identity(reader, name="seen")
    pl = {n: canonical("cpu:0") for n in g.nodes}
    pl.update({"reader": canonical("cpu:1"), "reader/init": canonical("cpu:1"), "seen": canonical("cpu:1")})
    with DistributedSession(g, Cluster.local(2), pl, store=fc.ContainerStore()) as s:
        s.run("writer/init")
        seen = [float(s.run("seen:0")) for _ in range(3)]
    assert seen == [1.0, 2.0, 3.0]


def test_steps_from_two_client_threads_do_not_deadlock():
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (8,), name="x")
        a = fc.tanh(x, name="a")
        b = fc.exp(a, name="b")
        fc.add(b, a, name="c")
    pl = {"x": canonical("cpu:0"), "a": canonical("cpu:0"), "b": canonical("cpu:1"), "c": canonical("cpu:0")}
    results: dict[int, list[np.ndarray]] = {}
    with DistributedSession(g, Cluster.local(2), pl, store=fc.ContainerStore(), step_timeout=10) as s:
        def client(k: int) -> None:
            results[k] = [s.run("c:0", {"x:0": np.full(8, k + i, np.float32)}) for i in range(20)]

        threads = [threading.Thread(target=client, args=(k,)) for k in (0, 100)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    for k, outs in results.items():
        for i, out in enumerate(outs):
            v = np.tanh(np.float32(k + i))
            np.testing.assert_allclose(out, np.exp(v) + v, rtol=1e-6)
    assert len(results) == 2


# ----------------------------------------------------------------------------- feeds and fetches
def test_feeds_and_fetches_go_to_the_devices_that_hold_them():
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (None, 2), name="x")
        a = fc.square(x, name="a")
        b = fc.exp(x, name="b")
        fc.add(a, b, name="c")
    pl = {"x": canonical("cpu:2"), "a": canonical("cpu:0"), "b": canonical("cpu:1"), "c": canonical("cpu:1")}
    xv = np.arange(6, dtype=np.float32).reshape(3, 2) / 4
    with DistributedSession(g, Cluster.local(3), pl, store=fc.ContainerStore()) as s:
        a_v, c_v, x_v = s.run(["a:0", "c:0", "x:0"], {x: xv})
        parts = s.step_plan(["a:0", "c:0", "x:0"], {x: xv}).partitions
        # feeding an intermediate: its producer's device does no work at all
        c2 = s.run("c:0", {"a:0": np.zeros((3, 2), np.float32), x: xv})
    assert canonical("cpu:2") not in parts  # x is fed: its own device has nothing to run
    assert {n.attrs["tensor_name"] for g_ in parts.values() for n in g_.nodes.values() if n.op == "Recv"} == {"a:0"}
    np.testing.assert_allclose(a_v, xv ** 2)
    np.testing.assert_allclose(c_v, xv ** 2 + np.exp(xv), rtol=1e-6)
    np.testing.assert_array_equal(x_v, xv)
    np.testing.assert_allclose(c2, np.exp(xv), rtol=1e-6)


def test_async_kernels_outside_a_distributed_session_say_so():
    g = fc.Graph()
    with g.as_default():
        from flowctl.engine.ops.communication import recv

        recv("t:0", "float32", (2,), "cpu:1", "cpu:0", name="r")
    with pytest.raises(fc.ExecutionError, match="needs a step context"):
        fc.Session(g, store=fc.ContainerStore()).run("r:0")


def test_unknown_device_in_placement_is_an_error():
    g, _ = build_mlp()
    pl = round_robin(g, 4)
    with pytest.raises(fc.PlacementError, match="cluster lacks"):
        DistributedSession(g, Cluster.local(2), pl, store=fc.ContainerStore())


@pytest.mark.gpu
def test_cpu_and_gpu_partitions_agree_with_one_cpu(reference):
    from flowctl.engine.cluster import PROFILES, Device

    g, t = build_mlp()
    cluster = Cluster([Device(canonical("cpu:0"), PROFILES["cpu_core"]), Device(canonical("gpu:0"), PROFILES["h100"])])
    placement = {n: canonical("gpu:0") if d == canonical("cpu:1") else d for n, d in layer_wise(g, 2).items()}
    for compress, rtol in ((False, 1e-4), (True, 1.5e-2)):  # GPU BLAS sums in another order: not bitwise
        with DistributedSession(g, cluster, placement, store=fc.ContainerStore(), compress=compress) as s:
            losses, variables = _train(s, t)
        np.testing.assert_allclose(losses, reference[0], rtol=rtol)
        for name, want in reference[1].items():
            np.testing.assert_allclose(variables[name], want, atol=4e-2 if compress else 1e-4, err_msg=name)
