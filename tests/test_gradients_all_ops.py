"""Every differentiable op's gradient against central finite differences, in float64.

The cases below are composites (one graph exercises many ops) plus second-order cases, which push
the fused gradient ops (ReluGrad, Conv2DBackpropInput, ...) through their own gradient functions.
The last test fails if any op registered as differentiable was never differentiated here: adding
an op without a gradient check breaks the suite.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine import autodiff
from flowctl.engine.control_flow import cond, while_loop
from flowctl.engine.ops.control import acc_push, acc_stack, accumulator
from flowctl.engine.gradcheck import check_gradients
from flowctl.engine.ops.api import make1
from flowctl.engine.opdef import OPS

R = np.random.default_rng(42)
EXERCISED: set[str] = set()


def arr(*shape: int, lo: float = -1.5, hi: float = 1.5) -> np.ndarray:
    return R.uniform(lo, hi, size=shape)


def pos(*shape: int) -> np.ndarray:
    return R.uniform(0.4, 1.6, size=shape)


def second_order(fwd: Callable[..., fc.Tensor], wrt: str = "x") -> Callable[..., fc.Tensor]:
    """(inputs..., dy) -> d<fwd, dy>/d<wrt>: its gradient runs the fused gradient ops' own rules."""
    def build(dy: fc.Tensor, **xs: fc.Tensor) -> fc.Tensor:
        y = fwd(**xs)
        return fc.gradients(y, [xs[wrt]], grad_ys=[dy])[0]
    return build


def _elementwise(a, b, c):
    terms = [
        fc.abs_(a) + b, fc.exp(a) - fc.log(c), fc.sqrt(c) * fc.rsqrt(c + 1.0), fc.pow_(c, b) / (c + 2.0),
        fc.maximum(a, b), fc.minimum(a, b), fc.neg(fc.square(a)), fc.sigmoid(a) * fc.tanh(b),
        fc.relu(a), fc.select(fc.greater(a, b), a * 2.0, b), fc.cast(a, "float64") * fc.sign(b),
        fc.check_numerics(fc.identity(c)),
    ]
    return fc.add_n(terms)


def _array(x, y, p):
    cat = fc.concat([x, y], axis=1)                                  # (2, 7)
    s1, s2 = fc.split(cat, [3, 4], axis=1)
    sl = fc.slice_(fc.pad(s2, [[1, 0], [0, 2]]), [0, 1], [3, 4])      # (3, 4)
    t = fc.transpose(fc.tile(s1, [1, 2]), [1, 0])                     # (6, 2)
    r = fc.squeeze(fc.expand_dims(fc.reshape(t, [3, 4]), 0), [0])    # (3, 4)
    st = fc.stack([sl, r], axis=0)                                   # (2, 3, 4)
    u0, u1 = fc.unstack(st, axis=0)
    g = fc.gather(p, fc.constant(np.array([2, 0, 2], np.int32)), axis=0)  # (3, 4)
    return u0 * u1 + g


def _matrix(a, b, m):
    mm = (fc.reduce_sum(fc.matmul(a, fc.transpose(b))) + fc.reduce_sum(fc.matmul(a, b, transpose_a=True))
          + fc.reduce_sum(fc.matmul(a, b, transpose_b=True))
          + fc.reduce_sum(fc.matmul(a, fc.transpose(b), transpose_a=True, transpose_b=True)))
    bm = fc.batch_matmul(fc.stack([m, m * 2.0]), fc.stack([m, m]), adj_y=True)
    inv = fc.matrix_inverse(m + fc.constant(np.eye(3) * 3.0))
    det = fc.matrix_determinant(m + fc.constant(np.eye(3) * 2.0))
    return fc.reduce_sum(mm) + fc.reduce_sum(bm) + fc.reduce_sum(inv) + det


def _reductions(x):
    return [fc.reduce_sum(x, axis=1), fc.reduce_mean(x, axis=[0, 2], keepdims=True), fc.reduce_max(x, axis=-1),
            fc.reduce_min(x, axis=[0, 1]), fc.reduce_prod(x + 0.5, axis=[0, 2], keepdims=True), fc.reduce_prod(x)]


