"""How a Ray worker takes a tensor from another task (engine/distributed/worker.py, §3.3), without a
Ray cluster: a large tensor read from the object store arrives as a read-only view and goes to the
Recv as it is (no copy); only a Recv whose value may outlive the step (it reaches an Assign or a
queue) gets a writeable copy; and no kernel writes into the read-only view, while the step's result
is the same."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

import flowctl as fc
from flowctl.engine.devices import canonical
from flowctl.engine.distributed.worker import WorkerRendezvous, kept_recvs
from flowctl.engine.partition import partition
from flowctl.engine.rendezvous import RendezvousKey

W0, W1 = canonical("worker0/cpu:0"), canonical("worker1/cpu:0")


def _graph() -> tuple[fc.Graph, dict[str, str]]:
    """Worker 0 makes `a` and `b`; worker 1 adds 1 to `a` (Add, `a`'s last reader, may write into its
    buffer) and assigns `b` to a Variable, through an Identity."""
    g = fc.Graph(seed=0)
    with g.as_default():
        x = fc.placeholder("float32", (64, 64), name="x")
        a = fc.mul(x, np.float32(2.0), name="a")
        b = fc.mul(x, np.float32(3.0), name="b")
        fc.add(a, np.float32(1.0), name="plus")
        v = fc.variable(fc.zeros((64, 64)), name="v")
        fc.assign(v, fc.identity(b, name="ib"), name="keep")
    placement = {n: (W0 if n in ("x", "a", "b") else W1) for n in g.nodes}
    return g, placement


def _recv_attrs(part: fc.Graph) -> dict[str, dict]:
    return {n.attrs["tensor_name"]: n.attrs for n in part.nodes.values() if n.op == "Recv"}


def test_only_a_recv_that_reaches_an_assign_is_kept():
    g, placement = _graph()
    part = partition(g, placement)[W1]
    recvs = _recv_attrs(part)
    assert set(recvs) == {"a:0", "b:0"}
    assert kept_recvs(part) == {(W1, "b:0")}


def test_a_read_only_tensor_reaches_the_recv_uncopied_unless_kept():
    g, placement = _graph()
    part = partition(g, placement)[W1]
    rv = WorkerRendezvous(SimpleNamespace(task=1, peers={}, kept=kept_recvs(part)))  # type: ignore[arg-type]
    stored = np.arange(4096, dtype=np.float32).reshape(64, 64)
    stored.flags.writeable = False  # as Ray's zero-copy read of its object store hands it over
    got: dict[str, object] = {}
    for name in ("a:0", "b:0"):
        key = RendezvousKey(7, W0, W1, name)
        rv.accept(tuple(key), stored)
        rv.recv_async(key, lambda value, err, name=name: got.__setitem__(name, value))
    assert got["a:0"] is stored  # no copy: kernels only read it
    kept = got["b:0"]
    assert kept is not stored and isinstance(kept, np.ndarray) and kept.flags.writeable
    np.testing.assert_array_equal(kept, stored)


def test_kernels_never_write_into_a_read_only_received_tensor():
    """A worker (in this process, no Ray) runs its partition on tensors delivered as read-only views:
    Add, the last reader of `a`, may write into an input it owns but leaves the view alone; the
    Variable gets its own writeable copy of `b`."""
    from flowctl.engine.distributed.worker import Worker

    g, placement = _graph()
    part = partition(g, placement)[W1]
    worker = Worker(1, [W1], 0, [g.nodes["v"].to_dict()])
    worker.load(0, [(W1, part.to_json(), ["plus:0", "keep:0"], [], [])])
    value = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    views = {}
    for name, scale in (("a:0", 2), ("b:0", 3)):
        views[name] = scale * value
        views[name].flags.writeable = False
        assert worker.deliver((5, W0, W1, name), views[name])
    outs, _ = worker.run(0, 5, 0, [[]])
    plus, keep = outs[0]
    np.testing.assert_array_equal(plus, 2 * value + 1)
    np.testing.assert_array_equal(views["a:0"], 2 * value)  # the view keeps its bits
    held = worker.variable_values()["v"]
    np.testing.assert_array_equal(held, 3 * value)
    np.testing.assert_array_equal(keep, 3 * value)
    assert held.flags.writeable and held is not views["b:0"]
