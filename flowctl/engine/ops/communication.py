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
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flowctl.engine.dtypes import as_dtype, itemsize
from flowctl.engine.graph import Tensor
from flowctl.engine.ops.api import graph_of, make1, make_op
from flowctl.engine.opdef import COMMUNICATION, REQUIRED, register_op
from flowctl.engine.shapes import InferError, TensorSpec

__all__ = ["send", "recv", "wire_bytes"]

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
