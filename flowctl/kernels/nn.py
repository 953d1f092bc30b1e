"""Neural-network kernels (softmax family, cross-entropies, BiasAdd, batch norm, Dropout), written
once against the array module `xp`. Every softmax subtracts the row maximum first, so exp never
overflows whatever the logits."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from flowctl.kernels import intra
from flowctl.kernels.conv import GEMM_ROWS, conv2d_forward
from flowctl.kernels.registry import into, kernel

Fn = Callable[..., Any]


def _log_softmax(xp: Any, x: Any, axis: int) -> tuple[Any, Any, Any]:
    """(log p, exp(x - max), sum of the latter): the pieces the softmax kernels share."""
    s = x - x.max(axis=axis, keepdims=True)
    e = xp.exp(s)
    z = e.sum(axis=axis, keepdims=True)
    s -= xp.log(z)  # s is a fresh buffer, so updating it in place is safe
    return s, e, z


@kernel("Softmax")
def softmax(xp: Any, attrs: dict[str, Any]) -> Fn:
    axis = attrs["axis"]

    def run(x: Any) -> Any:
        e = xp.exp(x - x.max(axis=axis, keepdims=True))
        e /= e.sum(axis=axis, keepdims=True)
        return e

    return run


@kernel("SoftmaxGrad")
def softmax_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    axis = attrs["axis"]
    return lambda dy, y: y * (dy - (dy * y).sum(axis=axis, keepdims=True))


@kernel("LogSoftmax")
def log_softmax(xp: Any, attrs: dict[str, Any]) -> Fn:
    axis = attrs["axis"]
    return lambda x: _log_softmax(xp, x, axis)[0]


@kernel("LogSoftmaxGrad")
def log_softmax_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    axis = attrs["axis"]
    return lambda dy, y: dy - xp.exp(y) * dy.sum(axis=axis, keepdims=True)


@kernel("SoftmaxCrossEntropyWithLogits")
def softmax_xent(xp: Any, attrs: dict[str, Any]) -> Fn:
    def run(logits: Any, labels: Any) -> tuple[Any, Any]:
        log_p, e, z = _log_softmax(xp, logits, 1)
        loss = -(labels * log_p).sum(axis=1)
        e /= z
        # d/dlogits of -sum(l * log p) is p * sum(l) - l; TensorFlow's p - l assumes rows sum to 1.
        backprop = e * labels.sum(axis=1, keepdims=True) - labels
        return loss, backprop

    return run


@kernel("SparseSoftmaxCrossEntropyWithLogits")
def sparse_softmax_xent(xp: Any, attrs: dict[str, Any]) -> Fn:
    def run(logits: Any, labels: Any, into: bool = False) -> tuple[Any, Any]:
        n, c = logits.shape
        _check_labels(xp, labels, c)
        # Four passes over the (n, c) logits (shift, exp, sum, scale), all in one buffer: the loss
        # needs log p only at the labels, and the one-hot is n scattered subtractions. The label
        # entries get the same float operations as the full log-softmax would give them.
        rows = xp.arange(n)
        idx = labels.astype("int64")
        e = xp.subtract(logits, logits.max(axis=1, keepdims=True), out=logits if into else None)
        shifted = e[rows, idx]
        xp.exp(e, out=e)
        z = e.sum(axis=1, keepdims=True)
        loss = -(shifted - xp.log(z)[:, 0])
        e /= z
        e[rows, idx] -= 1.0
        return loss, e

    return run


def _check_labels(xp: Any, labels: Any, c: int) -> None:
    # A bad label would index out of bounds (or wrap, for -1): say which one. On a GPU this
    # check costs one device-to-host sync per step, a price worth a clear error -- except inside a
    # captured CUDA graph, where no host read can happen: there the uncaptured first step checked
    # the labels, later ones are not checked (cupy's indexing wraps an out-of-range index).
    if getattr(xp, "is_capturing", None) is not None and xp.is_capturing():
        return
    bad = (labels < 0) | (labels >= c)
    if bool(bad.any()):
        i = int(xp.argmax(bad))
        raise ValueError(f"label {int(labels[i])} (example {i}) is out of range for {c} classes: "
                         f"labels must be in [0, {c})")


# Elements per block of rows in the CPU softmax cross-entropy: the block's max, shift, exp, sum
# and scale run while it sits in the core's L2 cache (1 MiB), so the [n, c] logits cross memory
# twice (read, and the backprop written) instead of once per pass (measured, lstm_lm's
# [700, 10000] logits on this 2-core VM: 8-10 ms against 57 ms in whole-array passes).
_XENT_BLOCK = 1 << 18


@kernel("SparseSoftmaxCrossEntropyWithLogits", device_types=("cpu",))
def sparse_softmax_xent_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    def run(logits: Any, labels: Any, into: bool = False) -> tuple[Any, Any]:
        n, c = logits.shape
        _check_labels(xp, labels, c)
        at = (xp.arange(n), labels.astype("int64"))
        picked = logits[at]  # read before the blocks below may overwrite them (into)
        e = logits if into else xp.empty_like(logits)
        m = xp.empty((n, 1), dtype=logits.dtype)
        z = xp.empty((n, 1), dtype=logits.dtype)
        step = max(1, _XENT_BLOCK // max(c, 1))

        def blocks(run: range) -> None:
            for s in run:
                rows = slice(s * step, (s + 1) * step)
                b = e[rows]
                xp.max(logits[rows], axis=1, keepdims=True, out=m[rows])
                xp.subtract(logits[rows], m[rows], out=b)
                xp.exp(b, out=b)
                xp.sum(b, axis=1, keepdims=True, out=z[rows])
                b /= z[rows]

        # each row's own passes: the blocks share out over the intra-op threads with the same bits
        intra.for_chunks(-(-n // step), blocks, xp=xp, least=2)
        # The same float operations per element as the whole-array kernel above, so the same bits.
        loss = -((picked - m[:, 0]) - xp.log(z)[:, 0])
        e[at] -= 1.0
        return loss, e

    return run


# In place (registry.INTO): the gradient (output 1) written over the logits, which the loss no
# longer needs once it has read them: one (n, c) buffer where there were two (NMT: 293 MB).
@into("SparseSoftmaxCrossEntropyWithLogits", device_types=("gpu",))
def sparse_softmax_xent_into(xp: Any, attrs: dict[str, Any]) -> Fn:
    run = sparse_softmax_xent(xp, attrs)
    return lambda k, logits, labels: run(logits, labels, into=True)


@into("SparseSoftmaxCrossEntropyWithLogits", device_types=("cpu",))
def sparse_softmax_xent_cpu_into(xp: Any, attrs: dict[str, Any]) -> Fn:
    run = sparse_softmax_xent_cpu(xp, attrs)
    return lambda k, logits, labels: run(logits, labels, into=True)


@kernel("XentGrad")
def xent_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda dy, m: dy[:, None] * m


@into("XentGrad")
def xent_grad_into(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda k, dy, m: xp.multiply(dy[:, None], m, out=m)


# BiasSparseXent and XentGradBias (ops/nn.py; made by engine/xent_bias.py): the reference runs the
# kernels of the pair it replaces one after the other, so it is the pair to the bit. The logits
# it biases are its own buffer (a fresh sum, or x itself in place), which the loss then overwrites
# with its gradient as SparseSoftmaxCrossEntropyWithLogits's in-place kernel does.
def _bias_xent(xent: Fn) -> Callable[[Any, dict[str, Any]], Fn]:
    def factory(xp: Any, attrs: dict[str, Any]) -> Fn:
        run = xent(xp, attrs)
        return lambda x, b, labels: run(xp.add(x, b), labels, into=True)
    return factory


def _bias_xent_into(xent: Fn) -> Callable[[Any, dict[str, Any]], Fn]:
    def factory(xp: Any, attrs: dict[str, Any]) -> Fn:
        run = xent(xp, attrs)
        return lambda k, x, b, labels: run(xp.add(x, b, out=x), labels, into=True)
    return factory


kernel("BiasSparseXent")(_bias_xent(sparse_softmax_xent))
kernel("BiasSparseXent", device_types=("cpu",))(_bias_xent(sparse_softmax_xent_cpu))
into("BiasSparseXent", device_types=("gpu",))(_bias_xent_into(sparse_softmax_xent))
into("BiasSparseXent", device_types=("cpu",))(_bias_xent_into(sparse_softmax_xent_cpu))


@kernel("XentGradBias")
def xent_grad_bias(xp: Any, attrs: dict[str, Any]) -> Fn:
    def run(dy: Any, m: Any) -> tuple[Any, Any]:
        g = dy[:, None] * m
        return g, g.sum(axis=0)
    return run


@into("XentGradBias")
def xent_grad_bias_into(xp: Any, attrs: dict[str, Any]) -> Fn:
    def run(k: int, dy: Any, m: Any) -> tuple[Any, Any]:
        g = xp.multiply(dy[:, None], m, out=m)
        return g, g.sum(axis=0)
    return run


@kernel("BiasAdd")
def bias_add(xp: Any, attrs: dict[str, Any]) -> Fn:
    return xp.add  # bias broadcasts over the last axis by numpy's rules


@into("BiasAdd")
def bias_add_into(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda k, x, b: xp.add(x, b, out=x)


@kernel("BiasAddGrad")
def bias_add_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda dy: dy.sum(axis=tuple(range(dy.ndim - 1)))


def _channel_dot(xp: Any, a: Any, b: Any) -> Any:
    """Per-channel sum of a * b over every axis but the last, without an (M, C) temporary: one
    pass (measured, 9,800 x 288 float32, one thread: 0.8 ms against 2.9-4.7 ms for (a*b).sum(0))."""
    c = a.shape[-1]
    if xp is not np:  # cupy's einsum may go through its own cuBLAS, which a CUDA-graph capture refuses
        return (a.reshape(-1, c) * b.reshape(-1, c)).sum(axis=0)
    return xp.einsum("ij,ij->j", a.reshape(-1, c), b.reshape(-1, c))


def _pieces(m: int, c: int, elements: int | None) -> list[slice]:
    """Runs of rows of an (m, c) matrix holding about `elements` values each (None: one run)."""
    if elements is None:
        return [slice(0, m)]
    step = max(1, elements // max(1, c))
    return [slice(a, min(m, a + step)) for a in range(0, m, step)]


def _column_sums(xp: Any, a: Any) -> Any:
    """Sums down the columns of a (rows, C) matrix as a matrix-vector product: one read of `a`
    (measured, 11M float32 values, one thread: 1.5 ms against 6.6 ms for a.sum(axis=0))."""
    return xp.matmul(xp.ones(a.shape[0], dtype=a.dtype), a)


def batch_norm_forward(xp: Any, x: Any, scale: Any, offset: Any, eps: float, relu: bool,
                       elements: int | None = None) -> tuple[Any, Any, Any]:
    """(y, mean, biased variance) over every axis but the last; y = max(0, .) when `relu`. Three
    reads of x and one write of y: the centred values of each run of rows live only in a
    run-sized buffer (in cache on CPU), the scale, shift and ReLU are applied in place on y.
    Runs of pieces go to the intra-op threads; the per-piece sums are added in piece order."""
    c = x.shape[-1]
    x2 = x.reshape(-1, c)
    m = x2.shape[0]
    mean = _column_sums(xp, x2) / m
    pieces = _pieces(m, c, elements)
    y = xp.empty(x.shape, dtype=x.dtype)
    y2 = y.reshape(-1, c)
    # In one piece (all of x in cache, or a GPU) the centred values are kept in y; over several
    # they are made again per piece, which costs less than writing and re-reading them.
    whole = len(pieces) == 1

    def squares(run: range) -> list[Any]:
        out = []
        for p in pieces[run.start:run.stop]:
            d = xp.subtract(x2[p], mean, out=y2[p]) if whole else x2[p] - mean
            out.append(_channel_dot(xp, d, d))
        return out

    var = xp.zeros(c, dtype=x.dtype)
    for part in intra.for_chunks(len(pieces), squares, xp=xp, least=PARALLEL_BN_PIECES):
        for v in part:
            var += v
    var /= m
    a = scale / xp.sqrt(var + eps)

    def normalise(run: range) -> None:
        for p in pieces[run.start:run.stop]:
            t = y2[p] if whole else xp.subtract(x2[p], mean, out=y2[p])
            t *= a
            t += offset
            if relu:
                xp.maximum(t, 0, out=t)

    intra.for_chunks(len(pieces), normalise, xp=xp, least=PARALLEL_BN_PIECES)
    return y, mean, var


def bn_grad_coefficients(xp: Any, scale: Any, var: Any, eps: float, m: int, dot: Any, doffset: Any,
                         stat_grads: tuple) -> tuple[Any, Any, Any, Any]:
    """(dscale, k, a, b) of dx = k*g + (x - mean)*a + b, from the per-channel sums of g (doffset)
    and of g*(x - mean) (dot) over m rows, plus the statistics' own gradients when they were used
    downstream."""
    rstd = 1.0 / xp.sqrt(var + eps)
    dscale = dot * rstd
    k = scale * rstd
    a = -k * rstd * dscale / m
    b = -k * doffset / m
    if stat_grads:  # the batch statistics were themselves used downstream
        dmean, dvar = stat_grads
        a = a + 2.0 / m * dvar
        b = b + dmean / m
    return dscale, k, a, b


def batch_norm_grad(xp: Any, dy: Any, x: Any, scale: Any, mean: Any, var: Any, y: Any | None,
                    stat_grads: tuple, eps: float, elements: int | None = None) -> tuple[Any, Any, Any]:
    """(dx, dscale, doffset). With `y` (the forward output after a fused ReLU) dy is first masked
    where y was clipped. dx = scale*rstd * (g - mean(g) - xhat * mean(g*xhat)), xhat = (x - mean)
    * rstd, g the masked dy: the normalisation's Jacobian including the paths through the batch
    mean and variance, written as k*g + (x - mean)*a + b per channel, plus the statistics' own
    gradients (dmean, dvar) when they were used downstream. Pieces as in the forward pass."""
    c = x.shape[-1]
    x2, dy2 = x.reshape(-1, c), dy.reshape(-1, c)
    m = x2.shape[0]
    pieces = _pieces(m, c, elements)
    dx = xp.empty(x.shape, dtype=dy.dtype)
    dx2 = dx.reshape(-1, c)
    g2 = dy2 if y is None else dx2  # the masked dy is kept in dx's buffer until dx overwrites it
    whole = len(pieces) == 1
    kept: list[Any] = []  # one piece: its centred values, still wanted by the second pass

    def sums(run: range) -> list[tuple[Any, Any]]:
        out = []
        for p in pieces[run.start:run.stop]:
            if y is not None:
                # y >= 0 after the ReLU, so sign(y) is its 0/1 mask in y's own dtype (a bool mask
                # times dy goes through a casting loop: measured 6x slower).
                g = xp.sign(y.reshape(-1, c)[p], out=dx2[p])
                g *= dy2[p]
            xc = x2[p] - mean
            if whole:
                kept.append(xc)
            out.append((_column_sums(xp, g2[p]), _channel_dot(xp, g2[p], xc)))
        return out

    doffset = xp.zeros(c, dtype=dy.dtype)
    dot = xp.zeros(c, dtype=dy.dtype)
    for part in intra.for_chunks(len(pieces), sums, xp=xp, least=PARALLEL_BN_PIECES):
        for s_off, s_dot in part:
            doffset += s_off
            dot += s_dot
    dscale, k, a, b = bn_grad_coefficients(xp, scale, var, eps, m, dot, doffset, stat_grads)

    def apply(run: range) -> None:
        for p in pieces[run.start:run.stop]:
            t = kept[0] if whole else x2[p] - mean
            t *= a
            t += b
            xp.multiply(g2[p], k, out=dx2[p])
            dx2[p] += t

    intra.for_chunks(len(pieces), apply, xp=xp, least=PARALLEL_BN_PIECES)
    return dx, dscale, doffset


@kernel("FusedBatchNorm")
def fused_batch_norm(xp: Any, attrs: dict[str, Any]) -> Fn:
    eps, relu = attrs["epsilon"], attrs["activation"] == "relu"
    return lambda x, scale, offset: batch_norm_forward(xp, x, scale, offset, eps, relu)


def _bn_grad_args(relu: bool, rest: tuple) -> tuple[Any, tuple]:
    """(y or None, (dmean, dvar) or ()) from the inputs after var: y comes first when ReLU is fused."""
    return (rest[0], rest[1:]) if relu else (None, rest)


@kernel("FusedBatchNormGrad")
def fused_batch_norm_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    eps, relu = attrs["epsilon"], attrs["activation"] == "relu"

    def run(dy: Any, x: Any, scale: Any, mean: Any, var: Any, *rest: Any) -> tuple[Any, Any, Any]:
        y, stat_grads = _bn_grad_args(relu, rest)
        return batch_norm_grad(xp, dy, x, scale, mean, var, y, stat_grads, eps)

    return run


# On CPU batch norm works on runs of about BN_ELEMENTS values, so the centred values (and the
# mask) of a run are still in cache for the next operation on them. Measured, one thread, batch 8,
# forward + ReLU / gradient + ReluGrad, ms, the unfused kernels whole -> these: 147x147x64
# 43 -> 33 / 67 -> 49; 73x73x80 11.7 -> 9.6 / 20 -> 16; 35x35x288 6.3 -> 4.4 / 13 -> 11.
# Per-channel broadcasting ops run at ~15 GB/s in cache against ~45 for same-shape ones, which
# is what is left of the time.
BN_ELEMENTS = 1 << 17
PARALLEL_BN_PIECES = 32


@kernel("FusedBatchNorm", device_types=("cpu",))
def fused_batch_norm_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    eps, relu = attrs["epsilon"], attrs["activation"] == "relu"
    return lambda x, scale, offset: batch_norm_forward(xp, x, scale, offset, eps, relu, BN_ELEMENTS)


@kernel("FusedBatchNormGrad", device_types=("cpu",))
def fused_batch_norm_grad_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    eps, relu = attrs["epsilon"], attrs["activation"] == "relu"

    def run(dy: Any, x: Any, scale: Any, mean: Any, var: Any, *rest: Any) -> tuple[Any, Any, Any]:
        y, stat_grads = _bn_grad_args(relu, rest)
        return batch_norm_grad(xp, dy, x, scale, mean, var, y, stat_grads, eps, BN_ELEMENTS)

    return run


def channel_affine(xp: Any, x: Any, scale: Any, shift: Any, relu: bool, elements: int | None = None) -> Any:
    """relu?(x * scale + shift) over the last axis, one run of rows at a time into the output."""
    c = x.shape[-1]
    x2 = x.reshape(-1, c)
    y = xp.empty(x.shape, dtype=x.dtype)
    y2 = y.reshape(-1, c)
    pieces = _pieces(x2.shape[0], c, elements)

    def apply(run: range) -> None:
        for p in pieces[run.start:run.stop]:
            t = xp.multiply(x2[p], scale, out=y2[p])
            t += shift
            if relu:
                xp.maximum(t, 0, out=t)

    intra.for_chunks(len(pieces), apply, xp=xp, least=PARALLEL_BN_PIECES)
    return y


@kernel("ChannelAffine")
def channel_affine_kernel(xp: Any, attrs: dict[str, Any]) -> Fn:
    relu = attrs["activation"] == "relu"
    return lambda x, scale, shift: channel_affine(xp, x, scale, shift, relu)


@kernel("ChannelAffine", device_types=("cpu",))
def channel_affine_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    relu = attrs["activation"] == "relu"
    return lambda x, scale, shift: channel_affine(xp, x, scale, shift, relu, BN_ELEMENTS)


# FusedConv2D(x, f, scale, shift) = ChannelAffine(Conv2D(x, f), scale, shift): the CPU plan's
# pass (engine/conv_affine.py) makes it of the pair. The reference runs the two kernels one after
# the other, so it is the unfused pair to the bit; the compiled variants (kernels/cpu/conv.py)
# apply the affine to each piece of the output as the convolution makes it.
@kernel("FusedConv2D")
def fused_conv2d_kernel(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding, relu = attrs["strides"], attrs["padding"], attrs["activation"] == "relu"
    return lambda x, f, scale, shift: channel_affine(xp, conv2d_forward(xp, x, f, strides, padding), scale, shift,
                                                     relu)


@kernel("FusedConv2D", device_types=("cpu",))
def fused_conv2d_cpu(xp: Any, attrs: dict[str, Any]) -> Fn:
    strides, padding, relu = attrs["strides"], attrs["padding"], attrs["activation"] == "relu"
    return lambda x, f, scale, shift: channel_affine(xp, conv2d_forward(xp, x, f, strides, padding, GEMM_ROWS),
                                                     scale, shift, relu, BN_ELEMENTS)


@kernel("Dropout")
def dropout(xp: Any, attrs: dict[str, Any]) -> Fn:
    gen = attrs["_resource"].generator
    rate = attrs["rate"]
    scale = 1.0 / (1.0 - rate)

    def run(x: Any) -> tuple[Any, Any]:
        # Drawn on the host from the node's own stream (cpu and gpu get the same mask); float32
        # uniforms halve the cost of float64 and resolve `rate` to 2**-24, far finer than needed.
        keep = gen.random(tuple(x.shape), dtype="float32") >= rate
        mask = xp.asarray(keep).astype(x.dtype)
        mask *= scale
        return x * mask, mask

    return run
