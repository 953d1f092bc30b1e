"""Recurrent layers: an LSTM unrolled over time, and content-based attention for encoder-decoders.

The graph is static (whitepaper §4.4's control flow is not needed for a fixed unroll length). The
LSTM's [(in + units), 4 * units] kernel (Zaremba et al. 2014, TensorFlow's BasicLSTMCell layout) is
used as its two row blocks, the way fast recurrent libraries cut the work: the input block W_x
multiplies every time step's input in one product over T*B rows, only h_{t-1} W_h stays in the
per-step loop, and one LSTMBlockCell node per step does the gates and the cell update. Autodiff
turns the T per-step products' weight gradients into one product over all steps.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

import flowctl as fc
from flowctl.engine.graph import Tensor
from flowctl.engine.shapes import TensorSpec
from flowctl.spec.layers.base import Builder, Layer, LayerError, Weight, fmt, known, rank, register
from flowctl.spec.layers.core import linear


@register
class LSTM(Layer):
    """A [batch, time, features] sequence -> [batch, time, units] (or [batch, units] for the last
    step when `return_sequences` is false). Gates in the order i, f, g, o."""

    type: Literal["lstm"]
    units: int = Field(ge=1)
    return_sequences: bool = True
    forget_bias: float = Field(0.0, description="added to the forget gate (BasicLSTMCell's forget_bias)")
    init_scale: float | None = Field(None, gt=0, description="uniform ±init_scale; default Glorot")
    projection_steps: int | None = Field(
        7, ge=1, description="time steps per input-projection product when the input arrives step by "
        "step from a recurrent layer below (the layer can start once that many are in; null: all)")

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        x = ins[0]
        rank(x, 3, "lstm", "[batch, time, features] input")
        known(x.shape[1], f"lstm '{self.name}' time steps (the unroll length)")
        known(x.shape[2], f"lstm '{self.name}' input features")
        if self.return_sequences:
            return TensorSpec((x.shape[0], x.shape[1], self.units), x.dtype)
        return TensorSpec((x.shape[0], self.units), x.dtype)

    def weights(self, ins: list[TensorSpec]) -> list[Weight]:
        d, u = int(ins[0].shape[2]), self.units
        init = ("uniform", self.init_scale) if self.init_scale else ("glorot_uniform", 0.05)
        return [Weight("kernel", (d + u, 4 * u), init=init[0], scale=init[1]),
                Weight("bias", (4 * u,), init="zeros")]

    def _projections(self, b: Builder, x: Tensor, w_x: Tensor, bias: Tensor) -> list[Tensor]:
        """x_t W_x + b for every step t, as [batch, 4 * units] tensors: one product over the whole
        sequence, or, where the layer below hands over its steps one by one, one per
        `projection_steps` of them (so this layer runs step t while the one below runs later ones:
        Figure 8's model parallelism)."""
        d, t_len = int(x.shape[2]), int(x.shape[1])
        steps = b.steps.get(x.name)
        if steps is None:
            xw = fc.bias_add(fc.matmul(fc.reshape(x, [-1, d], name="rows"), w_x, name="input_matmul"),
                             bias, name="input_bias")
            return fc.unstack(fc.reshape(xw, [-1, t_len, 4 * self.units], name="sequence"), axis=1,
                              name="input_steps")
        k = self.projection_steps or t_len
        out: list[Tensor] = []
        for c0 in range(0, t_len, k):
            with b.graph.name_scope(f"in{c0}"):
                chunk = steps[c0:c0 + k]
                rows = chunk[0] if len(chunk) == 1 else fc.concat(chunk, axis=0, name="rows")
                xw = fc.bias_add(fc.matmul(rows, w_x, name="input_matmul"), bias, name="input_bias")
                out += [xw] if len(chunk) == 1 else fc.split(xw, len(chunk), axis=0, name="input_steps")
        return out

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        x = ins[0]
        d, u = int(x.shape[2]), self.units
        kernel, bias = (b.variable(w) for w in self.weights([x.spec]))
        # Row blocks of the one kernel (views): checkpoints and parameter counts keep its layout.
        w_x, w_h = fc.split(kernel, [d, u], axis=0, name="kernel_rows")
        w_h_t = fc.transpose_copy(w_h, name="kernel_rows_t")  # for the gradient's dh = dz W_h^T
        h: Tensor | None = None
        c: Tensor | None = None
        outs: list[Tensor] = []
        for t, xw in enumerate(self._projections(b, x, w_x, bias)):
            with b.graph.name_scope(f"t{t}"):
                # At t = 0 the state is zero: the cell takes x's projection alone, so no zero state
                # (whose batch size is unknown until run time) is materialised.
                hw = None if h is None else fc.recurrent_matmul(h, w_h, w_h_t, name="matmul")
                h, c = fc.lstm_block_cell(xw, hw, c, forget_bias=self.forget_bias, name="cell")
                outs.append(h)
        if not self.return_sequences:
            return fc.identity(outs[-1], name="last")
        y = fc.stack(outs, axis=1, name="stack")  # runs only if a non-recurrent layer reads it
        b.steps[y.name] = outs
        return y


@register
class Attention(Layer):
    """Content-based attention (Luong et al. 2015, "general" score) for an encoder-decoder:
    `inputs: [queries, memory]`, queries [batch, Tq, d] (decoder states) attend over memory
    [batch, Tm, m] (encoder states): a = softmax(q W_a mᵀ), context = a m, and the output is
    tanh([context, q] W_c) of `units` features (default d)."""

    type: Literal["attention"]
    units: int | None = Field(None, ge=1)

    arity: ClassVar[tuple[int, int | None]] = (2, 2)

    def _dims(self, ins: list[TensorSpec]) -> tuple[int, int, int]:
        q, m = ins
        rank(q, 3, "attention", "[batch, time, features] query")
        rank(m, 3, "attention", "[batch, time, features] memory")
        if q.shape[0] is not None and m.shape[0] is not None and q.shape[0] != m.shape[0]:
            raise LayerError(f"attention queries {fmt(q.shape)} and memory {fmt(m.shape)} differ in batch",
                             "inputs")
        d = known(q.shape[2], "attention query features")
        md = known(m.shape[2], "attention memory features")
        return d, md, self.units or d

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        d, md, units = self._dims(ins)
        return TensorSpec((ins[0].shape[0], ins[0].shape[1], units), ins[0].dtype)

    def weights(self, ins: list[TensorSpec]) -> list[Weight]:
        d, md, units = self._dims(ins)
        return [Weight("score_kernel", (d, md)), Weight("output_kernel", (md + d, units))]

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        q, m = ins
        w_a, w_c = (b.variable(w) for w in self.weights([q.spec, m.spec]))
        with b.graph.name_scope("score"):
            qw = linear(b, q, w_a, None)  # [batch, Tq, m]
        scores = fc.batch_matmul(qw, m, adj_y=True, name="scores")  # [batch, Tq, Tm]
        align = fc.softmax(scores, name="align")
        context = fc.batch_matmul(align, m, name="context")  # [batch, Tq, m]
        joined = fc.concat([context, q], axis=2, name="concat")
        with b.graph.name_scope("output"):
            out = linear(b, joined, w_c, None)
        return fc.tanh(out, name="tanh")
