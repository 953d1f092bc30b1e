"""Queues (whitepaper §4.6, §5.3): FIFO order against a plain Python list; blocking by continuation
(a waiting dequeue or enqueue holds no executor thread, and other clients' steps wake it); close
semantics with the error naming the queue; seeded shuffles reproducible and unseeded ones
permutations; sharing through the ContainerStore.

Every wait is bounded: a step that should block runs on its own thread, is checked to be still
waiting, and must finish within TIMEOUT once released, so a bug fails the test instead of hanging."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.cluster import Cluster
from flowctl.engine.ops.queues import (
    QueueClosedError, dequeue, dequeue_many, enqueue, enqueue_many, fifo_queue, queue_close, queue_size,
    random_shuffle_queue,
)
from flowctl.engine.runtime import DistributedSession

TIMEOUT = 5.0
SETTLE = 0.2  # long enough for a step that is not blocked to have finished


class Step(threading.Thread):
    """A session.run on its own (daemon) thread, keeping its result or error."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001
            self.error = e

    def finish(self) -> Any:
        self.join(TIMEOUT)
        assert not self.is_alive(), f"step still blocked after {TIMEOUT} s"
        if self.error is not None:
            raise self.error
        return self.result


def blocked(step: Step) -> bool:
    time.sleep(SETTLE)
    return step.is_alive()


def session(g: fc.Graph, store: fc.ContainerStore | None = None) -> fc.Session:
    return fc.Session(g, store=store if store is not None else fc.ContainerStore())


# ----------------------------------------------------------------------------- order and batching
def test_fifo_order_and_components_match_a_list(rng):
    g = fc.Graph()
    with g.as_default():
        q = fifo_queue(10, ["float32", "int32"], [(2, 3), ()], name="q")
        x = fc.placeholder("float32", (2, 3), name="x")
        k = fc.placeholder("int32", (), name="k")
        put = enqueue(q, [x, k])
        take = dequeue(q)
        take3 = dequeue_many(q, 3)
        size = queue_size(q)
    s = session(g)
    ref: list[tuple[np.ndarray, int]] = []
    for i in range(7):
        xv = rng.standard_normal((2, 3)).astype(np.float32)
        s.run(put, {x: xv, k: i * 10})
        ref.append((xv, i * 10))
    assert int(s.run(size)) == 7
    xv, kv = s.run(take)
    np.testing.assert_array_equal(xv, ref[0][0])
    assert int(kv) == 0 and kv.dtype == np.int32
    xs, ks = s.run(take3)
    assert xs.shape == (3, 2, 3) and ks.shape == (3,)
    for j in range(3):  # stacked in arrival order
        np.testing.assert_array_equal(xs[j], ref[1 + j][0])
        assert int(ks[j]) == ref[1 + j][1]
    assert int(s.run(size)) == 3


def test_enqueue_many_slices_along_axis_0(rng):
    g = fc.Graph()
    with g.as_default():
        q = fifo_queue(8, "float64", (4,), name="q")
        batch = fc.placeholder("float64", (None, 4), name="batch")
        put = enqueue_many(q, batch)
        one = dequeue(q)[0]
        two = dequeue_many(q, 2)[0]
    s = session(g)
    data = rng.standard_normal((5, 4))
    s.run(put, {batch: data})
    got = [s.run(one)] + list(s.run(two)) + [s.run(one), s.run(one)]
    for j in range(5):
        np.testing.assert_array_equal(got[j], data[j])


def test_graph_with_queues_round_trips_through_json():
    g = fc.Graph()
    with g.as_default():
        q = random_shuffle_queue(6, 2, ["float32", "int64"], [(None, 3), (2,)], seed=5, name="q",
                                 shared_name="s")
        enqueue(q, [np.zeros((1, 3), np.float32), np.zeros(2, np.int64)], name="put")
        dequeue_many(q, 2, name="take")
    g2 = fc.Graph.from_json(g.to_json())
    assert [s.shape for s in g2.nodes["take"].outputs] == [(2, None, 3), (2, 2)]
    assert g2.nodes["q"].attrs == g.nodes["q"].attrs


# ----------------------------------------------------------------------------- blocking (§5.3)
def test_dequeue_waits_until_another_thread_enqueues():
    g = fc.Graph()
    with g.as_default():
        q = fifo_queue(4, "float32", (), name="q")
        v = fc.placeholder("float32", (), name="v")
        put = enqueue(q, v)
        take = dequeue(q)[0]
        close = queue_close(q, cancel_pending=True)
    s = session(g)
    waiting = Step(lambda: s.run(take))
    try:
        assert blocked(waiting), "a dequeue on an empty queue returned"
        s.run(put, {v: 3.5})  # the same session, from another client thread
        assert float(waiting.finish()) == 3.5
    finally:
        s.run(close)  # releases the waiting step if the test failed


