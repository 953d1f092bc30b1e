"""Random ops: the determinism rule (draws depend on the graph seed and the node's name or op seed,
never on execution order or on which other ops exist), per-step freshness, state round trips,
and the distributions' moments against closed forms from the math module."""
from __future__ import annotations

import math

import numpy as np
import pytest

import flowctl as fc

BUILDERS = {
    "uniform": lambda **kw: fc.random_uniform((3, 5), minval=-2.0, maxval=3.0, **kw),
    "normal": lambda **kw: fc.random_normal((3, 5), mean=1.0, stddev=2.0, **kw),
    "truncated": lambda **kw: fc.truncated_normal((3, 5), mean=-1.0, stddev=0.5, **kw),
}


def _session(g: fc.Graph) -> fc.Session:
    return fc.Session(g, store=fc.ContainerStore())


def _graph(kind: str, seed: int = 3, **kw: object) -> tuple[fc.Graph, fc.Tensor]:
    g = fc.Graph(seed=seed)
    with g.as_default():
        r = BUILDERS[kind](name="r", **kw)
    return g, r


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_fresh_sessions_replay_the_same_sequence_and_steps_differ(kind):
    g, r = _graph(kind)
    s1, s2 = _session(g), _session(g)
    a1, a2 = s1.run(r), s1.run(r)
    b1, b2 = s2.run(r), s2.run(r)
    np.testing.assert_array_equal(a1, b1)
    np.testing.assert_array_equal(a2, b2)
    assert not np.array_equal(a1, a2)  # the state persists: each step draws afresh
    assert a1.dtype == np.float32 and a1.shape == (3, 5)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_streams_depend_on_name_and_graph_seed_not_on_other_ops(kind):
    g, r = _graph(kind)
    alone = _session(g).run(r)
    # Another random op, added first (so it precedes r in any topological order) and run with it.
    g2 = fc.Graph(seed=3)
    with g2.as_default():
        other = fc.random_normal((7,), name="aaa_other")
        r2 = BUILDERS[kind](name="r")
        third = BUILDERS[kind](name="r_twin")
    got, twin, _ = _session(g2).run([r2, third, other])
    np.testing.assert_array_equal(got, alone)
    assert not np.array_equal(twin, alone)  # a different name is a different stream
    g3, r3 = _graph(kind, seed=4)
    assert not np.array_equal(_session(g3).run(r3), alone)  # the graph seed enters too


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_op_seed_makes_the_stream_independent_of_the_name(kind):
    g = fc.Graph(seed=3)
    with g.as_default():
        a = BUILDERS[kind](name="first", seed=42)
        b = BUILDERS[kind](name="second", seed=42)
        c = BUILDERS[kind](name="third", seed=43)
    va, vb, vc = _session(g).run([a, b, c])
    np.testing.assert_array_equal(va, vb)
    assert not np.array_equal(va, vc)


def test_rng_state_round_trip_continues_the_sequence():
    g = fc.Graph(seed=11)
    with g.as_default():
        u = fc.random_uniform((4,), name="u")
        n = fc.truncated_normal((4,), name="n")
    s = _session(g)
    s.run([u, n])
    saved = s.rng_states()
    assert set(saved) == {"u", "n"}
    expected = [s.run([u, n]) for _ in range(2)]
    resumed = _session(g)
    resumed.set_rng_states(saved)
    got = [resumed.run([u, n]) for _ in range(2)]
    for e, r in zip(expected, got):
        for a, b in zip(e, r):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(fc.GraphError, match="nope"):
        resumed.set_rng_states({"nope": saved["u"]})


def test_graph_json_round_trip_draws_the_same_numbers():
    g = fc.Graph(seed=5)
    with g.as_default():
        fc.random_normal((2, 3), stddev=3.0, seed=9, name="w")
    g2 = fc.Graph.from_json(g.to_json())
    np.testing.assert_array_equal(_session(g).run("w:0"), _session(g2).run("w:0"))


def _normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def test_moments_of_100k_samples():
    n = 100_000
    g = fc.Graph(seed=1)
    with g.as_default():
        u = fc.random_uniform((n,), minval=-1.0, maxval=3.0, dtype="float64")
        r = fc.random_normal((n,), mean=2.0, stddev=3.0)
        t = fc.truncated_normal((n,), mean=-1.0, stddev=2.0)
    vu, vr, vt = _session(g).run([u, r, t])
    assert vu.dtype == np.float64 and vr.dtype == np.float32
    # Uniform on [a, b): mean (a+b)/2, variance (b-a)^2/12.
    assert vu.min() >= -1.0 and vu.max() < 3.0
    assert abs(vu.mean() - 1.0) < 0.02 and abs(vu.var() - 16 / 12) < 0.02
    assert abs(vr.mean() - 2.0) < 0.05 and abs(vr.std() - 3.0) < 0.05
    # A standard normal truncated to [-2, 2] has variance 1 - 2*2*phi(2) / (Phi(2) - Phi(-2)).
    phi2 = math.exp(-2.0) / math.sqrt(2 * math.pi)
    trunc_std = math.sqrt(1 - 4 * phi2 / (_normal_cdf(2) - _normal_cdf(-2)))
    assert np.abs(vt.astype(np.float64) + 1.0).max() <= 4.0 + 1e-5  # never beyond 2 stddev
    assert abs(vt.mean() + 1.0) < 0.03 and abs(vt.std() - 2.0 * trunc_std) < 0.03
    assert np.abs(vt + 1.0).max() > 3.9  # and the range is actually used up to the bound


def test_integer_uniform_and_float_dtypes():
    g = fc.Graph(seed=2)
    with g.as_default():
        i = fc.random_uniform((1000,), minval=3, maxval=7, dtype="int32", name="i")
        a = fc.random_normal((50,), dtype="float64", name="same", seed=5)
        b = fc.random_normal((50,), dtype="float32", name="other", seed=5)
    vi, va, vb = _session(g).run([i, a, b])
    assert vi.dtype == np.int32 and set(vi.tolist()) == {3, 4, 5, 6}
    # Drawn in float64 and rounded: one seed, the same numbers in each float dtype.
    np.testing.assert_array_equal(va.astype(np.float32), vb)


def test_bad_attributes_are_construction_errors():
    with fc.Graph().as_default():
        with pytest.raises(fc.GraphError, match="fully known shape"):
            fc.random_normal((None, 3))
        with pytest.raises(fc.GraphError, match="maxval"):
            fc.random_uniform((3,), minval=2.0, maxval=1.0)
        with pytest.raises(fc.GraphError, match="float dtype"):
            fc.truncated_normal((3,), dtype="int32")


def test_random_ops_are_stateful_and_cost_per_sample():
    from flowctl.engine.opdef import RANDOM, get_op, ops_in_group

    assert {"RandomUniform", "RandomNormal", "TruncatedNormal"} <= ops_in_group(RANDOM)
    op = get_op("RandomNormal")
    assert op.stateful and op.resource == "rng" and not op.differentiable
    g = fc.Graph()
    with g.as_default():
        r = fc.random_normal((10, 20))
    flops, nbytes = op.estimate([], r.op.outputs, r.op.attrs)
    assert flops > 0 and nbytes == 10 * 20 * 4


@pytest.mark.gpu
def test_gpu_draws_equal_cpu_draws():
    g, r = _graph("truncated")
    cpu = _session(g).run(r)
    gpu = fc.Session(g, device="gpu:0", store=fc.ContainerStore()).run(r)
    np.testing.assert_array_equal(cpu, gpu)
