"""NN ops: each kernel against a float64 reference computed another way (explicit loops over
Python lists and the math module), every differentiable op through the finite-difference checker,
the batch-norm moving averages against a hand recurrence, and dropout's gradient against its mask."""
from __future__ import annotations

import math

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.gradcheck import check_gradients


def run(build, graph_seed=0, **inputs):
    g = fc.Graph(seed=graph_seed)
    with g.as_default():
        phs = {k: fc.placeholder(v.dtype.name, v.shape, name=k) for k, v in inputs.items()}
        out = build(**phs)
    return fc.Session(g, store=fc.ContainerStore()).run(out, {phs[k]: v for k, v in inputs.items()})


def ref_softmax_rows(rows):
    """Softmax of each list in `rows`, with math.exp (shifted by the row max, as any sane reference)."""
    out = []
    for r in rows:
        m = max(r)
        e = [math.exp(v - m) for v in r]
        s = math.fsum(e)
        out.append([v / s for v in e])
    return out


def ref_log_softmax_rows(rows):
    """log softmax as (v - max) - log(sum exp(v - max)): log of a probability near 1 loses digits."""
    out = []
    for r in rows:
        m = max(r)
        lse = math.log(math.fsum(math.exp(v - m) for v in r))
        out.append([v - m - lse for v in r])
    return out


def _rows_along(x, axis):
    """x's 1-D slices along `axis`, as lists, in the order of np.moveaxis(x, axis, -1)."""
    return np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis]).tolist()


# ---------------------------------------------------------------------------- softmax family
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_and_log_softmax_kernels(axis, rng):
    x = rng.standard_normal((3, 4, 5)) * 3
    sm, lsm = run(lambda x: [fc.softmax(x, axis=axis), fc.log_softmax(x, axis=axis)], x=x)
    moved = np.moveaxis(x, axis, -1).shape
    for got, ref_fn in ((sm, ref_softmax_rows), (lsm, ref_log_softmax_rows)):
        ref = np.moveaxis(np.array(ref_fn(_rows_along(x, axis))).reshape(moved), -1, axis)
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-15)


