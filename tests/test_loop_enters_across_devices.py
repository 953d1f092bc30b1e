"""A value entering a while loop on one device and read inside the loop on another (§4.4 across
devices). The backward loop of a placed training step reads its loop invariants (the weights) this
way whenever a placer puts an invariant's Enter with its producer and the loop elsewhere: the
Recv inside the loop runs every iteration, so the value must reach every iteration of the reading
device's frame, not only the first. Each test runs under a step timeout, so a deadlock fails the
test instead of hanging it, and the placed run must equal the one-device run exactly."""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.cluster import Cluster
from flowctl.engine.control_flow import while_loop
from flowctl.engine.partition import partition
from flowctl.engine.runtime import DistributedSession

STEP_TIMEOUT_S = 60.0  # generous on a shared 2-core machine; a deadlock never finishes at all


def _rnn() -> tuple[fc.Graph, dict[str, fc.Tensor], list[fc.Tensor]]:
    """h <- tanh(h W + b) for n steps; loss = sum(h^2); the loss and its gradients to x, W, b."""
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (2, 3), name="x")
        w = fc.placeholder("float64", (3, 3), name="w")
        b = fc.placeholder("float64", (3,), name="b")
        n = fc.placeholder("int32", (), name="n")
        # Computed weights, so a placement can put them, and the Enters reading them, on another device.
        w, b = fc.identity(w, name="w_used"), fc.identity(b, name="b_used")
        _, h = while_loop(lambda i, h: fc.less(i, n),
                          lambda i, h: (i + 1, fc.tanh(fc.matmul(h, w) + b, name="cell")),
                          [fc.constant(0, dtype="int32"), x], name="rnn")
        loss = fc.reduce_sum(h * h, name="loss")
        grads = fc.gradients(loss, [x, w, b])
    return g, {"x": x, "w": g.tensor("w:0"), "b": g.tensor("b:0"), "n": n}, [loss, *grads]


def _feeds(inputs: dict[str, fc.Tensor], n: int) -> dict[fc.Tensor, np.ndarray]:
    rng = np.random.default_rng(3)
    return {inputs["x"]: rng.standard_normal((2, 3)), inputs["w"]: rng.standard_normal((3, 3)) * 0.6,
            inputs["b"]: rng.standard_normal(3) * 0.1, inputs["n"]: np.int32(n)}


def _enters(g: fc.Graph, constant: bool | None) -> set[str]:
    return {name for name, node in g.nodes.items() if node.op == "Enter"
            and (constant is None or bool(node.attrs["is_constant"]) == constant)}


def _run_placed(g: fc.Graph, placement: dict[str, str], cluster: Cluster, fetches: list[fc.Tensor],
                feeds: dict[fc.Tensor, np.ndarray], recv_schedule: str = "asap") -> list[np.ndarray]:
    with DistributedSession(g, cluster, placement, store=fc.ContainerStore(), step_timeout=STEP_TIMEOUT_S,
                            recv_schedule=recv_schedule) as s:
        return s.run(fetches, feeds)


WEIGHTS = {"w_used", "b_used"}
CASES: dict[str, Callable[[fc.Graph], set[str]]] = {
    # The reported hang: the weights and their Enters into both loops on one device, the loops on the other.
    "invariants": lambda g: _enters(g, True) | WEIGHTS,
    "loop variables": lambda g: _enters(g, False),
    "every Enter": lambda g: _enters(g, None),
}