def test_queue_is_shared_by_sessions_on_one_store_through_shared_name():
    def build() -> tuple[fc.Graph, Any, Any]:
        g = fc.Graph()
        with g.as_default():
            q = fifo_queue(4, "int32", (2,), name="mine", shared_name="inbox")
            return g, enqueue(q, np.array([1, 2], np.int32)), dequeue(q)[0]

    store = fc.ContainerStore()
    g1, put, _ = build()
    g2, _, take = build()
    consumer = Step(lambda: session(g2, store).run(take))
    assert blocked(consumer)
    session(g1, store).run(put)  # a disjoint graph, another session (§4.7)
    np.testing.assert_array_equal(consumer.finish(), [1, 2])
    # A session on another store has its own queue.
    g3, put3, _ = build()
    other = session(g3)
    other.run(put3)
    assert int(other.run(queue_size(g3.tensor("mine:0")))) == 1


def test_enqueue_waits_while_full_until_a_dequeue():
    g = fc.Graph()
    with g.as_default():
        q = fifo_queue(2, "int32", (), name="q")
        v = fc.placeholder("int32", (), name="v")
        put = enqueue(q, v)
        take = dequeue(q)[0]
        size = queue_size(q)
        close = queue_close(q, cancel_pending=True)
    s = session(g)
    s.run(put, {v: 1})
    s.run(put, {v: 2})
    third = Step(lambda: s.run(put, {v: 3}))
    try:
        assert blocked(third), "an enqueue on a full queue returned"
        assert int(s.run(size)) == 2
        assert int(s.run(take)) == 1
        third.finish()
        assert int(s.run(size)) == 2
        assert [int(s.run(take)) for _ in range(2)] == [2, 3]
    finally:
        s.run(close)


def test_enqueue_many_larger_than_capacity_streams_through():
    g = fc.Graph()
    with g.as_default():
        q = fifo_queue(3, "int32", (), name="q")
        put = enqueue_many(q, np.arange(7, dtype=np.int32))
        take = dequeue_many(q, 2)[0]
        last = dequeue(q)[0]
    s = session(g)
    producer = Step(lambda: s.run(put))
    got = [int(v) for _ in range(3) for v in s.run(take)] + [int(s.run(last))]
    producer.finish()
    assert got == list(range(7))


def test_waiting_dequeue_does_not_stop_the_rest_of_its_step():
    """Step A dequeues from q1 (empty) and enqueues into q2. Only A's enqueue into q2 lets another
    client's step move an element into q1, so A completes only if its executor ran the enqueue while
    the dequeue was waiting."""
    g = fc.Graph()
    with g.as_default():
        q1 = fifo_queue(1, "float32", (), name="q1")
        q2 = fifo_queue(1, "float32", (), name="q2")
        wait_q1 = dequeue(q1, name="wait_q1")[0]
        signal_q2 = enqueue(q2, 7.0, name="signal_q2")
        relay = enqueue(q1, dequeue(q2, name="from_q2")[0] * 2.0, name="relay")
        closers = [queue_close(q1, cancel_pending=True), queue_close(q2, cancel_pending=True)]
    s = session(g)
    stats = fc.RunStats()
    a = Step(lambda: s.run([wait_q1, signal_q2], stats=stats))
    b = Step(lambda: s.run(relay))
    try:
        value, _ = a.finish()
        b.finish()
    finally:
        s.run(closers)
    assert float(value) == 14.0
    started = [n for n, _ in stats.starts]
    assert started.index("wait_q1") < started.index("signal_q2")  # the dequeue was already waiting


def test_queues_under_the_distributed_runtime():
    """A queue on one device feeding a consumer on another: the dequeued value crosses by Send/Recv,
    and a step waiting on the queue is woken by another step's enqueue."""
    g = fc.Graph()
    with g.as_default():
        q = fifo_queue(2, "float32", (3,), name="q")
        v = fc.placeholder("float32", (3,), name="v")
        put = enqueue(q, v, name="put")
        y = fc.reduce_sum(dequeue(q, name="take")[0] * 2.0, name="y")
    cluster = Cluster.local(2)
    d0, d1 = cluster.names
    placement = {n: (d1 if n.startswith(("y", "Const")) else d0) for n in g.nodes}
    store = fc.ContainerStore()
    with DistributedSession(g, cluster, placement, store=store) as consumer, \
            DistributedSession(g, cluster, placement, store=store) as producer:
        waiting = Step(lambda: consumer.run(y))
        assert blocked(waiting)
        producer.run(put, {v: np.array([1, 2, 3], np.float32)})
        assert float(waiting.finish()) == 12.0


