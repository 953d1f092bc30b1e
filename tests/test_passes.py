"""Graph passes: pruning (§4.2), CSE (§5.1) and constant folding, each checked by counting nodes
and by running the graph before and after on the same feeds."""
from __future__ import annotations

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.optimizers import SGD
from flowctl.engine.passes import MAX_FOLD_BYTES, cse, fold_constants, optimize, prune


def session(g: fc.Graph, **kw) -> fc.Session:
    return fc.Session(g, store=fc.ContainerStore(), **kw)


def ops_of(g: fc.Graph) -> list[str]:
    return sorted(n.op for n in g.nodes.values())


# ---------------------------------------------------------------------------- CSE
def twin_layers() -> tuple[fc.Graph, dict]:
    """Two identical matmul + bias layers built separately (their constants too)."""
    rng = np.random.default_rng(0)
    w, b = rng.normal(size=(3, 4)), rng.normal(size=(4,))
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (None, 3), name="x")
        y1 = fc.add(fc.matmul(x, fc.constant(w, name="w1"), name="mm1"), fc.constant(b, name="b1"), name="y1")
        y2 = fc.add(fc.matmul(x, fc.constant(w, name="w2"), name="mm2"), fc.constant(b, name="b2"), name="y2")
        out = fc.mul(y1, y2, name="out")
    return g, dict(x=x, y1=y1, y2=y2, out=out)


def test_cse_merges_identical_subgraphs_and_keeps_results(rng):
    g, t = twin_layers()
    xv = rng.normal(size=(5, 3))
    before = session(g).run(t["out"], {t["x"]: xv})
    assert len(g) == 10
    opt = cse(g.copy(), keep={"out", "x"})
    assert sorted(opt.nodes) == ["b1", "mm1", "out", "w1", "x", "y1"]
    assert opt.nodes["out"].inputs == ["y1:0", "y1:0"]
    after = session(opt).run("out:0", {"x:0": xv})
    np.testing.assert_array_equal(after, before)
    np.testing.assert_allclose(after, (xv @ g.nodes["w1"].attrs["value"] + g.nodes["b1"].attrs["value"]) ** 2,
                               rtol=1e-12)
    assert len(g) == 10  # the pass worked on the copy


def test_cse_keeps_a_kept_duplicate_under_its_name(rng):
    g, t = twin_layers()
    xv = rng.normal(size=(2, 3))
    opt = cse(g.copy(), keep={"y2", "out", "x"})
    assert opt.nodes["y2"].op == "Identity" and opt.nodes["y2"].inputs == ["y1:0"]
    assert "mm2" not in opt.nodes and "w2" not in opt.nodes
    # out still reads y2, so a feed of y2 keeps reaching it
    assert opt.nodes["out"].inputs == ["y1:0", "y2:0"]
    got = session(opt).run(["y2:0", "out:0"], {"x:0": xv})
    ref = xv @ g.nodes["w1"].attrs["value"] + g.nodes["b1"].attrs["value"]
    np.testing.assert_allclose(got[0], ref, rtol=1e-12)
    np.testing.assert_allclose(got[1], ref * ref, rtol=1e-12)


@pytest.mark.parametrize("executor", ["compiled", "dataflow"])
def test_session_optimize_fetches_and_feeds_a_merged_name(executor, rng):
    g, t = twin_layers()
    xv, y2v = rng.normal(size=(2, 3)), rng.normal(size=(2, 4))
    plain, opt = session(g, executor=executor), session(g, optimize=True, executor=executor)
    np.testing.assert_array_equal(opt.run(t["y2"], {t["x"]: xv}), plain.run(t["y2"], {t["x"]: xv}))
    # Feeding y2 must reach `out` and not y1: merging y2 into y1 would lose the feed.
    y1v = plain.run(t["y1"], {t["x"]: xv})
    np.testing.assert_allclose(opt.run(t["out"], {t["x"]: xv, t["y2"]: y2v}), y1v * y2v, rtol=1e-12)
    # ... and a fed y1 must not reach y2's consumers: a fed node is never a survivor.
    np.testing.assert_allclose(opt.run(t["out"], {t["x"]: xv, t["y1"]: y2v}), y2v * y1v, rtol=1e-12)
    stats = fc.RunStats()
    opt.run(t["out"], {t["x"]: xv}, stats=stats)
    assert sorted(stats.nodes_run) == ["b1", "mm1", "out", "w1", "y1"]  # the twin is computed once