def _nn(logits, labels_dense, x4, scale, offset, bias):
    sparse = fc.constant(np.array([1, 0, 3], np.int32))
    xent = fc.softmax_cross_entropy(logits, fc.softmax(labels_dense))
    sxent = fc.sparse_softmax_cross_entropy(logits, sparse)
    y, _mean, _var = fc.fused_batch_norm(x4, scale, offset)
    return [xent + sxent, fc.log_softmax(logits) * 0.3, y, fc.bias_add(x4, bias)]


def _conv(x, f):
    y = fc.conv2d(x, f, strides=(2, 2), padding="SAME")
    return [fc.max_pool(y, (2, 2), (1, 1), "VALID"), fc.avg_pool(y, (3, 3), (2, 2), "SAME")]


def _math(a, b, c):
    # a's entries sit away from integers and from the jumps of mod(a, c), where rounding and the
    # remainders are differentiable (with derivative 0 and 1 and -floor(a / c) or -trunc(a / c)).
    return [fc.floor(a) * a + fc.ceil(a) * b + fc.round_(a * 0.5) * c, fc.mod(a, c), fc.truncatemod(a, c),
            fc.erf(a) + fc.gelu(b), fc.sin(a) * fc.cos(b)]


def _scan_select(x, p, u):
    idx = fc.constant(np.array([[0, 1], [2, 0], [0, 1]], np.int32))
    return [fc.cumsum(x, axis=1), fc.cumsum(x, axis=0, exclusive=True, reverse=True), fc.top_k(x, 2)[0],
            fc.gather_nd(p, idx), fc.scatter_nd(idx, u, (3, 2, 4)), fc.reduce_sum(fc.top_k(x, 3)[0])]


def _einsum(a, b, v):
    return [fc.einsum("ij,jk->ik", a, b), fc.einsum("ij,jk,k->i", a, b, v), fc.einsum("ij->", a),
            fc.einsum("ij,k->jk", a, v), fc.einsum("ij", a)]


def _control(x, w):
    zero = fc.constant(0.0, dtype="float64")
    y = cond(fc.greater(fc.reduce_sum(x), zero), lambda: fc.tanh(x) * 2.0, lambda: x * x)

    def body(i, h, acc):
        h2 = cond(fc.less(fc.reduce_sum(h), zero), lambda: h * 0.5, lambda: fc.tanh(fc.matmul(h, w)))
        return i + 1, h2, acc_push(acc, h2 * h2)

    _, h, acc = while_loop(lambda i, h, a: fc.less(i, fc.constant(3, dtype="int32")), body,
                           [fc.constant(0, dtype="int32"), y, accumulator()])
    return [h, acc_stack(acc, y)]


