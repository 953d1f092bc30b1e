"""Optimizers as graph builders: three steps of each on a least-squares problem against a float64
numpy implementation of the same update rule, written out by hand; learning rates as placeholders
and Variables; global-norm clipping; slots as ordinary Variables."""
from __future__ import annotations

import math

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.optimizers import SGD, Adam, Momentum, clip_by_global_norm

RTOL = 1e-10


def problem(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return dict(x=rng.normal(size=(5, 3)), y=rng.normal(size=(5, 2)), w=rng.normal(size=(3, 2)),
                b=rng.normal(size=(2,)))


def build(p: dict[str, np.ndarray], make_opt, lr_kind: str = "float", clip_norm=None):
    """loss = sum((x @ w + b - y)^2) with w, b under the scope `dense`."""
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (None, 3), name="x")
        y = fc.placeholder("float64", (None, 2), name="y")
        with g.name_scope("dense"):
            w = fc.variable(p["w"], name="w")
            b = fc.variable(p["b"], name="b")
        loss = fc.reduce_sum(fc.square(fc.matmul(x, w) + b - y), name="loss")
        lr = None
        if lr_kind == "placeholder":
            lr = fc.placeholder("float64", (), name="lr")
        elif lr_kind == "placeholder32":
            lr = fc.placeholder("float32", (), name="lr")
        elif lr_kind == "variable":
            lr = fc.variable(np.float64(0.0), name="lr", trainable=False)
        opt = make_opt(lr)
        train = opt.minimize(loss, clip_norm=clip_norm)
        init = fc.global_variables_initializer()
    sess = fc.Session(g, store=fc.ContainerStore())
    sess.run(init)
    return g, sess, dict(x=x, y=y, w=w, b=b, loss=loss, lr=lr, train=train, opt=opt)


def grads_np(p: dict[str, np.ndarray], w: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """d/dw and d/db of sum((x w + b - y)^2), by explicit loops over the examples."""
    gw, gb = np.zeros_like(w), np.zeros_like(b)
    for xi, yi in zip(p["x"], p["y"]):
        r = 2.0 * (xi @ w + b - yi)
        gw += np.outer(xi, r)
        gb += r
    return gw, gb


def sgd_np(params, grads, state, lr):
    return [v - lr * g for v, g in zip(params, grads)]


def momentum_np(params, grads, state, lr, momentum=0.9, nesterov=False):
    accums = state.setdefault("momentum", [np.zeros_like(v) for v in params])
    out = []
    for i, (v, g) in enumerate(zip(params, grads)):
        accums[i] = momentum * accums[i] + g
        step = g + momentum * accums[i] if nesterov else accums[i]
        out.append(v - lr * step)
    return out


def adam_np(params, grads, state, lr, beta1=0.9, beta2=0.999, eps=1e-8):
    t = state["t"] = state.get("t", 0) + 1
    m = state.setdefault("m", [np.zeros_like(v) for v in params])
    s = state.setdefault("v", [np.zeros_like(v) for v in params])
    lr_t = lr * math.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t)
    out = []
    for i, (v, g) in enumerate(zip(params, grads)):
        m[i] = beta1 * m[i] + (1.0 - beta1) * g
        s[i] = beta2 * s[i] + (1.0 - beta2) * g * g
        out.append(v - lr_t * m[i] / (np.sqrt(s[i]) + eps))
    return out


CASES = {
    "sgd": (lambda lr, r: SGD(r if lr is None else lr), sgd_np, {}),
    "momentum": (lambda lr, r: Momentum(r if lr is None else lr, momentum=0.8), momentum_np, {"momentum": 0.8}),
    "nesterov": (lambda lr, r: Momentum(r if lr is None else lr, momentum=0.7, nesterov=True), momentum_np,
                 {"momentum": 0.7, "nesterov": True}),
    "adam": (lambda lr, r: Adam(r if lr is None else lr, beta1=0.85, beta2=0.99, epsilon=1e-6), adam_np,
             {"beta1": 0.85, "beta2": 0.99, "eps": 1e-6}),
}


def run_case(case: str, lr_kind: str, lrs: list[float], clip=None):
    make, ref_step, kw = CASES[case]
    p = problem()
    g, sess, t = build(p, lambda lr: make(lr, lrs[0]), lr_kind, clip)
    params, state = [p["w"].copy(), p["b"].copy()], {}
    for lr in lrs:
        feeds = {t["x"]: p["x"], t["y"]: p["y"]}
        if lr_kind.startswith("placeholder"):
            feeds[t["lr"]] = lr
        elif lr_kind == "variable":
            sess.run(fc.assign(t["lr"], np.float64(lr)))
        sess.run(t["train"], feeds)
        grads = list(grads_np(p, *params))
        if clip is not None:
            norm = math.sqrt(sum(float((gr * gr).sum()) for gr in grads))
            grads = [gr * clip / max(norm, clip) for gr in grads]
        params = ref_step(params, grads, state, lr, **kw)
    return sess.variable_values(), params, state, t


