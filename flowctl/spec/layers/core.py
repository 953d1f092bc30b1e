"""Core layers: input, dense, flatten, dropout, concat, embedding, activation and the loss."""
from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import Field, PrivateAttr

import flowctl as fc
from flowctl.engine.dtypes import is_float
from flowctl.engine.graph import Tensor
from flowctl.engine.shapes import TensorSpec
from flowctl.spec.layers.base import (
    Activation, Builder, Layer, LayerError, Weight, elements, fmt, known, register,
)


def activate(x: Tensor, activation: str) -> Tensor:
    if activation == "none":
        return x
    return {"relu": fc.relu, "tanh": fc.tanh, "sigmoid": fc.sigmoid, "gelu": fc.gelu,
            "gelu_tanh": fc.gelu_tanh}[activation](x, name=activation)


def linear(b: Builder, x: Tensor, kernel: Tensor, bias: Tensor | None, transpose: bool = False) -> Tensor:
    """x @ kernel (+ bias) over the last axis of x, whatever its rank: a rank > 2 input is folded
    to a matrix first so the product is one MatMul, not a batched one. `transpose`: x @ kernelᵀ
    (a tied output layer reads the embedding's [vocab, dim] table as is)."""
    shape = x.shape
    if len(shape) > 2:
        x = fc.reshape(x, (-1, shape[-1]), name="fold")
    y = fc.matmul(x, kernel, transpose_b=transpose, name="matmul")
    if bias is not None:
        y = fc.bias_add(y, bias, name="bias_add")
    if len(shape) > 2:
        y = fc.reshape(y, tuple(-1 if d is None else d for d in shape[:-1]) + (kernel.shape[0 if transpose else -1],),
                       name="unfold")
    return y


def as_index(x: Tensor) -> Tensor:
    """Integer ids as the ops that index take them (int32/int64): a narrow input (uint8 labels,
    int16 token ids: less to read and to feed) is widened where it is used."""
    return x if x.dtype in ("int32", "int64") else fc.cast(x, "int32", name="as_index")


def sequence_mask(lengths: Tensor, steps: int, dtype: str, name: str = "mask") -> Tensor:
    """[batch, steps]: 1 where the step is below the example's length, 0 past it (padding)."""
    t = fc.reshape(fc.range_(steps, dtype="int32", name=f"{name}_steps"), (1, steps), name=f"{name}_row")
    lens = fc.reshape(fc.cast(lengths, "int32", name=f"{name}_lengths"), (-1, 1), name=f"{name}_column")
    return fc.cast(fc.less(t, lens, name=f"{name}_alive"), dtype, name=name)


def check_lengths(spec: TensorSpec, layer: str, names: list[str]) -> None:
    if len(spec.shape) != 1 or not spec.dtype.startswith(("int", "uint")):
        raise LayerError(f"{layer}: lengths '{names[-1]}' must be one integer per example ([batch]), got "
                         f"{fmt(spec.shape)} {spec.dtype}", "inputs")


@register
class Input(Layer):
    """A model input, fed from the data source: `shape` is per example (the batch is added)."""

    type: Literal["input"]
    shape: list[int] = Field(description="per-example shape, without the batch")
    dtype: Literal["float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "uint16"] | None = Field(
        None, description="the fed values' dtype; default: model.dtype (float inputs are the model's dtype)")
    classes: int | None = Field(None, ge=1, description="integer inputs take values in [0, classes)")

    arity: ClassVar[tuple[int, int | None]] = (0, 0)

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        # Unset: the model's dtype (a float input then meets weights of its own dtype); a dtype the
        # spec names is kept, as a float64 input fed straight to a loss needs.
        return TensorSpec((None, *self.shape), self.dtype or self._dtype)

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        return fc.placeholder(self.dtype or self._dtype, (None, *self.shape), name=self.name)