CASES: dict[str, tuple[Callable[..., Any], dict[str, np.ndarray], dict[str, Any]]] = {
    "elementwise": (_elementwise, {"a": arr(2, 3), "b": arr(3), "c": pos(2, 3)}, {}),
    "array": (_array, {"x": arr(2, 3), "y": arr(2, 4), "p": arr(4, 4)}, {}),
    "matrix": (_matrix, {"a": arr(2, 3), "b": arr(2, 3), "m": arr(3, 3)}, {}),
    "reductions": (_reductions, {"x": R.permutation(24).reshape(2, 3, 4) * 0.1}, {}),
    "nn": (_nn, {"logits": arr(3, 4), "labels_dense": arr(3, 4), "x4": arr(2, 2, 2, 3), "scale": pos(3),
                 "offset": arr(3), "bias": arr(3)}, {"rtol": 1e-4}),
    "control_flow": (_control, {"x": arr(2, 3), "w": arr(3, 3)}, {}),  # Switch, Merge; loops as units
    # the LSTM step ops: both LSTMBlockCell forms (from a state; the first step, zero state),
    # RecurrentMatMul in both forms (dh transposed; dh from w's given transpose) and TransposeCopy
    "recurrent": (lambda xw, h, w, c: [*fc.lstm_block_cell(xw, fc.recurrent_matmul(h, w, fc.transpose(w)), c,
                                                           forget_bias=0.5), fc.lstm_block_cell(xw)[1],
                                        fc.transpose_copy(w) * 0.5, fc.recurrent_matmul(h * 0.5, w) * 0.25],
                  {"xw": arr(2, 8), "h": arr(2, 3), "w": arr(3, 8), "c": arr(2, 2)}, {}),
    # inference batch norm's one pass, with and without its ReLU (x chosen so x*s + b keeps clear of
    # the ReLU's kink: outputs of either sign at least 0.2 from it)
    "channel_affine": (lambda x, s, b: [make1("ChannelAffine", [x, s, b], {"activation": "relu"}),
                                        make1("ChannelAffine", [x, s, b]) * 0.5],
                       {"x": (np.where(R.random((2, 3, 3)) < 0.5, -1.0, 1.0) * R.uniform(0.2, 1.5, (2, 3, 3))
                              - np.array([0.3, -0.2, 0.1])) / np.array([0.8, 1.3, 0.6]),
                        "s": np.array([0.8, 1.3, 0.6]), "b": np.array([0.3, -0.2, 0.1])}, {}),
    # the training ops' differentiable one (L2Loss), over a matrix and over more than one block
    "training": (lambda x, v: [fc.l2_loss(x), fc.l2_loss(v) * 0.25],
                 {"x": arr(2, 3), "v": arr(70000)}, {}),
    "conv": (_conv, {"x": arr(2, 6, 5, 2), "f": arr(3, 2, 2, 3)}, {"rtol": 1e-4}),
    # unknown dimensions take the run-time-shape gradient ops (ReshapeLike, SplitLike, SliceGrad, ...)
    "unknown_dims": (lambda x, y: [fc.reshape(x, [-1]) * 1.0,
                                   fc.concat([x, y], axis=0) * 1.0,
                                   fc.slice_(x, [0, 1], [-1, 2]),
                                   fc.pad(x, [[1, 1], [0, 1]]) * 1.0,
                                   x * fc.reduce_sum(y, axis=0)],
                     {"x": arr(2, 3), "y": arr(3, 3)}, {"shapes": {"x": (None, None), "y": (None, 3)}}),
    # second order: the gradient ops' own gradients
    "second_activations": (second_order(lambda x: fc.relu(x) + fc.sigmoid(x) + fc.tanh(x)),
                           {"x": arr(2, 3), "dy": arr(2, 3)}, {}),
    "second_conv": (second_order(lambda x, f: fc.conv2d(x, f, (1, 1), "SAME"), wrt="f"),
                    {"x": arr(1, 4, 4, 2), "f": arr(2, 3, 2, 2), "dy": arr(1, 4, 4, 2)},
                    {"rtol": 1e-4, "wrt": ["x", "dy"]}),
    "second_conv_input": (second_order(lambda x, f: fc.conv2d(x, f, (2, 2), "VALID"), wrt="x"),
                          {"x": arr(1, 5, 5, 2), "f": arr(3, 3, 2, 2), "dy": arr(1, 2, 2, 2)},
                          {"rtol": 1e-4, "wrt": ["f", "dy"]}),
    "second_avg_pool": (second_order(lambda x: fc.avg_pool(x, (2, 2), (2, 2), "SAME")),
                        {"x": arr(1, 3, 3, 2), "dy": arr(1, 2, 2, 2)}, {"wrt": ["dy"]}),
    "second_bias_reduce": (second_order(lambda x, b: fc.bias_add(x, b) * 2.0 + fc.reduce_mean(x, axis=0), wrt="b"),
                           {"x": arr(3, 2), "b": arr(2), "dy": arr(3, 2)}, {"wrt": ["dy"]}),
    "second_reduce_max": (second_order(lambda x: fc.reduce_max(x, axis=1) * fc.reduce_sum(x, axis=1)),
                          {"x": R.permutation(6).reshape(2, 3) * 0.3, "dy": arr(2)}, {}),
    "second_array": (second_order(lambda x, p: fc.gather(p, fc.constant(np.array([1, 1], np.int32))) *
                                  fc.tile(fc.pad(x, [[0, 0], [1, 0]]), [1, 1]), wrt="p"),
                     {"x": arr(2, 2), "p": arr(3, 3), "dy": arr(2, 3)}, {"wrt": ["x", "dy"]}),
    "second_unknown": (second_order(lambda x, y: fc.concat([fc.reshape(x, [-1, 2]), y], axis=0) * 1.0 +
                                    fc.reduce_sum(fc.slice_(x, [0, 0], [-1, 2]) * x), wrt="x"),
                       {"x": arr(2, 2), "y": arr(3, 2), "dy": arr(5, 2)},
                       {"shapes": {"x": (None, None), "y": (None, None), "dy": (None, None)},
                        "wrt": ["x", "dy"]}),
    "second_tile_pad": (second_order(lambda x: fc.tile(fc.pad(x, [[1, 0], [0, 1]]), [2, 1])),
                        {"x": arr(2, 2), "dy": arr(6, 3)}, {"wrt": ["dy"]}),
    "math": (_math, {"a": R.uniform(0.1, 0.4, (2, 3)) + np.array([[-2.0, 0.0, 1.0]]), "b": arr(3),
                     "c": R.uniform(0.6, 0.9, (2, 3))}, {}),
    # distinct entries of x: top_k has no ties, where its gradient would be a convention
    "scan_select": (_scan_select, {"x": R.permutation(12).reshape(3, 4) * 0.1, "p": arr(3, 2, 4),
                                   "u": arr(3, 4)}, {}),
    "einsum": (_einsum, {"a": arr(2, 3), "b": arr(3, 4), "v": arr(4)}, {}),
    "second_gather_nd": (second_order(lambda p: fc.gather_nd(p, fc.constant(np.array([[1], [1], [0]], np.int32))),
                                      wrt="p"),
                         {"p": arr(2, 3), "dy": arr(3, 3)}, {"wrt": ["dy"], "shapes": {"p": (None, 3)}}),
    "broadcast_like": (lambda x, like: make1("BroadcastLike", [x, like]) * like,
                       {"x": arr(3), "like": arr(2, 3)}, {}),
    "second_broadcast": (second_order(lambda x, y: x * y, wrt="y"),
                         {"x": arr(3, 2), "y": arr(2), "dy": arr(3, 2)},
                         {"shapes": {"x": (None, 2), "dy": (None, 2)}, "wrt": ["x", "dy"]}),
}


