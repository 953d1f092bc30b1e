"""Neural-network ops (whitepaper Table 1 "Neural-net building blocks"), other than convolution and
pooling: Softmax, LogSoftmax, the two softmax cross-entropies, BiasAdd, batch normalisation and
Dropout, with the fused gradient ops their gradients use (§4.1: one fused node per gradient rather
than a chain of small ones, since every node costs a dispatch).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flowctl.engine.dtypes import INTS, is_float
from flowctl.engine.errors import GraphError
from flowctl.engine.graph import Graph, Tensor
from flowctl.engine.ops.api import constant, graph_of, make, make1
from flowctl.engine.ops.conv import _conv_cost, _conv_infer
from flowctl.engine.ops.elementwise import neg, rsqrt
from flowctl.engine.opdef import NN, REQUIRED, CostFn, memory_bytes, register_op
from flowctl.engine.ops.state import assign_sub
from flowctl.engine.shapes import InferError, TensorSpec, dims_equal, merge_dim, normalize_axis

__all__ = ["batch_norm", "bias_add", "dropout", "fused_batch_norm", "log_softmax", "softmax",
           "softmax_cross_entropy", "sparse_softmax_cross_entropy"]


# ---------------------------------------------------------------------------- shape functions
def _float(spec: TensorSpec, what: str) -> None:
    if not is_float(spec.dtype):
        raise InferError(f"{what} must be float, got {spec.dtype}")


def _same_dtype(a: TensorSpec, b: TensorSpec) -> None:
    if a.dtype != b.dtype:
        raise InferError(f"dtypes differ: {a.dtype} and {b.dtype} (insert a Cast)")


def _softmax_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    _float(ins[0], "logits")
    normalize_axis(attrs["axis"], len(ins[0].shape))
    return [ins[0]]


def _softmax_grad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    _float(ins[1], "the softmax output")
    _same_dtype(ins[0], ins[1])
    return [ins[1]]


def _matrix(spec: TensorSpec, what: str) -> tuple[int | None, int | None]:
    if len(spec.shape) != 2:
        raise InferError(f"{what} must be (batch, classes), got shape {spec.shape}")
    return spec.shape[0], spec.shape[1]


def _xent_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    logits, labels = ins
    _float(logits, "logits")
    _same_dtype(logits, labels)
    (n, c), (ln, lc) = _matrix(logits, "logits"), _matrix(labels, "labels")
    if not (dims_equal(n, ln) and dims_equal(c, lc)):
        raise InferError(f"logits {logits.shape} and labels {labels.shape} must have the same shape")
    n, c = merge_dim(n, ln), merge_dim(c, lc)
    return [TensorSpec((n,), logits.dtype), TensorSpec((n, c), logits.dtype)]


def _sparse_xent_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    logits, labels = ins
    _float(logits, "logits")
    n, c = _matrix(logits, "logits")
    if labels.dtype not in INTS:
        raise InferError(f"labels must be integer class ids, got {labels.dtype}")
    if len(labels.shape) != 1 or not dims_equal(n, labels.shape[0]):
        raise InferError(f"labels must be (batch,) = ({n},), got shape {labels.shape}")
    n = merge_dim(n, labels.shape[0])
    return [TensorSpec((n,), logits.dtype), TensorSpec((n, c), logits.dtype)]


def _xent_grad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    dy, m = ins
    _same_dtype(dy, m)
    n, c = _matrix(m, "backprop")
    if len(dy.shape) != 1 or not dims_equal(dy.shape[0], n):
        raise InferError(f"dy must be ({n},), got {dy.shape}")
    return [TensorSpec((merge_dim(n, dy.shape[0]), c), m.dtype)]


def _bias_xent_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    x, b, labels = ins
    return _sparse_xent_infer([_bias_add_infer([x, b], attrs)[0], labels], attrs)


def _xent_grad_bias_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    g = _xent_grad_infer(ins, attrs)[0]
    return [g, TensorSpec((g.shape[1],), g.dtype)]


def _channels(x: TensorSpec, vec: TensorSpec, what: str, wide: bool = False) -> int | None:
    """The channel count shared by x's last axis and a per-channel vector. `wide`: a bfloat16 x
    may come with float32 vectors (batch norm's parameters and statistics stay float32)."""
    if len(x.shape) < 1:
        raise InferError(f"x must have at least one axis (channels last), got {x.shape}")
    if not (wide and x.dtype == "bfloat16" and vec.dtype == "float32"):
        _same_dtype(x, vec)
    if len(vec.shape) != 1 or not dims_equal(vec.shape[0], x.shape[-1]):
        raise InferError(f"{what} must be ({x.shape[-1]},) to match x's last axis, got {vec.shape}")
    return merge_dim(x.shape[-1], vec.shape[0])


def _bias_add_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    x, b = ins
    c = _channels(x, b, "bias")
    return [TensorSpec(tuple(x.shape[:-1]) + (c,), x.dtype)]


def _affine_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    x, scale, shift = ins
    _float(x, "x")
    c = _channels(x, scale, "scale")
    _channels(x, shift, "shift")
    if attrs["activation"] not in ("none", "relu"):
        raise InferError(f"activation must be 'none' or 'relu', got {attrs['activation']!r}")
    return [TensorSpec(tuple(x.shape[:-1]) + (c,), x.dtype)]


def _fused_conv_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    window = {"strides": attrs["strides"], "padding": attrs["padding"]}
    return _affine_infer([*_conv_infer(ins[:2], window), *ins[2:]], {"activation": attrs["activation"]})


def _bias_add_grad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    _float(ins[0], "dy")
    if len(ins[0].shape) < 1:
        raise InferError(f"dy must have at least one axis, got {ins[0].shape}")
    return [TensorSpec((ins[0].shape[-1],), ins[0].dtype)]


_BN_ACTIVATIONS = ("none", "relu")


def _bn_activation(attrs: dict[str, Any]) -> bool:
    """Whether a ReLU is fused into the batch norm (and its gradient)."""
    if attrs["activation"] not in _BN_ACTIVATIONS:
        raise InferError(f"activation must be one of {', '.join(_BN_ACTIVATIONS)}, got {attrs['activation']!r}")
    return attrs["activation"] == "relu"


def _bn_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    x, scale, offset = ins
    _bn_activation(attrs)
    _float(x, "x")
    if len(x.shape) < 2:
        raise InferError(f"x must be (N, C) or NHWC, got shape {x.shape}")
    c = merge_dim(_channels(x, scale, "scale", wide=True), _channels(x, offset, "offset", wide=True))
    _same_dtype(scale, offset)
    vec = TensorSpec((c,), scale.dtype)  # the statistics in the parameters' dtype
    return [TensorSpec(tuple(x.shape[:-1]) + (c,), x.dtype), vec, vec]


def _bn_grad_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    fused = _bn_activation(attrs)
    first = "(dy, x, scale, mean, var, y)" if fused else "(dy, x, scale, mean, var)"
    if len(ins) - fused not in (5, 7):
        raise InferError(f"takes {first} and optionally (dmean, dvar), got {len(ins)} inputs")
    dy, x, scale = ins[:3]
    _float(x, "x")
    _same_dtype(dy, x)
    if fused:
        _same_dtype(ins[5], x)
        if not all(dims_equal(a, b) for a, b in zip(ins[5].shape, x.shape)) or len(ins[5].shape) != len(x.shape):
            raise InferError(f"y must be shaped like x {x.shape}, got {ins[5].shape}")
    for v in ins[2:5] + ins[5 + fused:]:
        _channels(x, v, "per-channel inputs", wide=True)
        _same_dtype(v, scale)
    vec = TensorSpec((x.shape[-1],), scale.dtype)
    return [x, vec, vec]


def _dropout_infer(ins: list[TensorSpec], attrs: dict[str, Any]) -> list[TensorSpec]:
    _float(ins[0], "x")
    if not 0.0 <= attrs["rate"] < 1.0:
        raise InferError(f"rate must be in [0, 1), got {attrs['rate']}")
    return [ins[0], ins[0]]


# ---------------------------------------------------------------------------- cost functions
def _per_element(flops: float) -> CostFn:
    """`flops` FLOPs per element of the first input (a static estimate for the cost model)."""

    def cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
             attrs: dict[str, Any]) -> tuple[float, float]:
        return flops * float(np.prod(ins[0])), memory_bytes(ins, outs, dtypes)

    return cost


