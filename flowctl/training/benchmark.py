"""`flowctl bench SPEC`: each placer's predicted step time beside the step time measured on the
spec's devices (virtual CPU devices here), examples/s and peak memory per device.

Predictions come from the simulator over a *measured* cost model: the step is profiled op by op
once on a device of the same profile, so prediction error is the simulator's (overlap, transfers,
scheduling), not a roofline guess.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import numpy as np

import flowctl as fc
from flowctl.data import make_source
from flowctl.engine.cluster import Cluster
from flowctl.engine.container import ContainerStore
from flowctl.engine.errors import PlacementError
from flowctl.engine.placement import MeasuredCostModel, Placement, place
from flowctl.engine.runtime import DistributedSession, blas_limits
from flowctl.spec.check import LoadedSpec
from flowctl.spec.cluster import cluster_for
from flowctl.training.planning import StepGraph, expert_rules, step_graph
from flowctl.training.strategies import model_inputs


def _feeds(step: StepGraph, loaded: LoadedSpec, batch: int) -> dict[Any, Any]:
    data = make_source(loaded.spec.data.model_dump(), model_inputs(loaded), batch, base_dir=loaded.base_dir)
    feeds: dict[Any, Any] = {step.model.inputs[k]: v for k, v in data.next_batch().items()}
    feeds[step.lr] = np.asarray(0.0, dtype=step.lr.dtype)  # rate 0: the variables stay where they are
    return feeds


def _measure(session: fc.Session, step: StepGraph, feeds: dict[Any, Any], steps: int) -> tuple[float, fc.RunStats]:
    stats = fc.RunStats()
    session.run([step.loss, step.train_op], feeds, stats=stats)  # warm-up: plans, allocator, threads
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        session.run([step.loss, step.train_op], feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), stats


def bench_spec(loaded: LoadedSpec, algorithms: tuple[str, ...] = ("single", "expert", "greedy"),
               steps: int = 5, devices: str | None = None,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
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

    say("profiling every op of the step")
    cost = MeasuredCostModel(cluster, batch=batch)
    one = cluster.devices[0]
    cost.profile(init_session, [step.loss, step.train_op], feeds, repeat=3, threads=one.threads)
    say("calibrating the runtime's per-node cost on one device")
    everything_on_one = {n: one.name for n in g.nodes}
    with blas_limits(cluster), DistributedSession(free, cluster, everything_on_one, store=store) as ds:
        t_one, _ = _measure(ds, step, feeds, steps)
    from flowctl.engine.placement import step_nodes

    dispatch = cost.calibrate(t_one, free, step_nodes(free, [step.train_op.node]), one.name)

    # The same total threads on one device: the baseline model parallelism has to beat.
    total_threads = sum(d.threads for d in cluster.devices)
    whole = Cluster.local(1, threads=total_threads)
    results: dict[str, Any] = {"spec": loaded.spec.name or loaded.spec.model.name, "batch": batch,
                               "devices": cluster.describe(), "placements": {}}
    say(f"one device with all {total_threads} threads")
    with blas_limits(whole):
        s = fc.Session(free, device=whole.devices[0].name, store=store)
        t_whole, st = _measure(s, step, feeds, steps)
    results["one_device_all_threads"] = {"threads": total_threads, "step_s": t_whole,
                                         "examples_per_s": batch / t_whole, "peak_bytes": st.peak_bytes}
    rules = expert_rules(loaded)
    layers = step.model.layer_of()
    for alg in algorithms:
        if alg == "expert" and not rules:
            results["placements"][alg] = {"error": "no rules in the spec"}
            continue
        say(f"{alg}: placing and measuring")
        try:
            pl: Placement = place(g, cluster, cost, alg, targets=[step.train_op.node], rules=rules or None,
                                  layers=layers)
        except PlacementError as e:
            results["placements"][alg] = {"error": str(e)}
            continue
        used = sorted(set(pl.assignment[n] for n in pl.simulation.start))
        with blas_limits(cluster), DistributedSession(g, cluster, pl.assignment, store=store) as ds:
            t, st = _measure(ds, step, feeds, steps)
        per_device = {d: s_.peak_bytes for d, s_ in st.devices.items()}
        results["placements"][alg] = {
            "predicted_step_s": pl.step_time, "measured_step_s": t, "examples_per_s": batch / t,
            "error": None, "prediction_error": (pl.step_time - t) / t, "devices_used": used,
            "peak_bytes_per_device": per_device,
            "predicted_busy_s": {d.device: d.busy for d in pl.devices}, "placement_seconds": pl.seconds,
        }
    ok = {k: v for k, v in results["placements"].items() if v.get("error") is None}
    if len(ok) > 1:
        by_pred = sorted(ok, key=lambda k: ok[k]["predicted_step_s"])
        by_meas = sorted(ok, key=lambda k: ok[k]["measured_step_s"])
        results["same_ranking"] = by_pred == by_meas
        results["ranking_predicted"], results["ranking_measured"] = by_pred, by_meas
    results["cost_model_fallbacks"] = len(cost.fallbacks())
    results["dispatch_us_per_node"] = dispatch * 1e6
    return results