def test_cse_never_merges_random_ops_or_variables():
    g = fc.Graph(seed=3)
    with g.as_default():
        r1 = fc.random_normal((4,), dtype="float64", name="r1")
        r2 = fc.random_normal((4,), dtype="float64", name="r2")
        v1 = fc.variable(np.zeros(3), name="v1")
        v2 = fc.variable(np.zeros(3), name="v2")
        s = fc.add(fc.exp(v1, name="e1"), fc.exp(v2, name="e2"), name="s")
        d = fc.sub(r1, r2, name="d")
        init = fc.global_variables_initializer()
    assert g.nodes["r1"].attrs.keys() == g.nodes["r2"].attrs.keys()
    opt = cse(g.copy(), keep={"s", "d"})
    for name in ("r1", "r2", "v1", "v2", "v1/init", "v2/init", "e1", "e2"):
        assert name in opt.nodes, name
    assert opt.nodes["d"].inputs == ["r1:0", "r2:0"]
    sess = session(g, optimize=True)
    sess.run(init)
    assert np.abs(sess.run(d)).min() > 0  # two streams, not one stream subtracted from itself
    sess.run([fc.assign(v2, np.ones(3))])
    np.testing.assert_allclose(sess.run(s), 1.0 + np.e)


# ---------------------------------------------------------------------------- constant folding
def test_fold_turns_constant_product_into_one_const(rng):
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (3,), name="x")
        y = fc.add(fc.mul(fc.constant(2.0), fc.constant(3.0), name="six"), x, name="y")
    xv = rng.normal(size=3).astype(np.float32)
    before = session(g).run(y, {x: xv})
    folded = fold_constants(g.copy(), keep={"y", "x"})
    assert ops_of(folded) == ["Add", "Const", "Placeholder"]
    assert folded.nodes["six"].op == "Const"  # same name, so refs to it stay valid
    assert folded.nodes["six"].attrs["value"] == np.float32(6.0)
    assert folded.nodes["y"].inputs == ["six:0", "x:0"]
    np.testing.assert_array_equal(session(folded).run("y:0", {"x:0": xv}), before)
    np.testing.assert_allclose(before, xv.astype(np.float64) + 6.0, rtol=1e-6)


def test_fold_chain_and_multi_output_node():
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (2,), name="x")
        parts = fc.split(fc.exp(fc.constant(np.arange(4.0), name="c"), name="e"), 2, name="sp")
        y = fc.add(fc.mul(parts[0], x, name="m0"), parts[1], name="y")
    folded = fold_constants(g.copy(), keep={"y", "x"})
    assert sorted(folded.nodes) == ["m0", "sp/folded_0", "sp/folded_1", "x", "y"]
    np.testing.assert_array_equal(folded.nodes["sp/folded_1"].attrs["value"], np.exp([2.0, 3.0]))
    xv = np.array([0.5, -1.0])
    np.testing.assert_allclose(session(folded).run("y:0", {"x:0": xv}),
                               [np.exp(0) * 0.5 + np.exp(2), np.exp(1) * -1.0 + np.exp(3)], rtol=1e-12)


def test_fold_skips_random_stateful_large_and_kept_inputs():
    g = fc.Graph()
    with g.as_default():
        r = fc.mul(fc.random_normal((3,), dtype="float64", name="r"), 2.0, name="r2")
        v = fc.variable(np.ones(3), name="v")
        vv = fc.mul(v, fc.constant(np.full(3, 2.0)), name="vv")
        n = MAX_FOLD_BYTES // 8 + 1
        big = fc.exp(fc.constant(np.zeros(n), name="zeros"), name="big")
        c = fc.mul(fc.constant(np.float64(2.0)), fc.constant(np.float64(5.0)), name="c")
        y = fc.add(c, 1.0, name="y")
    folded = fold_constants(g.copy(), keep={"r2", "vv", "big", "c", "y"})
    assert folded.nodes["r2"].op == "Mul" and folded.nodes["vv"].op == "Mul"
    assert folded.nodes["big"].op == "Exp"
    # c is kept (it may be fed), so y must go on reading it rather than become a constant 11
    assert folded.nodes["c"].op == "Const" and folded.nodes["y"].op == "Add"
    sess = session(g, optimize=True)
    assert sess.run(y) == 11.0
    assert sess.run(y, {c: np.float64(-1.0)}) == 0.0


def test_fold_keeps_control_dependencies_on_the_new_const():
    g = fc.Graph()
    with g.as_default():
        v = fc.variable(np.zeros(()), name="v")
        bump = fc.assign_add(v, np.float64(1.0), name="bump")
        with g.control_dependencies([bump]):
            c = fc.exp(fc.constant(np.float64(0.0), name="zero"), name="c")
        init = fc.global_variables_initializer()
    folded = fold_constants(g.copy(), keep={"c"})
    assert folded.nodes["c"].op == "Const" and folded.nodes["c"].control_inputs == ["bump"]
    sess = session(g, optimize=True)
    sess.run(init)
    assert sess.run(c) == 1.0
    assert sess.variable_values()["v"] == 1.0  # the bump still ran