@pytest.mark.parametrize("recv_schedule", ["asap", "alap"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("n", [1, 4])
def test_enters_on_another_device_than_the_loop_equal_one_device(case: str, n: int, recv_schedule: str) -> None:
    g, inputs, fetches = _rnn()
    feeds = _feeds(inputs, n)
    want = fc.Session(g).run(fetches, feeds)
    cluster = Cluster.local(2)
    d0, d1 = cluster.names
    moved = CASES[case](g)
    assert moved and any(name.startswith("gradients/") for name in moved)  # forward and backward loops
    placement = {name: d1 if name in moved else d0 for name in g.nodes}
    got = _run_placed(g, placement, cluster, fetches, feeds, recv_schedule)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_an_enter_read_on_another_device_is_copied_there_and_crosses_once() -> None:
    g, inputs, fetches = _rnn()
    cluster = Cluster.local(2)
    d0, d1 = cluster.names
    invariants = _enters(g, True)
    parts = partition(g, {name: d1 if name in invariants | WEIGHTS else d0 for name in g.nodes})
    # Device 1 holds nothing of either loop but Enters, all of them read on device 0: they enter
    # there instead, and the weights they carry cross in the root frame, once per step.
    assert not any(node.op == "Enter" for node in parts[d1].nodes.values())
    copies = [n for n in parts[d0].nodes if n.startswith("_enter/")]
    assert sorted(c.split("/", 1)[1].rsplit("/", 1)[0] for c in copies) == sorted(invariants)
    assert {n for n in parts[d0].nodes if n.startswith("_recv/")} == {
        "_recv/w_used/0/cpu1_to_cpu0", "_recv/b_used/0/cpu1_to_cpu0"}
    for name, node in parts[d0].nodes.items():
        if node.op == "Recv":
            assert not node.control_inputs, f"{name} waits on a loop's control: it would run per iteration"


def test_an_enter_read_on_its_own_device_and_another_stays_and_is_copied() -> None:
    g, inputs, fetches = _rnn()
    cluster = Cluster.local(2)
    d0, d1 = cluster.names
    # The forward body's MatMul alone on device 1 reads W's Enter on device 0, which the backward
    # pass's accumulators on device 0 read as well: the Enter stays and gets a copy on device 1.
    cell_mm = next(n for n in g.nodes if n.startswith("rnn/") and g.nodes[n].op == "MatMul")
    placement = {name: d1 if name == cell_mm else d0 for name in g.nodes}
    feeds = _feeds(inputs, 3)
    want = fc.Session(g).run(fetches, feeds)
    got = _run_placed(g, placement, cluster, fetches, feeds)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    parts = partition(g, placement)
    assert any(n.startswith("_enter/") for n in parts[d1].nodes)


def test_a_nested_loop_on_another_device_than_its_outer_loop_equals_one_device() -> None:
    """The inner loop's Enters run in the outer frame on the outer loop's device; copied to the
    inner loop's device, they give that device a control loop of the outer frame (one per outer
    iteration), for the forward loops and the nested backward loops alike."""
    from flowctl.engine.frames import assign_frames

    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (2, 3), name="x")
        w = fc.placeholder("float64", (3, 3), name="w")

        def outer(i: fc.Tensor, h: fc.Tensor) -> tuple[fc.Tensor, fc.Tensor]:
            _, h2 = while_loop(lambda j, h: fc.less(j, fc.constant(2, dtype="int32")),
                               lambda j, h: (j + 1, fc.tanh(fc.matmul(h, w))),
                               [fc.constant(0, dtype="int32"), h], name="inner")
            return i + 1, h2 * 0.9

        _, h = while_loop(lambda i, h: fc.less(i, fc.constant(3, dtype="int32")), outer,
                          [fc.constant(0, dtype="int32"), x], name="outer")
        loss = fc.reduce_sum(h * h)
        fetches = [loss, *fc.gradients(loss, [x, w])]
    frames = assign_frames(g)
    inner = {f for f, parent in frames.parent.items() if parent != ""}
    assert len(inner) == 2  # the forward inner loop and its gradient
    cluster = Cluster.local(2)
    d0, d1 = cluster.names
    placement = {n: d1 if frames.exec_frame[n] in inner else d0 for n in g.nodes}
    rng = np.random.default_rng(0)
    feeds = {x: rng.standard_normal((2, 3)), w: rng.standard_normal((3, 3))}
    want = fc.Session(g).run(fetches, feeds)
    got = _run_placed(g, placement, cluster, fetches, feeds)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
