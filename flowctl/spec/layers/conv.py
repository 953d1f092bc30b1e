"""Convolution and pooling layers (NHWC). conv2d can carry batch norm and an activation, as Keras'
Inception-v3 `conv2d_bn` does: Conv2D without bias, BatchNormalization(scale=False), ReLU."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

import flowctl as fc
from flowctl.engine.graph import Tensor
from flowctl.engine.shapes import TensorSpec
from flowctl.spec.layers.base import (
    Activation, Builder, Layer, LayerError, Weight, fmt, known, out_size, pair, rank, register,
)
from flowctl.spec.layers.core import activate

Padding = Literal["same", "valid"]
IntOrPair = int | list[int]


def _window(x: TensorSpec, k: tuple[int, int], s: tuple[int, int], padding: str, layer: str,
            channels: int | None) -> TensorSpec:
    rank(x, 4, layer, "NHWC input")
    _, h, w, c = x.shape
    ho, wo = out_size(h, k[0], s[0], padding), out_size(w, k[1], s[1], padding)
    if ho == 0 or wo == 0:
        raise LayerError(f"a {k[0]}x{k[1]} window with padding {padding} does not fit an input of "
                         f"{h}x{w} (shape {fmt(x.shape)})", "kernel" if layer == "conv2d" else "pool")
    return TensorSpec((x.shape[0], ho, wo, c if channels is None else channels), x.dtype)


@register
class Conv2D(Layer):
    """2-D convolution, optionally followed by batch norm and an activation (named `conv`, `bn`,
    and the activation's name inside the layer's scope)."""

    type: Literal["conv2d"]
    filters: int = Field(ge=1)
    kernel: IntOrPair
    strides: IntOrPair = 1
    padding: Padding = "same"
    activation: Activation = "none"
    use_bias: bool | None = Field(None, description="default: true unless batch_norm")
    batch_norm: bool = False
    bn_scale: bool = Field(True, description="learn a per-channel scale (Keras Inception: false)")
    bn_epsilon: float = Field(1e-3, gt=0)
    bn_momentum: float = Field(0.99, ge=0, lt=1)

    @property
    def bias(self) -> bool:
        return (not self.batch_norm) if self.use_bias is None else self.use_bias

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        k, s = pair(self.kernel, "kernel"), pair(self.strides, "strides")
        out = _window(ins[0], k, s, self.padding, "conv2d", self.filters)
        known(ins[0].shape[3], f"conv2d '{self.name}' input channels")
        return out

    def weights(self, ins: list[TensorSpec]) -> list[Weight]:
        kh, kw = pair(self.kernel, "kernel")
        cin = int(ins[0].shape[3])
        f = self.filters
        ws = [Weight("kernel", (kh, kw, cin, f), fan=(kh * kw * cin, kh * kw * f))]
        if self.bias:
            ws.append(Weight("bias", (f,), init="zeros"))
        if self.batch_norm:
            if self.bn_scale:
                ws.append(Weight("bn/gamma", (f,), init="ones"))
            ws += [Weight("bn/beta", (f,), init="zeros"),
                   Weight("bn/moving_mean", (f,), trainable=False, init="zeros"),
                   Weight("bn/moving_variance", (f,), trainable=False, init="ones")]
        return ws

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        ws = {w.name: b.variable(w) for w in self.weights([ins[0].spec])}
        sh, sw = pair(self.strides, "strides")
        y = fc.conv2d(ins[0], ws["kernel"], strides=(sh, sw), padding=self.padding.upper(), name="conv")
        if self.bias:
            y = fc.bias_add(y, ws["bias"], name="bias_add")
        if self.batch_norm:
            # A ReLU goes into the batch norm's kernel (one pass, one buffer, forward and backward).
            fused = "relu" if self.activation == "relu" else "none"
            y = b.batch_norm(y, ws.get("bn/gamma"), ws["bn/beta"], ws["bn/moving_mean"],
                             ws["bn/moving_variance"], self.bn_epsilon, self.bn_momentum, fused)
            if fused == "relu":
                return y
        return activate(y, self.activation)


class _Pool(Layer):
    pool: IntOrPair
    strides: IntOrPair | None = Field(None, description="default: the pool size")
    padding: Padding = "valid"

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        k = pair(self.pool, "pool")
        s = pair(self.strides if self.strides is not None else self.pool, "strides")
        return _window(ins[0], k, s, self.padding, self.type, None)

    def _args(self) -> dict:
        k = pair(self.pool, "pool")
        s = pair(self.strides if self.strides is not None else self.pool, "strides")
        return {"ksize": k, "strides": s, "padding": self.padding.upper()}


@register
class MaxPool(_Pool):
    type: Literal["max_pool"]

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        return fc.max_pool(ins[0], name="max_pool", **self._args())


@register
class AvgPool(_Pool):
    type: Literal["avg_pool"]

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        return fc.avg_pool(ins[0], name="avg_pool", **self._args())


@register
class GlobalAvgPool(Layer):
    """Mean over the spatial dimensions: NHWC -> NC."""

    type: Literal["global_avg_pool"]

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        rank(ins[0], 4, "global_avg_pool", "NHWC input")
        return TensorSpec((ins[0].shape[0], ins[0].shape[3]), ins[0].dtype)

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        return fc.reduce_mean(ins[0], axis=(1, 2), name="mean")
