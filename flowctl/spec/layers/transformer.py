"""Decoder-only Transformer layers (Vaswani et al. 2017; GPT-2's pre-norm arrangement, Radford
et al. 2019): multi-head self-attention, learned absolute positions, and the residual block that
joins them with an MLP.

Attention is PyTorch's `scaled_dot_product_attention`: softmax(q kᵀ / sqrt(head_dim) + mask) v,
the causal mask lower-triangular with the diagonal, the padding mask off keys at or past each
example's length. A masked score is replaced (Select, not added) by the dtype's most negative
finite value: a softmax over a row whose keys are all masked (a length-0 example) then averages
them instead of making NaN, and in float16 nothing overflows to inf before the max is subtracted
(the Softmax kernel subtracts each row's max first, so exp never exceeds 1).

Rotary positions (Su et al. 2021) in GPT-NeoX/LLaMA's "rotate half" form: the head's features
split in two halves (x1, x2), and x -> x cos(tθ) + (-x2, x1) sin(tθ) with θ_i = 10000^(-2i/head_dim)
repeated over both halves.
"""
from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

import flowctl as fc
from flowctl.engine.dtypes import np_dtype
from flowctl.engine.graph import Tensor
from flowctl.engine.shapes import TensorSpec
from flowctl.spec.layers.base import Builder, Layer, LayerError, Weight, known, rank, register
from flowctl.spec.layers.core import activate, check_lengths, linear, sequence_mask
from flowctl.spec.layers.norm import layer_norm

Positions = Literal["none", "rotary"]
ROTARY_BASE = 10000.0


def _sequence(ins: list[TensorSpec], layer: str, names: list[str]) -> tuple[int, int]:
    """(T, d) of a [batch, T, d] float input, both known (the masks and positions are built for T)."""
    x = ins[0]
    rank(x, 3, layer, "[batch, time, features]")
    if not x.dtype.startswith("float"):
        raise LayerError(f"{layer} needs a float input, got {x.dtype}")
    if len(ins) == 2:
        check_lengths(ins[1], layer, names)
    return known(x.shape[1], f"{layer} time steps"), known(x.shape[2], f"{layer} features")


def _heads(d: int, heads: int, positions: str) -> int:
    if d % heads:
        raise LayerError(f"{d} features do not split over {heads} heads", "heads")
    hd = d // heads
    if positions == "rotary" and hd % 2:
        raise LayerError(f"rotary positions rotate pairs of features: head size {hd} ({d} / {heads}) must be even",
                         "positions")
    return hd


def attention_weights(d: int, prefix: str = "") -> list[Weight]:
    return [Weight(f"{prefix}qkv_kernel", (d, 3 * d)), Weight(f"{prefix}qkv_bias", (3 * d,), init="zeros"),
            Weight(f"{prefix}output_kernel", (d, d)), Weight(f"{prefix}output_bias", (d,), init="zeros")]


def rotary_tables(steps: int, head_dim: int, dtype: str) -> tuple[Tensor, Tensor]:
    """cos and sin of tθ, [steps, head_dim], θ repeated over both halves (the rotate-half layout).
    Made from a Range in the graph, not stored (a 1024-step table would be a 256 KiB constant), and
    computed in float32 at least: float16 angles near 1000 would be off by a quarter turn."""
    exact = "float64" if dtype == "float64" else "float32"
    inv = ROTARY_BASE ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    t = fc.reshape(fc.range_(steps, dtype=exact, name="rotary_steps"), (steps, 1), name="rotary_column")
    half = t * fc.constant(inv[None, :].astype(np_dtype(exact)), name="rotary_inv_freq")
    angles = fc.concat([half, half], axis=1, name="rotary_angles")
    cos, sin = fc.cos(angles, name="rotary_cos"), fc.sin(angles, name="rotary_sin")
    if exact != dtype:
        cos, sin = fc.cast(cos, dtype, name="rotary_cos_cast"), fc.cast(sin, dtype, name="rotary_sin_cast")
    return cos, sin


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, name: str) -> Tensor:
    x1, x2 = fc.split(x, 2, axis=3, name=f"{name}_halves")
    turned = fc.concat([fc.neg(x2, name=f"{name}_neg"), x1], axis=3, name=f"{name}_rotate_half")
    return fc.add(x * cos, turned * sin, name=name)


