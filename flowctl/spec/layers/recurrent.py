"""Recurrent layers: an LSTM and a GRU over time, and content-based attention for encoder-decoders.

The LSTM's [(in + units), 4 * units] kernel (Zaremba et al. 2014, TensorFlow's BasicLSTMCell
layout) is used as its two row blocks, the way fast recurrent libraries cut the work. `unroll:
static` makes T steps: the input block W_x multiplies every time step's input in one product over
T*B rows, only h_{t-1} W_h stays in the per-step loop, one LSTMBlockCell node per step does the
gates and the cell update, and autodiff turns the T per-step products' weight gradients into one
product over all steps. `unroll: dynamic` makes one cell in a while loop over the time axis
(whitepaper §4.4), so the graph holds a few dozen nodes whatever T is; its per-step outputs are
pushed onto an accumulator stacked after the loop. Both compute step 0 from the input alone (the
state is zero there) and agree up to float32 rounding. The GRU shares the input projection
(`projections`) and the loop's shape; its gates are composed ops, not a fused cell.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

import flowctl as fc
from flowctl.engine.graph import Tensor
from flowctl.engine.shapes import TensorSpec
from flowctl.spec.layers.base import Builder, Layer, LayerError, Weight, fmt, known, rank, register
from flowctl.spec.layers.core import check_lengths, linear, sequence_mask


def sequence_output(layer: LSTM | GRU, ins: list[TensorSpec]) -> TensorSpec:
    """A recurrent layer's output spec: [batch, time, units], or [batch, units] for the last step;
    a second input, the lengths, needs the loop (`unroll: dynamic`)."""
    x, kind = ins[0], layer.type
    rank(x, 3, kind, "[batch, time, features] input")
    if len(ins) == 2:
        if layer.unroll != "dynamic":
            raise LayerError(f"{kind} '{layer.name}': a lengths input needs unroll: dynamic", "inputs")
        rank(ins[1], 1, kind, "[batch] lengths input")
        if not ins[1].dtype.startswith(("int", "uint")):
            raise LayerError(f"{kind} '{layer.name}': lengths must be integers, got {ins[1].dtype}", "inputs")
    known(x.shape[1], f"{kind} '{layer.name}' time steps (the unroll length)")
    known(x.shape[2], f"{kind} '{layer.name}' input features")
    if layer.return_sequences:
        return TensorSpec((x.shape[0], x.shape[1], layer.units), x.dtype)
    return TensorSpec((x.shape[0], layer.units), x.dtype)


def projections(b: Builder, x: Tensor, w_x: Tensor, bias: Tensor, width: int,
                projection_steps: int | None) -> list[Tensor]:
    """x_t W_x + b for every step t, as [batch, width] tensors: one product over the whole
    sequence, or, where the layer below hands over its steps one by one, one per
    `projection_steps` of them (so this layer runs step t while the one below runs later ones:
    Figure 8's model parallelism)."""
    d, t_len = int(x.shape[2]), int(x.shape[1])
    steps = b.steps.get(x.name)
    if steps is None:
        xw = fc.bias_add(fc.matmul(fc.reshape(x, [-1, d], name="rows"), w_x, name="input_matmul"),
                         bias, name="input_bias")
        return fc.unstack(fc.reshape(xw, [-1, t_len, width], name="sequence"), axis=1, name="input_steps")
    k = projection_steps or t_len
    out: list[Tensor] = []
    for c0 in range(0, t_len, k):
        with b.graph.name_scope(f"in{c0}"):
            chunk = steps[c0:c0 + k]
            rows = chunk[0] if len(chunk) == 1 else fc.concat(chunk, axis=0, name="rows")
            xw = fc.bias_add(fc.matmul(rows, w_x, name="input_matmul"), bias, name="input_bias")
            out += [xw] if len(chunk) == 1 else fc.split(xw, len(chunk), axis=0, name="input_steps")
    return out



class Recurrent(Layer):
    """What the recurrent layers (lstm, gru) share: their keys and their output's shape."""

    units: int = Field(ge=1)
    return_sequences: bool = True
    init_scale: float | None = Field(None, gt=0, description="uniform ±init_scale; default Glorot")
    unroll: Literal["static", "dynamic"] = Field(
        "static", description="static: one cell per time step; dynamic: one cell in a while loop over time")
    projection_steps: int | None = Field(
        7, ge=1, description="static: time steps per input-projection product when the input arrives step by "
        "step from a recurrent layer below (the layer can start once that many are in; null: all). Unset, "
        "it applies where the layers may run on different devices; on one device (or one replica each) a "
        "layer has nothing to overlap with and takes all steps in one product")

    arity: ClassVar[tuple[int, int | None]] = (1, 2)  # the sequence, and optionally its lengths

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        return sequence_output(self, ins)

    def chunk_steps(self, b: Builder) -> int | None:
        """The steps per input product: `projection_steps` where the spec sets it or where the
        layers may run on different devices (b.split_layers); otherwise all of them: on one device
        five products of 140 rows cost lstm_lm's second layer 2% of its step against one of 700."""
        return self.projection_steps if "projection_steps" in self.model_fields_set or b.split_layers else None


@register
class LSTM(Recurrent):
    """A [batch, time, features] sequence -> [batch, time, units] (or [batch, units] for the last
    step when `return_sequences` is false). Gates in the order i, f, g, o.

    With `unroll: dynamic` a second input may give each example's length ([batch] int32, from the
    data): the loop then runs max(lengths) steps, an example's state stops changing after its
    length and its outputs there are zero (the last state is the state at its length)."""

    type: Literal["lstm"]
    forget_bias: float = Field(0.0, description="added to the forget gate (BasicLSTMCell's forget_bias)")

    def weights(self, ins: list[TensorSpec]) -> list[Weight]:
        d, u = int(ins[0].shape[2]), self.units
        init = ("uniform", self.init_scale) if self.init_scale else ("glorot_uniform", 0.05)
        return [Weight("kernel", (d + u, 4 * u), init=init[0], scale=init[1]),
                Weight("bias", (4 * u,), init="zeros")]

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        x = ins[0]
        d, u = int(x.shape[2]), self.units
        kernel, bias = (b.variable(w) for w in self.weights([x.spec]))
        if self.unroll == "dynamic":
            # At t = 0 the state is zero, so only the input rows of the kernel contribute; slicing
            # them avoids materialising a zero state whose batch size is unknown until run time.
            w_in = fc.slice_(kernel, (0, 0), (d, 4 * u), name="kernel_input_rows")
            return self._build_dynamic(x, kernel, bias, w_in, ins[1] if len(ins) == 2 else None)
        # Row blocks of the one kernel (views): checkpoints and parameter counts keep its layout.
        w_x, w_h = fc.split(kernel, [d, u], axis=0, name="kernel_rows")
        h: Tensor | None = None
        c: Tensor | None = None
        outs: list[Tensor] = []
        for t, xw in enumerate(projections(b, x, w_x, bias, 4 * u, self.chunk_steps(b))):
            with b.graph.name_scope(f"t{t}"):
                # At t = 0 the state is zero: the cell takes x's projection alone, so no zero state
                # (whose batch size is unknown until run time) is materialised.
                hw = None if h is None else fc.recurrent_matmul(h, w_h, name="matmul")
                h, c = fc.lstm_block_cell(xw, hw, c, forget_bias=self.forget_bias, name="cell")
                outs.append(h)
        if not self.return_sequences:
            return fc.identity(outs[-1], name="last")
        y = fc.stack(outs, axis=1, name="stack")  # runs only if a non-recurrent layer reads it
        b.steps[y.name] = outs
        return y

    def _gates(self, z: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        i, f, g, o = fc.split(z, 4, axis=1, name="gates")
        if self.forget_bias:
            f = f + self.forget_bias
        return i, f, g, o

    def _first(self, xt: Tensor, w_in: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        i, f, g, o = self._gates(fc.bias_add(fc.matmul(xt, w_in, name="matmul"), bias, name="bias_add"))
        c = fc.sigmoid(i, name="input_gate") * fc.tanh(g, name="candidate")
        return fc.sigmoid(o, name="output_gate") * fc.tanh(c, name="tanh_c"), c

    def _cell(self, xt: Tensor, h: Tensor, c: Tensor, kernel: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        z = fc.bias_add(fc.matmul(fc.concat([xt, h], axis=1, name="concat"), kernel, name="matmul"),
                        bias, name="bias_add")
        i, f, g, o = self._gates(z)
        ig = fc.sigmoid(i, name="input_gate") * fc.tanh(g, name="candidate")
        c = fc.sigmoid(f, name="forget_gate") * c + ig
        return fc.sigmoid(o, name="output_gate") * fc.tanh(c, name="tanh_c"), c

    def _build_dynamic(self, x: Tensor, kernel: Tensor, bias: Tensor, w_in: Tensor,
                       lengths: Tensor | None) -> Tensor:
        """Steps 1..T-1 (or 1..max(lengths)-1) in a while loop (§4.4). Each iteration pushes its
        output onto an accumulator stacked (zero-padded to T-1 rows) after the loop; the loop's
        gradient hands row t of the stack's gradient back to iteration t."""
        from flowctl.engine.control_flow import while_loop
        from flowctl.engine.ops.control import acc_push, acc_stack, accumulator

        T, d, u = int(x.shape[1]), int(x.shape[2]), self.units
        xs = fc.transpose(x, [1, 0, 2], name="time_major")  # [T, batch, d]
        lens = None if lengths is None else fc.cast(lengths, "int32", name="lengths")

        def step_input(t: Tensor) -> Tensor:
            return fc.reshape(fc.gather(xs, fc.reshape(t, [1]), axis=0), [-1, d], name="x_t")

        def alive(t: Tensor) -> Tensor:  # [batch, 1]: 1 while t < the example's length
            assert lens is not None
            return fc.expand_dims(fc.cast(fc.less(t, lens), x.dtype), 1, name="alive")

        with x.graph.name_scope("t0"):
            t0 = fc.constant(0, dtype="int32")
            h, c = self._first(step_input(t0), w_in, bias)
            out0 = h if lens is None else h * alive(t0)
        if lens is not None:
            h, c = out0, c * alive(t0)
        if T > 1:
            def body(t: Tensor, h: Tensor, c: Tensor, acc: Tensor) -> tuple[Tensor, ...]:
                h2, c2 = self._cell(step_input(t), h, c, kernel, bias)
                out = h2
                if lens is not None:  # past its length an example keeps its state, outputs zero
                    m = alive(t)
                    out = h2 * m
                    h2, c2 = out + h * (1.0 - m), c2 * m + c * (1.0 - m)
                return t + 1, h2, c2, acc_push(acc, out) if self.return_sequences else acc

            steps = fc.constant(T, dtype="int32")
            if lens is not None:
                steps = fc.minimum(fc.reduce_max(lens), steps, name="steps")
            _, h, _, acc = while_loop(lambda t, h, c, a: fc.less(t, steps), body,
                                      [fc.constant(1, dtype="int32"), h, c, accumulator(x.graph)],
                                      shape_invariants=[None, (None, u), (None, u), None], name="time_loop",
                                      expected_iterations=T - 1)
        if not self.return_sequences:
            return fc.identity(h, name="last")
        if T == 1:
            return fc.expand_dims(out0, 1, name="batch_major")
        rows = acc_stack(acc, out0, rows=T - 1)
        outs = fc.concat([fc.expand_dims(out0, 0), rows], axis=0, name="outputs")  # [T, batch, u]
        return fc.reshape(fc.transpose(outs, [1, 0, 2]), [-1, T, u], name="batch_major")


@register
class GRU(Recurrent):
    """A gated recurrent unit (Cho et al. 2014) as torch.nn.GRU and cuDNN compute it, gates in the
    order r, z, n: r = σ(x W_xr + b_r + h W_hr + c_r), z = σ(x W_xz + b_z + h W_hz + c_z),
    n = tanh(x W_xn + b_n + r ⊙ (h W_hn + c_n)), h' = (1 − z) ⊙ n + z ⊙ h. `kernel` is
    [(in + units), 3 * units], its input rows W_x above its recurrent rows W_h (PyTorch's
    weight_ih_l0 and weight_hh_l0, transposed, stacked); `bias` (b) joins the input projection,
    `recurrent_bias` (c) the recurrent one, which it must stay apart from because r scales it.

    As the LSTM: the input projection of every step is one product before the recurrence (static
    or dynamic), only h W_h + c runs per step; `unroll: dynamic` loops over time (§4.4) and may
    take the lengths as a second input, past which an example's state stops changing and its
    outputs are zero. The gates are composed from Sigmoid, Tanh, Mul and Add nodes."""

    type: Literal["gru"]

    def weights(self, ins: list[TensorSpec]) -> list[Weight]:
        d, u = int(ins[0].shape[2]), self.units
        init = ("uniform", self.init_scale) if self.init_scale else ("glorot_uniform", 0.05)
        return [Weight("kernel", (d + u, 3 * u), init=init[0], scale=init[1]),
                Weight("bias", (3 * u,), init="zeros"),
                Weight("recurrent_bias", (3 * u,), init="zeros")]

    def _cell(self, xw: Tensor, h: Tensor | None, w_h: Tensor, c: Tensor) -> Tensor:
        """h' from x_t W_x + b (`xw`, [batch, 3 * units]) and h_{t-1}; h None is the zero state,
        where h W_h + c is c alone (no zero state, whose batch size is unknown until run time)."""
        hw = c if h is None else fc.bias_add(fc.recurrent_matmul(h, w_h, name="matmul"), c, name="bias_add")
        xr, xz, xn = fc.split(xw, 3, axis=1, name="input_gates")
        hr, hz, hn = fc.split(hw, 3, axis=len(hw.shape) - 1, name="recurrent_gates")
        r = fc.sigmoid(xr + hr, name="reset_gate")
        z = fc.sigmoid(xz + hz, name="update_gate")
        n = fc.tanh(xn + r * hn, name="candidate")
        if h is None:
            return fc.sub(n, z * n, name="h")
        return fc.add(n, z * (h - n), name="h")  # (1 - z) n + z h

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        x = ins[0]
        d, u = int(x.shape[2]), self.units
        kernel, bias, c = (b.variable(w) for w in self.weights([x.spec]))
        # Row blocks of the one kernel (views): checkpoints and parameter counts keep its layout.
        w_x, w_h = fc.split(kernel, [d, u], axis=0, name="kernel_rows")
        if self.unroll == "dynamic":
            return self._build_dynamic(x, w_x, w_h, bias, c, ins[1] if len(ins) == 2 else None)
        h: Tensor | None = None
        outs: list[Tensor] = []
        for t, xw in enumerate(projections(b, x, w_x, bias, 3 * u, self.chunk_steps(b))):
            with b.graph.name_scope(f"t{t}"):
                h = self._cell(xw, h, w_h, c)
                outs.append(h)
        if not self.return_sequences:
            return fc.identity(outs[-1], name="last")
        y = fc.stack(outs, axis=1, name="stack")  # runs only if a non-recurrent layer reads it
        b.steps[y.name] = outs
        return y

    def _build_dynamic(self, x: Tensor, w_x: Tensor, w_h: Tensor, bias: Tensor, c: Tensor,
                       lengths: Tensor | None) -> Tensor:
        """Step 0 from the input alone, steps 1..T-1 (or 1..max(lengths)-1) in a while loop
        (§4.4), each reading its row of the input projection made before the loop; outputs are
        pushed onto an accumulator stacked (zero-padded to T-1 rows) after it."""
        from flowctl.engine.control_flow import while_loop
        from flowctl.engine.ops.control import acc_push, acc_stack, accumulator

        T, d, u = int(x.shape[1]), int(x.shape[2]), self.units
        xw = fc.bias_add(fc.matmul(fc.reshape(x, [-1, d], name="rows"), w_x, name="input_matmul"),
                         bias, name="input_bias")
        xws = fc.transpose(fc.reshape(xw, [-1, T, 3 * u], name="sequence"), [1, 0, 2],
                           name="time_major")  # [T, batch, 3 * units]
        lens = None if lengths is None else fc.cast(lengths, "int32", name="lengths")

        def step_input(t: Tensor) -> Tensor:
            return fc.reshape(fc.gather(xws, fc.reshape(t, [1]), axis=0), [-1, 3 * u], name="xw_t")

        def alive(t: Tensor) -> Tensor:  # [batch, 1]: 1 while t < the example's length
            assert lens is not None
            return fc.expand_dims(fc.cast(fc.less(t, lens), x.dtype), 1, name="alive")

        with x.graph.name_scope("t0"):
            t0 = fc.constant(0, dtype="int32")
            h = self._cell(step_input(t0), None, w_h, c)
            if lens is not None:  # an example of length 0 keeps the zero state
                h = h * alive(t0)
        out0 = h
        if T > 1:
            def body(t: Tensor, h: Tensor, acc: Tensor) -> tuple[Tensor, ...]:
                h2 = self._cell(step_input(t), h, w_h, c)
                out = h2
                if lens is not None:  # past its length an example keeps its state, outputs zero
                    m = alive(t)
                    out = h2 * m
                    h2 = out + h * (1.0 - m)
                return t + 1, h2, acc_push(acc, out) if self.return_sequences else acc

            steps = fc.constant(T, dtype="int32")
            if lens is not None:
                steps = fc.minimum(fc.reduce_max(lens), steps, name="steps")
            _, h, acc = while_loop(lambda t, h, a: fc.less(t, steps), body,
                                   [fc.constant(1, dtype="int32"), h, accumulator(x.graph)],
                                   shape_invariants=[None, (None, u), None], name="time_loop",
                                   expected_iterations=T - 1)
        if not self.return_sequences:
            return fc.identity(h, name="last")
        if T == 1:
            return fc.expand_dims(out0, 1, name="batch_major")
        rows = acc_stack(acc, out0, rows=T - 1)
        outs = fc.concat([fc.expand_dims(out0, 0), rows], axis=0, name="outputs")  # [T, batch, u]
        return fc.reshape(fc.transpose(outs, [1, 0, 2]), [-1, T, u], name="batch_major")


@register
class Attention(Layer):
    """Content-based attention (Luong et al. 2015, "general" score) for an encoder-decoder:
    `inputs: [queries, memory]`, queries [batch, Tq, d] (decoder states) attend over memory
    [batch, Tm, m] (encoder states): a = softmax(q W_a mᵀ), context = a m, and the output is
    tanh([context, q] W_c) of `units` features (default d). An optional third input, the memory's
    lengths per example, keeps the attention off the padding (those scores get -1e9 before the
    softmax, so their weights are exactly 0 in float32)."""

    type: Literal["attention"]
    units: int | None = Field(None, ge=1)

    arity: ClassVar[tuple[int, int | None]] = (2, 3)

    def _dims(self, ins: list[TensorSpec]) -> tuple[int, int, int]:
        q, m = ins[:2]
        if len(ins) == 3:
            check_lengths(ins[2], "attention", self.inputs or ["queries", "memory", "lengths"])
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
        q, m = ins[:2]
        w_a, w_c = (b.variable(w) for w in self.weights([q.spec, m.spec]))
        with b.graph.name_scope("score"):
            qw = linear(b, q, w_a, None)  # [batch, Tq, m]
        scores = fc.batch_matmul(qw, m, adj_y=True, name="scores")  # [batch, Tq, Tm]
        if len(ins) == 3:
            steps = known(m.shape[1], "attention memory steps")
            mask = fc.expand_dims(sequence_mask(ins[2], steps, scores.dtype, name="memory_mask"), 1,
                                  name="memory_mask_row")  # [batch, 1, Tm]
            # float16 tops out at 65504: 1e9 would be inf there, and 0 * inf a NaN on real keys
            big = 3e4 if scores.dtype == "float16" else 1e9
            scores = scores + (mask - 1.0) * big
        align = fc.softmax(scores, name="align")
        context = fc.batch_matmul(align, m, name="context")  # [batch, Tq, m]
        joined = fc.concat([context, q], axis=2, name="concat")
        with b.graph.name_scope("output"):
            out = linear(b, joined, w_c, None)
        return fc.tanh(out, name="tanh")
