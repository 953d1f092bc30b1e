"""Recurrent-cell ops: LSTMBlockCell, the gates and cell update of one LSTM time step as one node,
and LSTMBlockCellGrad, its fused gradient (§4.1: one fused node per gradient rather than a chain of
small ones; TensorFlow's LSTMBlockCell does the same).

The products stay outside the cell, as MatMul nodes the layer emits: the input projection of every
time step is one product over all T*B rows, only the recurrent product h_{t-1} W_h runs per step,
and the weight gradients come out of autodiff as one product over all steps. What the cell fuses
is the per-element work between them: z = xw + hw, four gate nonlinearities, c = f c' + i g and
h = o tanh(c) (about ten passes over [B, 4U] as separate nodes, one here). RecurrentMatMul is the
loop's product h_{t-1} W_h. Its gradient's dh = dz W_h^T is computed transposed, as
(W_h dz^T)^T: the same product with the long [U, 4U] operand in front, which OpenBLAS splits
between threads along its 650 rows instead of the batch's 20 (measured, lstm_lm's shapes on this
2-core VM, 2 threads: 0.49 against 0.73 ms per step, 0.83 for dz @ W_h.T; at 1 thread all but
the last equal), and which reads W_h itself, so no transposed copy of it is made. The older
three-input form (h, W_h, W_h^T from TransposeCopy) computes dh = dz W_h^T from the copy.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flowctl.engine.dtypes import is_float
from flowctl.engine.errors import GraphError
from flowctl.engine.graph import Tensor
from flowctl.engine.ops.api import make
from flowctl.engine.opdef import MATRIX, MOVEMENT, NN, memory_bytes, movement_cost, register_op
from flowctl.engine.shapes import InferError, TensorSpec, dims_equal, merge_dim

__all__ = ["lstm_block_cell", "recurrent_matmul", "transpose_copy"]


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
    if not is_float(act.dtype):
        raise InferError(f"act must be float, got {act.dtype}")
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


def _recurrent_matmul_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if len(ins) not in (2, 3):
        raise InferError(f"takes (h, w) or (h, w, w_t), got {len(ins)} inputs")
    h, w = ins[:2]
    if len(h.shape) != 2 or len(w.shape) != 2:
        raise InferError(f"needs matrices h and w, got shapes {h.shape} and {w.shape}")
    if not dims_equal(h.shape[1], w.shape[0]):
        raise InferError(f"inner dimensions differ: h {h.shape}, w {w.shape}")
    if len(ins) == 3:
        _same(TensorSpec((w.shape[1], w.shape[0]), w.dtype), ins[2], "w_t and the transpose of w")
    if h.dtype != w.dtype:
        raise InferError(f"dtypes differ: {h.dtype}, {w.dtype} (insert a Cast)")
    return [TensorSpec((h.shape[0], w.shape[1]), h.dtype)]


def _recurrent_matmul_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                           attrs: dict[str, Any]) -> tuple[float, float]:
    return 2.0 * float(np.prod(outs[0])) * ins[0][1], memory_bytes(ins[:2], outs, dtypes)


def _g_recurrent_matmul(op: Any, dy: list[Tensor]) -> list[Tensor | None]:
    from flowctl.engine.ops.array import transpose
    from flowctl.engine.ops.matrix import matmul

    h, w = op.inputs[:2]
    # dW as a product autodiff stacks over all steps with the other steps' ones
    dw = matmul(h, dy[0], transpose_a=True, name="matmul_grad")
    if len(op.inputs) == 3:  # dh = dy W^T from the contiguous copy
        return [matmul(dy[0], op.inputs[2], name="matmul_grad"), dw, None]
    # dh = (W dy^T)^T: the product transposed (see the module doc); the Transpose is a view
    dh_t = matmul(w, dy[0], transpose_b=True, name="matmul_grad_t")
    return [transpose(dh_t, [1, 0], name="matmul_grad"), dw]


def _transpose_copy_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    if len(ins[0].shape) != 2:
        raise InferError(f"needs a matrix, got shape {ins[0].shape}")
    return [TensorSpec(tuple(reversed(ins[0].shape)), ins[0].dtype)]


# TransposeCopy(w) = w^T as a contiguous copy (Transpose itself is a free view).
register_op("TransposeCopy", _transpose_copy_infer, num_inputs=1, group=MOVEMENT, cost=movement_cost,
            grad=lambda op, dy: [make("TransposeCopy", [dy[0]], name="transpose_grad")[0]])

# RecurrentMatMul(h, w[, w_t]) = h @ w: the product of the per-step loop. Its gradient computes dh
# as (w dy^T)^T, or, given w_t (w's transpose, a contiguous copy), as dy @ w_t.
register_op("RecurrentMatMul", _recurrent_matmul_infer, min_inputs=2, group=MATRIX,
            grad=_g_recurrent_matmul, cost=_recurrent_matmul_cost)


def _pack_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    w = ins[0]
    if len(w.shape) != 2 or None in w.shape:
        raise InferError(f"needs a matrix of known shape, got {w.shape}")
    k, n = (w.shape[1], w.shape[0]) if attrs["transpose"] else w.shape
    lanes = attrs["lanes"]
    if lanes not in (8, 16):
        raise InferError(f"lanes must be 8 or 16, got {lanes}")
    return [TensorSpec((-(-n // lanes), k, lanes), w.dtype)]


def _panel_matmul_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    a, wp = ins
    if len(a.shape) != 2 or len(wp.shape) != 3:
        raise InferError(f"needs a matrix and packed panels, got shapes {a.shape} and {wp.shape}")
    if not dims_equal(a.shape[1], wp.shape[1]):
        raise InferError(f"inner dimensions differ: a {a.shape}, panels {wp.shape}")
    if a.dtype != wp.dtype:
        raise InferError(f"dtypes differ: {a.dtype}, {wp.dtype} (insert a Cast)")
    m, n = a.shape[0], attrs["n"]
    return [TensorSpec((n, m) if attrs["transpose_out"] else (m, n), a.dtype)]


def _panel_matmul_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                       attrs: dict[str, Any]) -> tuple[float, float]:
    return 2.0 * float(np.prod(outs[0])) * ins[0][1], memory_bytes(ins, outs, dtypes)


# PackPanels(w) -> wp (P, K, lanes): w's columns (w^T's where `transpose`) in panels of `lanes`,
# each panel's K x lanes block contiguous, wp[p, k, l] = w[k, p * lanes + l], zero past N.
# PanelMatMul(a, wp) = a @ w from the packed w (N = attr n columns), or its transpose as a view
# where `transpose_out`. Both made by the CPU plan's pass (engine/recurrent_pack.py) from a
# recurrent product's weight and its readers, never by a model: no gradients.
register_op("PackPanels", _pack_infer, num_inputs=1, attrs={"lanes": ("int", 16), "transpose": ("bool", False)},
            group=MOVEMENT, cost=movement_cost, differentiable=False)
register_op("PanelMatMul", _panel_matmul_infer, num_inputs=2,
            attrs={"n": ("int", 0), "transpose_out": ("bool", False)}, group=MATRIX, cost=_panel_matmul_cost,
            differentiable=False)


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


def recurrent_matmul(h: Any, w: Any, w_t: Any = None, name: str | None = None) -> Tensor:
    """h @ w. The gradient's dh is (w dy^T)^T, or dy @ w_t where `w_t` (w's transpose as a
    contiguous copy: `transpose_copy(w)`) is given."""
    ins = [h, w] if w_t is None else [h, w, w_t]
    return make("RecurrentMatMul", ins, name=name or "RecurrentMatMul")[0]


def transpose_copy(w: Any, name: str | None = None) -> Tensor:
    """A matrix's transpose as a contiguous copy."""
    return make("TransposeCopy", [w], name=name or "TransposeCopy")[0]