def _fused_conv_cost(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                     attrs: dict[str, Any]) -> tuple[float, float]:
    """The convolution's FLOPs and three per output element; the bytes of the fused node's own
    inputs and output (the convolution's output never goes to memory and back)."""
    flops = _conv_cost(ins[:2], outs, dtypes, attrs)[0] + 3.0 * float(np.prod(outs[0]))
    return flops, memory_bytes(ins, outs, dtypes)


# Counts: Softmax is max, subtract, exp, sum, divide per element; the cross-entropies add a log,
# the label product and the backprop; batch norm's forward is mean (1), variance (3) and the
# scale-and-shift (4); its backward two reductions (3) plus the dx formula (6).
_SOFTMAX_COST, _SOFTMAX_GRAD_COST, _XENT_COST = _per_element(5), _per_element(4), _per_element(9)
_BN_COST, _BN_GRAD_COST, _DROPOUT_COST = _per_element(8), _per_element(9), _per_element(3)


def _one_per_output(ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], dtypes: list[str],
                    attrs: dict[str, Any]) -> tuple[float, float]:
    return float(np.prod(outs[0])), memory_bytes(ins, outs, dtypes)


# ---------------------------------------------------------------------------- gradient functions
def _is_zero(t: Tensor) -> bool:
    """True for the zero gradient autodiff fills in for an unused output of a multi-output op."""
    return t.op.op == "ZerosLike"


