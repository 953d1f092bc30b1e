"""§4.4 control flow: cond and while_loop against plain Python, frames in the executor, shape
invariants at construction, and loops in GraphDef JSON."""
from __future__ import annotations

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine.control_flow import cond, while_loop
from flowctl.engine.errors import ExecutionError, GraphError
from flowctl.engine.gradcheck import check_gradients


def f64(v: float) -> fc.Tensor:
    return fc.constant(v, dtype="float64")


def i32(v: int) -> fc.Tensor:
    return fc.constant(v, dtype="int32")


def _halving(parallel: int) -> tuple[fc.Graph, fc.Tensor, list[fc.Tensor]]:
    """while k > 1: k = k / 2 if k > 10 else k - 1 -- a trip count that depends on the data."""
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (), name="x")

        def body(k, steps, total):
            k2 = cond(fc.greater(k, f64(10.0)), lambda: k / 2.0, lambda: k - 1.0)
            return k2, steps + 1, total + k2

        out = while_loop(lambda k, s, t: fc.greater(k, f64(1.0)), body, [x, i32(0), f64(0.0)],
                         parallel_iterations=parallel)
    return g, x, out


def _halving_py(k: float) -> tuple[float, int, float]:
    steps, total = 0, 0.0
    while k > 1:
        k = k / 2 if k > 10 else k - 1
        steps += 1
        total += k
    return k, steps, total


@pytest.mark.parametrize("parallel", [1, 4])
def test_data_dependent_trip_count_matches_python(parallel: int) -> None:
    g, x, out = _halving(parallel)
    sess = fc.Session(g)
    for start in [0.5, 1.0, 3.0, 10.5, 137.5, 4096.25]:
        k, steps, total = sess.run(out, {x: np.float64(start)})
        rk, rsteps, rtotal = _halving_py(start)
        assert int(steps) == rsteps
        assert float(k) == rk and float(total) == pytest.approx(rtotal, rel=1e-15)


def test_parallel_iterations_give_the_same_numbers() -> None:
    """A loop whose iterations are independent apart from the counter: 8 in flight == 1 in flight."""
    rng = np.random.default_rng(0)
    w, xs = rng.standard_normal((4, 4)), rng.standard_normal((9, 4))
    results = []
    for parallel in (1, 8):
        g = fc.Graph()
        with g.as_default():
            wt, xt = fc.constant(w), fc.constant(xs)

            def body(i, acc):
                row = fc.reshape(fc.gather(xt, fc.reshape(i, [1]), axis=0), [1, 4])
                return i + 1, acc + fc.tanh(fc.matmul(row, wt))

            _, acc = while_loop(lambda i, a: fc.less(i, i32(9)), body, [i32(0), fc.zeros([1, 4], "float64")],
                                parallel_iterations=parallel)
        results.append(fc.Session(g).run(acc))
    ref = np.tanh(xs @ w).sum(axis=0, keepdims=True)
    np.testing.assert_allclose(results[0], ref, rtol=1e-12)
    np.testing.assert_array_equal(results[0], results[1])


def test_nested_loops() -> None:
    g = fc.Graph()
    with g.as_default():
        n = fc.placeholder("int32", (), name="n")

        def outer(i, acc):
            _, inner = while_loop(lambda j, a: fc.less(j, i), lambda j, a: (j + 1, a + j * i), [i32(0), acc])
            return i + 1, inner

        _, total = while_loop(lambda i, a: fc.less(i, n), outer, [i32(0), i32(0)])
    sess = fc.Session(g)
    for k in [0, 1, 5, 12]:
        assert int(sess.run(total, {n: np.int32(k)})) == sum(j * i for i in range(k) for j in range(i))


def test_loop_on_an_untaken_branch_is_dead_and_a_taken_one_runs() -> None:
    g = fc.Graph()
    with g.as_default():
        n = fc.placeholder("int32", (), name="n")
        z = cond(fc.greater(n, i32(5)),
                 lambda: while_loop(lambda i: fc.less(i, n), lambda i: i + 2, i32(0)),
                 lambda: n * 10)
    sess = fc.Session(g)
    for k in [2, 5, 6, 9]:
        stats = fc.RunStats()
        got = int(sess.run(z, {n: np.int32(k)}, stats=stats))
        assert got == ((k + k % 2) if k > 5 else 10 * k)
        loop_body_runs = sum(1 for name in stats.nodes_run if name.endswith("/Add"))
        assert (loop_body_runs > 0) == (k > 5)