@register
class Dense(Layer):
    """A fully connected layer over the last axis. With `tie: <embedding layer>` its kernel is
    that embedding's [vocab, dim] table, transposed (Press and Wolf 2017; GPT-2's output head):
    one variable, read by both layers, whose gradient sums both uses."""

    type: Literal["dense"]
    units: int = Field(ge=1)
    activation: Activation = "none"
    use_bias: bool = True
    tie: str | None = Field(None, description="an earlier embedding layer whose table (transposed) is the kernel; "
                                              "units must be its vocab and the input features its dim")
    # (vocab, dim) of the tied embedding, set by the spec check, which resolves `tie`.
    _tied: tuple[int, int] | None = PrivateAttr(None)

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        x = ins[0]
        if len(x.shape) < 2:
            raise LayerError(f"dense needs an input of rank >= 2 (batch, features), got shape {fmt(x.shape)}")
        n = known(x.shape[-1], f"dense '{self.name}' input features")
        if self.tie is not None:
            assert self._tied is not None, "the spec check resolves `tie` before inference"
            vocab, dim = self._tied
            if (vocab, dim) != (self.units, n):
                raise LayerError(f"tied to embedding '{self.tie}' [{vocab}, {dim}], so units must be {vocab} "
                                 f"and the input features {dim}; got units {self.units}, input features {n}", "tie")
        return TensorSpec((*x.shape[:-1], self.units), x.dtype)

    def weights(self, ins: list[TensorSpec]) -> list[Weight]:
        n = int(ins[0].shape[-1])
        ws = [] if self.tie is not None else [Weight("kernel", (n, self.units))]
        if self.use_bias:
            ws.append(Weight("bias", (self.units,), init="zeros"))
        return ws

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        ws = {w.name: b.variable(w) for w in self.weights([ins[0].spec])}
        if self.tie is not None:
            y = linear(b, ins[0], b.shared(self.tie, "table"), ws.get("bias"), transpose=True)
        else:
            y = linear(b, ins[0], ws["kernel"], ws.get("bias"))
        return activate(y, self.activation)


@register
class Flatten(Layer):
    type: Literal["flatten"]

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        n = elements(ins[0])
        if n is None:
            raise LayerError(f"flatten needs every non-batch dimension known, got {fmt(ins[0].shape)}")
        return TensorSpec((ins[0].shape[0], n), ins[0].dtype)

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        return fc.reshape(ins[0], (-1, int(math.prod(ins[0].shape[1:]))), name="reshape")


@register
class ActivationLayer(Layer):
    type: Literal["activation"]
    activation: Activation = "relu"

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        return ins[0]

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        return activate(ins[0], self.activation) if self.activation != "none" else fc.identity(ins[0])


@register
class Dropout(Layer):
    """Drops units with probability `rate` while training; the identity otherwise."""

    type: Literal["dropout"]
    rate: float = Field(ge=0.0, lt=1.0)

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        return ins[0]

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        steps = b.steps.get(ins[0].name)
        if not b.training or self.rate == 0.0:
            y = fc.identity(ins[0], name="identity")
            if steps is not None:
                b.steps[y.name] = steps
            return y
        if steps is None:
            return fc.dropout(ins[0], rate=self.rate, name="dropout")
        # Between recurrent layers: one mask per time step (the same distribution as one mask over
        # the sequence), keeping the steps separate so the next layer need not wait for them all.
        outs = [fc.dropout(s, rate=self.rate, name=f"dropout_t{t}") for t, s in enumerate(steps)]
        y = fc.stack(outs, axis=1, name="stack")
        b.steps[y.name] = outs
        return y


@register
class Concat(Layer):
    """Joins its inputs along `axis` (Inception's branches along channels)."""

    type: Literal["concat"]
    axis: int = -1

    arity: ClassVar[tuple[int, int | None]] = (2, None)

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        r = len(ins[0].shape)
        if not -r <= self.axis < r or self.axis in (0, -r):
            raise LayerError(f"concat axis {self.axis} is out of range for rank {r} (axis 0 is the batch)",
                             "axis")
        ax = self.axis % r
        total: int | None = 0
        out = list(ins[0].shape)
        names = self.inputs or []
        for i, s in enumerate(ins):
            if len(s.shape) != r or any(a is not None and b is not None and a != b
                                        for j, (a, b) in enumerate(zip(s.shape, out)) if j != ax):
                shapes = ", ".join(f"{n} {fmt(x.shape)}" for n, x in zip(names, ins))
                raise LayerError(f"concat along axis {self.axis} needs all other dimensions equal: {shapes}",
                                 "inputs")
            if s.dtype != ins[0].dtype:
                raise LayerError(f"concat inputs differ in dtype: {', '.join(x.dtype for x in ins)}", "inputs")
            total = None if total is None or s.shape[ax] is None else total + s.shape[ax]
        out[ax] = total
        return TensorSpec(tuple(out), ins[0].dtype)

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        return fc.concat(ins, axis=self.axis % len(ins[0].shape), name="concat")