def _no_backprop_grad(op: Any, g: Tensor) -> None:
    # The backprop output exists so the gradient need not recompute the softmax (as in TensorFlow);
    # differentiating through it would need the softmax Jacobian, which no model here uses.
    if not _is_zero(g):
        raise GraphError(f"node '{op.name}': gradients through output 1 (backprop) of "
                         f"{op.node.op} are not supported; differentiate the loss, output 0")


def _g_softmax(op: Any, dy: list[Tensor]) -> list[Tensor]:
    return [make1("SoftmaxGrad", [dy[0], op.outputs[0]], {"axis": op.attrs["axis"]})]


def _g_log_softmax(op: Any, dy: list[Tensor]) -> list[Tensor]:
    return [make1("LogSoftmaxGrad", [dy[0], op.outputs[0]], {"axis": op.attrs["axis"]})]


def _g_xent(op: Any, dy: list[Tensor]) -> list[Tensor]:
    _no_backprop_grad(op, dy[1])
    logits = op.inputs[0]
    # d loss / d labels = -log_softmax(logits), per row scaled by dy.
    log_p = make1("LogSoftmax", [logits], {"axis": 1})
    return [make1("XentGrad", [dy[0], op.outputs[1]]), make1("XentGrad", [neg(dy[0]), log_p])]


def _g_sparse_xent(op: Any, dy: list[Tensor]) -> list[Tensor | None]:
    _no_backprop_grad(op, dy[1])
    return [make1("XentGrad", [dy[0], op.outputs[1]]), None]  # integer labels: no gradient


def _g_bias_add(op: Any, dy: list[Tensor]) -> list[Tensor]:
    return [dy[0], make1("BiasAddGrad", [dy[0]])]