def test_cond_captures_outside_tensors_and_constants() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((3, 2)), rng.standard_normal((3, 2))
    g = fc.Graph()
    with g.as_default():
        p = fc.placeholder("bool", (), name="p")
        x, y = fc.constant(a), fc.constant(b)
        out = cond(p, lambda: (x * 2.0, fc.reduce_sum(y)), lambda: (x + y, f64(7.0)))
    sess = fc.Session(g)
    t = sess.run(out, {p: True})
    np.testing.assert_allclose(t[0], a * 2)
    assert float(t[1]) == pytest.approx(b.sum())
    f = sess.run(out, {p: False})
    np.testing.assert_allclose(f[0], a + b)
    assert float(f[1]) == 7.0


def test_shape_invariants_are_checked_at_construction() -> None:
    g = fc.Graph()
    with g.as_default():
        v = fc.constant(np.ones(2))
        with pytest.raises(GraphError, match=r"loop variable 1 .*\(2,\).*\(4,\).*shape_invariants"):
            while_loop(lambda i, x: fc.less(i, i32(3)), lambda i, x: (i + 1, fc.concat([x, x], axis=0)),
                       [i32(0), v])
        with pytest.raises(GraphError, match="branches disagree"):
            cond(fc.less(i32(0), i32(1)), lambda: v, lambda: fc.reshape(v, [1, 2]))
    g = fc.Graph()
    with g.as_default():
        v = fc.constant(np.ones(2))
        _, grown = while_loop(lambda i, x: fc.less(i, i32(3)), lambda i, x: (i + 1, fc.concat([x, x], axis=0)),
                              [i32(0), v], shape_invariants=[None, (None,)])
        assert grown.shape == (None,)
    assert fc.Session(g).run(grown).shape == (16,)


def test_loops_round_trip_through_json() -> None:
    g, x, out = _halving(3)
    back = fc.Graph.from_json(g.to_json())
    assert back.to_json() == g.to_json()
    got = fc.Session(back).run([t.name for t in out], {x.name: np.float64(99.0)})
    want = fc.Session(g).run(out, {x: np.float64(99.0)})
    assert [float(v) for v in got] == [float(v) for v in want]


def test_fetching_a_tensor_inside_a_loop_is_refused() -> None:
    g = fc.Graph()
    with g.as_default():
        while_loop(lambda i: fc.less(i, i32(3)), lambda i: i + 1, [i32(0)], name="loop")
    body = next(n for n in g.nodes if n.startswith("loop/Add"))
    with pytest.raises(ExecutionError, match="inside loop frame"):
        fc.Session(g).run(body + ":0")


# ---------------------------------------------------------------------------------------------------
# Gradients (§4.1 with §4.4): finite differences through the project's gradcheck, in float64.

def _rnn(parallel: int):
    def build(x, w):
        def body(i, h):
            return i + 1, fc.tanh(fc.matmul(h, w)) + h * 0.5

        _, h = while_loop(lambda i, h: fc.less(i, i32(4)), body, [i32(0), x], parallel_iterations=parallel)
        return h
    return build


@pytest.mark.parametrize("parallel", [1, 4])
def test_while_gradient_against_finite_differences(parallel: int) -> None:

    rng = np.random.default_rng(3)
    check_gradients(_rnn(parallel), {"x": rng.standard_normal((2, 3)), "w": rng.standard_normal((3, 3))})


def test_gradient_of_a_data_dependent_loop_and_a_cond_inside_it() -> None:

    def growth(x, w):
        def body(h, acc):
            h2 = cond(fc.less(fc.reduce_sum(h), f64(0.0)), lambda: h * 1.5, lambda: fc.tanh(fc.matmul(h, w)) + h)
            return h2, acc + fc.reduce_sum(h2 * h2)

        return while_loop(lambda h, acc: fc.less(fc.reduce_sum(h * h), f64(40.0)), body, [x, f64(0.0)])

    rng = np.random.default_rng(4)
    for _ in range(3):
        check_gradients(growth, {"x": rng.standard_normal((2, 3)), "w": rng.standard_normal((3, 3)) * 0.5})


def test_cond_gradient_differentiates_the_taken_branch() -> None:

    def build(x):
        return cond(fc.greater(fc.reduce_sum(x), f64(0.0)), lambda: fc.tanh(x) * 2.0, lambda: x * x)

    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3))
    check_gradients(build, {"x": x if x.sum() > 0 else -x})
    check_gradients(build, {"x": -x if x.sum() > 0 else x})


