"""Communication ops: Send and Recv (whitepaper §3.2.2, §5.3, §5.5).

Partitioning (flowctl/engine/partition.py) inserts them; users rarely write them by hand. A Send on
the producer's device and a Recv on the consumer's meet in the step's rendezvous under the key
(step, send_device, recv_device, tensor_name, frame, iteration); the runtime hands both the step
context, which is why both are declared asynchronous (`is_async`): Recv completes through a
continuation when the tensor arrives and holds no thread meanwhile (§5.3); Send completes before
its `start` returns (a local Send only buffers) and is asynchronous only to receive the context.

`compress` (§5.5): a float32 tensor travels as its upper 16 bits (sign, exponent, 7 mantissa bits,
i.e. bfloat16 by truncation) and is widened on arrival by zero-filling the dropped bits, the cheap
conversion the paper describes (no probabilistic rounding). Relative error per transfer < 2**-7.

`CollectiveAllReduce` (issue 33, engine/allreduce.py): the all-reduce of data parallelism as one op
per replica device, as TensorFlow's collective ops are, instead of a ring of Add nodes over
Send/Recv. N nodes share a `group_key` (one per gradient bucket); the node of rank k, on replica
k's device, takes that replica's flat bucket and outputs the sum over all N ranks. Its kernel is a
rendezvous of the N device threads of one process (`LocalRendezvous.collective`): asynchronous
like a Recv, the last rank to arrive reduces. On CPU devices the sum is numpy's, in rank order
(rank 0 + rank 1 + ...): every rank gets the same array, and two ranks give the exchange's bits.
On GPUs it is NCCL's all-reduce over a clique of the group's devices (kernels/cuda/nccl.py):
identical on every rank, but in NCCL's own order of additions, so not bitwise the CPU's sum. The
cost model prices it as the ring's wire traffic, 2(N-1)/N of the bucket over the link to the next
rank's device (placement/cost.py `collective_transfer`), so `place` and the simulator still see
what the transfer costs.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flowctl.engine.dtypes import as_dtype, itemsize
from flowctl.engine.graph import Tensor
from flowctl.engine.ops.api import graph_of, make1, make_op
from flowctl.engine.opdef import COLLECTIVE, COMMUNICATION, REQUIRED, elementwise_cost, register_op
from flowctl.engine.shapes import InferError, TensorSpec

__all__ = ["collective_all_reduce", "send", "recv", "wire_bytes"]

# The dtype that may be compressed on the wire, and the bytes per element it then takes.
COMPRESSIBLE = "float32"
COMPRESSED_ITEMSIZE = 2

_LINK_ATTRS: dict[str, tuple[str, Any]] = {
    "tensor_name": ("str", REQUIRED),  # the "node:port" (or "^node" for a control edge) carried
    "send_device": ("str", REQUIRED),
    "recv_device": ("str", REQUIRED),
    "compress": ("bool", False),
}


def wire_bytes(shape: tuple[int, ...], dtype: str, compress: bool) -> float:
    """Bytes one transfer of a tensor moves (§5.5: half for a compressed float32)."""
    size = COMPRESSED_ITEMSIZE if compress and dtype == COMPRESSIBLE else itemsize(dtype)
    return float(int(np.prod(shape)) * size)


def _check_compress(dtype: str, attrs: dict[str, Any]) -> None:
    if attrs["compress"] and dtype != COMPRESSIBLE:
        raise InferError(f"compress=True needs a {COMPRESSIBLE} tensor, got {dtype}")
    if not attrs["tensor_name"] or not attrs["send_device"] or not attrs["recv_device"]:
        raise InferError("tensor_name, send_device and recv_device must be non-empty")


def _send_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    _check_compress(ins[0].dtype, attrs)
    return []


def _recv_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if attrs["shape"] is None:
        raise InferError("Recv needs a shape (unknown dimensions may be None)")
    _check_compress(attrs["dtype"], attrs)
    return [TensorSpec(tuple(attrs["shape"]), attrs["dtype"])]


def _send_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
               attrs: dict[str, Any]) -> tuple[float, float]:
    return 0.0, wire_bytes(ins[0], dtypes[0], attrs["compress"])


def _recv_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
               attrs: dict[str, Any]) -> tuple[float, float]:
    return 0.0, wire_bytes(outs[0], dtypes[0], attrs["compress"])


# stateful: never merged by CSE nor folded as a constant (a Recv has no inputs), never pruned apart.
register_op("Send", _send_infer, num_inputs=1, attrs=dict(_LINK_ATTRS), group=COMMUNICATION,
            cost=_send_cost, stateful=True, is_async=True, differentiable=False)
register_op("Recv", _recv_infer, num_inputs=0,
            # maybe_dead: the value may be a cond's dead branch (§4.4), so the receiving
            # partition runs on the executor that propagates deadness.
            attrs={**_LINK_ATTRS, "dtype": ("dtype", REQUIRED), "shape": ("shape", REQUIRED),
                   "maybe_dead": ("bool", False)},
            group=COMMUNICATION, cost=_recv_cost, stateful=True, is_async=True, differentiable=False)


def send(x: Tensor, tensor_name: str, send_device: str, recv_device: str, compress: bool = False,
         name: str | None = None) -> Tensor:
    """A Send of `x` (a target: it has no outputs)."""
    attrs = {"tensor_name": tensor_name, "send_device": send_device, "recv_device": recv_device,
             "compress": compress}
    return make_op("Send", [x], attrs, name=name or "Send", graph=x.graph)


def recv(tensor_name: str, dtype: Any, shape: Any, send_device: str, recv_device: str,
         compress: bool = False, name: str | None = None) -> Tensor:
    attrs = {"tensor_name": tensor_name, "send_device": send_device, "recv_device": recv_device,
             "compress": compress, "dtype": as_dtype(dtype), "shape": shape}
    return make1("Recv", [], attrs, name=name or "Recv", graph=graph_of())


def _collective_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    n, k, devices = attrs["group_size"], attrs["rank"], attrs["devices"]
    if n < 1 or not 0 <= k < n:
        raise InferError(f"rank {k} of a group of {n}: need 0 <= rank < group_size")
    if not attrs["group_key"]:
        raise InferError("group_key must be non-empty")
    if devices and len(devices) != n:
        raise InferError(f"devices names {len(devices)} device(s) for a group of {n}")
    return [TensorSpec(ins[0].shape, ins[0].dtype)]


def _collective_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                     attrs: dict[str, Any]) -> tuple[float, float]:
    """The reduction's arithmetic on this rank's device (its share: (N-1)/N of the adds, read and
    written); the wire time is the cost model's (`collective_transfer`), over the group's link."""
    n = max(1, attrs["group_size"])
    flops, nbytes = elementwise_cost(ins, outs, dtypes, attrs)
    return flops * (n - 1) / n, nbytes


# stateful: N nodes of one group must each run once, never merged by CSE nor folded.
register_op("CollectiveAllReduce", _collective_infer, num_inputs=1,
            attrs={"group_key": ("str", REQUIRED), "group_size": ("int", REQUIRED), "rank": ("int", REQUIRED),
                   # the group's devices in rank order (canonical names): the NCCL clique, and the
                   # link the cost model prices
                   "devices": ("strs", ())},
            group=COLLECTIVE, cost=_collective_cost, stateful=True, is_async=True, differentiable=False)


def collective_all_reduce(x: Tensor, group_key: str, group_size: int, rank: int, devices: Any = (),
                          name: str | None = None) -> Tensor:
    """Rank `rank`'s node of the all-reduce `group_key` over `group_size` ranks: the sum of every
    rank's `x` (same shape and dtype on each), in rank order."""
    attrs = {"group_key": group_key, "group_size": group_size, "rank": rank, "devices": tuple(devices)}
    return make1("CollectiveAllReduce", [x], attrs, name=name or "CollectiveAllReduce", graph=x.graph)
