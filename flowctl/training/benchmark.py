"""`flowctl bench SPEC`: each placer's predicted step time beside the step time measured on the
spec's devices (virtual CPU devices here), examples/s and peak memory per device.

Predictions come from the simulator over a *measured* cost model: the step is profiled op by op
once on a device of the same profile, so prediction error is the simulator's (overlap, transfers,
scheduling), not a roofline guess.
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from typing import Any, Callable

import numpy as np

import flowctl as fc
from flowctl.data import make_source
from flowctl.engine.cluster import Cluster, Link
from flowctl.engine.container import ContainerStore
from flowctl.engine.errors import PlacementError
from flowctl.engine.placement import CostTable, MeasuredCostModel, Placement, place
from flowctl.engine.placement.simulator import contention_for
from flowctl.engine.runtime import DistributedSession, blas_limits
from flowctl.spec.check import LoadedSpec
from flowctl.spec.cluster import cluster_for
from flowctl.training.planning import StepGraph, expert_rules, step_graph
from flowctl.training.strategies import model_inputs


BENCH_SAMPLES = 32  # jittered simulations behind each prediction (seconds, beside minutes of measuring)


def _feeds(step: StepGraph, loaded: LoadedSpec, batch: int) -> dict[Any, Any]:
    data = make_source(loaded.spec.data.model_dump(), model_inputs(loaded), batch, base_dir=loaded.base_dir)
    feeds: dict[Any, Any] = {step.model.inputs[k]: v for k, v in data.next_batch().items()}
    feeds[step.lr] = np.asarray(0.0, dtype=step.lr.dtype)  # rate 0: the variables stay where they are
    return feeds


def _timed_block(session: fc.Session, step: StepGraph, feeds: dict[Any, Any], steps: int) -> list[float]:
    """One untimed step (after another placement ran, caches and BLAS threads are someone else's),
    then `steps` timed ones."""
    session.run([step.loss, step.train_op], feeds)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        session.run([step.loss, step.train_op], feeds)
        times.append(time.perf_counter() - t0)
    return times


def _measure(session: fc.Session, step: StepGraph, feeds: dict[Any, Any], steps: int) -> tuple[float, fc.RunStats]:
    stats = fc.RunStats()
    session.run([step.loss, step.train_op], feeds, stats=stats)  # warm-up: plans, allocator, threads
    return statistics.median(_timed_block(session, step, feeds, steps)), stats


def measure_concurrency(graph: fc.Graph, init: str, cluster: Cluster, devices: tuple[Any, Any], step: StepGraph,
                        feeds: dict[Any, Any], steps: int) -> dict[str, Any]:
    """The whole step on each of two devices alone, then on both at the same time, each with its
    own copy of the state (a split model's devices hold different weights, so they share no
    cache lines). `together / alone` is what contention costs this process; the simulator's
    factor is solved from it (`contention_for`)."""
    sessions = []
    try:
        for d in devices:
            s = DistributedSession(graph, cluster, {n: d.name for n in graph.nodes}, store=ContainerStore())
            sessions.append(s)
            s.run(init)
        with blas_limits(cluster):
            alone: list[float] = []
            for s in sessions:  # each block's untimed first step compiles the plans
                alone += _timed_block(s, step, feeds, steps)
            together: list[list[float]] = [[], []]
            errors: list[BaseException] = []

            def worker(k: int) -> None:
                try:
                    together[k] = _timed_block(sessions[k], step, feeds, steps)
                except BaseException as e:  # noqa: BLE001 -- re-raised on the calling thread
                    errors.append(e)

            threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            if errors:
                raise errors[0]
    finally:
        for s in sessions:
            s.close()
    a, t = statistics.median(alone), statistics.median(together[0] + together[1])
    return {"devices": [d.name for d in devices], "alone_s": a, "together_s": t, "ratio": t / a}


def _set_contention(cost: MeasuredCostModel, graph: fc.Graph, nodes: list[str], cluster: Cluster,
                    cpus: list[Any], ratio: float) -> None:
    table = CostTable.build(graph, cluster, cost, nodes)
    names = cluster.names
    cost.contention = contention_for(table, names.index(cpus[0].name), names.index(cpus[1].name), ratio, cluster)


def measure_links(cluster: Cluster, crossings: int = 40, repeat: int = 7) -> dict[tuple[str, str], Link]:
    """Each pair of devices' link as the runtime moves tensors over it (Send, rendezvous, Recv and
    any copy): a chain of Identity ops alternating between the two devices is timed against the
    same chain on one device, with a 4-byte tensor (latency per crossing) and a 4 MiB one (the
    extra per byte). The simulator then costs transfers as they are, not as a datasheet says."""
    out: dict[tuple[str, str], Link] = {}
    names = cluster.names
    for a_i, a in enumerate(names):
        for b in names[a_i + 1:]:
            per: dict[int, float] = {}
            for n, hops in ((1, crossings), (1 << 20, 4)):
                g = fc.Graph()
                with g.as_default():
                    x = fc.placeholder("float32", (n,), name="x")
                    h = x
                    for k in range(hops):
                        h = fc.identity(h, name=f"hop{k}")
                value = np.ones(n, np.float32)
                took = {}
                for label, far in (("one", a), ("two", b)):
                    pl = {nm: (far if nm.startswith("hop") and int(nm[3:]) % 2 == 0 else a) for nm in g.nodes}
                    with DistributedSession(g, cluster, pl, store=ContainerStore()) as s:
                        s.run(h, {x: value})
                        ts = []
                        for _ in range(repeat):
                            t0 = time.perf_counter()
                            s.run(h, {x: value})
                            ts.append(time.perf_counter() - t0)
                    took[label] = statistics.median(ts)
                # `two` crosses at every even hop and back at the next: `hops` crossings in all.
                per[n] = max(0.0, took["two"] - took["one"]) / hops
            latency = per[1]
            extra = per[1 << 20] - latency
            bandwidth = (4 << 20) / extra if extra > 0 else 1e15  # handed over by reference: free
            out[(a, b)] = Link(bandwidth, latency)
    return out


# ---------------------------------------------------------------------------- statistics
# Step times of one placement come in rounds (blocks measured in turn with the other placements,
# so every placement sees the machine's drift alike). A median's interval is distribution-free
# (order statistics); two placements are told apart only when a rank-sum test and the bootstrap
# interval of their ratio both say so, which keeps false alarms near 5% even at 15 steps each.
BOOT = 2000
LEVEL = 0.95
MIN_STEPS = 5  # fewer timed steps than this per placement: no pair is called, everything ties
PREDICTED_TIE = 0.02  # predicted within 2% of each other: the simulator calls the pair even


def _pooled(rounds: list[list[float]]) -> np.ndarray:
    return np.asarray([t for r in rounds for t in r], dtype=np.float64)


def _binomial_cdf(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n


def median_ci(rounds: list[list[float]]) -> tuple[float, float, float]:
    """(median, low, high): the median step time of all rounds and its distribution-free interval
    of at least 95% (order statistics: the number of steps below the true median is Binomial(n,
    1/2)), so it is honest however few steps there are; under six it is the whole range."""
    x = np.sort(_pooled(rounds))
    n = len(x)
    # x_(k) lies above the median when at most k steps fall below it, P(X <= k): the largest k with
    # that at most (1 - LEVEL) / 2 gives the interval [x_(k), x_(n-1-k)].
    k = 0
    while k + 1 < n - 1 - k and _binomial_cdf(k + 1, n) <= (1 - LEVEL) / 2:
        k += 1
    return float(np.median(x)), float(x[k]), float(x[n - 1 - k])


def _rank_sum_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided p-value of the Mann-Whitney U test (normal approximation with tie correction and
    continuity correction): does one placement's step time tend to be lower than the other's?"""
    n1, n2 = len(a), len(b)
    both = np.concatenate([a, b])
    order = np.argsort(both, kind="mergesort")
    ranks = np.empty(len(both))
    ranks[order] = np.arange(1, len(both) + 1)
    _, inverse, counts = np.unique(both, return_inverse=True, return_counts=True)
    sums = np.zeros(len(counts))
    np.add.at(sums, inverse, ranks)
    ranks = (sums / counts)[inverse]  # ties share their mean rank
    u = ranks[:n1].sum() - n1 * (n1 + 1) / 2
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - float((counts ** 3 - counts).sum()) / (n * (n - 1)))
    if var <= 0:
        return 1.0  # every step took the same time
    z = max(abs(u - n1 * n2 / 2) - 0.5, 0.0) / math.sqrt(var)
    return math.erfc(z / math.sqrt(2))