def test_a_tensor_entering_a_loop_twice_gets_both_gradients() -> None:
    """x is the loop variable's initial value and, inside the body, an invariant: its gradient is
    the sum of both paths (one of them was dropped once)."""
    rng = np.random.default_rng(3)

    def build(x, w):
        return while_loop(lambda i, a: fc.less(i, i32(3)), lambda i, a: (i + 1, fc.tanh(a * w + x)),
                          [i32(0), x])[1]

    check_gradients(build, {"x": rng.standard_normal(3), "w": rng.standard_normal(3)})


@pytest.mark.parametrize("n", [0, 1, 3])
def test_gradient_of_nested_loops_with_data_dependent_trip_counts(n: int) -> None:
    """The inner loop's trip count depends on the outer counter and a fed value; it reads outer
    body values as invariants (h, s) and the outermost input w: every path differentiated."""
    rng = np.random.default_rng(n)

    def build(x, w, n):
        def outer(i, h):
            s = fc.sin(h) * w
            _, h2 = while_loop(lambda j, a: fc.less(j, n - i),
                               lambda j, a: (j + 1, fc.tanh(a * s + h)), [i32(0), h])
            return i + 1, h2

        return while_loop(lambda i, h: fc.less(i, n), outer, [i32(0), x])[1]

    check_gradients(build, {"x": rng.standard_normal(3), "w": rng.standard_normal(3), "n": np.int32(n)},
                    wrt=["x", "w"])


def test_gradient_of_three_nested_loops() -> None:
    rng = np.random.default_rng(4)

    def build(x, w):
        def l1(i, h):
            def l2(j, a):
                _, a2 = while_loop(lambda k, c: fc.less(k, i32(2)),
                                   lambda k, c: (k + 1, fc.tanh(c * w + a)), [i32(0), a])
                return j + 1, a2

            _, h2 = while_loop(lambda j, a: fc.less(j, i + 1), l2, [i32(0), h])
            return i + 1, h2 * 0.9

        return while_loop(lambda i, h: fc.less(i, i32(2)), l1, [i32(0), x])[1]

    check_gradients(build, {"x": rng.standard_normal(2), "w": rng.standard_normal(2)})


def test_gradient_of_nested_loops_with_a_cond_is_the_same_for_any_parallel_iterations() -> None:
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal(3), rng.standard_normal(3)
    grads = []
    for parallel in (1, 8):
        def build(x, w):
            def outer(i, h):
                def inner(j, a):
                    return j + 1, cond(fc.greater(fc.reduce_sum(a), f64(0.0)),
                                       lambda: fc.tanh(a * w), lambda: a * a * 0.5)

                _, h2 = while_loop(lambda j, a: fc.less(j, i32(3)), inner, [i32(0), h],
                                   parallel_iterations=parallel)
                return i + 1, h2 + x

            return while_loop(lambda i, h: fc.less(i, i32(3)), outer, [i32(0), x],
                              parallel_iterations=parallel)[1]

        check_gradients(build, {"x": x, "w": w})
        g = fc.Graph()
        with g.as_default():
            xp, wp = fc.placeholder("float64", (3,), name="x"), fc.placeholder("float64", (3,), name="w")
            grads.append(fc.Session(g).run(fc.gradients(build(xp, wp), [xp, wp]), {xp: x, wp: w}))
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


def test_cse_and_constant_folding_keep_frames_apart() -> None:
    """The same expression inside and outside a loop, constants pinned in a body and two loop
    variables entering from one tensor: optimized, the loop has the same frames and results."""
    from flowctl.engine.frames import assign_frames
    from flowctl.engine.passes import optimize

    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (), name="x")
        outside = x * 2.0 + f64(1.0) * f64(3.0)
        start = i32(0)

        def body(i, j, h):
            inside = h * 2.0 + f64(1.0) * f64(3.0)  # folds to a Const pinned in the frame
            return i + 1, j + 2, inside

        i, j, h = while_loop(lambda i, j, h: fc.less(i, i32(3)), body, [start, start, x])
        out = [i, j, h, outside]
    want = fc.Session(g).run(out, {x: np.float64(0.5)})
    opt = optimize(g.copy(), keep={x.node} | {t.node for t in out})
    frames = assign_frames(opt)
    assert frames.out_frame["while/Exit"] == "" and frames.exec_frame["while/Exit"] == "while"
    assert len([n for n in opt.nodes.values() if n.op == "Enter" and not n.attrs["is_constant"]]) == 3
    assert len(opt) < len(g)  # something was folded or merged
    got = fc.Session(opt).run([t.name for t in out], {x.name: np.float64(0.5)})
    assert [float(v) for v in got] == [float(v) for v in want] == [3.0, 6.0, 0.5 * 8 + 3 * 7, 4.0]


