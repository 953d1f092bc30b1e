"""Queues (whitepaper §4.6, §5.3): FIFOQueue and RandomShuffleQueue, and the ops that use them.

A queue node is state, like a Variable: its output is a handle that names the queue, and every op
that uses the queue takes that handle as input 0 by reference (`ref_inputs=(0,)`), so the executor
neither waits for nor runs the queue node, and placement keeps the users on the queue's device
(§4.3, as for Assign). The queue object lives in the session's ContainerStore under
(container, "queue:" + (shared_name or node name)) (§4.7), so every session and client thread on
that store shares it: one thread's step enqueues while another's dequeues.

Enqueue, EnqueueMany, Dequeue and DequeueMany are asynchronous kernels (§5.3): an enqueue on a full
queue or a dequeue on one without enough elements registers its continuation and returns, so no
executor thread is held while it waits and the rest of the step keeps running. QueueClose and
QueueSize complete at once.

Close semantics (TensorFlow's): after QueueClose, an enqueue fails at once; a dequeue still drains
what is left and then fails with `QueueClosedError` naming the queue, what it holds and what the op
needed. `cancel_pending=True` also fails the enqueues still waiting for room. A RandomShuffleQueue
ignores `min_after_dequeue` once closed, so it drains completely.

Shuffling: a RandomShuffleQueue's stream is seeded like the random ops (flowctl.engine.ops.random):
from its own `seed` when non-zero, otherwise from the graph seed and the queue's name. An "unseeded"
queue is therefore still a fixed permutation for a given graph: a resumed or repeated run sees the
same order. Queue contents are not checkpointed (neither are TensorFlow's); a training run that
resumes refills them from its data cursor.

Component shapes are attrs `ranks` and `dims` (the shapes flattened, -1 for an unknown dimension),
because the attr schema has no list-of-shapes type; the builders take ordinary shapes.
"""
from __future__ import annotations

from typing import Any, Sequence

from flowctl.engine.container import ContainerStore, derive_seed
from flowctl.engine.dtypes import as_dtype
from flowctl.engine.errors import GraphError, QueueClosedError
from flowctl.engine.graph import Graph, Node, Tensor, parse_ref
from flowctl.engine.ops.api import constant, graph_of, make, make1, make_op
from flowctl.engine.opdef import REQUIRED, STATE, movement_cost, register_op
from flowctl.engine.queue import QueueRef, QueueSpec
from flowctl.engine.shapes import InferError, TensorSpec, dims_equal

__all__ = ["fifo_queue", "random_shuffle_queue", "enqueue", "enqueue_many", "dequeue", "dequeue_many",
           "queue_close", "queue_size", "QueueClosedError"]

QUEUE_OPS = ("FIFOQueue", "RandomShuffleQueue")
# The handle a queue node outputs: a placeholder scalar. Users bind the queue through the ref edge,
# never through the handle's value.
HANDLE = TensorSpec((), "int32")


# ---------------------------------------------------------------------------------- component specs
_COMPONENTS: dict[str, tuple[str, Any]] = {
    "dtypes": ("strs", REQUIRED),
    "ranks": ("ints", REQUIRED),
    "dims": ("ints", ()),
}


def component_specs(attrs: dict[str, Any]) -> list[TensorSpec]:
    """The (shape, dtype) of each component of one queue element, decoded from the attrs."""
    dtypes, ranks, dims = attrs["dtypes"], attrs["ranks"] or (), attrs["dims"] or ()
    if not dtypes:
        raise InferError("a queue element needs at least one component (dtypes is empty)")
    if len(ranks) != len(dtypes):
        raise InferError(f"{len(dtypes)} component dtypes but {len(ranks)} shapes")
    if any(r < 0 for r in ranks) or sum(ranks) != len(dims):
        raise InferError(f"ranks {list(ranks)} do not match the {len(dims)} flattened dims {list(dims)}")
    specs, at = [], 0
    for dt, r in zip(dtypes, ranks):
        try:
            dtype = as_dtype(dt)
        except GraphError as e:
            raise InferError(str(e)) from None
        specs.append(TensorSpec(tuple(None if d < 0 else d for d in dims[at:at + r]), dtype))
        at += r
    return specs


def _encode_components(dtypes: Any, shapes: Any) -> dict[str, Any]:
    if isinstance(dtypes, (str, type)) or not isinstance(dtypes, Sequence):
        dtypes = [dtypes]
    dts = [as_dtype(d) for d in dtypes]
    if shapes is None:
        raise GraphError("a queue needs the shape of every component (None for an unknown dimension)")
    shapes = list(shapes)
    if len(dts) == 1 and (not shapes or not isinstance(shapes[0], (list, tuple))):
        shapes = [shapes]  # one component: a bare shape is accepted
    if len(shapes) != len(dts):
        raise GraphError(f"a queue with {len(dts)} component dtypes needs {len(dts)} shapes, got {len(shapes)}")
    return {"dtypes": tuple(dts), "ranks": tuple(len(s) for s in shapes),
            "dims": tuple(-1 if d is None else int(d) for s in shapes for d in s)}


