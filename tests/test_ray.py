"""The distributed engine on a real Ray cluster (whitepaper §3.2.2, §3.3; issue 15): two worker tasks
on two Ray nodes of this machine train a model to the same numbers as one process; a checkpoint
moves between a Ray run and a local one both ways; a killed or hung worker fails the step with a
typed error naming it, and after a restart and a restore the run goes on exactly as one that never
failed. One Ray cluster (two nodes, one CPU each, a custom resource per node) serves the module."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Any, Iterator

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine import checkpoint as ckpt
from flowctl.engine import strategies as st
from flowctl.engine.cluster import Cluster
from flowctl.engine.devices import canonical
from flowctl.engine.errors import ExecutionError, PlacementError, WorkerLostError
from flowctl.engine.optimizers import Adam
from flowctl.engine.runtime import DistributedSession, count_transfers

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster as RayCluster  # noqa: E402

from flowctl.engine.distributed import RaySession, connect, tasks_of, worker_cluster  # noqa: E402
from flowctl.engine.distributed.recovery import Recovery  # noqa: E402

DIM, HIDDEN, CLASSES, BATCH = 10, 16, 4, 24
W0, W1 = canonical("worker0/cpu:0"), canonical("worker1/cpu:0")
PIN = {0: {"pin0": 1.0}, 1: {"pin1": 1.0}}  # task k on node k


@pytest.fixture(scope="module")
def ray_nodes() -> Iterator[RayCluster]:
    """Two Ray nodes (raylets) of one CPU each, in a temporary directory of their own."""
    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp  # sockets and logs here, not in a shared /tmp/ray
    nodes = RayCluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 0, "resources": {"pin0": 1}, "include_dashboard": False,
        "object_store_memory": 80 << 20})
    try:
        nodes.add_node(num_cpus=1, num_gpus=0, resources={"pin1": 1}, object_store_memory=80 << 20)
        ray.init(address=nodes.address, log_to_driver=False)
        nodes.wait_for_nodes()
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()
        if old is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- the model
def build(dropout: float = 0.25) -> tuple[fc.Graph, dict[str, Any], list[fc.Tensor], Adam]:
    """Two dense layers with dropout between them (a random op, so random states matter), Adam (so
    optimizer slots are state too)."""
    g = fc.Graph(seed=5)
    with g.as_default():
        x = fc.placeholder("float32", (None, DIM), name="x")
        y = fc.placeholder("int32", (None,), name="y")
        with g.name_scope("layer0"):
            w0 = fc.variable(fc.truncated_normal((DIM, HIDDEN), stddev=0.4), name="w")
            b0 = fc.variable(fc.zeros((HIDDEN,)), name="b")
            h = fc.dropout(fc.relu(fc.bias_add(fc.matmul(x, w0), b0)), dropout)
        with g.name_scope("layer1"):
            w1 = fc.variable(fc.truncated_normal((HIDDEN, CLASSES), stddev=0.4), name="w")
            b1 = fc.variable(fc.zeros((CLASSES,)), name="b")
            logits = fc.bias_add(fc.matmul(h, w1), b1)
        loss = fc.reduce_mean(fc.sparse_softmax_cross_entropy(logits, y), name="loss")
    return g, {"x": x, "y": y, "loss": loss}, [w0, b0, w1, b1], Adam(0.05)


def batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    out = []
    for _ in range(n):
        x = rng.standard_normal((BATCH, DIM)).astype(np.float32)
        out.append({"x": x, "y": ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)).astype(np.int32)})
    return out


def model_parallel(devices: tuple[str, str]) -> tuple[st.TrainStep, fc.Tensor]:
    """Layer k (forward, gradients, variables, slots) on devices[k]; the loss on devices[1]."""
    g, t, variables, opt = build()
    assignment = {n: devices[0] for n in g.nodes if n.startswith("layer0/")}
    step = st.model_parallel(g, t["loss"], {"x": t["x"], "y": t["y"]}, variables, opt, assignment, devices[1])
    with g.as_default():
        init = fc.global_variables_initializer(g)
    assert step.placement is not None
    step.placement.update({n: devices[1] for n in g.nodes if n not in step.placement})
    return step, init


def train(sess: fc.Session, step: st.TrainStep, data: list[dict[str, np.ndarray]]) -> list[float]:
    return [float(sess.run([step.loss, step.train_op], step.feeds(b))[0]) for b in data]


def same_variables(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, np.ndarray], list[dict[str, Any]]]:
    """Six steps on one device: the losses, the final variables and the checkpoint after each step."""
    step, init = model_parallel((canonical("cpu:0"), canonical("cpu:0")))
    sess = fc.Session(step.graph, store=fc.ContainerStore())
    sess.run(init)
    losses, states = [], []
    for b in batches(6):
        losses += train(sess, step, [b])
        tensors, state = ckpt.capture(sess)
        states.append({"tensors": tensors, "state": state})
    assert losses[-1] < losses[0]
    return losses, sess.variable_values(), states


# ----------------------------------------------------------------------------- equivalence
def test_model_parallel_over_two_workers_matches_one_device(ray_nodes, reference):
    step, init = model_parallel((W0, W1))
    with RaySession(step.graph, worker_cluster([W0, W1]), step.placement, resources=PIN) as s:
        assert s.workers[0].node_id != s.workers[1].node_id  # each task pinned to its own node
        assert {s.workers[0].pid, s.workers[1].pid}.isdisjoint({os.getpid()})
        s.run(init)
        losses = train(s, step, batches(6))
        moved = count_transfers(s.partitions([step.loss, step.train_op], step.feeds(batches(1)[0])))
        assert moved[(W0, W1)] > 0 and moved[(W1, W0)] > 0  # activations forward, gradients back
        values = s.variable_values()
    ref_losses, ref_values, _ = reference
    # Bitwise: the same kernels on the same inputs; a transfer through Ray moves the exact bytes.
    assert losses == ref_losses
    same_variables(values, ref_values)


def _strategy(name: str, devices: list[str]) -> tuple[st.TrainStep, fc.Tensor]:
    g, t, variables, opt = build()
    inputs = {"x": t["x"], "y": t["y"]}
    if name == "sync_data_parallel":  # Figure 7 top: a replica per task, parameters on task 0
        step = st.sync_data_parallel(g, t["loss"], inputs, variables, opt, devices)
    else:  # Figure 9: layer 0 on task 0, layer 1 on task 1, two micro-batches in flight
        layer0 = {n: devices[0] for n in g.nodes if n.startswith("layer0/")}
        step = st.pipeline(g, t["loss"], inputs, variables, opt, 2, layer0, devices[1])
    with g.as_default():
        init = fc.global_variables_initializer(g)
    assert step.placement is not None
    step.placement.update({n: devices[0] for n in g.nodes if n not in step.placement})
    return step, init


@pytest.mark.parametrize("strategy", ["sync_data_parallel", "pipeline"])
def test_strategies_over_two_workers_match_the_same_placement_in_one_process(ray_nodes, strategy):
    def run(devices: list[str], ray_session: bool) -> tuple[list[float], dict[str, np.ndarray]]:
        step, init = _strategy(strategy, devices)
        assert step.placement is not None
        sess: Any = (RaySession(step.graph, worker_cluster(devices), step.placement, resources=PIN) if ray_session
                     else DistributedSession(step.graph, Cluster.local(2), step.placement, store=fc.ContainerStore()))
        with sess:
            sess.run(init)
            return train(sess, step, batches(4)), sess.variable_values()

    local_losses, local_values = run([canonical("cpu:0"), canonical("cpu:1")], False)
    ray_losses, ray_values = run([W0, W1], True)
    # Same graph, same kernels, same AddN order: equal to float32 rounding (here, to the bit).
    np.testing.assert_allclose(ray_losses, local_losses, rtol=1e-6)
    assert local_values.keys() == ray_values.keys()
    for name in local_values:
        np.testing.assert_allclose(ray_values[name], local_values[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_large_tensors_cross_nodes_through_the_object_store(ray_nodes):
    """Above Ray's 100 KiB inline limit the sender puts a transfer into the object store and the
    receiver reads it as a read-only view: kernels read it as it is (Add leaves it alone), and the
    Variable that keeps one gets its own writeable copy."""
    g = fc.Graph(seed=2)
    with g.as_default():
        x = fc.placeholder("float32", (300, 300), name="x")
        doubled = fc.mul(x, np.float32(2.0), name="doubled")  # on worker 0
        v = fc.variable(fc.zeros((300, 300)), name="v")  # on worker 1
        keep = fc.assign(v, doubled, name="keep")
        total = fc.reduce_sum(fc.add(keep, x), name="total")  # worker 1 reads x too
    placement = {n: (W0 if n in ("x", "doubled") else W1) for n in g.nodes}
    value = np.random.default_rng(0).standard_normal((300, 300)).astype(np.float32)
    with RaySession(g, worker_cluster([W0, W1]), placement, resources=PIN) as s:
        s.run("v/init")
        got_total, got_v = s.run([total, keep], {x: value})
        again = s.variable_values()["v"]
    np.testing.assert_allclose(got_total, (3 * value.astype(np.float64)).sum(), rtol=1e-5)
    np.testing.assert_array_equal(got_v, 2 * value)
    np.testing.assert_array_equal(again, 2 * value)
    assert got_v.flags.writeable and again.flags.writeable


def test_checkpoints_move_between_ray_and_local_runs(ray_nodes, reference):
    ref_losses, ref_values, states = reference
    data = batches(6)
    step, init = model_parallel((W0, W1))
    with RaySession(step.graph, worker_cluster([W0, W1]), step.placement, resources=PIN) as s:
        s.run(init)
        train(s, step, data[:3])
        tensors, state = ckpt.capture(s)  # gathered from both workers (variables, slots, dropout's state)
        assert tensors.keys() == states[2]["tensors"].keys()
        same_variables(tensors, states[2]["tensors"])
        # ... and the reverse: a local checkpoint (after step 2) into the Ray run, which goes on.
        ckpt.apply(s, states[1]["tensors"], states[1]["state"])
        assert train(s, step, data[2:4]) == ref_losses[2:4]
    local, _ = model_parallel((canonical("cpu:0"), canonical("cpu:0")))
    sess = fc.Session(local.graph, store=fc.ContainerStore())
    ckpt.apply(sess, tensors, state)  # the Ray checkpoint (after step 3) in one process
    assert train(sess, local, data[3:]) == ref_losses[3:]
    same_variables(sess.variable_values(), ref_values)


def test_steps_from_two_client_threads_keep_one_order_on_every_worker(ray_nodes):
    """Each worker queues steps in the master's order, so concurrent steps cannot wait on each
    other crosswise (§7 asynchronous training issues Runs from several threads)."""
    step, init = model_parallel((W0, W1))
    errors: list[BaseException] = []
    with RaySession(step.graph, worker_cluster([W0, W1]), step.placement, resources=PIN, step_timeout=60) as s:
        s.run(init)

        def client(k: int) -> None:
            try:
                for b in batches(8)[k::2]:
                    assert np.isfinite(s.run(step.loss, step.feeds(b)))
                    s.run([step.loss, step.train_op], step.feeds(b))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert errors == []


def test_async_data_parallel_replicas_on_two_workers_apply_every_update(ray_nodes):
    """Figure 7 bottom across processes: each replica's client thread reads the parameters and the
    update counter from worker 0 and sends its gradients back as one update there."""
    g, t, variables, opt = build(dropout=0.0)
    a = st.async_data_parallel(g, t["loss"], {"x": t["x"], "y": t["y"]}, variables, opt, [W0, W1])
    with g.as_default():
        init = fc.global_variables_initializer(g)
    placement = {n: a.placement.get(n, W0) for n in g.nodes}
    data = batches(8)
    stale: list[int] = []
    errors: list[BaseException] = []
    with RaySession(g, worker_cluster([W0, W1]), placement, resources=PIN, step_timeout=60) as s:
        s.run(init)
        first = s.variable_values()

        def replica(k: int) -> None:
            try:
                for b in data[k::2]:
                    loss, grads, read = s.run([a.losses[k], a.grads[k], a.version],
                                              {a.inputs[k]["x"]: b["x"], a.inputs[k]["y"]: b["y"]})
                    assert np.isfinite(loss)
                    applied = int(s.run([a.applied, a.apply], dict(zip(a.grad_inputs, grads)))[0])
                    stale.append(applied - 1 - int(read))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=replica, args=(k,)) for k in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        last = s.variable_values()
    assert errors == []
    assert len(stale) == 8 and min(stale) >= 0
    assert int(last["async/updates"]) == 8  # every update applied once, none lost between workers
    assert not np.array_equal(last["layer0/w"], first["layer0/w"])


# ----------------------------------------------------------------------------- failures
def test_a_kernel_error_on_one_worker_aborts_the_step_and_names_the_node(ray_nodes):
    step, init = model_parallel((W0, W1))
    feeds = step.feeds(batches(1)[0])
    with RaySession(step.graph, worker_cluster([W0, W1]), step.placement, resources=PIN, step_timeout=60) as s:
        with pytest.raises(ExecutionError) as info:
            s.run([step.loss, step.train_op], feeds)  # not initialised: a Variable holds nothing
        assert not isinstance(info.value, WorkerLostError)
        assert "is uninitialized" in str(info.value) and "/job:worker/task:" in str(info.value)
        assert info.value.node is not None and info.value.node.startswith("layer")
        s.run(init)  # both workers are still there and take the next step
        assert np.isfinite(s.run([step.loss, step.train_op], feeds)[0])


def _kill_and_recover(s: RaySession, step: st.TrainStep, init: fc.Tensor, sig: int,
                      reference: Any, expect: str) -> None:
    ref_losses, ref_values, states = reference
    data = batches(6)
    s.run(init)
    train(s, step, data[:4])  # two steps past the checkpoint after step 2: they will be replayed
    victim = s.workers[1]
    os.kill(victim.pid, sig)
    try:
        started = time.monotonic()
        with pytest.raises(WorkerLostError) as info:
            train(s, step, data[4:5])
        # Bounded: Ray reports a death at once; a hang is found by the health checks.
        assert time.monotonic() - started < s.health_interval + s.health_timeout + 10
        err = info.value
        assert err.task == 1 and err.node == victim.node and err.exit_code == 5
        assert "worker task 1 (/job:worker/task:1)" in str(err) and expect in str(err)
        with pytest.raises(WorkerLostError, match="restart_lost_workers"):
            s.run(step.loss, step.feeds(data[0]))  # lost stays lost until restarted
        assert s.restart_lost_workers() == [1]
        assert s.workers[1].pid != victim.pid and s.workers[1].node_id == victim.node_id
    finally:
        if sig == signal.SIGSTOP:
            try:
                os.kill(victim.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    ckpt.apply(s, states[1]["tensors"], states[1]["state"])  # restore the last checkpoint, replay
    assert train(s, step, data[2:]) == ref_losses[2:]
    same_variables(s.variable_values(), ref_values)


def test_a_killed_worker_fails_the_step_and_a_restart_with_restore_continues_exactly(ray_nodes, reference):
    step, init = model_parallel((W0, W1))
    events: list[tuple[int, str, str]] = []
    with RaySession(step.graph, worker_cluster([W0, W1]), step.placement, resources=PIN, step_timeout=60,
                    health_interval=1.0, health_timeout=5.0, on_worker=lambda *e: events.append(e)) as s:
        _kill_and_recover(s, step, init, signal.SIGKILL, reference, "ActorDiedError")
    # What a console shows of task 1: its start, its loss and its restart.
    assert [state for t, state, _ in events if t == 1] == ["starting", "running", "lost", "restarting",
                                                             "starting", "running"]
    assert ("CPU=1, pin1=1" in events[1][2] or "CPU=1, pin1=1" in events[0][2])


def test_a_hung_worker_misses_its_health_check_and_is_replaced(ray_nodes, reference):
    step, init = model_parallel((W0, W1))
    with RaySession(step.graph, worker_cluster([W0, W1]), step.placement, resources=PIN, step_timeout=60,
                    health_interval=0.5, health_timeout=2.0) as s:
        _kill_and_recover(s, step, init, signal.SIGSTOP, reference, "health check")


def test_a_transfer_to_a_dead_worker_fails_the_step_as_that_worker_lost(ray_nodes):
    """§3.3 (a): task 0 only sends; its delivery to task 1, whose process is gone, fails; the step
    is reported as task 1 lost (recoverable), whichever of the two failures the master sees first."""
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (4,), name="x")
        y = fc.identity(fc.identity(x, name="a"), name="b")
    with RaySession(g, worker_cluster([W0, W1]), {"x": W0, "a": W0, "b": W1}, resources=PIN,
                    step_timeout=60) as s:
        np.testing.assert_array_equal(s.run(y, {x: np.arange(4, dtype=np.float32)}), np.arange(4))
        os.kill(s.workers[1].pid, signal.SIGKILL)
        with pytest.raises(WorkerLostError) as info:
            s.run(y, {x: np.ones(4, np.float32)})
        assert info.value.task == 1 and s.lost == {1}
        assert s.restart_lost_workers() == [1]
        np.testing.assert_array_equal(s.run(y, {x: np.ones(4, np.float32)}), np.ones(4))


def test_a_training_loop_recovers_up_to_max_failures_then_ends_with_the_checkpoint_intact(ray_nodes, reference):
    """§3.3 end to end: checkpoints every 2 steps; task 1 killed before steps 3 and 5 (each time one
    step is replayed from the checkpoint); the run ends with an uninterrupted run's numbers. A third
    loss, past max_failures = 2, ends the run with exit 5."""
    ref_losses, ref_values, _ = reference
    data = batches(6)
    step, init = model_parallel((W0, W1))
    saves: dict[int, tuple[dict[str, np.ndarray], dict[str, Any]]] = {}
    with RaySession(step.graph, worker_cluster([W0, W1]), step.placement, resources=PIN, step_timeout=60) as s:

        def restore() -> int:
            last = max(saves)
            ckpt.apply(s, *saves[last])
            return last

        recovery = Recovery(s, max_failures=2, restore=restore)
        s.run(init)
        saves[0] = ckpt.capture(s)
        losses: dict[int, float] = {}
        kill_before = {3, 5}
        i = 0
        while i < len(data):
            if i in kill_before:
                kill_before.discard(i)
                os.kill(s.workers[1].pid, signal.SIGKILL)
            try:
                losses[i] = train(s, step, [data[i]])[0]
            except WorkerLostError as e:
                i = recovery.handle(e, i).resumed_step
                continue
            i += 1
            if i % 2 == 0:
                saves[i] = ckpt.capture(s)
        assert [losses[k] for k in range(6)] == ref_losses
        same_variables(s.variable_values(), ref_values)
        assert [(r.failure, r.failed_step, r.resumed_step, r.replayed, r.tasks) for r in recovery.restarts] == \
            [(1, 3, 2, 1, [1]), (2, 5, 4, 1, [1])]
        os.kill(s.workers[1].pid, signal.SIGKILL)
        with pytest.raises(WorkerLostError) as lost:
            train(s, step, data[:1])
        with pytest.raises(WorkerLostError) as final:
            recovery.handle(lost.value, 6)
        assert final.value.exit_code == 5 and final.value.task == 1
        assert "after 2 restart(s), cluster.max_failures is 2; the last checkpoint is intact" in str(final.value)


@pytest.mark.slow  # 6-8 s: the start timeout has to run out
def test_a_worker_that_cannot_be_restarted_is_a_worker_lost_error_naming_it(ray_nodes):
    step, init = model_parallel((W0, W1))
    with RaySession(step.graph, worker_cluster([W0, W1]), step.placement, resources=PIN, step_timeout=60,
                    start_timeout=3.0) as s:
        s.run(init)
        victim = s.workers[1]
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(WorkerLostError):
            train(s, step, batches(1))

        @ray.remote(num_cpus=0, resources={"pin1": 1})
        class Squatter:  # holds the only node resource task 1 may run on
            def ready(self) -> bool:
                return True

        squatter = Squatter.remote()
        assert ray.get(squatter.ready.remote(), timeout=60)
        try:
            with pytest.raises(WorkerLostError) as info:
                s.restart_lost_workers()
            assert info.value.task == 1 and info.value.node == victim.node and info.value.exit_code == 5
            assert "worker task 1 (/job:worker/task:1) last on" in str(info.value)
            assert "could not be restarted: worker task(s) [1] did not start within 3 s" in str(info.value)
        finally:
            ray.kill(squatter)
        assert s.restart_lost_workers() == [1]  # once the node is free again
        s.run(init)
        assert np.isfinite(train(s, step, batches(1))[0])


# ----------------------------------------------------------------------------- clusters
def test_worker_device_names_and_the_resources_each_task_asks_for():
    assert canonical("worker1/gpu:0") == "/job:worker/task:1/device:gpu:0"
    assert canonical("worker/cpu") == "/job:worker/task:0/device:cpu:0"
    cl = worker_cluster(["worker0/cpu:0", "worker0/cpu:1", "worker1/gpu:0", "worker1/cpu:0"], threads=2)
    t0, t1 = tasks_of(cl, {1: {"big_node": 1}})
    assert (t0.task, t0.num_cpus, t0.num_gpus, t0.resources) == (0, 4.0, 0.0, {})
    assert (t1.task, t1.num_cpus, t1.num_gpus, t1.resources) == (1, 2.0, 1.0, {"big_node": 1.0})
    # Planning: a transfer between tasks costs a Ray hop, one within a task an in-process hop.
    assert cl.link(canonical("worker0/cpu:0"), canonical("worker1/cpu:0")).latency > \
        cl.link(canonical("worker0/cpu:0"), canonical("worker0/cpu:1")).latency
    with pytest.raises(PlacementError, match="on job .localhost. .write it as .worker0/cpu:0.."):
        tasks_of(Cluster.local(2))
    with pytest.raises(PlacementError, match="no device"):
        tasks_of(cl, {3: {"x": 1}})


@pytest.mark.parametrize("devices, resources, message", [
    (["worker0/gpu:0"], None, r"worker task 0 \(/job:worker/task:0/device:gpu:0\) needs CPU=1, GPU=1, but no node"),
    (["worker0/cpu:0"], {0: {"tpu_pod": 1}}, r"needs CPU=1, tpu_pod=1, but no node of the Ray cluster has that"),
])
def test_a_resource_no_node_has_is_one_placement_error(ray_nodes, devices, resources, message):
    g = fc.Graph()
    with g.as_default():
        fc.constant(np.ones(2, np.float32), name="c")
    with pytest.raises(PlacementError, match=message) as info:
        RaySession(g, worker_cluster(devices), {"c": devices[0]}, resources=resources)
    assert info.value.exit_code == 4


def test_a_worker_on_another_ray_version_is_one_placement_error(ray_nodes, monkeypatch):
    g = fc.Graph()
    with g.as_default():
        fc.constant(np.ones(2, np.float32), name="c")
    real = ray.__version__
    monkeypatch.setattr(ray, "__version__", "0.0.1")  # this process claims another Ray than its workers
    with pytest.raises(PlacementError, match=f"worker task 0 on .* runs Ray {real} .* this process has Ray 0.0.1"):
        RaySession(g, worker_cluster([W0]), {"c": W0})


def test_a_bad_address_is_one_placement_error_at_once():
    with pytest.raises(PlacementError, match="cannot read Ray address 'http://head'"):
        connect("http://head")
    for address in ("ray://127.0.0.1:1", "127.0.0.1:1"):  # nothing listens on port 1
        with pytest.raises(PlacementError, match=f"cannot join a Ray cluster at {address}: nothing answers"):
            connect(address)


@pytest.mark.slow  # starts a Ray cluster of its own (about 10 s)
def test_without_a_cluster_a_session_starts_a_local_one_and_shuts_it_down(tmp_path):
    """`cluster: {type: ray, workers: N}` without an address: the session starts Ray for the run and
    ends it on close (run in a child process, away from this module's cluster)."""
    import subprocess
    import sys

    script = (
        "import numpy as np, ray, flowctl as fc\n"
        "from flowctl.engine.distributed import RaySession, worker_cluster\n"
        "g = fc.Graph()\n"
        "with g.as_default():\n"
        "    x = fc.placeholder('float32', (3,), name='x')\n"
        "    y = fc.mul(fc.identity(x, name='a'), np.float32(2), name='b')\n"
        "pl = {n: 'worker1/cpu:0' for n in g.nodes}\n"
        "pl.update(x='worker0/cpu:0', a='worker0/cpu:0')\n"
        "with RaySession(g, worker_cluster(['worker0/cpu:0', 'worker1/cpu:0']), pl) as s:\n"
        "    assert ray.is_initialized() and len(s.workers) == 2\n"
        "    print(s.run(y, {x: np.arange(3, dtype=np.float32)}).tolist())\n"
        "print(ray.is_initialized())\n")
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="rt", dir="/tmp")}
    try:
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[0.0,", "2.0,", "4.0]", "False"]