def self_attention(b: Builder, x: Tensor, lengths: Tensor | None, w: dict[str, Tensor], heads: int, causal: bool,
                   dropout: float, positions: str) -> Tensor:
    """Multi-head self-attention of x [batch, T, d] with one fused qkv projection; `w` holds
    qkv_kernel [d, 3d], qkv_bias, output_kernel [d, d], output_bias."""
    T, d = int(x.shape[1]), int(x.shape[2])
    hd = d // heads
    dtype = x.dtype
    with b.graph.name_scope("qkv"):
        qkv = linear(b, x, w["qkv_kernel"], w["qkv_bias"])  # [batch, T, 3d]
    # [batch, T, 3, heads, hd] -> [3, batch, heads, T, hd]: one transpose for all three
    qkv = fc.transpose(fc.reshape(qkv, (-1, T, 3, heads, hd), name="split_heads"), [2, 0, 3, 1, 4],
                       name="heads_major")
    q, k, v = (fc.reshape(t, (-1, heads, T, hd), name=f"{n}") for t, n in
               zip(fc.split(qkv, 3, axis=0, name="qkv_parts"), "qkv"))
    if positions == "rotary":
        cos, sin = rotary_tables(T, hd, dtype)
        q, k = _rotate(q, cos, sin, "q_rotary"), _rotate(k, cos, sin, "k_rotary")
    scores = fc.batch_matmul(q, k, adj_y=True, name="scores") * (1.0 / float(np.sqrt(hd)))  # [batch, h, T, T]
    lowest = fc.constant(np.asarray(np.finfo(np_dtype(dtype)).min, np_dtype(dtype)), name="masked_score")
    if causal:
        # key s <= query t, from two Ranges (a stored [T, T] mask would be a megabyte at T = 1024)
        steps = fc.range_(T, dtype="int32", name="causal_steps")
        keep = fc.less(fc.reshape(steps, (1, T), name="causal_keys"),
                       fc.reshape(steps + 1, (T, 1), name="causal_queries"), name="causal_mask")
        scores = fc.select(keep, scores, lowest, name="causal")
    if lengths is not None:
        alive = sequence_mask(lengths, T, "bool", name="key_mask")  # [batch, T]
        keep = fc.reshape(alive, (-1, 1, 1, T), name="key_mask_rows")  # [batch, 1, 1, T]: every query, head
        scores = fc.select(keep, scores, lowest, name="padding")
    probs = fc.softmax(scores, axis=-1, name="weights")
    if b.training and dropout > 0:
        probs = fc.dropout(probs, rate=dropout, name="weights_dropout")
    ctx = fc.batch_matmul(probs, v, name="context")  # [batch, heads, T, hd]
    ctx = fc.reshape(fc.transpose(ctx, [0, 2, 1, 3], name="time_major"), (-1, T, d), name="merge_heads")
    with b.graph.name_scope("output"):
        return linear(b, ctx, w["output_kernel"], w["output_bias"])


@register
class SelfAttention(Layer):
    """Multi-head self-attention over [batch, T, d] (d split over `heads`), with a fused qkv
    projection and an output projection, biases on both. An optional second input, each
    example's length, masks the padding keys."""

    type: Literal["self_attention"]
    heads: int = Field(ge=1, description="attention heads; the features must split evenly over them")
    causal: bool = Field(False, description="each position attends only to itself and earlier ones")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the attention weights, while training")
    positions: Positions = Field("none", description="rotary: RoPE (rotate-half, base 10000) on queries and keys")

    arity: ClassVar[tuple[int, int | None]] = (1, 2)

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        _, d = _sequence(ins, "self_attention", self.inputs or ["x", "lengths"])
        _heads(d, self.heads, self.positions)
        return ins[0]

    def weights(self, ins: list[TensorSpec]) -> list[Weight]:
        return attention_weights(int(ins[0].shape[2]))

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        w = {wt.name: b.variable(wt) for wt in self.weights([ins[0].spec])}
        lengths = ins[1] if len(ins) == 2 else None
        return self_attention(b, ins[0], lengths, w, self.heads, self.causal, self.dropout, self.positions)


