"""The queue itself (whitepaper §4.6, §5.3): state kept in a container (§4.7), like a Variable's.

A `Queue` holds elements (tuples of arrays, one per component) and two lines of waiting ops:
enqueues waiting for room and dequeues waiting for elements, each served in arrival order. An op
that cannot complete at once is recorded with its continuation and the kernel returns (§5.3); the
op that changes the queue (an enqueue, a dequeue, a close) then completes whichever waiters it
made ready. Continuations are called after the queue's lock is released: one only appends to its
executor's completion queue, but holding the lock across it would order the queue's lock before
every executor's.

The queue ops (flowctl.engine.ops.queues) bind a `QueueRef` to each queue node's kernel
(flowctl.kernels.queues); the kernels reach the queue through it.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from flowctl.engine.errors import QueueClosedError
from flowctl.engine.shapes import TensorSpec

__all__ = ["Done", "Element", "Finish", "Queue", "QueueRef", "QueueSpec"]

Element = tuple[Any, ...]
Done = Callable[[Any, "BaseException | None"], None]
# What a queue continuation gets: the dequeued elements (None for an enqueue), or an error.
Finish = Callable[["list[Element] | None", "BaseException | None"], None]


@dataclass(frozen=True)
class QueueSpec:
    """What a queue node declares; two nodes sharing a queue (shared_name) must agree on it."""

    name: str
    shuffle: bool
    capacity: int
    min_after_dequeue: int
    seed: int
    components: tuple[TensorSpec, ...]

    def signature(self) -> tuple[Any, ...]:
        # The seed is left out: whichever node makes a shared queue seeds it.
        return (self.shuffle, self.capacity, self.min_after_dequeue, self.components)

    def describe(self) -> str:
        comps = ", ".join(f"{c.dtype}{list(c.shape)}" for c in self.components)
        kind = f"RandomShuffleQueue(min_after_dequeue={self.min_after_dequeue})" if self.shuffle else "FIFOQueue"
        return f"{kind} capacity {self.capacity} of ({comps})"


@dataclass
class _Waiter:
    node: str
    op: str
    finish: Finish
    want: int = 0  # dequeue: elements needed
    elements: list[Element] = field(default_factory=list)  # enqueue: elements not yet added


def _elements(k: int) -> str:
    return f"{k} element" + ("" if k == 1 else "s")


class Queue:
    def __init__(self, spec: QueueSpec) -> None:
        self.spec = spec
        self.closed = False
        self._lock = threading.Lock()
        # FIFO pops the front (a deque); a shuffling queue picks by index and pops the end (a list).
        self._buf: Any = [] if spec.shuffle else deque()
        # Host-side index choice only (not tensor computation), so numpy on every device type.
        self._rng = np.random.Generator(np.random.Philox(key=spec.seed)) if spec.shuffle else None
        self._enqueuers: deque[_Waiter] = deque()
        self._dequeuers: deque[_Waiter] = deque()

    def __repr__(self) -> str:
        closed = ", closed" if self.closed else ""
        return f"<Queue '{self.spec.name}' {self.spec.describe()}: {len(self._buf)} held{closed}>"

    def size(self) -> int:
        with self._lock:
            return len(self._buf)

    def enqueue(self, elements: list[Element], finish: Finish, node: str, op: str) -> None:
        """Add `elements` in order, waiting (by continuation) for room; `finish(None, err)`."""
        with self._lock:
            if self.closed:
                err: BaseException | None = QueueClosedError(
                    f"node '{node}' ({op}): queue '{self.spec.name}' is closed; {op} cannot add "
                    f"{_elements(len(elements))}", node=node, op=op)
                ready: list[tuple[Finish, Any, BaseException | None]] = [(finish, None, err)]
            else:
                self._enqueuers.append(_Waiter(node, op, finish, elements=list(elements)))
                ready = self._flush()
        _call(ready)

    def dequeue(self, want: int, finish: Finish, node: str, op: str) -> None:
        """Remove `want` elements at once, waiting (by continuation) until there are enough;
        `finish(elements, None)`, or `finish(None, QueueClosedError)` once they can never come."""
        with self._lock:
            self._dequeuers.append(_Waiter(node, op, finish, want=want))
            ready = self._flush()
        _call(ready)

    def close(self, cancel_pending: bool = False) -> None:
        with self._lock:
            self.closed = True
            ready: list[tuple[Finish, Any, BaseException | None]] = []
            if cancel_pending:
                while self._enqueuers:
                    w = self._enqueuers.popleft()
                    ready.append((w.finish, None, QueueClosedError(
                        f"node '{w.node}' ({w.op}): queue '{self.spec.name}' was closed with cancel_pending "
                        f"while {w.op} waited for room; {_elements(len(w.elements))} not added",
                        node=w.node, op=w.op)))
            ready += self._flush()
        _call(ready)

    def _take(self, k: int) -> list[Element]:
        if self._rng is None:
            return [self._buf.popleft() for _ in range(k)]
        out = []
        for _ in range(k):
            # Uniform pick from the buffer (§4.6 "randomly shuffles its elements within a large
            # in-memory buffer"): swap the pick to the end and pop it.
            j = int(self._rng.integers(len(self._buf)))
            self._buf[j], self._buf[-1] = self._buf[-1], self._buf[j]
            out.append(self._buf.pop())
        return out

    def _flush(self) -> list[tuple[Finish, Any, BaseException | None]]:
        """Serve waiters in arrival order until none can progress (lock held). Returns the
        continuations to call once the lock is released."""
        ready: list[tuple[Finish, Any, BaseException | None]] = []
        cap = self.spec.capacity
        progress = True
        while progress:
            progress = False
            while self._enqueuers and len(self._buf) < cap:
                w = self._enqueuers[0]
                room = cap - len(self._buf)
                self._buf.extend(w.elements[:room])
                del w.elements[:room]
                progress = True
                if w.elements:
                    break
                self._enqueuers.popleft()
                ready.append((w.finish, None, None))
            while self._dequeuers:
                w = self._dequeuers[0]
                # Until closed a shuffling queue keeps min_after_dequeue elements to mix with.
                keep = 0 if self.closed else self.spec.min_after_dequeue
                if len(self._buf) >= w.want + keep:
                    self._dequeuers.popleft()
                    ready.append((w.finish, self._take(w.want), None))
                    progress = True
                elif self.closed and not self._enqueuers:
                    # Nothing can arrive any more: this dequeue, and any behind it, can never complete
                    # unless enough is left (a smaller DequeueMany behind a larger one still drains).
                    self._dequeuers.popleft()
                    ready.append((w.finish, None, QueueClosedError(
                        f"node '{w.node}' ({w.op}): queue '{self.spec.name}' is closed and has "
                        f"{_elements(len(self._buf))}; {w.op} needs {w.want}", node=w.node, op=w.op)))
                    progress = True
                else:
                    break
        return ready


def _call(ready: list[tuple[Finish, Any, BaseException | None]]) -> None:
    for finish, value, err in ready:
        finish(value, err)


_create_lock = threading.Lock()


class QueueRef:
    """What a queue op's kernel is bound to (attrs["_resource"]): the container slot holding the
    queue, and the spec to make it from. The queue is made on first use and again after its
    container is reset (§4.7), which is why kernels call `get()` each time rather than keep it."""

    def __init__(self, slot: Any, spec: QueueSpec) -> None:
        self.slot = slot
        self.spec = spec

    def get(self) -> Queue:
        q = self.slot.value
        if q is None:
            with _create_lock:
                q = self.slot.value
                if q is None:
                    q = self.slot.value = Queue(self.spec)
        if q.spec is not self.spec and q.spec.signature() != self.spec.signature():
            raise ValueError(f"queue '{self.spec.name}' already exists as {q.spec.describe()}; this node "
                             f"declares {self.spec.describe()} (shared_name must name one queue)")
        return q