def compare(a: list[list[float]], b: list[list[float]], seed: int = 0) -> dict[str, Any]:
    """The ratio of median step times a/b, its 95% bootstrap interval, and the rank-sum test's
    p-value. `faster`: "a" or "b" only when the test rejects equal speed at 5% *and* the interval
    leaves out 1, with at least MIN_STEPS steps each; otherwise None, a tie: this many steps cannot
    tell them apart. (Either rule alone is too eager with few steps: a bootstrap of 15 steps calls
    about 8% of equal pairs different.)"""
    xa, xb = _pooled(a), _pooled(b)
    rng = np.random.default_rng(seed)
    ratio = float(np.median(xa) / np.median(xb))
    boot = (np.median(xa[rng.integers(0, len(xa), (BOOT, len(xa)))], axis=1)
            / np.median(xb[rng.integers(0, len(xb), (BOOT, len(xb)))], axis=1))
    q = (1 - LEVEL) / 2
    lo, hi = float(np.quantile(boot, q)), float(np.quantile(boot, 1 - q))
    p = _rank_sum_p(xa, xb)
    faster = None
    if min(len(xa), len(xb)) >= MIN_STEPS and p < 1 - LEVEL:
        faster = "a" if hi < 1 else ("b" if lo > 1 else None)
    return {"ratio": ratio, "low": lo, "high": hi, "p": p, "faster": faster}


