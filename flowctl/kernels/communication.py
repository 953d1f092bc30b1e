"""Send and Recv kernels (whitepaper §3.2.2, §5.3, §5.5).

Both are asynchronous kernels: the factory returns `start(step, inputs, done)`. `step` is duck-typed
(the engine's StepContext): `step.key(src, dst, tensor_name)` builds the rendezvous key and
`step.rendezvous` has `send(key, value)` and `recv_async(key, callback)`.

Within one process a tensor is handed over by reference: kernels never mutate their inputs and
assignments replace a variable's array, so the receiving device may share the sender's buffer.
A Recv on a device whose array module differs from the sender's moves the array: off a GPU on a
copy thread once the producer's CUDA event fires, onto a GPU on a copy stream the compute stream
waits for (`backend.receive`), so neither device's thread waits for the other's queue.

CollectiveAllReduce is asynchronous too: each rank joins the step's collective
(`LocalRendezvous.collective`) and returns; the last rank to join reduces on its own thread and
every rank's continuation gets its output. No device thread ever blocks on another, so no step can
deadlock on a collective (a device still computing simply joins later), and an aborted step wakes
the ranks that wait (`LocalRendezvous.abort`). On the CPU, and wherever the arrays are not cupy's
(the launch ledger), the reduction is the ranks' sum in rank order, one array shared by every rank
(kernels never write their inputs, and buffer forwarding only takes a buffer no other rank holds).
On GPUs the last rank launches NCCL's all-reduce for all N ranks in one NCCL group, each rank on
its own device's current stream (kernels/cuda/nccl.py): nothing waits on the host.
"""
from __future__ import annotations

from typing import Any, Callable

from flowctl.kernels.backend import DEAD, cupy_or_none, mark_ready, receive
from flowctl.kernels.registry import kernel

Done = Callable[[Any, "BaseException | None"], None]

# bfloat16 truncation (§5.5): keep the upper 16 bits of the IEEE float32 bit pattern.
_QUIET_NAN_HIGH = 0x7FC0  # a NaN whose payload sat only in the dropped bits must stay a NaN


def narrow(xp: Any, x: Any) -> Any:
    """float32 -> uint16 holding its upper 16 bits (sign, exponent, top 7 mantissa bits)."""
    x = xp.asarray(x, dtype=xp.float32)
    high = (x.view(xp.uint32) >> 16).astype(xp.uint16)
    nan = xp.isnan(x)
    if bool(nan.any()):
        high = xp.where(nan, xp.uint16(_QUIET_NAN_HIGH), high)
    return high


def widen(xp: Any, y: Any) -> Any:
    """uint16 upper halves -> float32 with the low 16 mantissa bits zero-filled (§5.5)."""
    return (xp.asarray(y).astype(xp.uint32) << 16).view(xp.float32)


@kernel("Send")
def send(xp: Any, attrs: dict[str, Any]) -> Callable[[Any, tuple[Any, ...], Done], None]:
    src, dst, name = attrs["send_device"], attrs["recv_device"], attrs["tensor_name"]
    compress = bool(attrs["compress"])

    def start(step: Any, inputs: tuple[Any, ...], done: Done) -> None:
        if inputs[0] is DEAD:  # §4.4: an untaken branch's value travels as a dead token
            step.rendezvous.send(step.key(src, dst, name), DEAD)
            done(None, None)
            return
        value = narrow(xp, inputs[0]) if compress else inputs[0]
        step.rendezvous.send(step.key(src, dst, name), mark_ready(value))
        done(None, None)  # a local Send never waits: the rendezvous buffers until the Recv comes

    return start


@kernel("Recv")
def recv(xp: Any, attrs: dict[str, Any]) -> Callable[[Any, tuple[Any, ...], Done], None]:
    src, dst, name = attrs["send_device"], attrs["recv_device"], attrs["tensor_name"]
    compress = bool(attrs["compress"])
    on_host = xp.__name__ == "numpy"

    def start(step: Any, inputs: tuple[Any, ...], done: Done) -> None:
        def moved(value: Any, err: BaseException | None) -> None:
            if err is not None:
                done(None, err)
                return
            try:
                done(widen(xp, value) if compress else value, None)
            except Exception as e:  # noqa: BLE001 -- reported as this Recv's failure
                done(None, e)

        def arrived(value: Any, err: BaseException | None) -> None:
            if err is not None:
                done(None, err)
                return
            if value is DEAD:
                done(DEAD, None)
                return
            try:
                receive(value, on_host, xp, moved)
            except Exception as e:  # noqa: BLE001 -- reported as this Recv's failure
                done(None, e)

        # §5.3: registers the continuation and returns; the executor goes on with other work.
        step.rendezvous.recv_async(step.key(src, dst, name), arrived)

    return start


def sum_in_rank_order(values: list[Any]) -> list[Any]:
    """The collective's CPU reduction: rank 0 + rank 1 + ... (left to right), one array for all."""
    acc = values[0] + values[1]
    for v in values[2:]:
        acc = acc + v
    return [acc] * len(values)


@kernel("CollectiveAllReduce")
def collective_all_reduce(xp: Any, attrs: dict[str, Any]) -> Callable[[Any, tuple[Any, ...], Done], None]:
    group, size, rank = attrs["group_key"], int(attrs["group_size"]), int(attrs["rank"])
    on_host = xp.__name__ == "numpy"

    def start(step: Any, inputs: tuple[Any, ...], done: Done) -> None:
        x = inputs[0]
        if x is DEAD:
            done(None, ValueError(f"collective {group!r} rank {rank}: a dead (untaken-branch) value cannot "
                                  f"be all-reduced"))
            return
        if size == 1:
            done(x, None)
            return
        cp = None if on_host else cupy_or_none()
        if cp is not None and isinstance(x, cp.ndarray):
            from flowctl.kernels.cuda import nccl

            value, reduce = nccl.arrive(cp, x), nccl.all_reduce
        else:
            value, reduce = x, sum_in_rank_order
        step.rendezvous.collective(step.collective_key(group), rank, size, value, reduce, done)

    return start