def test_softmax_is_stable_for_huge_logits():
    x = np.array([[1000.0, 1001.0, -1000.0], [-5000.0, -5000.0, -5000.0]], dtype=np.float32)
    sm, lsm = run(lambda x: [fc.softmax(x), fc.log_softmax(x)], x=x)
    assert np.isfinite(sm).all() and np.isfinite(lsm).all()
    e = 1 / (1 + math.exp(1))
    np.testing.assert_allclose(sm[0], [e, 1 - e, 0.0], rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(sm[1], [1 / 3] * 3, rtol=1e-6)
    np.testing.assert_allclose(lsm[0, :2], [math.log(e), math.log(1 - e)], rtol=1e-5)
    assert lsm[0, 2] == pytest.approx(-2001.0 - math.log(1 + math.exp(-1)), rel=1e-6)


@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax_gradients(axis, rng):
    x = rng.standard_normal((2, 3, 4))
    check_gradients(lambda x: fc.softmax(x, axis=axis), {"x": x})
    check_gradients(lambda x: fc.log_softmax(x, axis=axis), {"x": x})


def test_softmax_needs_a_float_and_a_valid_axis():
    with fc.Graph().as_default():
        with pytest.raises(fc.GraphError, match="axis 2 out of range"):
            fc.softmax(fc.placeholder("float32", (3, 4)), axis=2)
        with pytest.raises(fc.GraphError, match="must be float"):
            fc.softmax(fc.placeholder("int32", (3, 4)))


# ---------------------------------------------------------------------------- cross-entropies
def test_softmax_cross_entropy_kernel(rng):
    logits = rng.standard_normal((4, 6)) * 2
    labels = rng.uniform(0, 1, (4, 6))
    labels[0] = [0, 0, 1, 0, 0, 0]  # one-hot row and general (unnormalised) rows
    got = run(lambda l, y: fc.softmax_cross_entropy(l, y), l=logits, y=labels)
    ref = [-math.fsum(t * math.log(p) for t, p in zip(trow, prow))
           for trow, prow in zip(labels.tolist(), ref_softmax_rows(logits.tolist()))]
    assert got.shape == (4,)
    np.testing.assert_allclose(got, ref, rtol=1e-12)


def test_softmax_cross_entropy_gradients_reach_logits_and_labels(rng):
    logits = rng.standard_normal((3, 5))
    labels = rng.uniform(0, 1, (3, 5))
    check_gradients(lambda l, y: fc.softmax_cross_entropy(l, y), {"l": logits, "y": labels})


def test_gradient_through_the_backprop_output_is_refused(rng):
    g = fc.Graph()
    with g.as_default():
        l = fc.placeholder("float32", (2, 3))
        y = fc.placeholder("float32", (2, 3))
        loss = fc.softmax_cross_entropy(l, y, name="xent")
        with pytest.raises(fc.GraphError, match="'xent'.*output 1"):
            fc.gradients([loss, fc.Tensor(g, loss.node, 1)], [l])


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_sparse_softmax_cross_entropy_kernel_and_gradient(dtype, rng):
    logits = rng.standard_normal((5, 4)) * 2
    labels = np.array([0, 3, 1, 3, 2], dtype=dtype)
    got = run(lambda l, y: fc.sparse_softmax_cross_entropy(l, y), l=logits, y=labels)
    probs = ref_softmax_rows(logits.tolist())
    np.testing.assert_allclose(got, [-math.log(p[k]) for p, k in zip(probs, labels.tolist())], rtol=1e-12)
    check_gradients(lambda l, y: fc.sparse_softmax_cross_entropy(l, y), {"l": logits, "y": labels})


def test_sparse_and_dense_agree_on_one_hot_labels(rng):
    logits = rng.standard_normal((6, 3)).astype(np.float32)
    labels = np.array([2, 0, 1, 1, 0, 2], dtype=np.int32)
    onehot = np.eye(3, dtype=np.float32)[labels]

    def build(l, s, d):
        a, b = fc.sparse_softmax_cross_entropy(l, s), fc.softmax_cross_entropy(l, d)
        return [a, b] + fc.gradients([a], [l]) + fc.gradients([b], [l])

    a, b, ga, gb = run(build, l=logits, s=labels, d=onehot)
    assert a.dtype == np.float32
    np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(ga, gb, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", [5, -1])
def test_sparse_xent_bad_label_names_node_label_and_classes(bad):
    g = fc.Graph()
    with g.as_default():
        l = fc.placeholder("float32", (None, 5), name="logits")
        y = fc.placeholder("int32", (None,), name="labels")
        loss = fc.sparse_softmax_cross_entropy(l, y, name="my_xent")
    sess = fc.Session(g, store=fc.ContainerStore())
    with pytest.raises(fc.ExecutionError, match=rf"'my_xent'.*label {bad} .*5 classes") as e:
        sess.run(loss, {l: np.zeros((3, 5)), y: [0, bad, 1]})
    assert e.value.node == "my_xent"


def test_cross_entropy_shape_errors():
    with fc.Graph().as_default():
        with pytest.raises(fc.GraphError, match="same shape"):
            fc.softmax_cross_entropy(fc.placeholder("float32", (2, 3)), fc.placeholder("float32", (2, 4)))
        with pytest.raises(fc.GraphError, match="integer class ids"):
            fc.sparse_softmax_cross_entropy(fc.placeholder("float32", (2, 3)), fc.placeholder("float32", (2,)))


# ---------------------------------------------------------------------------- BiasAdd
def test_bias_add_kernel_and_gradient(rng):
    x = rng.standard_normal((2, 3, 2, 4))
    b = rng.standard_normal(4)
    got = run(lambda x, b: fc.bias_add(x, b), x=x, b=b)
    ref = np.empty_like(x)
    for idx in np.ndindex(*x.shape):
        ref[idx] = x[idx] + b[idx[-1]]
    np.testing.assert_array_equal(got, ref)
    check_gradients(lambda x, b: fc.bias_add(x, b), {"x": x, "b": b})
    # BiasAddGrad itself has a gradient (a broadcast back), for second derivatives:
    # d(sum(bias_add(x, b) * x^2))/db = BiasAddGrad(x^2), differentiated again w.r.t. x.
    check_gradients(lambda x, b: fc.gradients(fc.bias_add(x, b) * fc.square(x), [b])[0],
                    {"x": x, "b": b}, wrt=["x"])


def test_bias_add_with_unknown_batch_and_mismatch():
    x = np.arange(6.0).reshape(3, 2)
    g = fc.Graph()
    with g.as_default():
        xp = fc.placeholder("float64", (None, 2))
        y = fc.bias_add(xp, np.array([10.0, 20.0]))
        assert y.shape == (None, 2)
        with pytest.raises(fc.GraphError, match=r"bias must be \(2,\)"):
            fc.bias_add(xp, np.zeros(3))
    np.testing.assert_array_equal(fc.Session(g, store=fc.ContainerStore()).run(y, {xp: x}),
                                  [[10, 21], [12, 23], [14, 25]])


# ---------------------------------------------------------------------------- batch norm
def ref_batch_norm(x, scale, offset, eps):
    """Per-channel mean and biased variance with explicit loops and math.fsum, then the formula."""
    c = x.shape[-1]
    cols = [[] for _ in range(c)]
    for idx in np.ndindex(*x.shape):
        cols[idx[-1]].append(float(x[idx]))
    mean = [math.fsum(v) / len(v) for v in cols]
    var = [math.fsum((a - m) ** 2 for a in v) / len(v) for v, m in zip(cols, mean)]
    y = np.empty(x.shape)
    for idx in np.ndindex(*x.shape):
        k = idx[-1]
        y[idx] = (x[idx] - mean[k]) / math.sqrt(var[k] + eps) * scale[k] + offset[k]
    return y, np.array(mean), np.array(var)


def test_fused_batch_norm_kernel_nhwc(rng):
    x = rng.standard_normal((3, 4, 5, 2)) * 2 + 1
    scale, offset = rng.uniform(0.5, 2, 2), rng.standard_normal(2)
    got = run(lambda x, s, o: list(fc.fused_batch_norm(x, s, o, epsilon=1e-3)), x=x, s=scale, o=offset)
    for a, b in zip(got, ref_batch_norm(x, scale, offset, 1e-3)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", [(6, 3), (2, 3, 2, 2)])
def test_fused_batch_norm_gradient(shape, rng):
    x = rng.standard_normal(shape)
    c = shape[-1]
    inputs = {"x": x, "s": rng.uniform(0.5, 2, c), "o": rng.standard_normal(c)}
    check_gradients(lambda x, s, o: fc.fused_batch_norm(x, s, o)[0], inputs)
    # The batch statistics used downstream too: the gradient op's (dmean, dvar) path.
    check_gradients(lambda x, s, o: list(fc.fused_batch_norm(x, s, o)), inputs)


def test_batch_norm_inference_uses_moving_statistics_and_is_differentiable(rng):
    x = rng.standard_normal((4, 3))
    mm, mv = rng.standard_normal(3), rng.uniform(0.5, 2, 3)
    scale, offset = rng.uniform(0.5, 2, 3), rng.standard_normal(3)

    def build(x, s, o, m, v):
        return fc.batch_norm(x, s, o, m, v, training=False, epsilon=1e-2)[0]

    got = run(build, x=x, s=scale, o=offset, m=mm, v=mv)
    ref = [[(x[i][k] - mm[k]) / math.sqrt(mv[k] + 1e-2) * scale[k] + offset[k] for k in range(3)]
           for i in range(4)]
    np.testing.assert_allclose(got, ref, rtol=1e-12)
    check_gradients(build, {"x": x, "s": scale, "o": offset, "m": mm, "v": mv}, wrt=["x", "s", "o"])


def test_batch_norm_training_moving_averages_follow_the_recurrence(rng):
    momentum, steps, c = 0.9, 4, 3
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (None, 2, c), name="x")
        scale = fc.variable(np.ones(c), name="gamma")
        offset = fc.variable(np.zeros(c), name="beta")
        mm = fc.variable(np.zeros(c), name="moving_mean", trainable=False)
        mv = fc.variable(np.ones(c), name="moving_var", trainable=False)
        y, updates = fc.batch_norm(x, scale, offset, mm, mv, training=True, momentum=momentum)
        y_eval, none = fc.batch_norm(x, scale, offset, mm, mv, training=False)
    assert none == [] and len(updates) == 2
    assert updates[0].node.startswith("BatchNorm/") and y_eval.node.startswith("BatchNorm_1/")
    sess = fc.Session(g, store=fc.ContainerStore())
    sess.run(fc.global_variables_initializer(g))
    want_m, want_v = [0.0] * c, [1.0] * c
    for step in range(steps):
        batch = rng.standard_normal((2 + step, 2, c)) * (step + 1) + step  # batch size varies
        out, _ = sess.run([y, updates], {x: batch})
        np.testing.assert_allclose(out, ref_batch_norm(batch, [1] * c, [0] * c, 1e-3)[0], rtol=1e-10)
        _, bm, bv = ref_batch_norm(batch, [1] * c, [0] * c, 1e-3)
        want_m = [momentum * m + (1 - momentum) * b for m, b in zip(want_m, bm)]
        want_v = [momentum * v + (1 - momentum) * b for v, b in zip(want_v, bv)]
    vals = sess.variable_values()
    np.testing.assert_allclose(vals["moving_mean"], want_m, rtol=1e-12)
    np.testing.assert_allclose(vals["moving_var"], want_v, rtol=1e-12)
    # Evaluation reads the averages and leaves them alone.
    sess.run(y_eval, {x: batch})
    np.testing.assert_array_equal(sess.variable_values()["moving_mean"], vals["moving_mean"])


def test_batch_norm_channel_mismatch_is_a_graph_error():
    with fc.Graph().as_default():
        with pytest.raises(fc.GraphError, match=r"scale must be \(4,\)"):
            fc.fused_batch_norm(fc.placeholder("float32", (None, 4)), np.ones(3, np.float32),
                                np.zeros(4, np.float32))


# ---------------------------------------------------------------------------- dropout
def _dropout_graph(rate, seed=0, graph_seed=0):
    g = fc.Graph(seed=graph_seed)
    with g.as_default():
        x = fc.placeholder("float64", (None, 50), name="x")
        y = fc.dropout(x, rate, seed=seed, name="drop")
        dy = fc.placeholder("float64", (None, 50), name="dy")
        (gx,) = fc.gradients(y, [x], grad_ys=[dy])
    return g, x, y, dy, gx, fc.Tensor(g, y.node, 1)


def test_dropout_gradient_is_dy_times_the_mask_used(rng):
    g, x, y, dy, gx, mask = _dropout_graph(0.3)
    sess = fc.Session(g, store=fc.ContainerStore())
    xv, dyv = rng.standard_normal((40, 50)), rng.standard_normal((40, 50))
    yv, gv, mv = sess.run([y, gx, mask], {x: xv, dy: dyv})
    keep = 1 / 0.7
    assert set(np.unique(mv).tolist()) == {0.0, keep}
    assert abs((mv > 0).mean() - 0.7) < 0.03
    np.testing.assert_array_equal(gv, dyv * mv)
    np.testing.assert_array_equal(yv, xv * mv)
    np.testing.assert_allclose(yv[mv > 0], xv[mv > 0] / 0.7, rtol=1e-15)


def test_dropout_mask_is_fresh_each_step_follows_the_batch_and_replays():
    g, x, y, dy, gx, mask = _dropout_graph(0.5)
    s1, s2 = (fc.Session(g, store=fc.ContainerStore()) for _ in range(2))
    ones = np.ones((8, 50))
    a1, a2 = s1.run(mask, {x: ones}), s1.run(mask, {x: ones[:3]})
    assert a2.shape == (3, 50)
    assert not np.array_equal(a1[:3], a2)
    np.testing.assert_array_equal(s2.run(mask, {x: ones}), a1)  # a new session replays
    g2, x2, _, _, _, mask2 = _dropout_graph(0.5, graph_seed=1)
    assert not np.array_equal(fc.Session(g2, store=fc.ContainerStore()).run(mask2, {x2: ones}), a1)


def test_dropout_rate_zero_is_identity_and_bad_rate_is_an_error():
    with fc.Graph().as_default():
        x = fc.placeholder("float32", (None, 3))
        assert fc.dropout(x, 0.0) is x
        with pytest.raises(fc.GraphError, match=r"rate must be in \[0, 1\)"):
            fc.dropout(x, 1.0)
        with pytest.raises(fc.GraphError, match="must be float"):
            fc.dropout(fc.placeholder("int32", (3,)), 0.5)


# ---------------------------------------------------------------------------- registry facts
def test_costs_and_flags():
    from flowctl.engine.opdef import NN, get_op, ops_in_group

    assert {"Softmax", "BiasAdd", "FusedBatchNorm", "Dropout",
            "SparseSoftmaxCrossEntropyWithLogits"} <= ops_in_group(NN)
    drop = get_op("Dropout")
    assert drop.stateful and drop.resource == "rng" and drop.differentiable
    flops, nbytes = get_op("FusedBatchNorm").cost([(8, 4, 4, 16), (16,), (16,)],
                                                  [(8, 4, 4, 16), (16,), (16,)], ["float32"] * 3, {})
    assert flops == 8 * 8 * 4 * 4 * 16 and nbytes == 4 * (2 * 8 * 4 * 4 * 16 + 4 * 16)
    flops, _ = get_op("BiasAdd").cost([(32, 10), (10,)], [(32, 10)], ["float32"], {})
    assert flops == 320


def test_nn_graph_json_round_trip(rng):
    g = fc.Graph(seed=4)
    with g.as_default():
        x = fc.placeholder("float32", (None, 3), name="x")
        out = fc.softmax(fc.dropout(fc.bias_add(x, np.ones(3, np.float32)), 0.25, seed=3))
    g2 = fc.Graph.from_json(g.to_json())
    xv = rng.standard_normal((5, 3)).astype(np.float32)
    a = fc.Session(g, store=fc.ContainerStore()).run(out, {x: xv})
    b = fc.Session(g2, store=fc.ContainerStore()).run(out.name, {"x:0": xv})
    np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_gpu_matches_cpu(rng):
    x = rng.standard_normal((6, 2, 2, 3)).astype(np.float32)
    labels = np.array([0, 2, 1, 2, 0, 1], dtype=np.int32)
    g = fc.Graph(seed=7)
    with g.as_default():
        xp = fc.placeholder("float32", x.shape, name="x")
        lp = fc.placeholder("int32", (6,), name="labels")
        s, o = fc.constant(np.ones(3, np.float32)), fc.constant(np.zeros(3, np.float32))
        # Dropout's GPU kernel draws from the device's own counter-based stream, not the CPU's
        # generator, so the devices' masks differ (test_cuda_kernels checks the GPU's against its
        # numpy twin): at a rate of 0 dropout is the identity and leaves the graph.
        y = fc.dropout(fc.fused_batch_norm(xp, s, o)[0], 0.0)
        sm = fc.softmax(fc.log_softmax(fc.bias_add(y, o)), axis=1)
        logits = fc.placeholder("float32", (6, 3), name="logits")
        loss = fc.sparse_softmax_cross_entropy(logits, lp)
        outs = [y, sm, loss] + fc.gradients([sm, y, loss], [xp, s, o, logits])
    feeds = {xp: x, lp: labels, logits: rng.standard_normal((6, 3)).astype(np.float32)}
    cpu = fc.Session(g, store=fc.ContainerStore()).run(outs, feeds)
    gpu = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(outs, feeds)
    for a, b in zip(cpu, gpu):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
