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
from pathlib import Path
from typing import Any, Callable

import numpy as np

import flowctl as fc
from flowctl.bench.stats import compare, median_ci, ranking
from flowctl.engine.cluster import Cluster, Link
from flowctl.engine.container import ContainerStore
from flowctl.engine.errors import PlacementError
from flowctl.engine.placement import CostTable, MeasuredCostModel, Placement, expect, simulate, step_nodes
from flowctl.engine.placement.profiler import profile
from flowctl.engine.placement.calibration import contention_for
from flowctl.engine.runtime import DistributedSession, blas_limits
from flowctl.kernels.registry import gpu_count
from flowctl.spec.check import LoadedSpec
from flowctl.spec.model import build_model
from flowctl.training.inputs import make_sources
from flowctl.training.measure import step_feeds as _feeds
from flowctl.training.measure import step_fetches as _fetches
from flowctl.training.measure import timed_block as _timed_block
from flowctl.training.program import Step, StepConfig, build_step, cluster_for, place_step, step_config
from flowctl.training.trace import step_trace, write_trace


BENCH_SAMPLES = 32  # jittered simulations behind each prediction (seconds, beside minutes of measuring)
INPUT_IMAGES = 512  # images an images source decodes for its images/s (a few seconds on 2 cores)


def _measure(session: fc.Session, step: Step, feeds: dict[Any, Any], steps: int) -> tuple[float, fc.RunStats]:
    stats = fc.RunStats()
    session.run(_fetches(step), feeds, stats=stats)  # warm-up: plans, allocator, threads
    return statistics.median(_timed_block(session, step, feeds, steps)), stats


