"""Recurrent-cell ops: LSTMBlockCell, the gates and cell update of one LSTM time step as one node,
and LSTMBlockCellGrad, its fused gradient (§4.1: one fused node per gradient rather than a chain of
small ones; TensorFlow's LSTMBlockCell does the same).

The products stay outside the cell, as MatMul nodes the layer emits: the input projection of every
time step is one product over all T*B rows, only the recurrent product h_{t-1} W_h runs per step,
and the weight gradients come out of autodiff as one product over all steps. What the cell fuses
is the per-element work between them: z = xw + hw, four gate nonlinearities, c = f c' + i g and
h = o tanh(c) (about ten passes over [B, 4U] as separate nodes, one here).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flowctl.engine.dtypes import is_float
from flowctl.engine.errors import GraphError
from flowctl.engine.graph import Tensor
from flowctl.engine.ops.api import make
from flowctl.engine.ops.registry import NN, memory_bytes, register_op
from flowctl.engine.shapes import InferError, TensorSpec, dims_equal, merge_dim

__all__ = ["lstm_block_cell"]


def _gates(spec: TensorSpec, what: str) -> tuple[int | None, int]:
    """(batch, units) of a [batch, 4 * units] gate tensor."""
    if len(spec.shape) != 2 or spec.shape[1] is None or spec.shape[1] % 4:
        raise InferError(f"{what} must be [batch, 4 * units] with known units, got {spec.shape}")
    return spec.shape[0], spec.shape[1] // 4


def _same(a: TensorSpec, b: TensorSpec, what: str) -> None:
    if a.dtype != b.dtype:
        raise InferError(f"{what}: dtypes differ: {a.dtype} and {b.dtype} (insert a Cast)")
    if len(a.shape) != len(b.shape) or not all(map(dims_equal, a.shape, b.shape)):
        raise InferError(f"{what}: shapes {a.shape} and {b.shape} differ")


def _cell_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if len(ins) not in (1, 3):
        raise InferError(f"takes (xw) for the first step or (xw, hw, c_prev), got {len(ins)} inputs")
    xw = ins[0]
    if not is_float(xw.dtype):
        raise InferError(f"xw must be float, got {xw.dtype}")
    n, u = _gates(xw, "xw")
    if len(ins) == 3:
        hw, c_prev = ins[1], ins[2]
        _same(xw, hw, "xw and hw")
        _same(TensorSpec((xw.shape[0], u), xw.dtype), c_prev, "the cell state c_prev and [batch, units]")
        n = merge_dim(merge_dim(n, hw.shape[0]), c_prev.shape[0])
    state = TensorSpec((n, u), xw.dtype)
    return [state, state, TensorSpec((n, 4 * u), xw.dtype)]


def _cell_grad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if len(ins) not in (4, 5):
        raise InferError(f"takes (dh, dc, act, c[, c_prev]), got {len(ins)} inputs")
    dh, dc, act, c = ins[:4]
    n, u = _gates(act, "act")
    for what, s in (("dh", dh), ("dc", dc), ("c", c)) + ((("c_prev", ins[4]),) if len(ins) == 5 else ()):
        _same(TensorSpec((n, u), act.dtype), s, f"{what} and [batch, units]")
    out = [TensorSpec((n, 4 * u), act.dtype)]
    return out + [TensorSpec((n, u), act.dtype)] if len(ins) == 5 else out


# Per element of the [B, U] state: the cell forward is the add (4 per unit), 4 gate
# nonlinearities (~4 each, as tanh), c (3) and h (2 plus a tanh); the backward ~20.
def _cell_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
               attrs: dict[str, Any]) -> tuple[float, float]:
    return 25.0 * float(np.prod(outs[0])), memory_bytes(ins, outs, dtypes)


def _cell_grad_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                    attrs: dict[str, Any]) -> tuple[float, float]:
    return 5.0 * float(np.prod(outs[0])), memory_bytes(ins, outs, dtypes)


def _g_cell(op: Any, dy: list[Tensor]) -> list[Tensor]:
    dh, dc, dact = dy
    if dact.op.op != "ZerosLike":
        # The activations exist so the gradient need not recompute them (as the softmax backprop
        # output); differentiating through them would need their own Jacobian, which no layer uses.
        raise GraphError(f"node '{op.name}': gradients through output 2 (act) of LSTMBlockCell are "
                         f"not supported; differentiate h and c")
    _, c, act = op.outputs
    first = len(op.inputs) == 1
    ins = [dh, dc, act, c] + ([] if first else [op.inputs[2]])
    outs = make("LSTMBlockCellGrad", ins, name="cell_grad")
    if first:
        return [outs[0]]
    dz, dc_prev = outs
    return [dz, dz, dc_prev]


# LSTMBlockCell(xw[, hw, c_prev]) -> (h, c, act): z = xw + hw, gates i, f, g, o in that order along
# the last axis, c = sigmoid(f + forget_bias) c_prev + sigmoid(i) tanh(g), h = sigmoid(o) tanh(c);
# act holds the four activated gates for the gradient. One input: the first step (zero state).
register_op("LSTMBlockCell", _cell_infer, min_inputs=1, attrs={"forget_bias": ("float", 0.0)}, group=NN,
            grad=_g_cell, cost=_cell_cost)
# LSTMBlockCellGrad(dh, dc, act, c[, c_prev]) -> (dz[, dc_prev]); not itself differentiated.
register_op("LSTMBlockCellGrad", _cell_grad_infer, min_inputs=4, group=NN, cost=_cell_grad_cost)


def lstm_block_cell(xw: Any, hw: Any = None, c_prev: Any = None, forget_bias: float = 0.0,
                    name: str | None = None) -> tuple[Tensor, Tensor]:
    """One LSTM step from its pre-activations: (h, c). `xw` is x_t W_x + b, `hw` h_{t-1} W_h (both
    [batch, 4 * units], gates i, f, g, o); leave `hw` and `c_prev` out for a step from the zero state."""
    if (hw is None) != (c_prev is None):
        raise GraphError("lstm_block_cell: give both hw and c_prev, or neither (the zero state)")
    ins = [xw] if hw is None else [xw, hw, c_prev]
    h, c, _ = make("LSTMBlockCell", ins, {"forget_bias": forget_bias}, name=name or "LSTMBlockCell")
    return h, c