def _components_of(q: Tensor) -> dict[str, Any]:
    node = q.op
    if node.op not in QUEUE_OPS:
        raise GraphError(f"'{q.name}' is the output of {node.op} '{node.name}', not a queue "
                         f"({' or '.join(QUEUE_OPS)})")
    return {k: node.attrs[k] for k in _COMPONENTS}


def _describe(spec: TensorSpec) -> str:
    return f"{spec.dtype}{list(spec.shape)}"


def _check_components(what: str, got: list[TensorSpec], want: list[TensorSpec], batched: bool) -> None:
    if len(got) != len(want):
        raise InferError(f"{what} got {len(got)} component(s), the queue's elements have {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        shape = g.shape[1:] if batched else g.shape
        if batched and not g.shape:
            raise InferError(f"{what}: component {i} is a scalar; EnqueueMany needs a leading batch dimension")
        ok = g.dtype == w.dtype and len(shape) == len(w.shape) and all(dims_equal(a, b)
                                                                         for a, b in zip(shape, w.shape))
        if not ok:
            lead = "[n] + " if batched else ""
            raise InferError(f"{what}: component {i} is {_describe(g)}, the queue expects "
                             f"{lead}{_describe(w)}")


# ---------------------------------------------------------------------------------- shape functions
def _queue_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    component_specs(attrs)
    if attrs["capacity"] < 1:
        raise InferError(f"capacity must be >= 1, got {attrs['capacity']}")
    if "min_after_dequeue" in attrs and not 0 <= attrs["min_after_dequeue"] < attrs["capacity"]:
        raise InferError(f"min_after_dequeue must be in [0, capacity) = [0, {attrs['capacity']}), "
                         f"got {attrs['min_after_dequeue']}")
    return [HANDLE]


def _enqueue_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    _check_components("Enqueue", ins[1:], component_specs(attrs), batched=False)
    return []


def _enqueue_many_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    _check_components("EnqueueMany", ins[1:], component_specs(attrs), batched=True)
    lead = {s.shape[0] for s in ins[1:] if s.shape[0] is not None}
    if len(lead) > 1:
        raise InferError(f"EnqueueMany components disagree on the batch size: {sorted(lead)}")
    return []


def _dequeue_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    return component_specs(attrs)


def _dequeue_many_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if attrs["n"] < 1:
        raise InferError(f"DequeueMany needs n >= 1, got {attrs['n']}")
    return [TensorSpec((attrs["n"], *s.shape), s.dtype) for s in component_specs(attrs)]


def _free(ins: Any, outs: Any, dtypes: Any, attrs: Any) -> tuple[float, float]:
    return 0.0, 0.0


_QUEUE_ATTRS: dict[str, tuple[str, Any]] = {
    "capacity": ("int", REQUIRED), **_COMPONENTS, "container": ("str", ""), "shared_name": ("str", ""),
}
# All of them: stateful (never merged by CSE, folded or pruned apart), not differentiable, bound to
# the queue through resource kind "queue" (Session._resource).
_COMMON: dict[str, Any] = dict(group=STATE, stateful=True, differentiable=False, resource="queue")
register_op("FIFOQueue", _queue_infer, num_inputs=0, attrs=dict(_QUEUE_ATTRS), cost=_free, **_COMMON)
register_op("RandomShuffleQueue", _queue_infer, num_inputs=0, cost=_free,
            attrs={**_QUEUE_ATTRS, "min_after_dequeue": ("int", 0), "seed": ("int", 0)}, **_COMMON)
_USER: dict[str, Any] = dict(_COMMON, ref_inputs=(0,))
register_op("Enqueue", _enqueue_infer, min_inputs=2, attrs=dict(_COMPONENTS), cost=movement_cost,
            is_async=True, **_USER)
register_op("EnqueueMany", _enqueue_many_infer, min_inputs=2, attrs=dict(_COMPONENTS), cost=movement_cost,
            is_async=True, **_USER)
register_op("Dequeue", _dequeue_infer, num_inputs=1, attrs=dict(_COMPONENTS), cost=movement_cost,
            is_async=True, **_USER)
register_op("DequeueMany", _dequeue_many_infer, num_inputs=1, attrs={**_COMPONENTS, "n": ("int", REQUIRED)},
            cost=movement_cost, is_async=True, **_USER)
register_op("QueueClose", lambda ins, a: [], num_inputs=1, attrs={"cancel_pending": ("bool", False)},
            cost=_free, **_USER)
register_op("QueueSize", lambda ins, a: [TensorSpec((), "int32")], num_inputs=1, cost=_free, **_USER)


# ---------------------------------------------------------------------------------- the resource
def queue_resource(graph: Graph, node: Node, store: ContainerStore) -> QueueRef:
    """What Session._resource binds for resource kind "queue": the queue node's own queue, or that
    of the queue feeding input 0. The queue itself is made on first use (and again after its
    container is reset)."""
    qnode = node
    if node.op not in QUEUE_OPS:
        src = parse_ref(node.inputs[0])[0]
        qnode = graph.nodes[src]
        if qnode.op not in QUEUE_OPS:
            raise GraphError(f"node '{node.name}' ({node.op}) must take a queue ({' or '.join(QUEUE_OPS)}) "
                             f"as its first input, not '{qnode.name}' ({qnode.op})")
    a = qnode.attrs
    key = a["shared_name"] or qnode.name
    shuffle = qnode.op == "RandomShuffleQueue"
    most = a["capacity"] - (a["min_after_dequeue"] if shuffle else 0)
    if node.op == "DequeueMany" and node.attrs["n"] > most:
        # A DequeueMany takes its n elements at once, so n must fit beside the elements kept back.
        raise GraphError(f"node '{node.name}' (DequeueMany) takes n={node.attrs['n']} elements at once, but queue "
                         f"'{key}' can hand out at most {most} at a time (capacity {a['capacity']}"
                         + (f" less min_after_dequeue {a['min_after_dequeue']}" if shuffle else "") + ")")
    spec = QueueSpec(name=key, shuffle=shuffle, capacity=a["capacity"],
                     min_after_dequeue=a["min_after_dequeue"] if shuffle else 0,
                     seed=derive_seed(graph.seed, key, a["seed"]) if shuffle else 0,
                     components=tuple(component_specs(a)))
    return QueueRef(store.get(a["container"]).slot("queue:" + key), spec)


# ---------------------------------------------------------------------------------- Python API
def fifo_queue(capacity: int, dtypes: Any, shapes: Any, name: str | None = None, shared_name: str = "",
               container: str = "") -> Tensor:
    """A first-in first-out queue of elements with one component per dtype (§4.6). `shapes`: one
    shape per component (None for an unknown dimension). Returns the queue's handle."""
    attrs = {"capacity": capacity, "container": container, "shared_name": shared_name,
             **_encode_components(dtypes, shapes)}
    return make1("FIFOQueue", [], attrs, name=name or "fifo_queue", graph=graph_of())


def random_shuffle_queue(capacity: int, min_after_dequeue: int, dtypes: Any, shapes: Any, seed: int = 0,
                         name: str | None = None, shared_name: str = "", container: str = "") -> Tensor:
    """A queue that dequeues a uniformly random element of its buffer (§4.6), and (until closed)
    only while more than `min_after_dequeue` elements remain, so the buffer stays mixed. `seed` 0
    derives the stream from the graph seed and the queue's name."""
    attrs = {"capacity": capacity, "min_after_dequeue": min_after_dequeue, "seed": seed,
             "container": container, "shared_name": shared_name, **_encode_components(dtypes, shapes)}
    return make1("RandomShuffleQueue", [], attrs, name=name or "random_shuffle_queue", graph=graph_of())


def _values(q: Tensor, values: Any) -> list[Tensor]:
    """As TensorFlow: a list or tuple holds one value per component; anything else (a Tensor, an
    array, a number) is the value of a one-component element."""
    specs = component_specs(_components_of(q))
    vals = list(values) if isinstance(values, (list, tuple)) else [values]
    if len(vals) != len(specs):
        raise GraphError(f"queue '{q.op.name}' holds elements of {len(specs)} component(s); got {len(vals)} "
                         f"value(s) (pass a list with one value per component)")
    return [v if isinstance(v, Tensor) else constant(v, dtype=s.dtype, graph=q.graph)
            for v, s in zip(vals, specs)]


def enqueue(q: Tensor, values: Any, name: str | None = None) -> Tensor:
    """Add one element (one value per component); waits while the queue is full. A target."""
    return make_op("Enqueue", [q, *_values(q, values)], _components_of(q), name=name or "Enqueue",
                   graph=q.graph)


def enqueue_many(q: Tensor, values: Any, name: str | None = None) -> Tensor:
    """Add the n elements sliced along axis 0 of each component, in order. A target."""
    return make_op("EnqueueMany", [q, *_values(q, values)], _components_of(q),
                   name=name or "EnqueueMany", graph=q.graph)


def dequeue(q: Tensor, name: str | None = None) -> list[Tensor]:
    """Remove one element: one Tensor per component (a list even for one component)."""
    return make("Dequeue", [q], _components_of(q), name=name or "Dequeue", graph=q.graph)


def dequeue_many(q: Tensor, n: int, name: str | None = None) -> list[Tensor]:
    """Remove `n` elements at once, each component stacked along a new axis 0."""
    return make("DequeueMany", [q], {**_components_of(q), "n": n}, name=name or "DequeueMany", graph=q.graph)


def queue_close(q: Tensor, cancel_pending: bool = False, name: str | None = None) -> Tensor:
    """Close the queue (a target): later enqueues fail, dequeues drain then fail;
    `cancel_pending` also fails the enqueues waiting for room."""
    _components_of(q)
    return make_op("QueueClose", [q], {"cancel_pending": cancel_pending}, name=name or "QueueClose",
                   graph=q.graph)


def queue_size(q: Tensor, name: str | None = None) -> Tensor:
    """The number of elements in the queue now (int32 scalar)."""
    _components_of(q)
    return make1("QueueSize", [q], name=name or "QueueSize", graph=q.graph)