@pytest.mark.parametrize("case", sorted(CASES))
def test_three_steps_match_numpy(case):
    values, params, state, t = run_case(case, "float", [0.05, 0.05, 0.05])
    np.testing.assert_allclose(values["dense/w"], params[0], rtol=RTOL)
    np.testing.assert_allclose(values["dense/b"], params[1], rtol=RTOL)
    assert not np.allclose(values["dense/w"], problem()["w"])  # it moved
    for slot in ("momentum", "m", "v"):
        if slot in state:
            name = t["opt"].name
            np.testing.assert_allclose(values[f"dense/w/{name}/{slot}"], state[slot][0], rtol=RTOL)
            np.testing.assert_allclose(values[f"dense/b/{name}/{slot}"], state[slot][1], rtol=RTOL)
    if case == "adam":
        assert values["Adam/t"] == 3
        np.testing.assert_allclose(values["Adam/beta1_power"], 0.85 ** 4, rtol=1e-14)


@pytest.mark.parametrize("case", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("lr_kind", ["placeholder", "variable"])
def test_learning_rate_tensor_changes_per_step(case, lr_kind):
    lrs = [0.1, 0.03, 0.007]
    values, params, _, _ = run_case(case, lr_kind, lrs)
    np.testing.assert_allclose(values["dense/w"], params[0], rtol=RTOL)
    np.testing.assert_allclose(values["dense/b"], params[1], rtol=RTOL)
    # A fixed rate gives a different answer, so the per-step rates really were used.
    fixed, _, _, _ = run_case(case, "float", [lrs[0]] * 3)
    assert not np.allclose(fixed["dense/w"], values["dense/w"])


def test_float32_learning_rate_is_cast_for_float64_variables():
    lrs = [0.25, 0.125, 0.0625]  # exact in float32, so the float64 reference applies as is
    values, params, _, _ = run_case("sgd", "placeholder32", lrs)
    np.testing.assert_allclose(values["dense/w"], params[0], rtol=RTOL)


@pytest.mark.parametrize("case", ["sgd", "adam"])
def test_minimize_with_clipping_matches_numpy(case):
    values, params, _, _ = run_case(case, "float", [0.05, 0.05, 0.05], clip=0.5)
    np.testing.assert_allclose(values["dense/w"], params[0], rtol=RTOL)
    np.testing.assert_allclose(values["dense/b"], params[1], rtol=RTOL)


@pytest.mark.parametrize("factor", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("tensor_norm", [False, True])
def test_clip_by_global_norm_against_numpy(factor, tensor_norm, rng):
    a, c = rng.normal(size=(3,)), rng.normal(size=(2, 2))
    norm = math.sqrt(sum(v * v for v in a.ravel()) + sum(v * v for v in c.ravel()))
    clip = factor * norm
    g = fc.Graph()
    with g.as_default():
        ta = fc.placeholder("float64", (3,), name="a")
        tc = fc.placeholder("float64", (2, 2), name="c")
        cn = fc.placeholder("float64", (), name="cn") if tensor_norm else clip
        clipped, gn = clip_by_global_norm([ta, None, tc], cn)
    assert clipped[1] is None
    feeds = {ta: a, tc: c}
    if tensor_norm:
        feeds[cn] = clip
    got_a, got_c, got_norm = fc.Session(g, store=fc.ContainerStore()).run([clipped[0], clipped[2], gn], feeds)
    np.testing.assert_allclose(got_norm, norm, rtol=1e-12)
    scale = clip / norm if factor < 1 else 1.0
    np.testing.assert_allclose(got_a, a * scale, rtol=1e-12)
    np.testing.assert_allclose(got_c, c * scale, rtol=1e-12)
    if factor > 1:
        np.testing.assert_array_equal(got_a, a)  # below the limit: untouched, bit for bit
    else:
        np.testing.assert_allclose(math.sqrt((got_a ** 2).sum() + (got_c ** 2).sum()), clip, rtol=1e-12)


def test_slots_are_variables_named_after_their_variable():
    g, sess, t = build(problem(), lambda lr: Adam(0.01))
    opt = t["opt"]
    names = [s.node for s in opt.slots()]
    assert names == ["dense/w/Adam/m", "dense/w/Adam/v", "dense/b/Adam/m", "dense/b/Adam/v"]
    all_vars = {v.node for v in fc.variables(g)}
    assert set(names) <= all_vars
    assert {"Adam/beta1_power", "Adam/beta2_power", "Adam/t"} <= {v.node for v in opt.variables()} <= all_vars
    assert {v.node for v in fc.trainable_variables(g)} == {"dense/w", "dense/b"}
    init_inputs = {r.split(":")[0] for r in g.nodes["init"].inputs}
    for s in opt.variables():
        node = g.nodes[s.node]
        assert node.op == "Variable" and not node.attrs["trainable"]
        assert f"{s.node}/init" in init_inputs
    assert g.nodes["dense/w/Adam/m"].colocate_with == ["dense/w"]
    values = sess.variable_values()  # initialised to zeros by the global initializer
    np.testing.assert_array_equal(values["dense/w/Adam/v"], np.zeros((3, 2)))


def test_slot_names_ignore_the_callers_name_scope():
    g = fc.Graph()
    with g.as_default():
        w = fc.variable(np.ones(2), name="w")
        loss = fc.reduce_sum(fc.square(w))
        with g.name_scope("train"):
            opt = Momentum(0.1)
            opt.minimize(loss)
    assert [s.node for s in opt.slots()] == ["w/Momentum/momentum"]
    assert "w/Momentum/momentum/init" in g.nodes


def test_variables_without_gradient_are_skipped_and_none_at_all_is_an_error():
    g = fc.Graph()
    with g.as_default():
        w = fc.variable(np.ones(2), name="w")
        unused = fc.variable(np.ones(2), name="unused")
        loss = fc.reduce_sum(fc.square(w))
        opt = SGD(0.5)
        gv = opt.compute_gradients(loss)
        assert [v.node for _, v in gv] == ["w", "unused"] and gv[1][0] is None
        train = opt.apply_gradients(gv)
        init = fc.global_variables_initializer()
        with pytest.raises(fc.GraphError, match="no gradients for any of the variables"):
            opt.apply_gradients([(None, unused)])
    sess = fc.Session(g, store=fc.ContainerStore())
    sess.run(init)
    sess.run(train)
    vals = sess.variable_values()
    np.testing.assert_array_equal(vals["w"], [0.0, 0.0])  # 1 - 0.5 * 2
    np.testing.assert_array_equal(vals["unused"], [1.0, 1.0])


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_l2_loss_against_float64(dtype, rng):
    # 200,000 values: several of the kernel's dot-product blocks, summed in float64 between them
    # (scaled so that float16's half-norm, about 9,000, stays within its range)
    x = (0.3 * rng.normal(size=(400, 500))).astype(dtype)
    g = fc.Graph()
    with g.as_default():
        t = fc.placeholder(dtype, (400, 500), name="t")
        half = fc.l2_loss(t)
    got = fc.Session(g, store=fc.ContainerStore()).run(half, {t: x})
    assert got.dtype == np.dtype(dtype) and got.shape == ()
    want = 0.5 * (x.astype(np.float64) ** 2).sum()
    np.testing.assert_allclose(float(got), want, rtol={"float16": 1e-3, "float32": 1e-6, "float64": 1e-13}[dtype])


def test_sgd_is_one_update_node_per_variable_with_the_clip_scale_in_its_step_size():
    p = problem()
    g, sess, t = build(p, lambda lr: SGD(0.05), clip_norm=0.5)
    updates = [n for n in g.nodes.values() if n.op == "ApplyGradientDescent"]
    assert sorted(n.inputs[0] for n in updates) == ["dense/b:0", "dense/w:0"]
    assert not [n for n in g.nodes.values() if n.op == "AssignSub"]
    # delta is the unclipped gradient; the clip's scale multiplies the learning rate instead
    for n in updates:
        assert g.nodes[n.inputs[2].split(":")[0]].op != "Mul"


def test_apply_gradient_descent_leaves_a_value_read_before_it_untouched():
    w0 = np.arange(6.0).reshape(2, 3)
    g = fc.Graph()
    with g.as_default():
        w = fc.variable(w0, name="w")
        d = fc.placeholder("float64", (2, 3), name="d")
        step = fc.apply_gradient_descent(w, 0.5, d)
        init = fc.global_variables_initializer()
    sess = fc.Session(g, store=fc.ContainerStore())
    sess.run(init)
    before = sess.run(w)
    delta = np.full((2, 3), 2.0)
    new = sess.run(step, {d: delta})
    np.testing.assert_array_equal(new, w0 - 1.0)
    np.testing.assert_array_equal(before, w0)  # a new array for the slot, not a write into the old
    np.testing.assert_array_equal(sess.run(w), w0 - 1.0)
    with pytest.raises(fc.GraphError, match="does not fit"):
        with g.as_default():
            fc.apply_gradient_descent(w, 0.5, fc.placeholder("float64", (3, 2)))


@pytest.mark.parametrize("kind", ["sgd", "assign_sub", "sparse"])
def test_an_update_writes_in_place_only_when_nothing_else_holds_the_value(kind):
    """The fast path of the updates (no new array per step) must never show: a value fetched or
    viewed before an update keeps its bits, and the bits are those of the out-of-place update."""
    import weakref

    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((40, 3)).astype(np.float32)
    g = fc.Graph()
    with g.as_default():
        w = fc.variable(w0, name="w")
        d = fc.placeholder("float32", (40, 3), name="d")
        ids = fc.placeholder("int32", (5,), name="ids")
        if kind == "sgd":
            step = fc.apply_gradient_descent(w, np.float32(0.1), d)
        elif kind == "assign_sub":
            step = fc.assign_sub(w, d * np.float32(0.1))
        else:  # an embedding's sparse update through the gradient of a gather
            loss = fc.reduce_sum(fc.gather(w, ids) * fc.gather(d, ids))
            step = SGD(0.1).minimize(loss)
            assert [n for n in g.nodes.values() if n.op == "SparseApplyGradientDescent"]
        init = fc.global_variables_initializer()
    store = fc.ContainerStore()
    sess = fc.Session(g, store=store)
    sess.run(init)
    slot = store.get().slot("w")
    feeds = {d: rng.standard_normal((40, 3)).astype(np.float32), ids: np.array([1, 7, 7, 30, 2], np.int32)}
    expect = sess.run(w).copy()  # a fetched array: the first update must not write into it
    held = sess.run(w)
    sess.run(step, feeds)
    np.testing.assert_array_equal(held, expect)
    assert slot.value is not held
    del held
    out_of_place = []
    for _ in range(3):  # nothing holds the value now: the same array is updated ...
        before = weakref.ref(slot.value)
        sess.run(step, feeds)
        assert slot.value is before()
        out_of_place.append(slot.value.copy())
    # ... to the same bits as a fresh session whose every update copies (a caller holds each value)
    sess2 = fc.Session(g, store=fc.ContainerStore())
    sess2.run(init)
    sess2.run(step, feeds)
    for expected in out_of_place:
        keep = sess2.run(w)
        sess2.run(step, feeds)
        assert sess2.run(w) is not keep
        np.testing.assert_array_equal(sess2.run(w), expected)
    view = slot.value[3:]  # a view of the value is a holder too
    snapshot = view.copy()
    sess.run(step, feeds)
    np.testing.assert_array_equal(view, snapshot)


@pytest.mark.parametrize("kind", ["momentum", "nesterov", "adam"])
@pytest.mark.parametrize("hold", [False, True])
def test_fused_updates_equal_the_chains_they_replace_bitwise(kind, hold):
    """ApplyMomentum and ApplyAdam against the elementwise chains they replaced, float32, over more
    than one of the kernel's runs; `hold` keeps every fetched value, so the kernel takes its new-array
    path instead of writing in place."""
    from flowctl.engine.ops.training import apply_adam, apply_momentum

    rng = np.random.default_rng(11)
    w0 = rng.standard_normal((300, 250)).astype(np.float32)
    grads = [rng.standard_normal(w0.shape).astype(np.float32) for _ in range(3)]
    mom, b1, b2, eps, lr = 0.8, 0.85, 0.99, 1e-6, np.float32(0.01)

    def run(fused: bool) -> list[np.ndarray]:
        g = fc.Graph()
        with g.as_default():
            w = fc.variable(w0, name="w")
            s1 = fc.variable(np.zeros_like(w0), name="s1")
            s2 = fc.variable(np.full_like(w0, 0.5), name="s2")
            d = fc.placeholder("float32", w0.shape, name="d")
            if kind == "adam" and fused:
                step = apply_adam(w, s1, s2, lr, d, b1, b2, eps)
            elif kind == "adam":
                new_m = fc.assign(s1, s1 * b1 + d * (1.0 - b1))
                new_v = fc.assign(s2, s2 * b2 + fc.square(d) * (1.0 - b2))
                step = fc.assign_sub(w, lr * new_m / (fc.sqrt(new_v) + eps))
            elif fused:
                step = apply_momentum(w, s1, lr, d, mom, nesterov=kind == "nesterov")
            else:
                new_acc = fc.assign(s1, s1 * mom + d)
                step = fc.assign_sub(w, lr * (d + new_acc * mom if kind == "nesterov" else new_acc))
            init = fc.global_variables_initializer()
        sess = fc.Session(g, store=fc.ContainerStore())
        sess.run(init)
        held = []
        for gr in grads:
            sess.run(step, {d: gr})
            if hold:
                held.append(sess.run([w, s1, s2]))
        if hold:  # every value fetched along the way kept its bits
            for k, (a, b, c) in enumerate(held[:-1]):
                assert not np.array_equal(a, held[k + 1][0])
        return sess.run([w, s1, s2])

    fused, chain = run(True), run(False)
    for a, b in zip(fused, chain):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(fused[0], w0)