def _g_affine(op: Any, dy: list[Tensor]) -> list[Tensor]:
    x, scale, _ = op.inputs
    g = make1("ReluGrad", [dy[0], op.outputs[0]]) if op.attrs["activation"] == "relu" else dy[0]
    return [g * scale, make1("BiasAddGrad", [g * x]), make1("BiasAddGrad", [g])]


def _g_fused_bn(op: Any, dy: list[Tensor]) -> list[Tensor]:
    x, scale, _ = op.inputs
    y, mean, var = op.outputs
    ins = [dy[0], x, scale, mean, var]
    if op.attrs["activation"] == "relu":
        ins.append(y)  # where the output is 0 the ReLU clipped it: its gradient is masked there
    # The batch statistics usually feed only the (non-differentiable) moving-average updates, so
    # their gradients are zeros and the kernel can skip that term; otherwise it adds it exactly.
    if not (_is_zero(dy[1]) and _is_zero(dy[2])):
        ins += [dy[1], dy[2]]
    return make("FusedBatchNormGrad", ins, {"epsilon": op.attrs["epsilon"], "activation": op.attrs["activation"]})


def _g_dropout(op: Any, dy: list[Tensor]) -> list[Tensor]:
    # y = x * mask, and the mask does not depend on x: the mask output's own gradient is dropped.
    return [dy[0] * op.outputs[1]]


register_op("Softmax", _softmax_infer, num_inputs=1, attrs={"axis": ("int", -1)}, group=NN,
            grad=_g_softmax, cost=_SOFTMAX_COST)
register_op("LogSoftmax", _softmax_infer, num_inputs=1, attrs={"axis": ("int", -1)}, group=NN,
            grad=_g_log_softmax, cost=_SOFTMAX_COST)
# SoftmaxGrad(dy, y) = y * (dy - sum(dy * y)); LogSoftmaxGrad(dy, y) = dy - exp(y) * sum(dy).
# Like ReluGrad, the fused gradient ops are not themselves differentiated (no second derivatives).
for _op in ("SoftmaxGrad", "LogSoftmaxGrad"):
    register_op(_op, _softmax_grad_infer, num_inputs=2, attrs={"axis": ("int", -1)}, group=NN,
                cost=_SOFTMAX_GRAD_COST)

# Outputs: (per-example loss (batch,), backprop (batch, classes) = d loss / d logits).
register_op("SoftmaxCrossEntropyWithLogits", _xent_infer, num_inputs=2, group=NN, grad=_g_xent,
            cost=_XENT_COST)
register_op("SparseSoftmaxCrossEntropyWithLogits", _sparse_xent_infer, num_inputs=2, group=NN,
            grad=_g_sparse_xent, cost=_XENT_COST, forward=(0,), forward_to=1)
# XentGrad(dy, m) = dy[:, None] * m: scales each row of m by that example's loss gradient.
register_op("XentGrad", _xent_grad_infer, num_inputs=2, group=NN,
            cost=_one_per_output, forward=(1,))

register_op("BiasAdd", _bias_add_infer, num_inputs=2, group=NN, grad=_g_bias_add, cost=_one_per_output,
            forward=(0,))
# BiasSparseXent(x, bias, labels) = SparseSoftmaxCrossEntropyWithLogits(BiasAdd(x, bias), labels),
# and XentGradBias(dy, m) = (XentGrad(dy, m), BiasAddGrad(XentGrad(dy, m))): made by the CPU plan's
# pass (engine/xent_bias.py) of a classifier's last bias and its loss, never by a model; the biased
# logits are never written, and the bias gradient is summed as the loss gradient is made. The same
# bits as the pairs they replace; no gradients (the pass runs on a graph already differentiated).
register_op("BiasSparseXent", _bias_xent_infer, num_inputs=3, group=NN, cost=_XENT_COST, forward=(0,),
            forward_to=1, differentiable=False)
register_op("XentGradBias", _xent_grad_bias_infer, num_inputs=2, group=NN, cost=_per_element(2),
            forward=(1,), differentiable=False)