@register
class Embedding(Layer):
    """Token ids -> vectors: a Gather from a [vocab, dim] table."""

    type: Literal["embedding"]
    vocab: int = Field(ge=1)
    dim: int = Field(ge=1)
    init_scale: float = Field(0.05, gt=0, description="uniform ±init_scale (Zaremba et al.)")

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        if not ins[0].dtype.startswith(("int", "uint")):
            raise LayerError(f"embedding needs integer token ids, got {ins[0].dtype}")
        return TensorSpec((*ins[0].shape, self.dim), self._dtype)

    def weights(self, ins: list[TensorSpec]) -> list[Weight]:
        return [Weight("table", (self.vocab, self.dim), init="uniform", scale=self.init_scale)]

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        table = b.variable(self.weights([ins[0].spec])[0])
        return fc.gather(table, as_index(ins[0]), name="gather")


@register
class SoftmaxCrossEntropy(Layer):
    """Mean softmax cross-entropy of `inputs: [logits, labels]`. Integer labels are class ids
    (sparse); float labels are distributions with the logits' shape.

    For sequences (logits [batch, T, classes]) a third input, each example's length, masks the
    padding: the loss is the mean over real tokens only (PyTorch's `ignore_index`, TensorFlow NMT's
    target weights, normalised per token), so a padded position neither counts nor dilutes.

    `label_smoothing` ε (PyTorch's CrossEntropyLoss label_smoothing): each example's loss is
    (1-ε)·CE(labels) + ε·mean over the C classes of -log p, the cross-entropy with the target
    (1-ε)·labels + ε/C. It is the training loss only: evaluation (val/loss, val/perplexity) and
    inference report the plain cross-entropy, the quantity a perplexity is of."""

    type: Literal["softmax_cross_entropy"]
    label_smoothing: float = Field(0.0, ge=0, le=1, allow_inf_nan=False,
                                   description="ε: train on (1-ε)·CE + ε·mean over classes of -log p (PyTorch's "
                                               "label_smoothing); evaluation reports the plain cross-entropy")

    arity: ClassVar[tuple[int, int | None]] = (2, 3)

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        logits, labels = ins[:2]
        names = self.inputs or ["logits", "labels", "lengths"]
        if len(logits.shape) < 2:
            raise LayerError(f"logits must have rank >= 2, got {fmt(logits.shape)}", "inputs")
        if labels.dtype.startswith(("int", "uint")):
            want = logits.shape[:-1]
        else:
            want = logits.shape
        if len(labels.shape) != len(want) or any(a is not None and b is not None and a != b
                                                 for a, b in zip(labels.shape, want)):
            kind = "integer class ids" if labels.dtype.startswith(("int", "uint")) else "float distributions"
            raise LayerError(f"labels '{names[1]}' {fmt(labels.shape)} ({kind}) do not fit logits "
                             f"'{names[0]}' {fmt(logits.shape)}: expected labels of shape {fmt(want)}",
                             "inputs")
        if len(ins) == 3:
            if len(logits.shape) != 3:
                raise LayerError(f"a lengths input masks sequences: logits must be [batch, time, classes], "
                                 f"got {fmt(logits.shape)}", "inputs")
            check_lengths(ins[2], "softmax_cross_entropy", names)
        return TensorSpec((), logits.dtype)

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        logits, labels = ins[:2]
        steps = logits.shape[1] if len(logits.shape) == 3 else None
        if len(logits.shape) > 2:
            logits = fc.reshape(logits, (-1, logits.shape[-1]), name="fold_logits")
            labels = fc.reshape(labels, (-1,) if labels.dtype.startswith(("int", "uint")) else (-1, logits.shape[-1]),
                                name="fold_labels")
        if labels.dtype.startswith(("int", "uint")):
            per_example = fc.sparse_softmax_cross_entropy(logits, as_index(labels), name="xent")
        else:
            per_example = fc.softmax_cross_entropy(logits, labels, name="xent")
        eps = self.label_smoothing if b.training else 0.0
        if eps:
            # -mean_c log p_c: the cross-entropy against the uniform distribution, weighted ε.
            uniform = fc.neg(fc.reduce_mean(fc.log_softmax(logits, name="log_p"), axis=-1), name="uniform_xent")
            per_example = fc.add(per_example * (1.0 - eps), uniform * eps, name="smoothed")
        if len(ins) < 3:
            return fc.reduce_mean(per_example, name="mean")
        assert steps is not None
        mask = fc.reshape(sequence_mask(ins[2], steps, logits.dtype), (-1,), name="fold_mask")
        tokens = fc.maximum(fc.reduce_sum(mask, name="tokens"), fc.constant(1.0, logits.dtype), name="at_least_one")
        return fc.div(fc.reduce_sum(per_example * mask, name="masked_sum"), tokens, name="mean")

    @property
    def is_loss(self) -> bool:
        return True