# ----------------------------------------------------------------------------- closing
def test_close_enqueue_fails_and_dequeue_drains_then_names_the_queue():
    g = fc.Graph()
    with g.as_default():
        q = fifo_queue(5, "int32", (), name="q")
        put = enqueue_many(q, np.arange(3, dtype=np.int32))
        put_one = enqueue(q, np.int32(9))
        take = dequeue(q)[0]
        take2 = dequeue_many(q, 2)[0]
        close = queue_close(q)
    s = session(g)
    s.run(put)
    s.run(close)
    with pytest.raises(QueueClosedError, match="queue 'q' is closed; Enqueue cannot add 1 element"):
        s.run(put_one)
    np.testing.assert_array_equal(s.run(take2), [0, 1])
    with pytest.raises(fc.ExecutionError, match=r"queue 'q' is closed and has 1 element; DequeueMany needs 2"):
        s.run(take2)  # too few: nothing is taken
    assert int(s.run(take)) == 2
    with pytest.raises(QueueClosedError, match=r"queue 'q' is closed and has 0 elements; Dequeue needs 1") as e:
        s.run(take)
    assert e.value.node == take.node and e.value.op == "Dequeue"


def test_close_wakes_a_waiting_dequeue_with_the_error():
    g = fc.Graph()
    with g.as_default():
        q = fifo_queue(4, "float32", (), name="q")
        take = dequeue_many(q, 4)[0]
        close = queue_close(q)
    s = session(g)
    waiting = Step(lambda: s.run(take))
    assert blocked(waiting)
    s.run(close)
    with pytest.raises(QueueClosedError, match="queue 'q' is closed and has 0 elements; DequeueMany needs 4"):
        waiting.finish()


@pytest.mark.parametrize("cancel", [False, True])
def test_close_and_an_enqueue_waiting_for_room(cancel):
    g = fc.Graph()
    with g.as_default():
        q = fifo_queue(1, "int32", (), name="q")
        v = fc.placeholder("int32", (), name="v")
        put = enqueue(q, v)
        take = dequeue(q)[0]
        close = queue_close(q, cancel_pending=cancel)
    s = session(g)
    s.run(put, {v: 1})
    pending = Step(lambda: s.run(put, {v: 2}))
    assert blocked(pending)
    s.run(close)
    if cancel:
        with pytest.raises(QueueClosedError, match="closed with cancel_pending while Enqueue waited"):
            pending.finish()
        assert int(s.run(take)) == 1
    else:  # a pending enqueue still lands once there is room, and the dequeues drain it
        assert int(s.run(take)) == 1
        pending.finish()
        assert int(s.run(take)) == 2
    with pytest.raises(QueueClosedError):
        s.run(take)


# ----------------------------------------------------------------------------- shuffling
def _shuffled(seed: int, n: int = 30, min_after: int = 5, graph_seed: int = 0) -> list[int]:
    """A fresh graph and session each time: enqueue 0..n-1, close, drain one by one."""
    g = fc.Graph(seed=graph_seed)
    with g.as_default():
        q = random_shuffle_queue(n, min_after, "int32", (), seed=seed, name="q")
        put = enqueue_many(q, np.arange(n, dtype=np.int32))
        take = dequeue(q)[0]
        close = queue_close(q)
    s = session(g)
    s.run(put)
    s.run(close)
    return [int(s.run(take)) for _ in range(n)]


def test_seeded_shuffle_is_reproducible_across_fresh_sessions():
    a, b = _shuffled(seed=7), _shuffled(seed=7)
    assert a == b
    assert sorted(a) == list(range(30)) and a != list(range(30))
    assert _shuffled(seed=8) != a


def test_unseeded_shuffle_is_a_permutation():
    out = _shuffled(seed=0)
    assert sorted(out) == list(range(30))
    assert out != list(range(30))
    # An unseeded queue draws from the graph seed and its name (as the random ops do).
    assert _shuffled(seed=0, graph_seed=1) != out