def ranking(predicted: dict[str, float], measured: dict[str, list[list[float]]],
            same_placement: Callable[[str, str], bool] = lambda _a, _b: False) -> dict[str, Any]:
    """Does the simulator order the placements as the measurements do? Every pair is compared:
    - "same" / "reversed": the measurements separate the pair (see `compare`), in the predicted
      order or against it;
    - "tie": the measurements cannot separate the pair, which agrees with either prediction,
      because there is no order to get wrong;
    - "predicted tie": the simulator puts the pair within 2% but the measurements separate them:
      a miss of resolution, reported but not a reversal;
    - "same placement": two placers chose the same assignment, so there is nothing to rank.
    `same_ranking` holds when no pair is reversed."""
    names = sorted(predicted, key=lambda k: predicted[k])
    pairs = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:  # a is predicted no slower than b
            c = compare(measured[a], measured[b])
            pr = predicted[a] / predicted[b]
            if same_placement(a, b):
                verdict = "same placement"
            elif c["faster"] is None:
                verdict = "tie"
            elif pr > 1 - PREDICTED_TIE:
                verdict = "predicted tie"
            else:
                verdict = "same" if c["faster"] == "a" else "reversed"
            pairs.append({"predicted_faster": a, "other": b, "predicted_ratio": pr,
                          "measured_ratio": c["ratio"], "measured_low": c["low"], "measured_high": c["high"],
                          "p": c["p"], "verdict": verdict})
    med = {k: float(np.median(_pooled(v))) for k, v in measured.items()}
    return {"ranking_predicted": names, "ranking_measured": sorted(med, key=lambda k: med[k]),
            "pairs": pairs, "same_ranking": all(p["verdict"] != "reversed" for p in pairs),
            "strict_same_order": names == sorted(med, key=lambda k: med[k])}


