"""The CPU kernels that make the lstm_lm training step fast, against the whole-array kernels they
stand in for and float64 references: the blocked softmax cross-entropy, the fused SGD update and
the clipping sums (see also tests/test_optimizers.py)."""
from __future__ import annotations

import numpy as np
import pytest

from flowctl.kernels import nn as nn_kernels
from flowctl.kernels.registry import bind


@pytest.mark.parametrize("shape", [(300, 3000), (7, 5), (0, 4)])
def test_blocked_sparse_xent_equals_the_whole_array_kernel_bit_for_bit(shape, rng):
    n, c = shape
    logits = (3.0 * rng.standard_normal(shape)).astype(np.float32)
    labels = rng.integers(0, c, n).astype(np.int32)
    blocked = bind("SparseSoftmaxCrossEntropyWithLogits", "cpu", {})
    whole = nn_kernels.sparse_softmax_xent(np, {})
    assert blocked is not whole
    (l1, g1), (l2, g2) = blocked(logits, labels), whole(logits, labels)
    np.testing.assert_array_equal(l1, l2)
    np.testing.assert_array_equal(g1, g2)
    # and against float64: loss = logsumexp - logit at the label; backprop = softmax - one-hot
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1) if n else np.zeros(0)
    np.testing.assert_allclose(l1, lse - x[np.arange(n), labels], rtol=1e-5, atol=1e-5)
    p = np.exp(x - x.max(1, keepdims=True)) if n else x
    p = p / p.sum(1, keepdims=True) if n else p
    p[np.arange(n), labels] -= 1.0
    np.testing.assert_allclose(g1, p, atol=1e-6)


def test_blocked_sparse_xent_names_a_bad_label():
    run = bind("SparseSoftmaxCrossEntropyWithLogits", "cpu", {})
    with pytest.raises(ValueError, match="label 5 .example 1. is out of range for 4 classes"):
        run(np.zeros((2, 4), np.float32), np.array([0, 5], np.int32))


def _dense(ids, rows, shape):
    out = np.zeros(shape, rows.dtype)
    out[ids] = rows
    return out


@pytest.mark.parametrize("device_kernel", ["cpu", "generic"])
def test_gather_grad_rows_are_the_dense_gradient_rows(device_kernel, rng):
    from flowctl.kernels import training as tk

    params = np.zeros((50, 3, 2), np.float32)
    indices = np.array([[4, -1, 7], [4, 4, 0]], np.int32)  # repeats, and -1 is row 49
    dy = rng.standard_normal((2, 3, 3, 2)).astype(np.float32)
    run = bind("GatherGradRows", "cpu", {}) if device_kernel == "cpu" else tk.gather_grad_rows(np, {})
    ids, rows = run(dy, indices, params)
    assert ids.dtype == np.int64 and list(ids) == [0, 4, 7, 49] and rows.shape == (4, 3, 2)
    want = np.zeros(params.shape, np.float64)
    np.add.at(want, indices.reshape(-1) % 50, dy.reshape(6, 3, 2).astype(np.float64))
    np.testing.assert_allclose(_dense(ids, rows, params.shape), want, rtol=1e-6)
    if device_kernel == "cpu":  # the same sums as GatherGrad's CPU kernel, to the bit
        dense = bind("GatherGrad", "cpu", {"axis": 0})(dy, indices, params)
        np.testing.assert_array_equal(_dense(ids, rows, params.shape), dense)
    ids0, rows0 = run(np.zeros((0, 3, 2), np.float32), np.zeros(0, np.int32), params)
    assert ids0.shape == (0,) and rows0.shape == (0, 3, 2)


def _embedding_problem(sparse: bool, steps: int = 3):
    """sum(gather(table, ids) * w) under SGD with clipping, three steps; `sparse` False forces the
    dense path by handing the optimizer the gradient through an Identity."""
    import flowctl as fc
    from flowctl.engine.optimizers import SGD, clip_by_global_norm

    rng = np.random.default_rng(3)
    table0, w0 = rng.normal(size=(30, 4)), rng.normal(size=(5, 4))
    ids = np.array([3, 7, 3, 29, 0], np.int32)
    g = fc.Graph()
    with g.as_default():
        table = fc.variable(table0, name="table")
        w = fc.variable(w0, name="w")
        x = fc.placeholder("int32", (5,), name="ids")
        loss = fc.reduce_sum(fc.square(fc.gather(table, x) * w))
        opt = SGD(0.05)
        gv = opt.compute_gradients(loss)
        grads = [gr if sparse else fc.identity(gr) for gr, _ in gv]
        clipped, _ = clip_by_global_norm(grads, 0.5)
        train = opt.apply_gradients(list(zip(clipped, [v for _, v in gv])))
        init = fc.global_variables_initializer()
    sess = fc.Session(g, store=fc.ContainerStore())
    sess.run(init)
    for _ in range(steps):
        sess.run(train, {x: ids})
    return g, sess.run([table, w]), (table0, w0, ids)


