"""Queue kernels (whitepaper §4.6, §5.3). Each is bound to a `QueueRef` (attrs["_resource"]) and
reaches the queue (flowctl.engine.queue) through it on every call, so a reset container makes a
fresh queue.

The executor hands async kernels a step context; queues do not use it (they are shared by every
step and session on the store, not per step), and under a plain Session it is None.
"""
from __future__ import annotations

from typing import Any, Callable

from flowctl.engine.queue import Done, Element, QueueRef
from flowctl.kernels.registry import kernel


# ---------------------------------------------------------------------------------- kernels
def _handle(xp: Any, attrs: dict[str, Any]) -> Callable[[], Any]:
    ref: QueueRef = attrs["_resource"]
    zero = xp.zeros((), dtype=xp.int32)

    def run() -> Any:
        ref.get()  # running the queue node makes the queue
        return zero

    return run


kernel("FIFOQueue")(_handle)
kernel("RandomShuffleQueue")(_handle)


@kernel("Enqueue")
def enqueue(xp: Any, attrs: dict[str, Any]) -> Callable[[Any, tuple[Any, ...], Done], None]:
    ref: QueueRef = attrs["_resource"]
    node = attrs["_node"]

    def start(step: Any, inputs: tuple[Any, ...], done: Done) -> None:
        ref.get().enqueue([tuple(inputs)], lambda _, err: done(None, err), node, "Enqueue")

    return start


@kernel("EnqueueMany")
def enqueue_many(xp: Any, attrs: dict[str, Any]) -> Callable[[Any, tuple[Any, ...], Done], None]:
    ref: QueueRef = attrs["_resource"]
    node = attrs["_node"]

    def start(step: Any, inputs: tuple[Any, ...], done: Done) -> None:
        lead = {int(x.shape[0]) for x in inputs}
        if len(lead) != 1:
            raise ValueError(f"EnqueueMany components disagree on the batch size: {sorted(lead)}")
        # Slices are views: kernels never write into their inputs, so an element may share them.
        elements = [tuple(x[i] for x in inputs) for i in range(lead.pop())]
        ref.get().enqueue(elements, lambda _, err: done(None, err), node, "EnqueueMany")

    return start


def _outputs(parts: tuple[Any, ...]) -> Any:
    # The executor takes a one-output kernel's value bare and a multi-output kernel's as a tuple.
    return parts[0] if len(parts) == 1 else parts


@kernel("Dequeue")
def dequeue(xp: Any, attrs: dict[str, Any]) -> Callable[[Any, tuple[Any, ...], Done], None]:
    ref: QueueRef = attrs["_resource"]
    node = attrs["_node"]

    def start(step: Any, inputs: tuple[Any, ...], done: Done) -> None:
        def finish(elements: list[Element] | None, err: BaseException | None) -> None:
            done(None if elements is None else _outputs(elements[0]), err)

        ref.get().dequeue(1, finish, node, "Dequeue")

    return start


@kernel("DequeueMany")
def dequeue_many(xp: Any, attrs: dict[str, Any]) -> Callable[[Any, tuple[Any, ...], Done], None]:
    ref: QueueRef = attrs["_resource"]
    node, n = attrs["_node"], int(attrs["n"])

    def start(step: Any, inputs: tuple[Any, ...], done: Done) -> None:
        def finish(elements: list[Element] | None, err: BaseException | None) -> None:
            if elements is None:
                done(None, err)
                return
            try:
                parts = tuple(xp.stack([e[c] for e in elements]) for c in range(len(elements[0])))
            except Exception as e:  # noqa: BLE001 -- e.g. elements of different shapes: this node's failure
                done(None, ValueError(f"cannot batch {n} elements: {e}"))
                return
            done(_outputs(parts), None)

        ref.get().dequeue(n, finish, node, "DequeueMany")

    return start


@kernel("QueueClose")
def queue_close(xp: Any, attrs: dict[str, Any]) -> Callable[[], None]:
    ref: QueueRef = attrs["_resource"]
    cancel = bool(attrs["cancel_pending"])

    def run() -> None:
        ref.get().close(cancel)

    return run


@kernel("QueueSize")
def queue_size(xp: Any, attrs: dict[str, Any]) -> Callable[[], Any]:
    ref: QueueRef = attrs["_resource"]

    def run() -> Any:
        return xp.asarray(ref.get().size(), dtype=xp.int32)

    return run