def measure_concurrency(graph: fc.Graph, init: str, cluster: Cluster, devices: tuple[Any, Any], step: Step,
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


OpenSession = Callable[[fc.Graph, dict[str, str]], Any]  # (graph, placement) -> a session (context manager)
MiB4 = 1 << 20  # float32 elements in 4 MiB


def chain_link(open_session: OpenSession, a: str, b: str, crossings: int = 40, repeat: int = 7,
               together: bool = True) -> dict[str, float]:
    """Latency (s per crossing, 4-byte tensor) and bandwidth (bytes/s, from the 4 MiB tensor's extra
    time per crossing) of the link a <-> b as the sessions `open_session` makes move tensors.

    The chain on one device and the chain that crosses at every hop each keep their least disturbed
    run: a loaded machine only adds. With `together` both sessions stay open and are timed in turns,
    so that both see the same machine (Ray workers on a small machine cannot hold two sessions at
    once: they are timed one session after the other). Where the difference is still lost in the
    noise (not positive), the runs are doubled, up to three times."""
    per: dict[int, float] = {}
    for n, hops in ((1, crossings), (MiB4, 4)):
        g = fc.Graph()
        with g.as_default():
            x = fc.placeholder("float32", (n,), name="x")
            h = x
            for k in range(hops):
                h = fc.identity(h, name=f"hop{k}")
        feeds = {x: np.ones(n, np.float32)}
        placements = {"one": {nm: a for nm in g.nodes},
                      "two": {nm: (b if nm.startswith("hop") and int(nm[3:]) % 2 == 0 else a) for nm in g.nodes}}
        best = {"one": math.inf, "two": math.inf}

        def time_runs(sessions: dict[str, Any], runs: int) -> None:
            for s in sessions.values():
                s.run(h, feeds)  # warm-up: plans, actors' first calls
            for _ in range(runs):
                for label, s in sessions.items():
                    t0 = time.perf_counter()
                    s.run(h, feeds)
                    best[label] = min(best[label], time.perf_counter() - t0)

        runs = repeat
        for _attempt in range(4):
            if together:
                with open_session(g, placements["one"]) as s1, open_session(g, placements["two"]) as s2:
                    time_runs({"one": s1, "two": s2}, runs)
            else:
                for label, pl in placements.items():
                    with open_session(g, pl) as s:
                        time_runs({label: s}, runs)
            if best["two"] > best["one"]:
                break
            runs *= 2
        per[n] = max(0.0, best["two"] - best["one"]) / hops  # `two` crosses at every hop
    extra = per[MiB4] - per[1]
    return {"latency_s": per[1], "bandwidth_Bps": (4 * MiB4) / extra if extra > 0 else float("inf")}


def measure_links(cluster: Cluster, crossings: int = 40, repeat: int = 7) -> dict[tuple[str, str], Link]:
    """Each pair of devices' link as the runtime moves tensors over it (Send, rendezvous, Recv and
    any copy): a chain of Identity ops alternating between the two devices is timed against the
    same chain on one device, with a 4-byte tensor (latency per crossing) and a 4 MiB one (the
    extra per byte). The simulator then costs transfers as they are, not as a datasheet says."""
    def open_session(g: fc.Graph, placement: dict[str, str]) -> Any:
        return DistributedSession(g, cluster, placement, store=ContainerStore())

    out: dict[tuple[str, str], Link] = {}
    names = cluster.names
    for a_i, a in enumerate(names):
        for b in names[a_i + 1:]:
            r = chain_link(open_session, a, b, crossings, repeat)
            bandwidth = r["bandwidth_Bps"] if math.isfinite(r["bandwidth_Bps"]) else 1e15  # by reference: free
            out[(a, b)] = Link(bandwidth, r["latency_s"])
    return out


def bench_spec(loaded: LoadedSpec, algorithms: tuple[str, ...] = ("single", "expert", "greedy"),
               steps: int = 5, devices: str | None = None, rounds: int = 3,
               progress: Callable[[str], None] | None = None, trace: Path | None = None) -> dict[str, Any]:
    """Profile, place with each of `algorithms`, then measure every placement and the one-device
    baseline in `rounds` rounds of `steps` timed steps each, taking turns (the order rotates each
    round), so that drift in the machine's speed falls on all of them alike. With `trace`, one
    more step of each placement is traced into that directory (trace-<placer>.json, beside the
    simulator's prediction of it with the final calibration). For an images source, the images/s
    its workers decode and augment at the model's input size beside the model's own examples/s
    (`input_throughput`)."""
    say = progress or (lambda _m: None)
    config = step_config(loaded)
    cluster = cluster_for(config, devices)
    if any(d.type != "cpu" for d in cluster.devices) and gpu_count() == 0:
        raise PlacementError("bench measures on real devices, and this machine has no GPU; use "
                             "`flowctl place --devices ...` for predictions on hardware that is not here")
    step = build_step(build_model(loaded, training=True, devices=len(cluster.devices)), config)
    if step.train is None:
        raise PlacementError(f"bench measures synchronous steps; {step.strategy} runs one client thread per "
                             f"replica (measure it with `flowctl train`)")
    bench = _Bench(step, cluster, loaded, say)
    cost = bench.profile_and_calibrate(steps)
    placements, results = _place_all(step, config, cluster, cost, algorithms, say)
    times, peaks = bench.measure(placements, rounds, steps, traced=trace is not None)
    results = bench.report(results, placements, times, peaks, rounds, steps)
    if loaded.spec.data.source == "images":
        say("images: decoding and augmenting batches")
        batches = max(steps, math.ceil(INPUT_IMAGES / step.batch))
        results["input"] = input_throughput(loaded, step.batch, batches, best_examples_per_s(results))
    if trace is not None:
        results["traces"] = bench.write_traces(trace, placements)
    return results


def best_examples_per_s(results: dict[str, Any]) -> float | None:
    """The model's own speed: the fastest measured run's examples/s (any placement, or the whole
    step on one device), fed the same batch every step."""
    runs = [p for p in results["placements"].values() if p.get("error") is None]
    runs += [results[_Bench.BASE]] if _Bench.BASE in results else []
    return max((p["examples_per_s"] for p in runs), default=None)


def input_throughput(loaded: LoadedSpec, batch: int, batches: int, model_examples_per_s: float | None) -> dict[str, Any]:
    """Images/s an images source delivers at the model's input size (decode, resize, crop, flip,
    normalise, on its worker processes), timed over `batches` batches after one that starts the
    workers, beside the model's examples/s: the smaller limits training. Measured alone: in
    training the decoders and the model share the machine's cores."""
    src = make_sources(loaded, 1, batch)[0]
    try:
        src.next_batch()  # the worker processes start
        t0 = time.perf_counter()
        for _ in range(batches):
            src.next_batch()
        seconds = time.perf_counter() - t0
    finally:
        close = getattr(src, "close", None)
        if close is not None:
            close()
    aug = getattr(src, "aug", None)
    rate = batches * batch / seconds
    return {"source": "images", "images_per_s": rate, "batch": batch, "batches": batches, "seconds": seconds,
            "workers": getattr(src, "workers", None), "files": getattr(src, "n", None),
            "size": [aug.height, aug.width] if aug is not None else None,
            "model_examples_per_s": model_examples_per_s,
            "limits": None if model_examples_per_s is None else "input" if rate < model_examples_per_s else "model"}


def one_device_reference(times: dict[str, list[list[float]]], placements: dict[str, Placement],
                         whole: str | None) -> str | None:
    """What a placement's speed-up is measured against: the faster, by median, of the one-device
    runs measured beside it -- the whole step on one device with every device's threads
    (`whole`), and the `single` placement (the spec's first device, its own threads). Either can
    be the faster: on a loaded machine BLAS at two threads ran lstm_lm's step slower than one
    thread did, and a ratio against that run alone read 1.73x for what was no faster than
    `single`. None where neither was measured."""
    runs = [name for name in (whole, "single") if name is not None and name in times and
            (name != "single" or (name in placements and len(set(placements[name].assignment.values())) == 1))]
    if not runs:
        return None
    return min(runs, key=lambda name: median_ci(times[name])[0])


def _place_all(step: Step, config: StepConfig, cluster: Cluster, cost: MeasuredCostModel,
               algorithms: tuple[str, ...], say: Callable[[str], None]) -> tuple[dict[str, Placement], dict[str, Any]]:
    results: dict[str, Any] = {"spec": "", "batch": step.batch, "devices": cluster.describe(), "placements": {}}
    placements: dict[str, Placement] = {}
    for alg in algorithms:
        if alg == "expert" and not config.expert_rules():
            results["placements"][alg] = {"error": "no rules in the spec (placement.constraints or parallelism.groups)"}
            continue
        say(f"{alg}: placing")
        try:
            placements[alg] = place_step(step, config, cluster, cost, alg).chosen
        except PlacementError as e:
            results["placements"][alg] = {"error": str(e)}
    return placements, results


class _Bench:
    """One spec's step on one cluster: the sessions, the measured cost model and the timings."""

    BASE = "one_device_all_threads"

    def __init__(self, step: Step, cluster: Cluster, loaded: LoadedSpec, say: Callable[[str], None]) -> None:
        self.step, self.cluster, self.say = step, cluster, say
        self.name = loaded.spec.name or loaded.spec.model.name
        g = step.graph
        # The same graph without device constraints, for what runs on one device on purpose: the
        # initializer, profiling, calibration and the one-device baseline (variables are shared by
        # name through the store, so every session sees the same state).
        self.free = g.copy()
        for node in self.free.nodes.values():
            node.device = ""
        self.store = ContainerStore()
        self.init_session = fc.Session(self.free, device=cluster.devices[0].name, store=self.store)
        self.init_session.run(step.init.node)
        self.feeds = _feeds(step, loaded)
        self.nodes = step_nodes(self.free, step.targets)
        self.cost = MeasuredCostModel(cluster, batch=step.batch)
        self.calibrations: dict[str, tuple[DistributedSession, Any]] = {}
        self.traced: dict[str, tuple[fc.RunStats, dict[str, fc.Graph]]] = {}  # placer -> a step's stats, partitions
        self.concurrency: dict[str, Any] | None = None
        self.cpus = [d for d in cluster.devices if d.type == "cpu"]
        # Virtual CPU devices share one machine's cores: the baseline model parallelism has to beat
        # is the whole step on one device with all of their threads. (With a GPU, `single` is it.)
        self.total_threads = sum(d.threads for d in cluster.devices)
        self.whole = Cluster.local(1, threads=self.total_threads) if all(d.type == "cpu" for d in cluster.devices) \
            else None

    def profile_and_calibrate(self, steps: int) -> MeasuredCostModel:
        cluster, cost, step, feeds = self.cluster, self.cost, self.step, self.feeds
        reps: dict[str, Any] = {}  # one device per profile: where its ops are profiled and calibrated
        for d in cluster.devices:
            reps.setdefault(d.profile.name, d)
        for d in reps.values():
            self.say(f"profiling every op of the step on {d.name}")
            s_d = self.init_session if d is cluster.devices[0] else fc.Session(self.free, device=d.name,
                                                                               store=self.store)
            profile(cost, s_d, _fetches(step), feeds, repeat=3, threads=d.threads)
        # The runtime's per-node cost beyond the kernels, per profile, from the whole step run on
        # one device of it: first from a short run, for the placers; then again from the same runs
        # measured in the rounds beside the placements (so it sees the machine as they do).
        for prof, d in reps.items():
            self.say(f"calibrating the runtime's per-node cost on {d.name}")
            ds = DistributedSession(self.free, cluster, {n: d.name for n in self.free.nodes}, store=self.store)
            self.calibrations[prof] = (ds, d)
            with blas_limits(cluster):
                t_one, _ = _measure(ds, step, feeds, max(steps, 8))
            cost.calibrate(t_one, self.free, self.nodes, d.name)
        if len(cluster.devices) > 1:
            self.say("measuring the links between devices")
            with blas_limits(cluster):
                cost.links = measure_links(cluster)
        # Virtual CPU devices of this process share its caches and memory bandwidth: how much they
        # slow each other, from the step run on two of them at once, for the simulator.
        if len(self.cpus) > 1:
            a, b = self.cpus[0], self.cpus[1]
            self.say(f"measuring contention: the step on {a.name} and {b.name} at once")
            self.concurrency = measure_concurrency(self.free, step.init.node, cluster, (a, b), step, feeds,
                                                   max(steps, 4))
            _set_contention(cost, self.free, self.nodes, cluster, self.cpus, self.concurrency["ratio"])
        return cost

    def measure(self, placements: dict[str, Placement], rounds: int, steps: int,
                traced: bool = False) -> tuple[dict[str, list[list[float]]], dict[str, fc.RunStats]]:
        """Every placement, the calibration runs and the one-device baseline, in rounds; with
        `traced`, then one step of each placement with its timeline kept (self.traced)."""
        runs: dict[str, tuple[fc.Session, Cluster]] = {}  # name -> (session, its BLAS limit)
        peaks: dict[str, fc.RunStats] = {}
        sessions: list[DistributedSession] = [ds for ds, _ in self.calibrations.values()]
        try:
            for prof, (ds, _) in self.calibrations.items():
                runs[f"calibration:{prof}"] = (ds, self.cluster)
            if self.whole is not None:
                runs[self.BASE] = (fc.Session(self.free, device=self.whole.devices[0].name, store=self.store),
                                   self.whole)
            placed: dict[str, DistributedSession] = {}
            for alg, pl in placements.items():
                assignment = dict(pl.assignment)
                placed[alg] = DistributedSession(self.step.graph, self.cluster, assignment, store=self.store)
                sessions.append(placed[alg])
                runs[alg] = (placed[alg], self.cluster)
            times: dict[str, list[list[float]]] = {name: [] for name in runs}
            for name, (s, cl) in runs.items():  # plans, allocator, threads; and each one's memory
                with blas_limits(cl):
                    peaks[name] = fc.RunStats()
                    s.run(_fetches(self.step), self.feeds, stats=peaks[name])
            order = list(runs)
            for r in range(rounds):
                turn = order[r % len(order):] + order[:r % len(order)]
                for name in turn:
                    self.say(f"round {r + 1}/{rounds}: {name}")
                    s, cl = runs[name]
                    with blas_limits(cl):
                        times[name].append(_timed_block(s, self.step, self.feeds, steps))
            for alg, ds in placed.items() if traced else ():
                self.say(f"{alg}: tracing a step")
                stats = fc.RunStats()
                with blas_limits(self.cluster):
                    ds.run(_fetches(self.step), self.feeds, stats=stats)
                self.traced[alg] = (stats, ds.step_plan(_fetches(self.step), self.feeds).partitions)
        finally:
            for s in sessions:
                s.close()
        return times, peaks

    def write_traces(self, directory: Path, placements: dict[str, Placement]) -> dict[str, str]:
        """The traced steps as Chrome traces, each beside the simulator's schedule of its placement."""
        out = {}
        for alg, (stats, graphs) in self.traced.items():
            sim = simulate(self.step.graph, placements[alg].assignment, self.cluster, self.cost,
                           targets=self.step.targets)
            trace = step_trace(stats, graphs, self.step.layers, sim, title=f"{self.name} {alg}")
            out[alg] = str(write_trace(directory / f"trace-{alg}.json", trace))
        return out

    def report(self, results: dict[str, Any], placements: dict[str, Placement], times: dict[str, list[list[float]]],
               peaks: dict[str, fc.RunStats], rounds: int, steps: int) -> dict[str, Any]:
        cost, g, targets, batch, base = self.cost, self.step.graph, self.step.targets, self.step.batch, self.BASE

        def figures(name: str) -> dict[str, Any]:
            med, lo, hi = median_ci(times[name])
            return {"measured_step_s": med, "measured_low_s": lo, "measured_high_s": hi,
                    "examples_per_s": batch / med, "rounds_s": times[name]}

        results.update(spec=self.name, rounds=rounds, steps=steps)
        for prof, (_, d) in self.calibrations.items():
            cost.calibrate(statistics.median(t for r in times[f"calibration:{prof}"] for t in r), self.free,
                           self.nodes, d.name)
        results["calibration"] = {d.name: {"profile": prof, **figures(f"calibration:{prof}"),
                                           "dispatch_us_per_node": cost.dispatch_by[prof] * 1e6,
                                           "profile_scale": cost.scale_by.get(prof, 1.0)}
                                  for prof, (_, d) in self.calibrations.items()}
        if self.concurrency is not None:  # again, over the final calibration
            _set_contention(cost, self.free, self.nodes, self.cluster, self.cpus, self.concurrency["ratio"])
            results["contention"] = {**self.concurrency, "factor": cost.contention}
        # Predictions with the final calibration: the step in expectation over the profile's
        # measured jitter (a schedule that needs near-ties between devices to hold does not get
        # them), beside the exact schedule's; `placed_step_s` is what the placer saw when it chose.
        exact = {alg: simulate(g, pl.assignment, self.cluster, cost, targets=targets).step_time
                 for alg, pl in placements.items()}
        expected = {alg: expect(g, pl.assignment, self.cluster, cost, targets=targets, samples=BENCH_SAMPLES)
                    for alg, pl in placements.items()}
        predicted = {alg: e.mean for alg, e in expected.items()}
        results["jitter"] = cost.jitter
        if self.whole is not None:
            b = figures(base)
            results[base] = {"threads": self.total_threads, "step_s": b["measured_step_s"], **b,
                             "peak_bytes": peaks[base].peak_bytes}
        reference = one_device_reference(times, placements, base if self.whole is not None else None)
        if reference is not None:
            results["one_device_reference"] = {"name": reference, "step_s": median_ci(times[reference])[0]}
            if self.whole is not None:
                results[base]["vs_best_one_device"] = compare(times[base], times[reference])
        for alg, pl in placements.items():
            f = figures(alg)
            results["placements"][alg] = {
                "predicted_step_s": predicted[alg], "predicted_low_s": expected[alg].low,
                "predicted_high_s": expected[alg].high, "predicted_exact_s": exact[alg],
                "placed_step_s": pl.step_time, **f, "error": None,
                "prediction_error": (predicted[alg] - f["measured_step_s"]) / f["measured_step_s"],
                "devices_used": sorted(set(pl.assignment[n] for n in pl.simulation.start)),
                "peak_bytes_per_device": {d: s_.peak_bytes for d, s_ in peaks[alg].devices.items()},
                "predicted_busy_s": {d.device: d.busy for d in pl.devices}, "placement_seconds": pl.seconds,
                "vs_one_device": compare(times[alg], times[base]) if self.whole is not None else None,
                "vs_best_one_device": compare(times[alg], times[reference]) if reference is not None else None,
            }
        if len(placements) > 1:
            results.update(ranking(predicted, {a: times[a] for a in placements},
                                   lambda a, b: placements[a].assignment == placements[b].assignment))
        results["cost_model_fallbacks"] = len(cost.fallbacks())
        results["dispatch_us_per_node"] = cost.dispatch * 1e6
        results["links"] = [{"between": [a, b], "latency_us": lk.latency * 1e6, "bandwidth_gb_s": lk.bandwidth / 1e9}
                            for (a, b), lk in cost.links.items()]
        return results


__all__ = ["BENCH_SAMPLES", "bench_spec", "input_throughput", "measure_concurrency", "measure_links", "one_device_reference"]
