"""The bench's statistics (flowctl.training.benchmark): median step time with a distribution-free
interval, the ratio of two placements with its interval, and whether the simulator's ranking of
placements agrees with the measured one when ties (pairs the measurements cannot separate) agree
with either order. Samples are synthetic, from seeded generators: the verdicts are deterministic."""
from __future__ import annotations

import statistics

import numpy as np
import pytest

from flowctl.bench.stats import compare, median_ci, ranking


def rounds(rng: np.random.Generator, mu: float, sd: float, r: int = 3, n: int = 5) -> list[list[float]]:
    return [rng.normal(mu, sd, n).tolist() for _ in range(r)]


def pooled_median(rs: list[list[float]]) -> float:
    return statistics.median(t for r in rs for t in r)


# ----------------------------------------------------------------------------- median_ci
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("shape", [(3, 5), (1, 7), (4, 2)])
def test_median_ci_brackets_the_pooled_median(seed, shape):
    rng = np.random.default_rng(seed)
    rs = rounds(rng, 0.05, 0.01, *shape)
    med, lo, hi = median_ci(rs)
    assert med == pooled_median(rs)
    assert lo <= med <= hi
    assert lo < hi  # continuous samples: the resampled medians differ
    assert min(min(r) for r in rs) <= lo and hi <= max(max(r) for r in rs)


def test_median_ci_is_narrower_with_more_samples():
    # One small sample's bootstrap interval varies a lot in width (the median of 15 steps has few
    # distinct resampled values), so compare the mean width over ten samples of each size.
    rng = np.random.default_rng(3)
    widths = {}
    for n in (5, 80):
        w = []
        for _ in range(10):
            med, lo, hi = median_ci(rounds(rng, 1.0, 0.1, 3, n))
            assert lo <= med <= hi
            w.append(hi - lo)
        widths[n] = float(np.mean(w))
    # 16x the samples: about 4x narrower (measured 3.3x); at least 2x.
    assert widths[80] * 2 < widths[5], widths


def test_median_ci_is_the_order_statistic_interval():
    """Distribution-free: of 15 steps the 4th and 12th smallest (P(at most 3 of 15 below the median)
    = 1.8% each side); under six steps no pair of order statistics reaches 95%: the whole range."""
    assert median_ci([[float(x) for x in range(1, 16)]]) == (8.0, 4.0, 12.0)
    assert median_ci([[5.0, 1.0], [3.0, 2.0, 4.0]]) == (3.0, 1.0, 5.0)
    assert median_ci([[1.0] * 5, [2.0] * 5, [3.0] * 5]) == (2.0, 1.0, 3.0)  # drift between rounds counts


def test_median_ci_covers_the_true_median_at_least_95_percent():
    """On a skewed distribution (step times have a long right tail) and the default 3 x 5 steps,
    where a bootstrap interval covers only about 85%."""
    rng = np.random.default_rng(11)
    covered = 0
    for _ in range(400):
        _, lo, hi = median_ci([rng.lognormal(0.0, 0.3, 5).tolist() for _ in range(3)])
        covered += lo <= 1.0 <= hi  # lognormal(0, s) has median e^0
    assert covered / 400 >= 0.94