def test_a_loop_and_its_gradient_round_trip_through_json() -> None:
    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float64", (2, 3), name="x")
        w = fc.placeholder("float64", (3, 3), name="w")
        h = _rnn(2)(x, w)
        grads = fc.gradients(fc.reduce_sum(h * h), [x, w])
    back = fc.Graph.from_json(g.to_json())
    rng = np.random.default_rng(6)
    feeds = {"x:0": rng.standard_normal((2, 3)), "w:0": rng.standard_normal((3, 3))}
    fetch = [h.name] + [t.name for t in grads]
    want = fc.Session(g).run(fetch, feeds)
    got = fc.Session(back).run(fetch, feeds)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


def test_assignments_inside_a_loop_and_a_branch_update_the_variable() -> None:
    g = fc.Graph()
    with g.as_default():
        v = fc.variable(np.zeros(3, np.float32), name="v")
        init = fc.global_variables_initializer()
        p = fc.placeholder("bool", (), name="p")

        def body(i, s):
            up = fc.assign_add(v, fc.ones_like(s))
            return i + 1, s + up

        out = while_loop(lambda i, s: fc.less(i, i32(4)), body, [i32(0), fc.zeros([3], "float32")])
        branch = cond(p, lambda: fc.assign_add(v, fc.ones_like(v) * 10.0), lambda: fc.identity(v))
    sess = fc.Session(g, store=fc.ContainerStore())
    sess.run(init)
    i, s = sess.run(out)
    assert int(i) == 4 and s.tolist() == [10.0] * 3 and sess.run(v).tolist() == [4.0] * 3
    assert sess.run(branch, {p: False}).tolist() == [4.0] * 3
    assert sess.run(branch, {p: True}).tolist() == [14.0] * 3
    assert sess.run(v).tolist() == [14.0] * 3


def test_parallel_iterations_bounds_the_iterations_in_flight() -> None:
    """Iterations whose bodies do not depend on each other overlap up to parallel_iterations: with
    1 each body chain finishes before the next starts, with 4 they interleave."""
    def order(parallel: int) -> list[str]:
        g = fc.Graph()
        with g.as_default():
            def body(i, acc):
                a = fc.cast(i, "float64", name="a")
                x = fc.exp(a * 0.1)
                for _ in range(8):  # a chain longer than the counter's path to the next iteration
                    x = fc.abs_(x)
                c = fc.tanh(x, name="c")
                return i + 1, acc + c

            _, out = while_loop(lambda i, acc: fc.less(i, i32(4)), body, [i32(0), f64(0.0)],
                                parallel_iterations=parallel)
        stats = fc.RunStats()
        got = float(fc.Session(g).run(out, stats=stats))
        assert got == pytest.approx(sum(np.tanh(np.exp(0.1 * k)) for k in range(4)))
        return [n.rsplit("/", 1)[-1] for n in stats.nodes_run if n.rsplit("/", 1)[-1] in ("a", "c")]

    assert order(1) == ["a", "c"] * 4
    overlapped = order(4)
    assert sorted(overlapped) == sorted(["a", "c"] * 4) and overlapped != ["a", "c"] * 4


def test_two_loops_over_one_invariant_keep_their_gradient_sums_apart() -> None:
    """Each loop's gradient sums its invariant's gradient in a buffer of its own, also after
    CSE and constant folding (Session(optimize=True))."""

    def build(x, w):
        a = _rnn(1)(x, w)
        b = _rnn(2)(x * 2.0, w)
        return a * b

    rng = np.random.default_rng(7)
    inputs = {"x": rng.standard_normal((2, 3)), "w": rng.standard_normal((3, 3))}
    check_gradients(build, inputs)
    g = fc.Graph()
    with g.as_default():
        x = fc.constant(inputs["x"])
        w = fc.placeholder("float64", (3, 3), name="w")  # not foldable: CSE alone could merge the sums
        grads = fc.gradients(build(x, w), [w])
    feeds = {w: inputs["w"]}
    plain = fc.Session(g).run(grads, feeds)
    optimized = fc.Session(g, optimize=True)
    for _ in range(2):  # a second run must not see the first run's sums
        np.testing.assert_array_equal(optimized.run(grads, feeds)[0], plain[0])
