"""Layer normalization (Ba, Kiros and Hinton, 2016): each example normalized over its last axis,
then scaled and shifted per feature. Unlike batch norm it keeps no moving statistics, so training
and inference compute the same thing."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

import flowctl as fc
from flowctl.engine.graph import Tensor
from flowctl.engine.shapes import TensorSpec
from flowctl.spec.layers.base import Builder, Layer, LayerError, Weight, fmt, known, register


@register
class LayerNorm(Layer):
    """(x - mean) / sqrt(var + epsilon) over the last axis, times `gamma`, plus `beta`."""

    type: Literal["layer_norm"]
    epsilon: float = Field(1e-5, gt=0, description="added to the variance before the square root")
    scale: bool = Field(True, description="learn a per-feature gamma (initialised to 1)")
    center: bool = Field(True, description="learn a per-feature beta (initialised to 0)")

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        x = ins[0]
        if len(x.shape) < 2:
            raise LayerError(f"layer_norm needs an input of rank >= 2 (batch, ..., features), got {fmt(x.shape)}")
        if not x.dtype.startswith("float"):
            raise LayerError(f"layer_norm needs a float input, got {x.dtype}")
        known(x.shape[-1], f"layer_norm '{self.name}' input features")
        return x

    def weights(self, ins: list[TensorSpec]) -> list[Weight]:
        c = int(ins[0].shape[-1])
        ws = []
        if self.scale:
            ws.append(Weight("gamma", (c,), init="ones"))
        if self.center:
            ws.append(Weight("beta", (c,), init="zeros"))
        return ws

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        ws = {w.name: b.variable(w) for w in self.weights([ins[0].spec])}
        return layer_norm(ins[0], ws.get("gamma"), ws.get("beta"), self.epsilon)


def layer_norm(x: Tensor, gamma: Tensor | None, beta: Tensor | None, epsilon: float) -> Tensor:
    """x normalized over its last axis (biased variance, as PyTorch's), then scaled and shifted."""
    centred = x - fc.reduce_mean(x, axis=-1, keepdims=True, name="mean")
    var = fc.reduce_mean(fc.square(centred), axis=-1, keepdims=True, name="variance")
    y = centred * fc.rsqrt(var + epsilon, name="inv_std")
    if gamma is not None:
        y = y * gamma
    if beta is not None:
        y = y + beta
    return y