# ----------------------------------------------------------------------------- compare
def test_compare_separated_samples_names_the_faster():
    rng = np.random.default_rng(0)
    a, b = rounds(rng, 1.0, 0.02), rounds(rng, 1.5, 0.02)
    c = compare(a, b)
    assert c["faster"] == "a"
    assert c["low"] <= c["ratio"] <= c["high"] < 1
    assert c["ratio"] == pytest.approx(pooled_median(a) / pooled_median(b))
    assert c["ratio"] == pytest.approx(1 / 1.5, rel=0.05)
    s = compare(b, a)
    assert s["faster"] == "b"
    assert 1 < s["low"] <= s["ratio"] <= s["high"]
    assert s["ratio"] == pytest.approx(1 / c["ratio"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compare_overlapping_samples_is_a_tie(seed):
    rng = np.random.default_rng(seed)
    a, b = rounds(rng, 1.0, 0.3, 3, 20), rounds(rng, 1.0, 0.3, 3, 20)
    c = compare(a, b)
    assert c["faster"] is None
    assert c["low"] <= 1 <= c["high"]
    assert c["high"] - c["low"] > 0.1  # wide noise, wide interval


def test_compare_identical_measurements_is_a_tie():
    rs = rounds(np.random.default_rng(4), 1.0, 0.3)
    c = compare(rs, [list(r) for r in rs])
    assert c["ratio"] == 1.0 and c["faster"] is None
    const = [[2.0] * 4] * 3
    assert compare(const, const) == {"ratio": 1.0, "low": 1.0, "high": 1.0, "p": 1.0, "faster": None}


def test_compare_is_reproducible_for_a_seed():
    rng = np.random.default_rng(9)
    a, b = rounds(rng, 1.0, 0.2), rounds(rng, 1.1, 0.2)
    assert compare(a, b) == compare(a, b) == compare(a, b, seed=0)
    assert compare(a, b, seed=1)["ratio"] == compare(a, b)["ratio"]  # the ratio itself does not resample


def test_compare_with_few_steps_calls_nothing():
    """One step a round: however far apart, three steps each cannot make a verdict."""
    assert compare([[1.0], [1.01], [0.99]], [[2.0], [2.02], [1.98]])["faster"] is None
    assert compare([[1.0, 1.01, 0.99, 1.0, 1.02]], [[2.0, 2.02, 1.98, 2.0, 2.01]])["faster"] == "a"


def test_compare_calls_equal_placements_different_at_most_5_percent_of_the_time():
    """The false-alarm rate at the default 3 rounds x 5 steps, on a long-tailed distribution: the
    rank-sum test and the interval must both agree (a bootstrap alone called about 8%)."""
    rng = np.random.default_rng(12)
    alarms = sum(compare([rng.lognormal(0, 0.2, 5).tolist() for _ in range(3)],
                         [rng.lognormal(0, 0.2, 5).tolist() for _ in range(3)])["faster"] is not None
                 for _ in range(300))
    assert alarms / 300 <= 0.05, alarms


def test_compare_finds_a_10_percent_difference_in_3_by_5_steps():
    rng = np.random.default_rng(13)
    found = sum(compare([rng.normal(1.0, 0.03, 5).tolist() for _ in range(3)],
                        [rng.normal(1.1, 0.03, 5).tolist() for _ in range(3)])["faster"] == "a"
                for _ in range(100))
    assert found >= 95


# ----------------------------------------------------------------------------- ranking
def test_ranking_with_a_tie_is_the_same_ranking():
    rng = np.random.default_rng(5)
    measured = {"x": rounds(rng, 1.0, 0.02), "y": rounds(rng, 1.5, 0.3), "z": rounds(rng, 1.5, 0.3)}
    r = ranking({"z": 3.0, "x": 1.0, "y": 2.0}, measured)
    assert r["ranking_predicted"] == ["x", "y", "z"]
    verdicts = {(p["predicted_faster"], p["other"]): p["verdict"] for p in r["pairs"]}
    assert verdicts == {("x", "y"): "same", ("x", "z"): "same", ("y", "z"): "tie"}
    assert r["same_ranking"] is True
    med = {k: pooled_median(v) for k, v in measured.items()}
    assert r["ranking_measured"] == sorted(med, key=med.get)
    assert r["strict_same_order"] == (med["y"] < med["z"])
    for p in r["pairs"]:
        a, b = p["predicted_faster"], p["other"]
        assert p["predicted_ratio"] == pytest.approx({"x": 1.0, "y": 2.0, "z": 3.0}[a] / {"x": 1.0, "y": 2.0, "z": 3.0}[b])
        assert p["measured_ratio"] == pytest.approx(med[a] / med[b])
        assert p["measured_low"] <= p["measured_ratio"] <= p["measured_high"]


def test_ranking_tie_measured_in_the_other_order_still_agrees():
    """y and z cannot be told apart; z's median happens to be lower. The strict order differs, but
    no significant pair contradicts the prediction."""
    rng = np.random.default_rng(6)
    y = rounds(rng, 1.5, 0.3)
    z = [[t - 0.01 for t in reversed(r)] for r in y]
    r = ranking({"x": 1.0, "y": 2.0, "z": 3.0}, {"x": rounds(rng, 1.0, 0.02), "y": y, "z": z})
    assert r["ranking_measured"] == ["x", "z", "y"]
    assert r["strict_same_order"] is False
    assert [p["verdict"] for p in r["pairs"]] == ["same", "same", "tie"]
    assert r["same_ranking"] is True


def test_ranking_a_clear_pair_measured_the_other_way_is_reversed():
    rng = np.random.default_rng(7)
    measured = {"x": rounds(rng, 2.0, 0.02), "y": rounds(rng, 1.0, 0.02), "z": rounds(rng, 3.0, 0.02)}
    r = ranking({"x": 1.0, "y": 2.0, "z": 3.0}, measured)
    verdicts = {(p["predicted_faster"], p["other"]): p["verdict"] for p in r["pairs"]}
    assert verdicts == {("x", "y"): "reversed", ("x", "z"): "same", ("y", "z"): "same"}
    assert r["ranking_measured"] == ["y", "x", "z"]
    assert r["same_ranking"] is False
    assert r["strict_same_order"] is False


def test_ranking_an_even_prediction_is_not_a_reversal():
    """The simulator puts x and y within 2%; the measurements separate them. That is a miss of
    resolution, reported as such, not an order the simulator got wrong."""
    rng = np.random.default_rng(14)
    r = ranking({"x": 1.0, "y": 1.01}, {"x": rounds(rng, 1.5, 0.02), "y": rounds(rng, 1.0, 0.02)})
    assert [p["verdict"] for p in r["pairs"]] == ["predicted tie"]
    assert r["same_ranking"] is True and r["strict_same_order"] is False


def test_ranking_the_same_placement_twice_is_not_ranked():
    rng = np.random.default_rng(15)
    measured = {"x": rounds(rng, 1.5, 0.02), "y": rounds(rng, 1.0, 0.02)}
    r = ranking({"x": 1.0, "y": 2.0}, measured, same_placement=lambda a, b: True)
    assert [p["verdict"] for p in r["pairs"]] == ["same placement"]
    assert r["same_ranking"] is True
    assert ranking({"x": 1.0, "y": 2.0}, measured)["pairs"][0]["verdict"] == "reversed"


def test_ranking_of_two_placements_has_one_pair():
    rng = np.random.default_rng(8)
    r = ranking({"greedy": 0.5, "single": 0.9}, {"greedy": rounds(rng, 1.0, 0.02), "single": rounds(rng, 1.2, 0.02)})
    assert len(r["pairs"]) == 1
    p = r["pairs"][0]
    assert (p["predicted_faster"], p["other"], p["verdict"]) == ("greedy", "single", "same")
    assert r["same_ranking"] is True and r["strict_same_order"] is True


# ----------------------------------------------------------------------------- measured links
def test_links_are_measured_through_the_runtime_and_cost_transfers(tmp_path):
    from flowctl.engine.cluster import Cluster
    from flowctl.engine.placement import MeasuredCostModel
    from flowctl.bench.spec import measure_links

    cluster = Cluster.local(3, threads=3)
    links = measure_links(cluster, crossings=10, repeat=3)
    a, b, c = cluster.names
    assert set(links) == {(a, b), (a, c), (b, c)}
    for lk in links.values():
        # A crossing is a Send, a rendezvous hand-over and a Recv on another thread: microseconds
        # to a few milliseconds on any machine, never free.
        assert 1e-6 < lk.latency < 5e-2 and lk.bandwidth > 0
    cost = MeasuredCostModel(cluster, batch=1)
    static = cost.transfer_time(1000, a, b)
    cost.links = links
    assert cost.transfer_time(1000, b, a) == pytest.approx(links[(a, b)].latency + 1000 / links[(a, b)].bandwidth)
    assert cost.transfer_time(1000, a, a) == 0.0
    assert static == pytest.approx(cluster.link(a, b).latency + 1000 / cluster.link(a, b).bandwidth)
    cost.save(tmp_path / "m.json")
    assert MeasuredCostModel.load(tmp_path / "m.json", cluster).links == links


def _loop_graph():
    import flowctl as fc
    from flowctl.engine.control_flow import while_loop

    g = fc.Graph()
    with g.as_default():
        x = fc.placeholder("float32", (4, 8), name="x")
        w = fc.constant(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32), name="w")
        out = while_loop(lambda i, h: fc.less(i, fc.constant(np.int32(10))),
                         lambda i, h: (i + 1, fc.tanh(fc.matmul(h, w, name="mm"), name="act")),
                         [fc.constant(np.int32(0)), x], expected_iterations=10)
    return g, x, out


def test_a_step_with_a_loop_is_profiled_per_iteration_and_calibrated_by_its_runs():
    """The profiler cannot run a loop node by node: it times the frame executor's kernel runs. The
    calibration then counts a loop node's dispatch once per iteration (a step of N nodes, some
    in a 10-iteration loop, is not N dispatches)."""
    import flowctl as fc
    from flowctl.engine.cluster import Cluster
    from flowctl.engine.frames import run_counts
    from flowctl.engine.placement import MeasuredCostModel
    from flowctl.engine.placement.profiler import profile

    g, x, out = _loop_graph()
    cluster = Cluster.local(1)
    cost = MeasuredCostModel(cluster, batch=4)
    sess = fc.Session(g, device=cluster.names[0])
    assert profile(cost, sess, out[1], {x: np.ones((4, 8), np.float32)}, repeat=2) > 0
    for name in ("while/mm", "while/act"):
        assert cost.key_for(g, g.nodes[name], cluster.names[0]) in cost.records
    nodes = list(g.nodes)
    runs = run_counts(g)
    assert runs["while/mm"] == 10
    kernels = sum(runs.get(n, 1.0) * cost.op_time(g, g.nodes[n], cluster.names[0]) for n in nodes)
    measured = kernels + 1e-3  # what the runtime adds beyond the kernels: 1 ms over the step
    d = cost.calibrate(measured, g, nodes, cluster.names[0])
    weighted = sum(runs.get(n, 1.0) for n in nodes)
    assert d == pytest.approx(1e-3 / weighted, rel=1e-6)