def test_shuffle_holds_back_min_after_dequeue_until_closed():
    g = fc.Graph()
    with g.as_default():
        q = random_shuffle_queue(10, 3, "int32", (), seed=1, name="q")
        put = enqueue_many(q, np.arange(5, dtype=np.int32))
        take2 = dequeue_many(q, 2)[0]
        size = queue_size(q)
        close = queue_close(q)
    s = session(g)
    s.run(put)
    first = list(s.run(take2))  # 5 >= 2 + 3
    waiting = Step(lambda: s.run(take2))
    assert blocked(waiting), "dequeued below min_after_dequeue before the close"
    assert int(s.run(size)) == 3
    s.run(close)  # now the rest drains
    rest = list(waiting.finish())
    assert int(s.run(size)) == 1
    assert len(set(first + rest)) == 4 and set(first + rest) <= set(range(5))


def test_shuffle_picks_are_spread_over_the_buffer():
    """Each first pick from a full buffer of 8 is uniform: over 400 seeds every element comes
    first about 50 times (a chi-square test against the uniform distribution, p > 1e-4)."""
    from scipy.stats import chisquare

    counts = np.zeros(8)
    for seed in range(1, 401):
        g = fc.Graph()
        with g.as_default():
            q = random_shuffle_queue(8, 0, "int32", (), seed=seed, name="q")
            put = enqueue_many(q, np.arange(8, dtype=np.int32))
            take = dequeue(q)[0]
        s = session(g)
        s.run(put)
        counts[int(s.run(take))] += 1
    assert chisquare(counts).pvalue > 1e-4


# ----------------------------------------------------------------------------- errors
def test_mismatches_are_graph_errors():
    g = fc.Graph()
    with g.as_default():
        q = fifo_queue(2, ["float32", "int32"], [(3,), ()], name="q")
        with pytest.raises(fc.GraphError, match=r"component 0 is float32\[4\], the queue expects float32\[3\]"):
            enqueue(q, [np.zeros(4, np.float32), np.int32(1)])
        with pytest.raises(fc.GraphError, match="2 component"):
            enqueue(q, np.zeros(3, np.float32))
        with pytest.raises(fc.GraphError, match=r"\[n\] \+ float32\[3\]"):
            enqueue_many(q, [np.zeros((2, 4), np.float32), np.zeros(2, np.int32)])
        with pytest.raises(fc.GraphError, match="disagree on the batch size"):
            enqueue_many(q, [np.zeros((2, 3), np.float32), np.zeros(3, np.int32)])
        with pytest.raises(fc.GraphError, match="not a queue"):
            dequeue(fc.constant(1.0))
        with pytest.raises(fc.GraphError, match="capacity must be >= 1"):
            fifo_queue(0, "float32", ())
        with pytest.raises(fc.GraphError, match=r"min_after_dequeue must be in \[0, capacity\)"):
            random_shuffle_queue(4, 4, "float32", ())
        with pytest.raises(fc.GraphError, match="n >= 1"):
            dequeue_many(q, 0)


def test_dequeue_many_larger_than_the_queue_can_give_is_refused_at_plan_time():
    g = fc.Graph()
    with g.as_default():
        fifo = dequeue_many(fifo_queue(3, "float32", (), name="f"), 4, name="too_many")[0]
        shuffle = dequeue_many(random_shuffle_queue(6, 3, "float32", (), name="r"), 4, name="too_many_r")[0]
    s = session(g)
    with pytest.raises(fc.GraphError, match=r"n=4 elements at once, but queue 'f' can hand out at most 3 at a time \(capacity 3\)"):
        s.run(fifo)
    with pytest.raises(fc.GraphError, match="capacity 6 less min_after_dequeue 3"):
        s.run(shuffle)


def test_shared_name_must_name_one_queue():
    store = fc.ContainerStore()
    sizes = []
    for cap in (2, 3):
        g = fc.Graph()
        with g.as_default():
            sizes.append((g, queue_size(fifo_queue(cap, "float32", (), shared_name="same"))))
    session(sizes[0][0], store).run(sizes[0][1])
    with pytest.raises(fc.ExecutionError, match="queue 'same' already exists as FIFOQueue capacity 2"):
        session(sizes[1][0], store).run(sizes[1][1])


def test_container_reset_gives_a_fresh_queue():
    store = fc.ContainerStore()
    g = fc.Graph()
    with g.as_default():
        q = fifo_queue(2, "float32", (), name="q", container="inputs")
        put = enqueue(q, 1.0)
        size = queue_size(q)
    s = session(g, store)
    s.run(put)
    assert int(s.run(size)) == 1
    store.reset("inputs")
    assert int(s.run(size)) == 0