@pytest.fixture(autouse=True)
def record(monkeypatch):
    original = autodiff.OpView.__init__

    def spy(self, graph, node):
        EXERCISED.add(node.op)
        original(self, graph, node)

    monkeypatch.setattr(autodiff.OpView, "__init__", spy)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradient(case):
    build, inputs, kw = CASES[case]
    check_gradients(build, inputs, max_elements=30, **kw)


# Dropout draws a fresh mask every run, so finite differences cannot see one function; its gradient
# (exactly dy * mask) is asserted in tests/test_ops_nn.py. FusedElementwise's gradient is an error
# by design (fusion runs after autodiff), asserted in tests/test_fusion.py. RoundBF16 is a rounding
# with a straight-through gradient (a bfloat16 Cast's), which finite differences cannot see; it is
# asserted in tests/test_mixed_precision.py. Nothing else may be exempt.
EXEMPT = {"Dropout", "FusedElementwise", "RoundBF16"}


def test_every_differentiable_op_was_checked():
    EXERCISED.clear()
    for case in CASES:  # independent of test order and selection: the cases take well under a second
        test_gradient(case)
    differentiable = {n for n, d in OPS.items() if d.differentiable and d.grad is not None and d.ref_inputs == ()}
    missing = sorted(differentiable - EXERCISED - EXEMPT - {"Variable"})
    assert not missing, f"differentiable ops with no finite-difference check: {missing}"
