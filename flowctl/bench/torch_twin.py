"""A spec's model rebuilt in PyTorch, layer for layer, for `flowctl bench peers`.

The twin is read off the validated spec (its resolved layers, their static shapes and weights), so
it has the spec's shapes and parameter count by construction rather than by a second hand-written
model: convolutions without bias and batch norm without a scale where the spec says so (Keras's
Inception-v3 layout), TensorFlow's SAME padding (asymmetric where it has to be), average pools that
leave the padding out of the mean. Images run channels-last in memory (NHWC, as flowctl holds them)
while PyTorch indexes them NCHW. An LSTM layer is one `nn.LSTM`; its second bias vector (PyTorch
keeps b_ih and b_hh, the spec one bias) is frozen at zero and left out of the count. A GRU layer is
one `nn.GRU`, whose two bias vectors are the spec's `bias` and `recurrent_bias`. `Twin.load` copies
a flowctl model's weights into the recurrent layers, so their outputs can be compared.

This module imports torch; only `flowctl.bench.peers` imports it, after checking torch is there.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from flowctl.engine.errors import FlowctlError
from flowctl.spec.check import LayerInfo, LoadedSpec
from flowctl.spec.layers.base import pair


class TwinError(FlowctlError):
    """The spec uses a layer (or a setting) the PyTorch twin does not build."""

    exit_code = 2


def _same_pads(n: int, k: int, s: int) -> tuple[int, int]:
    """TensorFlow SAME: output ceil(n / s), the extra padding after when it is odd."""
    total = max((math.ceil(n / s) - 1) * s + k - n, 0)
    return total // 2, total - total // 2


def _window_pads(spec_in: Any, k: tuple[int, int], s: tuple[int, int],
                 padding: str) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) padding of a 2-D window layer over its NHWC input."""
    if padding == "valid":
        return 0, 0, 0, 0
    (t, b), (left, r) = (_same_pads(int(spec_in.shape[d]), k[d - 1], s[d - 1]) for d in (1, 2))
    return t, b, left, r


class BatchNorm(nn.Module):
    """Training-mode batch norm over channels (dim 1), with the spec's optional scale.

    Without a scale the weight is a frozen buffer of ones (not a Parameter: the parameter count and
    the optimizer's list are unchanged, and a non-persistent buffer leaves the state dict as it
    was) rather than `weight=None`: cuDNN's batch-norm backward returns an empty weight gradient
    for a None weight and autograd rejects it ("NativeBatchNormBackward0 returned an invalid
    gradient at index 2"). Multiplying by 1.0 is exact, so the CPU numerics are the same bits.
    """

    def __init__(self, c: int, scale: bool, eps: float, momentum: float) -> None:
        super().__init__()
        self.gamma: nn.Parameter | None = nn.Parameter(torch.ones(c)) if scale else None
        if not scale:
            self.register_buffer("unit_scale", torch.ones(c), persistent=False)
        self.beta = nn.Parameter(torch.zeros(c))
        self.register_buffer("running_mean", torch.zeros(c))
        self.register_buffer("running_var", torch.ones(c))
        self.eps, self.momentum = eps, 1.0 - momentum  # Keras momentum 0.99 is PyTorch's 0.01

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.gamma if self.gamma is not None else self.unit_scale
        return F.batch_norm(x, self.running_mean, self.running_var, weight, self.beta,
                            training=self.training, momentum=self.momentum, eps=self.eps)