# ChannelAffine(x, scale, shift) = activation(x * scale + shift), per channel (the last axis), in one
# pass: batch norm in inference, whose scale and shift come from the moving statistics. The same
# bits as the Mul, Add (and Relu) it replaces.
register_op("ChannelAffine", _affine_infer, num_inputs=3, attrs={"activation": ("str", "none")}, group=NN,
            grad=_g_affine, cost=_per_element(3.0))
# FusedConv2D(x, filter, scale, shift) = ChannelAffine(Conv2D(x, filter), scale, shift): made by
# the CPU plan's pass (engine/conv_affine.py) of a Conv2D read only by an inference batch norm's
# ChannelAffine, never by a model; no gradient (a differentiated Conv2D has a second reader).
register_op("FusedConv2D", _fused_conv_infer, num_inputs=4,
            attrs={"strides": ("ints", (1, 1)), "padding": ("str", "SAME"), "activation": ("str", "none")},
            group=NN, cost=_fused_conv_cost, differentiable=False)
# BiasAddGrad(dy): dy summed over every axis but the last.
register_op("BiasAddGrad", _bias_add_grad_infer, num_inputs=1, group=NN,
            grad=lambda op, dy: [make1("BroadcastLike", [dy[0], op.inputs[0]])], cost=_per_element(1))

# FusedBatchNorm(x, scale, offset) -> (y, batch mean, biased batch variance), over all axes but the
# last; activation "relu" makes y = max(0, normalised x) in the same pass (the statistics are the
# input's), which saves the separate ReLU's and ReluGrad's passes and buffers.
_BN_ATTRS = {"epsilon": ("float", 1e-3), "activation": ("str", "none")}
register_op("FusedBatchNorm", _bn_infer, num_inputs=3, attrs=dict(_BN_ATTRS), group=NN,
            grad=_g_fused_bn, cost=_BN_COST)
# FusedBatchNormGrad(dy, x, scale, mean, var[, y][, dmean, dvar]) -> (dx, dscale, doffset); y, the
# forward output, comes only with activation "relu".
register_op("FusedBatchNormGrad", _bn_grad_infer, min_inputs=5, attrs=dict(_BN_ATTRS),
            group=NN, cost=_BN_GRAD_COST)

# Dropout(x) -> (x * mask, mask), mask = keep / (1 - rate) drawn afresh each step at x's runtime
# shape from the node's own random stream (so it is stateful, with an "rng" resource).
register_op("Dropout", _dropout_infer, num_inputs=1, attrs={"rate": ("float", REQUIRED), "seed": ("int", 0)},
            group=NN, stateful=True, resource="rng", grad=_g_dropout, cost=_DROPOUT_COST)


# ---------------------------------------------------------------------------- Python API
def softmax(logits: Any, axis: int = -1, name: str | None = None) -> Tensor:
    return make1("Softmax", [logits], {"axis": axis}, name=name)


def log_softmax(logits: Any, axis: int = -1, name: str | None = None) -> Tensor:
    """log(softmax(logits)), computed as (x - max) - log(sum(exp(x - max))) so it never overflows."""
    return make1("LogSoftmax", [logits], {"axis": axis}, name=name)


def softmax_cross_entropy(logits: Any, labels: Any, name: str | None = None) -> Tensor:
    """Per-example -sum(labels * log_softmax(logits)) for (batch, classes) logits and dense labels;
    returns (batch,). Labels need not sum to one. Both logits and labels receive gradients."""
    return make("SoftmaxCrossEntropyWithLogits", [logits, labels], name=name)[0]


def sparse_softmax_cross_entropy(logits: Any, labels: Any, name: str | None = None) -> Tensor:
    """Per-example -log_softmax(logits)[i, labels[i]] for integer class ids (batch,); returns
    (batch,). A label outside [0, classes) stops the step with an ExecutionError."""
    g = graph_of(logits, labels)
    if not isinstance(labels, Tensor):
        labels = constant(np.asarray(labels), dtype="int32", graph=g)
    return make("SparseSoftmaxCrossEntropyWithLogits", [logits, labels], name=name, graph=g)[0]