def bench_spec(loaded: LoadedSpec, algorithms: tuple[str, ...] = ("single", "expert", "greedy"),
               steps: int = 5, devices: str | None = None, rounds: int = 3,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Profile, place with each of `algorithms`, then measure every placement and the one-device
    baseline in `rounds` rounds of `steps` timed steps each, taking turns (the order rotates each
    round), so that drift in the machine's speed falls on all of them alike."""
    say = progress or (lambda _m: None)
    batch = loaded.per_replica_batch
    cluster = cluster_for(loaded.spec, devices)
    if any(d.type != "cpu" for d in cluster.devices):
        from flowctl.kernels.backend import gpu_count

        if gpu_count() == 0:
            raise PlacementError("bench measures on real devices, and this machine has no GPU; use "
                                 "`flowctl place --devices ...` for predictions on hardware that is not here")
    step = step_graph(loaded)
    g = step.graph
    init = step.model.initializer()
    # The same graph without device constraints, for what runs on one device on purpose: the
    # initializer, profiling, calibration and the one-device baseline (variables are shared by name
    # through the store, so every session sees the same state).
    free = g.copy()
    for node in free.nodes.values():
        node.device = ""
    store = ContainerStore()
    init_session = fc.Session(free, device=cluster.devices[0].name, store=store)
    init_session.run(init.node)
    feeds = _feeds(step, loaded, batch)

    cost = MeasuredCostModel(cluster, batch=batch)
    reps: dict[str, Any] = {}  # one device per profile: where its ops are profiled and calibrated
    for d in cluster.devices:
        reps.setdefault(d.profile.name, d)
    for d in reps.values():
        say(f"profiling every op of the step on {d.name}")
        s_d = init_session if d is cluster.devices[0] else fc.Session(free, device=d.name, store=store)
        cost.profile(s_d, [step.loss, step.train_op], feeds, repeat=3, threads=d.threads)
    from flowctl.engine.placement import expect, simulate, step_nodes

    nodes = step_nodes(free, [step.train_op.node])
    # The runtime's per-node cost beyond the kernels, per profile, from the whole step run on one
    # device of it: first from a short run, for the placers; then again from the same runs measured
    # in the rounds beside the placements (so it sees the machine as they do), for the predictions.
    calibrations: dict[str, tuple[DistributedSession, Any]] = {}
    for prof, d in reps.items():
        say(f"calibrating the runtime's per-node cost on {d.name}")
        ds = DistributedSession(free, cluster, {n: d.name for n in g.nodes}, store=store)
        calibrations[prof] = (ds, d)
        with blas_limits(cluster):
            t_one, _ = _measure(ds, step, feeds, max(steps, 8))
        cost.calibrate(t_one, free, nodes, d.name)
    if len(cluster.devices) > 1:
        say("measuring the links between devices")
        with blas_limits(cluster):
            cost.links = measure_links(cluster)
    # Virtual CPU devices of this process share its caches and memory bandwidth: how much they
    # slow each other, from the step run on two of them at once, for the simulator.
    cpus = [d for d in cluster.devices if d.type == "cpu"]
    concurrency: dict[str, Any] | None = None
    if len(cpus) > 1:
        say(f"measuring contention: the step on {cpus[0].name} and {cpus[1].name} at once")
        concurrency = measure_concurrency(free, init.node, cluster, (cpus[0], cpus[1]), step, feeds, max(steps, 4))
        _set_contention(cost, free, nodes, cluster, cpus, concurrency["ratio"])

    # Virtual CPU devices share one machine's cores: the baseline model parallelism has to beat is
    # the whole step on one device with all of their threads. (With a GPU, `single` is the baseline.)
    base = "one_device_all_threads"
    total_threads = sum(d.threads for d in cluster.devices)
    whole = Cluster.local(1, threads=total_threads) if all(d.type == "cpu" for d in cluster.devices) else None
    results: dict[str, Any] = {"spec": loaded.spec.name or loaded.spec.model.name, "batch": batch,
                               "devices": cluster.describe(), "rounds": rounds, "steps": steps,
                               "placements": {}}
    rules = expert_rules(loaded)
    layers = step.model.layer_of()
    # What gets measured: name -> (session, BLAS limit). Sessions stay open for all rounds.
    runs: dict[str, tuple[fc.Session, Cluster]] = {}
    placements: dict[str, Placement] = {}
    for alg in algorithms:
        if alg == "expert" and not rules:
            results["placements"][alg] = {"error": "no rules in the spec"}
            continue
        say(f"{alg}: placing")
        try:
            placements[alg] = place(g, cluster, cost, alg, targets=[step.train_op.node], rules=rules or None,
                                    layers=layers)
        except PlacementError as e:
            results["placements"][alg] = {"error": str(e)}
            continue
    peaks: dict[str, fc.RunStats] = {}
    sessions: list[DistributedSession] = [ds for ds, _ in calibrations.values()]
    try:
        for prof, (ds, _) in calibrations.items():
            runs[f"calibration:{prof}"] = (ds, cluster)
        if whole is not None:
            runs[base] = (fc.Session(free, device=whole.devices[0].name, store=store), whole)
        for alg, pl in placements.items():
            sessions.append(DistributedSession(g, cluster, pl.assignment, store=store))
            runs[alg] = (sessions[-1], cluster)
        times: dict[str, list[list[float]]] = {name: [] for name in runs}
        for name, (s, cl) in runs.items():  # plans, allocator, threads; and each one's memory
            with blas_limits(cl):
                peaks[name] = fc.RunStats()
                s.run([step.loss, step.train_op], feeds, stats=peaks[name])
        order = list(runs)
        for r in range(rounds):
            turn = order[r % len(order):] + order[:r % len(order)]
            for name in turn:
                say(f"round {r + 1}/{rounds}: {name}")
                s, cl = runs[name]
                with blas_limits(cl):
                    times[name].append(_timed_block(s, step, feeds, steps))
    finally:
        for s in sessions:
            s.close()

    def figures(name: str) -> dict[str, Any]:
        med, lo, hi = median_ci(times[name])
        return {"measured_step_s": med, "measured_low_s": lo, "measured_high_s": hi,
                "examples_per_s": batch / med, "rounds_s": times[name]}

    for prof, (_, d) in calibrations.items():
        cost.calibrate(statistics.median(t for r in times[f"calibration:{prof}"] for t in r), free, nodes, d.name)
    results["calibration"] = {d.name: {"profile": prof, **figures(f"calibration:{prof}"),
                                       "dispatch_us_per_node": cost.dispatch_by[prof] * 1e6,
                                       "profile_scale": cost.scale_by.get(prof, 1.0)}
                              for prof, (_, d) in calibrations.items()}
    if concurrency is not None:  # again, over the final calibration
        _set_contention(cost, free, nodes, cluster, cpus, concurrency["ratio"])
        results["contention"] = {**concurrency, "factor": cost.contention}
    # Predictions with the final calibration: the step in expectation over the profile's measured
    # jitter (a schedule that needs near-ties between devices to hold does not get them), beside
    # the exact schedule's; `placed_step_s` is what the placer saw when it chose.
    exact = {alg: simulate(g, pl.assignment, cluster, cost, targets=[step.train_op.node]).step_time
             for alg, pl in placements.items()}
    expected = {alg: expect(g, pl.assignment, cluster, cost, targets=[step.train_op.node], samples=BENCH_SAMPLES)
                for alg, pl in placements.items()}
    predicted = {alg: e.mean for alg, e in expected.items()}
    results["jitter"] = cost.jitter
    if whole is not None:
        b = figures(base)
        results[base] = {"threads": total_threads, "step_s": b["measured_step_s"], **b,
                         "peak_bytes": peaks[base].peak_bytes}
    for alg, pl in placements.items():
        f = figures(alg)
        st = peaks[alg]
        results["placements"][alg] = {
            "predicted_step_s": predicted[alg], "predicted_low_s": expected[alg].low,
            "predicted_high_s": expected[alg].high, "predicted_exact_s": exact[alg],
            "placed_step_s": pl.step_time, **f, "error": None,
            "prediction_error": (predicted[alg] - f["measured_step_s"]) / f["measured_step_s"],
            "devices_used": sorted(set(pl.assignment[n] for n in pl.simulation.start)),
            "peak_bytes_per_device": {d: s_.peak_bytes for d, s_ in st.devices.items()},
            "predicted_busy_s": {d.device: d.busy for d in pl.devices}, "placement_seconds": pl.seconds,
            "vs_one_device": compare(times[alg], times[base]) if whole is not None else None,
        }
    if len(placements) > 1:
        results.update(ranking(predicted,
                               {a: times[a] for a in placements},
                               lambda a, b: placements[a].assignment == placements[b].assignment))
    results["cost_model_fallbacks"] = len(cost.fallbacks())
    results["dispatch_us_per_node"] = cost.dispatch * 1e6
    results["links"] = [{"between": [a, b], "latency_us": lk.latency * 1e6, "bandwidth_gb_s": lk.bandwidth / 1e9}
                        for (a, b), lk in cost.links.items()]
    return results