class ConvLayer(nn.Module):
    def __init__(self, info: LayerInfo, spec_in: Any) -> None:
        super().__init__()
        layer = info.layer
        k, s = pair(layer.kernel, "kernel"), pair(layer.strides, "strides")
        t, b, left, r = _window_pads(spec_in, k, s, layer.padding)
        self.pad = (left, r, t, b) if (t, left) != (b, r) else None
        self.conv = nn.Conv2d(int(spec_in.shape[3]), layer.filters, k, s, padding=0 if self.pad else (t, left),
                              bias=layer.bias)
        self.bn = BatchNorm(layer.filters, layer.bn_scale, layer.bn_epsilon, layer.bn_momentum) \
            if layer.batch_norm else None
        self.act = _activation(layer.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad:
            x = F.pad(x, self.pad)
        y = self.conv(x)
        if self.bn is not None:
            y = self.bn(y)
        return self.act(y)


class Pool(nn.Module):
    def __init__(self, info: LayerInfo, spec_in: Any) -> None:
        super().__init__()
        layer = info.layer
        k = pair(layer.pool, "pool")
        s = pair(layer.strides if layer.strides is not None else layer.pool, "strides")
        t, b, left, r = _window_pads(spec_in, k, s, layer.padding)
        if (t, left) != (b, r):
            raise TwinError(f"layer '{layer.name}': an asymmetric SAME pool has no PyTorch twin here")
        if layer.type == "max_pool":
            self.pool: nn.Module = nn.MaxPool2d(k, s, padding=(t, left))
        else:  # TensorFlow's SAME average leaves the padding out of the mean
            self.pool = nn.AvgPool2d(k, s, padding=(t, left), count_include_pad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x)


def _no_lengths(info: LayerInfo) -> None:
    if len(info.inputs) > 1:
        raise TwinError(f"layer '{info.layer.name}': a lengths input has no PyTorch twin here")


def _rows(kernel: Any, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A spec's [(in + units), gates * units] kernel as PyTorch's weight_ih and weight_hh
    ([gates * units, in] and [gates * units, units]: the row blocks, transposed)."""
    k = torch.as_tensor(kernel)
    return k[:d].T, k[d:].T


class Recurrent(nn.Module):
    def __init__(self, info: LayerInfo, spec_in: Any) -> None:
        super().__init__()
        _no_lengths(info)
        layer = info.layer
        self.last = not layer.return_sequences
        self.forget_bias, self.units = layer.forget_bias, layer.units
        self.lstm = nn.LSTM(int(spec_in.shape[2]), layer.units, batch_first=True)
        with torch.no_grad():
            self.lstm.bias_hh_l0.zero_()
            if layer.forget_bias:
                self.lstm.bias_ih_l0[layer.units:2 * layer.units] += layer.forget_bias
        self.lstm.bias_hh_l0.requires_grad_(False)

    def load(self, kernel: Any, bias: Any) -> None:
        """The spec layer's weights (gates i, f, g, o in both); the forget bias joins b_ih."""
        w_ih, w_hh = _rows(kernel, self.lstm.input_size)
        b = torch.as_tensor(bias).clone()
        b[self.units:2 * self.units] += self.forget_bias
        with torch.no_grad():
            for p, v in ((self.lstm.weight_ih_l0, w_ih), (self.lstm.weight_hh_l0, w_hh), (self.lstm.bias_ih_l0, b)):
                p.copy_(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x)
        return y[:, -1] if self.last else y


class GatedRecurrent(nn.Module):
    """A `gru` layer: nn.GRU computes the spec's equations (gates r, z, n; the recurrent bias
    inside r's product), so the twin is the module itself with the weights in PyTorch's layout."""

    def __init__(self, info: LayerInfo, spec_in: Any) -> None:
        super().__init__()
        _no_lengths(info)
        self.last = not info.layer.return_sequences
        self.gru = nn.GRU(int(spec_in.shape[2]), info.layer.units, batch_first=True)

    def load(self, kernel: Any, bias: Any, recurrent_bias: Any) -> None:
        w_ih, w_hh = _rows(kernel, self.gru.input_size)
        with torch.no_grad():
            for p, v in ((self.gru.weight_ih_l0, w_ih), (self.gru.weight_hh_l0, w_hh),
                         (self.gru.bias_ih_l0, torch.as_tensor(bias)),
                         (self.gru.bias_hh_l0, torch.as_tensor(recurrent_bias))):
                p.copy_(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.gru(x)
        return y[:, -1] if self.last else y


def _activation(name: str) -> nn.Module:
    return {"none": nn.Identity(), "relu": nn.ReLU(), "tanh": nn.Tanh(), "sigmoid": nn.Sigmoid(),
            "gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh")}[name]


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half (GPT-NeoX) layout, base 10000, on [batch, heads, T, head_dim]."""
    T, hd = x.shape[-2], x.shape[-1]
    inv = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    half = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    angles = torch.cat([half, half], dim=1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()


class SelfAttention(nn.Module):
    """`self_attention`'s twin: one fused qkv Linear (columns q, k, v, each heads x head_dim, as the
    spec's kernel), F.scaled_dot_product_attention, the output Linear."""

    def __init__(self, d: int, heads: int, causal: bool, dropout: float, positions: str) -> None:
        super().__init__()
        self.heads, self.causal, self.dropout, self.rotary = heads, causal, dropout, positions == "rotary"
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.rotary:
            q, k = _rotate(q), _rotate(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, T, d))


class Block(nn.Module):
    """`transformer_block`'s twin: pre-norm attention and MLP residuals (GPT-2's block)."""

    def __init__(self, info: LayerInfo, spec_in: Any) -> None:
        super().__init__()
        _no_lengths(info)
        layer, d = info.layer, int(spec_in.shape[2])
        self.ln_1, self.ln_2 = nn.LayerNorm(d, eps=layer.epsilon), nn.LayerNorm(d, eps=layer.epsilon)
        self.attention = SelfAttention(d, layer.heads, layer.causal, layer.dropout, layer.positions)
        self.mlp = nn.Sequential(nn.Linear(d, layer.mlp_ratio * d), _activation(layer.activation),
                                 nn.Linear(layer.mlp_ratio * d, d))
        self.drop = nn.Dropout(layer.dropout)

    def load(self, g1: Any, b1: Any, qkv: Any, qkv_b: Any, out: Any, out_b: Any, g2: Any, b2: Any,
             hidden: Any, hidden_b: Any, down: Any, down_b: Any) -> None:
        """The spec layer's weights in `weights()` order (kernels [in, out]: Linear's transposed)."""
        pairs = ((self.ln_1.weight, g1), (self.ln_1.bias, b1), (self.ln_2.weight, g2), (self.ln_2.bias, b2),
                 (self.attention.qkv.weight, _t(qkv)), (self.attention.qkv.bias, qkv_b),
                 (self.attention.out.weight, _t(out)), (self.attention.out.bias, out_b),
                 (self.mlp[0].weight, _t(hidden)), (self.mlp[0].bias, hidden_b),
                 (self.mlp[2].weight, _t(down)), (self.mlp[2].bias, down_b))
        _copy(pairs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class Positions(nn.Module):
    """`position_embedding`: a learned [max_length, d] table added to the first T rows."""

    def __init__(self, max_length: int, d: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(max_length, d) * 0.01)

    def load(self, table: Any) -> None:
        _copy([(self.table, table)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table[: x.shape[1]]


class Tied(nn.Module):
    """A `dense` with `tie:`: the embedding's table as the kernel (one Parameter), its own bias."""

    def __init__(self, embedding: nn.Embedding, bias: bool, activation: str) -> None:
        super().__init__()
        self.embedding = [embedding]  # not a submodule: the table is counted once, as the embedding's
        self.bias = nn.Parameter(torch.zeros(embedding.num_embeddings)) if bias else None
        self.act = _activation(activation)

    def load(self, *bias: Any) -> None:
        if self.bias is not None:
            _copy([(self.bias, bias[0])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(F.linear(x, self.embedding[0].weight, self.bias))


def _t(kernel: Any) -> torch.Tensor:
    return torch.as_tensor(kernel).T


def _copy(pairs: Any) -> None:
    with torch.no_grad():
        for p, v in pairs:
            p.copy_(torch.as_tensor(v))


def _load_plain(module: nn.Module, values: list[Any]) -> None:
    """An embedding's table, a layer norm's gamma and beta, a dense layer's kernel and bias."""
    if isinstance(module, nn.Embedding):
        _copy([(module.weight, values[0])])
    elif isinstance(module, nn.LayerNorm):
        _copy(list(zip((module.weight, module.bias), values)))
    elif isinstance(module, nn.Sequential) and isinstance(module[0], nn.Linear):
        _copy([(module[0].weight, _t(values[0]))] + ([(module[0].bias, values[1])] if len(values) > 1 else []))
    else:
        raise TwinError(f"the twin cannot copy weights into a {type(module).__name__}")


class Lambda(nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.fn(*xs)


def _xent(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if labels.dtype.is_floating_point:
        raise TwinError("softmax_cross_entropy with float labels has no PyTorch twin here")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long())


def _concat(axis: int, rank: int) -> Lambda:
    # NHWC's channel axis (-1, or 3) is PyTorch's dim 1; other ranks keep their axis.
    dim = 1 if rank == 4 and axis % 4 == 3 else axis % rank
    return Lambda(lambda *xs: torch.cat(xs, dim=dim))


def _module(info: LayerInfo, ins: list[Any], made: Any = None) -> nn.Module:
    layer, t = info.layer, info.layer.type
    if t == "dense" and getattr(layer, "tie", None):
        return Tied(made[_key(layer.tie)], layer.use_bias, layer.activation)
    if t == "transformer_block":
        return Block(info, ins[0])
    if t == "self_attention":
        _no_lengths(info)
        return SelfAttention(int(ins[0].shape[2]), layer.heads, layer.causal, layer.dropout, layer.positions)
    if t == "position_embedding":
        return Positions(layer.max_length, int(ins[0].shape[2]))
    if t == "layer_norm":
        if layer.scale != layer.center:
            raise TwinError(f"layer '{layer.name}': a layer norm with only one of scale and center has no twin here")
        return nn.LayerNorm(int(ins[0].shape[-1]), eps=layer.epsilon, elementwise_affine=layer.scale)
    if t == "conv2d":
        return ConvLayer(info, ins[0])
    if t in ("max_pool", "avg_pool"):
        return Pool(info, ins[0])
    if t == "global_avg_pool":
        return Lambda(lambda x: x.mean(dim=(2, 3)))
    if t == "dense":
        return nn.Sequential(nn.Linear(int(ins[0].shape[-1]), layer.units, bias=layer.use_bias),
                             _activation(layer.activation))
    if t == "dropout":
        return nn.Dropout(layer.rate)
    if t == "embedding":
        return nn.Embedding(layer.vocab, layer.dim)
    if t == "lstm":
        return Recurrent(info, ins[0])
    if t == "gru":
        return GatedRecurrent(info, ins[0])
    if t == "concat":
        return _concat(layer.axis, len(ins[0].shape))
    if t == "activation":
        return _activation(layer.activation)
    if t == "softmax_cross_entropy":
        return Lambda(_xent)
    raise TwinError(f"layer '{layer.name}' of type {t} has no PyTorch twin in flowctl bench peers")


class Twin(nn.Module):
    """The spec's layers in order; `forward(feeds)` returns every layer's output by name."""

    def __init__(self, loaded: LoadedSpec) -> None:
        super().__init__()
        self.order: list[tuple[str, list[str]]] = []
        self.inputs: list[str] = []
        self.layers = nn.ModuleDict()
        for name, info in loaded.layers.items():
            if info.layer.type == "input":
                self.inputs.append(name)
                continue
            ins = [loaded.layers[i].output for i in info.inputs]
            self.layers[_key(name)] = _module(info, ins, self.layers)
            self.order.append((name, list(info.inputs)))

    def forward(self, feeds: dict[str, torch.Tensor], upto: str | None = None) -> dict[str, torch.Tensor]:
        out = dict(feeds)
        for name, ins in self.order:
            out[name] = self.layers[_key(name)](*(out[i] for i in ins))
            if name == upto:
                break
        return out

    def load(self, weights: dict[str, list[Any]]) -> None:
        """Copy a flowctl model's weights (layer name -> its variables' values, in `weights()`
        order) into the twin: recurrent layers, Transformer blocks, positions, embeddings, layer
        norms, dense layers (a tied one takes its bias only: its kernel is the embedding's)."""
        for name, values in weights.items():
            module = self.layers[_key(name)]
            if isinstance(module, (Recurrent, GatedRecurrent, Block, Positions, Tied)):
                module.load(*values)
            else:
                _load_plain(module, values)

    def param_count(self) -> int:
        """Trainable parameters plus batch norm's moving statistics: how a spec counts."""
        stats = sum(b.numel() for n, b in self.named_buffers() if n.endswith(("running_mean", "running_var")))
        return sum(p.numel() for p in self.parameters() if p.requires_grad) + stats


def _key(name: str) -> str:
    return name.replace(".", "__").replace("/", "__")


def torch_feeds(loaded: LoadedSpec, arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
    """flowctl's input batch as PyTorch tensors: images NHWC -> NCHW views of channels-last memory."""
    out = {}
    for name, a in arrays.items():
        t = torch.from_numpy(a)
        if t.dim() == 4:
            t = t.permute(0, 3, 1, 2)  # already channels-last in memory: no copy
        out[name] = t
    return out