def bias_add(x: Any, bias: Any, name: str | None = None) -> Tensor:
    """x + bias over x's last axis; bias's gradient is dy summed over all the other axes."""
    return make1("BiasAdd", [x, bias], name=name)


def fused_batch_norm(x: Any, scale: Any, offset: Any, epsilon: float = 1e-3, activation: str = "none",
                     name: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(y, batch_mean, batch_variance): x normalised with its own statistics over every axis but
    the last (biased variance), then scaled and shifted per channel, then passed through
    `activation` ("none" or "relu") in the same kernel."""
    y, mean, var = make("FusedBatchNorm", [x, scale, offset], {"epsilon": epsilon, "activation": activation},
                        name=name)
    return y, mean, var


def _scope(g: Graph, name: str) -> str:
    """A unique name scope (relative to the current one) for a builder that emits several nodes."""
    return g.relative_name(g.unique_name(name))


def batch_norm(x: Tensor, scale: Tensor, offset: Tensor, moving_mean: Tensor, moving_variance: Tensor,
               training: bool, momentum: float = 0.99, epsilon: float = 1e-3, activation: str = "none",
               name: str | None = None) -> tuple[Tensor, list[Tensor]]:
    """Batch normalisation over every axis but the last (x is (N, C) or NHWC).

    `training` is a Python bool, fixed when the graph is built: build one graph (or one branch) to
    train and another to evaluate. Training normalises with the batch's mean and biased variance
    (one fused op whose gradient is the full analytic one w.r.t. x, scale and offset) and returns,
    as `update_ops`, the AssignSubs that move the averages: moving -= (moving - batch) * (1 - momentum),
    i.e. moving = momentum * moving + (1 - momentum) * batch. Run them with the train step. Inference
    normalises with the moving statistics (a differentiable ChannelAffine) and returns no updates.
    `moving_mean` and `moving_variance` are Variables the caller creates (`fc.variable`, usually
    trainable=False, initialised to 0 and 1). `activation` "relu" applies a ReLU to the result: in
    training inside the fused op (forward and gradient), in inference inside ChannelAffine.
    """
    g = graph_of(x)
    if not 0.0 <= momentum <= 1.0:
        raise GraphError(f"batch_norm: momentum must be in [0, 1], got {momentum}")
    with g.name_scope(_scope(g, name or "BatchNorm")):
        if not training:
            inv = rsqrt(moving_variance + epsilon, name="rsqrt") * scale
            # x * inv + (offset - mean * inv) (and the ReLU): one pass over x, the rest on
            # per-channel vectors.
            shift = offset - moving_mean * inv
            return make1("ChannelAffine", [x, inv, shift], {"activation": activation}, name="affine"), []
        y, mean, var = fused_batch_norm(x, scale, offset, epsilon=epsilon, activation=activation,
                                        name="FusedBatchNorm")
        updates = []
        for moving, batch, what in ((moving_mean, mean, "mean"), (moving_variance, var, "variance")):
            with g.colocate_with(moving):  # an assignment runs where its Variable lives (§4.7)
                updates.append(assign_sub(moving, (moving - batch) * (1.0 - momentum),
                                          name=f"update_moving_{what}"))
        return y, updates


def dropout(x: Tensor, rate: float, seed: int = 0, name: str | None = None) -> Tensor:
    """x * mask / (1 - rate), with a fresh Bernoulli(1 - rate) mask each step at x's runtime shape.
    Output 1 of the node (`fc.Tensor(g, y.node, 1)`) is the scaled mask used. At rate 0 this is x
    itself (no node). `seed` 0 derives the stream from the node name."""
    if rate == 0:
        return x
    return make("Dropout", [x], {"rate": rate, "seed": seed}, name=name)[0]