def test_sparse_embedding_update_matches_the_dense_one_and_float64_numpy():
    g, (t_sparse, w_sparse), (table, w, ids) = _embedding_problem(sparse=True)
    ops = {n.op for n in g.nodes.values()}
    assert {"GatherGradRows", "SparseApplyGradientDescent"} <= ops
    _, (t_dense, w_dense), _ = _embedding_problem(sparse=False)
    np.testing.assert_allclose(t_sparse, t_dense, rtol=1e-13)
    np.testing.assert_allclose(w_sparse, w_dense, rtol=1e-13)
    for _ in range(3):  # the same three steps by hand
        e = table[ids]
        ge, gw = 2 * e * w * w, 2 * e * e * w  # of sum((e w)^2)
        gt = np.zeros_like(table)
        np.add.at(gt, ids, ge)
        norm = np.sqrt((gt ** 2).sum() + (gw ** 2).sum())
        s = 0.5 / max(norm, 0.5)
        table, w = table - 0.05 * s * gt, w - 0.05 * s * gw
    np.testing.assert_allclose(t_sparse, table, rtol=1e-12)
    np.testing.assert_allclose(w_sparse, w, rtol=1e-12)


@pytest.mark.gpu
def test_gpu_training_kernels_match_cpu(rng):
    import cupy as cp  # type: ignore[import-not-found]

    x = rng.standard_normal((300, 700)).astype(np.float32)
    half_cpu = bind("L2Loss", "cpu", {})(x)
    np.testing.assert_allclose(cp.asnumpy(bind("L2Loss", "gpu", {})(cp.asarray(x))), half_cpu, rtol=1e-5)
    params = np.zeros((40, 6), np.float32)
    idx = np.array([3, 9, 3, -1, 0], np.int32)
    dy = rng.standard_normal((5, 6)).astype(np.float32)
    ids_c, rows_c = bind("GatherGradRows", "cpu", {})(dy, idx, params)
    ids_g, rows_g = bind("GatherGradRows", "gpu", {})(cp.asarray(dy), cp.asarray(idx), cp.asarray(params))
    # The GPU's rows have a fixed size (every index, sorted; a run's sum at its first position and
    # zeros after it: no data-dependent size, so a step can be captured): the same gradient.
    dense_c, dense_g = np.zeros_like(params), np.zeros_like(params)
    np.add.at(dense_c, ids_c, rows_c)
    np.add.at(dense_g, cp.asnumpy(ids_g), cp.asnumpy(rows_g))
    np.testing.assert_array_equal(dense_g, dense_c)
    logits = rng.standard_normal((8, 30)).astype(np.float32)
    labels = rng.integers(0, 30, 8).astype(np.int32)
    for got, want in zip(bind("SparseSoftmaxCrossEntropyWithLogits", "gpu", {})(cp.asarray(logits), cp.asarray(labels)),
                         bind("SparseSoftmaxCrossEntropyWithLogits", "cpu", {})(logits, labels)):
        np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-5, atol=1e-6)


def test_the_cpu_sparse_update_takes_a_gpus_rows_with_repeated_ids(rng):
    """A GPU's GatherGradRows has a fixed size: every index, sorted, each run's sum at its first
    position and zeros after it. Placed on a CPU, the sparse update must apply each run once."""
    from flowctl.engine.container import VariableSlot

    params = rng.standard_normal((10, 3)).astype(np.float32)
    idx = np.array([4, 1, 4, 4, 7], np.int32)
    dy = rng.standard_normal((5, 3)).astype(np.float32)
    ids, rows = bind("GatherGradRows", "cpu", {})(dy, idx, params)
    order = np.argsort(idx, kind="stable")
    fixed_ids = idx[order].astype(np.int64)
    fixed_rows = np.zeros((5, 3), np.float32)
    for p, i in enumerate(fixed_ids):
        if p == 0 or fixed_ids[p - 1] != i:
            fixed_rows[p] = rows[list(ids).index(i)]
    want, got = VariableSlot("w"), VariableSlot("w")
    want.value, got.value = params.copy(), params.copy()
    alpha = np.asarray(0.5, np.float32)
    bind("SparseApplyGradientDescent", "cpu", {"_resource": want})(alpha, ids, rows)
    bind("SparseApplyGradientDescent", "cpu", {"_resource": got})(alpha, fixed_ids, fixed_rows)
    np.testing.assert_array_equal(got.value, want.value)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("axis", [0, 1])
def test_run_sums_are_reduceats_bits(dtype, axis, rng):
    """The embedding gradients' run sums (GatherGrad and GatherGradRows on the CPU) equal
    np.add.reduceat to the bit, whatever the runs' lengths: single rows, short runs summed together,
    runs past the short limit (reduceat's pairwise sum of the rest) summed by reduceat."""
    from flowctl.kernels.array import _SHORT_RUN, run_sums

    lengths = rng.permutation(np.array([1] * 20 + list(range(2, _SHORT_RUN + 3)) + [17, 40, 200]))
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.intp)
    n = int(lengths.sum())
    shape = (n, 7) if axis == 0 else (3, n, 5)
    scale = 10.0 ** rng.uniform(-4, 4, size=(n, 1) if axis == 0 else (1, n, 1))
    x = (rng.standard_normal(shape) * scale).astype(dtype)
    want = np.add.reduceat(x, starts, axis=axis)
    got = run_sums(x, starts, axis)
    assert got.dtype == x.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    # a plain left-to-right sum differs somewhere: the test can tell the orders apart
    seq = np.stack([np.sum(np.moveaxis(x, axis, 0)[s:s + k], axis=0) if k < 3 else
                    _left_to_right(np.moveaxis(x, axis, 0)[s:s + k]) for s, k in zip(starts, lengths)])
    assert not np.array_equal(np.moveaxis(seq, 0, axis), want)


def _left_to_right(rows):
    acc = rows[0].copy()
    for r in rows[1:]:
        acc = acc + r
    return acc
