"""Neural-network kernels (softmax family, cross-entropies, BiasAdd, batch norm, Dropout), written
once against the array module `xp`. Every softmax subtracts the row maximum first, so exp never
overflows whatever the logits."""
from __future__ import annotations

from typing import Any, Callable

from flowctl.kernels.registry import kernel

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
    def run(logits: Any, labels: Any) -> tuple[Any, Any]:
        n, c = logits.shape
        _check_labels(xp, labels, c)
        # Four passes over the (n, c) logits (shift, exp, sum, scale), all in one buffer: the loss
        # needs log p only at the labels, and the one-hot is n scattered subtractions. The label
        # entries get the same float operations as the full log-softmax would give them.
        rows = xp.arange(n)
        idx = labels.astype("int64")
        e = logits - logits.max(axis=1, keepdims=True)
        shifted = e[rows, idx]
        xp.exp(e, out=e)
        z = e.sum(axis=1, keepdims=True)
        loss = -(shifted - xp.log(z)[:, 0])
        e /= z
        e[rows, idx] -= 1.0
        return loss, e

    return run


def _check_labels(xp: Any, labels: Any, c: int) -> None:
    bad = (labels < 0) | (labels >= c)
    # A bad label would index out of bounds (or wrap, for -1): say which one. On a GPU this
    # check costs one device-to-host sync per step, a price worth a clear error.
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
    def run(logits: Any, labels: Any) -> tuple[Any, Any]:
        n, c = logits.shape
        _check_labels(xp, labels, c)
        e = xp.empty_like(logits)
        m = xp.empty((n, 1), dtype=logits.dtype)
        z = xp.empty((n, 1), dtype=logits.dtype)
        step = max(1, _XENT_BLOCK // max(c, 1))
        for s in range(0, n, step):
            rows = slice(s, s + step)
            b = e[rows]
            xp.max(logits[rows], axis=1, keepdims=True, out=m[rows])
            xp.subtract(logits[rows], m[rows], out=b)
            xp.exp(b, out=b)
            xp.sum(b, axis=1, keepdims=True, out=z[rows])
            b /= z[rows]
        # The same float operations per element as the whole-array kernel below, so the same bits.
        at = (xp.arange(n), labels.astype("int64"))
        loss = -((logits[at] - m[:, 0]) - xp.log(z)[:, 0])
        e[at] -= 1.0
        return loss, e

    return run


@kernel("XentGrad")
def xent_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda dy, m: dy[:, None] * m


@kernel("BiasAdd")
def bias_add(xp: Any, attrs: dict[str, Any]) -> Fn:
    return xp.add  # bias broadcasts over the last axis by numpy's rules


@kernel("BiasAddGrad")
def bias_add_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    return lambda dy: dy.sum(axis=tuple(range(dy.ndim - 1)))


def _channel_dot(xp: Any, a: Any, b: Any) -> Any:
    """Per-channel sum of a * b over every axis but the last, without an (M, C) temporary: one
    pass (measured, 9,800 x 288 float32, one thread: 0.8 ms against 2.9-4.7 ms for (a*b).sum(0))."""
    c = a.shape[-1]
    return xp.einsum("ij,ij->j", a.reshape(-1, c), b.reshape(-1, c))


@kernel("FusedBatchNorm")
def fused_batch_norm(xp: Any, attrs: dict[str, Any]) -> Fn:
    eps = attrs["epsilon"]

    def run(x: Any, scale: Any, offset: Any) -> tuple[Any, Any, Any]:
        axes = tuple(range(x.ndim - 1))
        m = x.size // x.shape[-1]
        mean = x.mean(axis=axes)
        d = x - mean  # becomes the output: five passes over x's size, one buffer
        var = _channel_dot(xp, d, d) / m
        d *= scale / xp.sqrt(var + eps)
        d += offset
        return d, mean, var

    return run


@kernel("FusedBatchNormGrad")
def fused_batch_norm_grad(xp: Any, attrs: dict[str, Any]) -> Fn:
    eps = attrs["epsilon"]

    def run(dy: Any, x: Any, scale: Any, mean: Any, var: Any, *stat_grads: Any) -> tuple[Any, Any, Any]:
        axes = tuple(range(x.ndim - 1))
        m = x.size // x.shape[-1]  # elements per channel
        rstd = 1.0 / xp.sqrt(var + eps)
        xc = x - mean
        doffset = dy.sum(axis=axes)
        dscale = _channel_dot(xp, dy, xc) * rstd
        # dx = scale*rstd * (dy - mean(dy) - xhat * mean(dy*xhat)), xhat = xc * rstd: the
        # normalisation's Jacobian, including the paths through the batch mean and variance,
        # as k dy + (xc a + b) per channel, in one more buffer.
        k = scale * rstd
        if stat_grads:  # the batch statistics were themselves used downstream
            dmean, dvar = stat_grads
            extra = xc * (2.0 / m * dvar) + dmean / m
        xc *= -k * rstd * dscale / m
        xc -= k * doffset / m
        dx = dy * k
        dx += xc
        if stat_grads:
            dx += extra
        return dx, dscale, doffset

    return run


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
