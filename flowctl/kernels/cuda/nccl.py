"""NCCL's all-reduce for CollectiveAllReduce on GPUs of one process (issue 33).

One NCCL clique per set of devices, made once (`NcclCommunicator.initAll`: one communicator per
device, all in this process). Each rank's kernel, on its own device thread, `arrive`s: its send
buffer made contiguous, a receive buffer allocated on its device, and the stream it runs on (the
thread's current one). The last rank to reach the step's rendezvous calls `all_reduce`, which
issues every rank's `ncclAllReduce` inside one `groupStart`/`groupEnd`, each on its rank's stream:
a launch, no host synchronisation; each rank's later kernels, queued on that stream, read the sum
after it. Launches of different collectives are serialised under one lock, so every communicator
sees the collectives in the same order (NCCL needs that; two buckets issued in different orders on
two devices would hang both).

NCCL's sum is identical on every rank, but its order of additions is its own (rings, trees,
chunks): the result is not bitwise the CPU reference's rank-order sum.
"""
from __future__ import annotations

import threading
from typing import Any, NamedTuple

_cliques: dict[tuple[int, ...], list[Any]] = {}
_clique_lock = threading.Lock()
_launch_lock = threading.Lock()


class Part(NamedTuple):
    """One rank's share: its send and receive buffers, its stream and its CUDA device."""

    send: Any
    recv: Any
    stream: Any
    device: int


def arrive(cp: Any, x: Any) -> Part:
    """On the rank's own thread: what `all_reduce` needs of it."""
    device = int(x.device.id)
    with cp.cuda.Device(device):
        send = cp.ascontiguousarray(x)
        return Part(send, cp.empty_like(send), cp.cuda.get_current_stream(), device)


def clique(devices: tuple[int, ...]) -> list[Any]:
    """The communicators of `devices` (rank order), made on first use."""
    with _clique_lock:
        comms = _cliques.get(devices)
        if comms is None:
            from cupy.cuda import nccl  # type: ignore[import-not-found]

            comms = _cliques[devices] = list(nccl.NcclCommunicator.initAll(list(devices)))
        return comms


def _nccl_type(nccl: Any, dtype: Any) -> int:
    types = {"float16": nccl.NCCL_FLOAT16, "float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64,
             "int32": nccl.NCCL_INT32, "int64": nccl.NCCL_INT64}
    try:
        return types[str(dtype)]
    except KeyError:
        raise TypeError(f"NCCL all-reduce of {dtype} is not supported; use one of {sorted(types)}") from None


def all_reduce(parts: list[Part]) -> list[Any]:
    """Every rank's sum, each in its own receive buffer, launched on its own stream."""
    import cupy as cp  # type: ignore[import-not-found]
    from cupy.cuda import nccl  # type: ignore[import-not-found]

    devices = tuple(p.device for p in parts)
    if len(set(devices)) != len(devices):
        raise ValueError(f"the collective's ranks hold their buffers on CUDA devices {list(devices)}: each rank "
                         f"must run on a GPU of its own (its device thread's current device)")
    sizes = {int(p.send.size) for p in parts}
    if len(sizes) != 1 or len({str(p.send.dtype) for p in parts}) != 1:
        raise ValueError(f"the collective's ranks disagree on size or dtype: "
                         f"{[(int(p.send.size), str(p.send.dtype)) for p in parts]}")
    dtype = _nccl_type(nccl, parts[0].send.dtype)
    comms = clique(devices)
    with _launch_lock:
        nccl.groupStart()
        try:
            for comm, p in zip(comms, parts):
                with cp.cuda.Device(p.device):
                    comm.allReduce(p.send.data.ptr, p.recv.data.ptr, int(p.send.size), dtype, nccl.NCCL_SUM,
                                   p.stream.ptr)
        finally:
            nccl.groupEnd()
    return [p.recv for p in parts]