# ---------------------------------------------------------------------------- pruning
def branches() -> fc.Graph:
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (3,), name="x")
        b = fc.tanh(fc.exp(x, name="a"), name="b")
        fc.square(b, name="c")
        fc.sqrt(fc.abs_(fc.neg(x, name="d"), name="abs_d"), name="e")
        w = fc.variable(np.ones(3), name="w")
        fc.add(w, x, name="wx")
        fc.global_variables_initializer()
    return g


def test_prune_keeps_exactly_what_the_fetches_need():
    g = branches()
    assert sorted(prune(g, ["e:0"]).nodes) == ["abs_d", "d", "e", "x"]
    assert sorted(prune(g, ["c"], feeds=["x:0"]).nodes) == ["a", "b", "c", "x"]
    assert sorted(prune(g, ["init"]).nodes) == ["init", "w", "w/init", "w/initial_value"]  # ones: a Fill
    assert sorted(prune(g, ["wx:0", "c:0"], feeds=["b:0"]).nodes) == ["b", "c", "w", "wx", "x"]
    assert len(g) == 12  # the input graph is untouched


def test_prune_turns_a_fed_producer_into_a_placeholder():
    g = branches()
    p = prune(g, ["c:0"], feeds=["b:0"])
    assert sorted(p.nodes) == ["b", "c"]
    assert p.nodes["b"].op == "Placeholder"
    assert p.nodes["b"].attrs == {"dtype": "float64", "shape": (3,)}
    np.testing.assert_allclose(session(p).run("c:0", {"b:0": np.array([1.0, 2.0, 3.0])}), [1.0, 4.0, 9.0])


def test_prune_rejects_unknown_names():
    with pytest.raises(fc.GraphError, match="did you mean 'abs_d'"):
        prune(branches(), ["abs_e:0"])


# ---------------------------------------------------------------------------- the session option
def test_optimized_session_trains_like_the_plain_one(rng):
    xv, yv = rng.normal(size=(6, 3)), rng.normal(size=(6, 2))
    w0, v0 = rng.normal(size=(3, 4)), rng.normal(size=(4, 2))

    def build() -> tuple[fc.Graph, list, fc.Tensor, fc.Tensor]:
        g = fc.Graph()
        with g.as_default():
            x = fc.placeholder("float64", (None, 3), name="x")
            y = fc.placeholder("float64", (None, 2), name="y")
            w = fc.variable(w0, name="w")
            v = fc.variable(v0, name="v")
            scale = fc.constant(np.float64(0.5)) * fc.constant(np.float64(4.0))  # foldable
            h = fc.tanh(fc.matmul(x, w) * scale)
            h2 = fc.tanh(fc.matmul(x, w) * scale)  # a duplicate for CSE
            pred = fc.matmul(h + h2, v)
            loss = fc.reduce_sum(fc.square(pred - y))
            train = SGD(0.01).minimize(loss)
            init = fc.global_variables_initializer()
        return g, [x, y], loss, train, init

    results = []
    for optimize_ in (False, True):
        g, (x, y), loss, train, init = build()
        sess = session(g, optimize=optimize_)
        sess.run(init)
        losses = [sess.run([loss, train], {x: xv, y: yv})[0] for _ in range(3)]
        results.append((losses, sess.variable_values()))
        if optimize_:
            plan = sess.plan_for([loss, train], {x: xv, y: yv})
            assert len(plan.nodes) < len(session(g).plan_for([loss, train], {x: xv, y: yv}).nodes)
    (l0, v0_), (l1, v1_) = results
    np.testing.assert_allclose(l1, l0, rtol=1e-12)
    assert l0[2] < l0[0]
    for k in v0_:
        np.testing.assert_allclose(v1_[k], v0_[k], rtol=1e-12)


def test_optimize_is_fold_then_cse():
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (2,), name="x")
        a = fc.add(x, fc.constant(np.float64(1.0)) + fc.constant(np.float64(1.0)), name="a")
        b = fc.add(x, fc.constant(np.float64(2.0)), name="b")  # equal to a once folded
        fc.mul(a, b, name="out")
    opt = optimize(g.copy(), keep={"out", "x"})
    assert ops_of(opt) == ["Add", "Const", "Mul", "Placeholder"]
    np.testing.assert_allclose(session(opt).run("out:0", {"x:0": np.array([1.0, 2.0])}), [9.0, 16.0])