@register
class PositionEmbedding(Layer):
    """Learned absolute positions (GPT-2's wpe): row t of a [max_length, d] table added at step t."""

    type: Literal["position_embedding"]
    max_length: int = Field(ge=1, description="rows of the table: the longest sequence it can take")
    init_scale: float = Field(0.01, gt=0, description="truncated normal stddev of the initial table")

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        T, _ = _sequence(ins, "position_embedding", self.inputs or ["x"])
        if T > self.max_length:
            raise LayerError(f"the input has {T} steps, more than max_length {self.max_length}", "max_length")
        return ins[0]

    def weights(self, ins: list[TensorSpec]) -> list[Weight]:
        return [Weight("table", (self.max_length, int(ins[0].shape[2])), init="truncated_normal",
                       scale=self.init_scale)]

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        x = ins[0]
        table = b.variable(self.weights([x.spec])[0])
        T = int(x.shape[1])
        rows = table if T == self.max_length else fc.slice_(table, [0, 0], [T, -1], name="rows")
        return fc.add(x, rows, name="add")


@register
class TransformerBlock(Layer):
    """A pre-norm residual block (GPT-2): x + attention(ln_1(x)), then x + mlp(ln_2(x)), the MLP
    d -> mlp_ratio·d -> d with `activation` between. `dropout` drops the attention weights and each
    residual branch's output while training. Biases in every linear map and layer norm."""

    type: Literal["transformer_block"]
    heads: int = Field(ge=1, description="attention heads; the features must split evenly over them")
    mlp_ratio: int = Field(4, ge=1, description="the MLP's hidden width as a multiple of the features")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="attention-weight and residual dropout, while training")
    activation: Literal["gelu", "gelu_tanh"] = Field("gelu", description="gelu: exact (erf); gelu_tanh: GPT-2's")
    causal: bool = Field(True, description="each position attends only to itself and earlier ones")
    positions: Positions = Field("none", description="rotary: RoPE (rotate-half, base 10000) on queries and keys")
    epsilon: float = Field(1e-5, gt=0, description="the layer norms' epsilon")

    arity: ClassVar[tuple[int, int | None]] = (1, 2)

    def infer(self, ins: list[TensorSpec]) -> TensorSpec:
        _, d = _sequence(ins, "transformer_block", self.inputs or ["x", "lengths"])
        _heads(d, self.heads, self.positions)
        return ins[0]

    def weights(self, ins: list[TensorSpec]) -> list[Weight]:
        d = int(ins[0].shape[2])
        h = self.mlp_ratio * d
        return [Weight("ln_1/gamma", (d,), init="ones"), Weight("ln_1/beta", (d,), init="zeros"),
                *attention_weights(d, "attention/"),
                Weight("ln_2/gamma", (d,), init="ones"), Weight("ln_2/beta", (d,), init="zeros"),
                Weight("mlp/hidden_kernel", (d, h)), Weight("mlp/hidden_bias", (h,), init="zeros"),
                Weight("mlp/output_kernel", (h, d)), Weight("mlp/output_bias", (d,), init="zeros")]

    def build(self, b: Builder, ins: list[Tensor]) -> Tensor:
        x = ins[0]
        w = {wt.name: b.variable(wt) for wt in self.weights([x.spec])}
        lengths = ins[1] if len(ins) == 2 else None
        with b.graph.name_scope("ln_1"):
            h = layer_norm(x, w["ln_1/gamma"], w["ln_1/beta"], self.epsilon)
        with b.graph.name_scope("attention"):
            aw = {k.removeprefix("attention/"): t for k, t in w.items() if k.startswith("attention/")}
            a = self_attention(b, h, lengths, aw, self.heads, self.causal, self.dropout, self.positions)
            if b.training and self.dropout > 0:
                a = fc.dropout(a, rate=self.dropout, name="residual_dropout")
        x = fc.add(x, a, name="attention_residual")
        with b.graph.name_scope("ln_2"):
            h = layer_norm(x, w["ln_2/gamma"], w["ln_2/beta"], self.epsilon)
        with b.graph.name_scope("mlp"):
            with b.graph.name_scope("hidden"):
                h = activate(linear(b, h, w["mlp/hidden_kernel"], w["mlp/hidden_bias"]), self.activation)
            with b.graph.name_scope("output"):
                m = linear(b, h, w["mlp/output_kernel"], w["mlp/output_bias"])
            if b.training and self.dropout > 0:
                m = fc.dropout(m, rate=self.dropout, name="residual_dropout")
        return fc.add(x, m, name="mlp_residual")


__all__ = ["PositionEmbedding", "SelfAttention", "TransformerBlock", "rotary_tables", "self_attention"]
