"""Measurements of the distributed engine on Ray (issue 15), printed as JSON:

    python -m flowctl.bench.ray [--repeat 7] [--steps 20] [--links-only]

- Cross-worker Send/Recv: latency (4 B tensor) and bandwidth (4 MiB tensor) between two worker
  processes, beside the in-process rendezvous between two virtual CPU devices. Both are measured
  the way `flowctl bench` measures links: a chain of Identity ops alternating between the two
  devices, timed against the same chain on one device; the difference per crossing is the cost of
  the crossing (Send, rendezvous, Recv and any copy).
- The cross-worker rate per tensor size (`link_rates`: 4 MiB and 64 MiB float32, GB/s, median of
  the repeats): a tensor a Variable holds on one worker crosses to the other and back, with no
  feed or fetch through the master, so only the crossings differ from the chain on one worker.
- What a step costs beyond its kernels: a Run on one Ray worker (the master's call, the feed and
  the fetch, 4 B and 256 KiB) beside one in this process.
- Sync data parallel over 2 workers against 1 (examples/s) on a small MLP, beside the same over 1
  and 2 virtual CPUs of one process, and the simulator's prediction for the 2-worker step given the
  measured Ray link.

Starts a local Ray cluster of its own (4 logical CPUs, so the 1- and 2-worker sessions are open
at once; a 600 MiB object store, so a step's four 64 MiB crossings stay in shared memory; in a
fresh temporary directory) unless this process is connected already, and shuts it down afterwards.
`--links-only` measures the per-size rates alone.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

import flowctl as fc
from flowctl.engine import strategies as st
from flowctl.engine.cluster import Cluster, Link
from flowctl.engine.container import ContainerStore
from flowctl.engine.devices import canonical
from flowctl.engine.optimizers import SGD
from flowctl.bench.spec import OpenSession, chain_link
from flowctl.engine.runtime import DistributedSession, blas_limits

OpenSyncSession = Callable[[fc.Graph, dict[str, str], Sequence[str]], Any]  # ... and its devices


def run_overhead(open_session: OpenSession, device: str, sizes: Sequence[int] = (1, 64 * 1024),
                 repeat: int = 30) -> dict[str, float]:
    """Median seconds of a step that feeds one float32 tensor of each size to `device`, passes it
    through one Identity and fetches it: what a Run costs beyond its kernels (for a Ray worker, the
    master's call and its answer, with the feed and the fetch)."""
    out = {}
    for n in sizes:
        g = fc.Graph()
        with g.as_default():
            x = fc.placeholder("float32", (n,), name="x")
            y = fc.identity(x, name="y")
        value = np.ones(n, np.float32)
        with open_session(g, {"x": device, "y": device}) as s:
            s.run(y, {x: value})
            ts = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                s.run(y, {x: value})
                ts.append(time.perf_counter() - t0)
        out[f"{4 * n}_bytes_s"] = statistics.median(ts)
    return out


def link_rates(open_session: OpenSession, a: str, b: str, sizes: Sequence[int] = (4 << 20, 64 << 20),
               hops: int = 4, repeat: int = 7, store_bytes: int | None = None) -> dict[str, Any]:
    """The link a <-> b per tensor size (bytes of float32): a Variable's tensor on `a` passes through
    `hops` Identity ops that alternate b, a, b, ... (every hop a crossing) and the step's target waits
    for the last one; the same chain on `a` alone is the baseline, and a 4-byte tensor's chain the
    fixed cost of a crossing. Nothing moves through the master (no feed, no fetch). The two chains
    are timed in alternating rounds; per size, the median step of each.

    The rates are a training run's after its first steps: before the rounds, each size's chain runs
    untimed until twice the object store's bytes (`store_bytes`, default the cluster's) have
    crossed. Two fresh workers fault in the store's shared pages as they first write and read them
    (16,384 faults per 64 MiB, one for each 4 KiB page, in each of the two processes), which a run
    pays once, in its first steps: measured on a 2-core AMD EPYC host, a fresh pair's first 64 MiB
    chains took 417 and 106 ms, then 63-70 after one untimed run (4.8 GB/s) and 55-60 after ten
    (5.8 GB/s).

    Per size: `crossing_s` (the median step's extra time per crossing), `GBps` (the bytes over that
    time less the 4-byte crossing's: the rate the simulator's `Link.bandwidth` means) and
    `GBps_whole` (the bytes over the whole crossing)."""
    def chain(n: int) -> tuple[fc.Graph, fc.Tensor, fc.Tensor, dict[str, dict[str, str]]]:
        g = fc.Graph()
        with g.as_default():
            v = fc.variable(fc.zeros((n,)), name="v")
            h = v
            for k in range(hops):
                h = fc.identity(h, name=f"hop{k}")
            done = fc.group([h])
            init = fc.global_variables_initializer(g)
        one = {nm: a for nm in g.nodes}
        two = {nm: (b if nm.startswith("hop") and int(nm[3:]) % 2 == 0 else a) for nm in g.nodes}
        return g, done, init, {"one": one, "two": two}

    per_crossing: dict[int, float] = {}
    for n in (1, *(size // 4 for size in sizes)):
        g, done, init, placements = chain(n)
        times: dict[str, list[float]] = {"one": [], "two": []}
        with open_session(g, placements["one"]) as s1, open_session(g, placements["two"]) as s2:
            sessions = {"one": s1, "two": s2}
            warm = _warm_runs(4 * n * hops, store_bytes)
            for s in sessions.values():
                s.run(init)
                for _ in range(warm if s is s2 else 1):  # plans, the actors' first calls; the store's pages
                    s.run(done)
            for _ in range(repeat):
                for label, s in sessions.items():
                    t0 = time.perf_counter()
                    s.run(done)
                    times[label].append(time.perf_counter() - t0)
        per_crossing[n] = (statistics.median(times["two"]) - statistics.median(times["one"])) / hops
    out: dict[str, Any] = {"latency_s": per_crossing[1]}
    for size in sizes:
        t = per_crossing[size // 4]
        extra = t - per_crossing[1]
        out[f"{size >> 20}_MiB"] = {"crossing_s": t, "GBps": size / extra / 1e9 if extra > 0 else float("inf"),
                                    "GBps_whole": size / t / 1e9 if t > 0 else float("inf")}
    return out


WARM_RUNS_MAX = 64


def _warm_runs(bytes_per_run: int, store_bytes: int | None) -> int:
    """Untimed runs of a chain moving `bytes_per_run` across, so that twice the object store's bytes
    have crossed first (at least one run, at most WARM_RUNS_MAX)."""
    if store_bytes is None:
        import ray

        store_bytes = int(ray.cluster_resources().get("object_store_memory", 0)) if ray.is_initialized() else 0
    return max(1, min(WARM_RUNS_MAX, -(-2 * store_bytes // max(1, bytes_per_run))))


def _mlp(dim: int = 256, hidden: int = 512,
         classes: int = 10) -> tuple[fc.Graph, dict[str, fc.Tensor], list[fc.Tensor]]:
    g = fc.Graph(seed=1)
    with g.as_default():
        x = fc.placeholder("float32", (None, dim), name="x")
        y = fc.placeholder("int32", (None,), name="y")
        w0 = fc.variable(fc.truncated_normal((dim, hidden), stddev=0.05), name="w0")
        b0 = fc.variable(fc.zeros((hidden,)), name="b0")
        w1 = fc.variable(fc.truncated_normal((hidden, classes), stddev=0.05), name="w1")
        b1 = fc.variable(fc.zeros((classes,)), name="b1")
        logits = fc.bias_add(fc.matmul(fc.relu(fc.bias_add(fc.matmul(x, w0), b0)), w1), b1)
        loss = fc.reduce_mean(fc.sparse_softmax_cross_entropy(logits, y), name="loss")
    return g, {"x": x, "y": y, "loss": loss}, [w0, b0, w1, b1]


def _sync_step(devices: Sequence[str], batch: int) -> tuple[st.TrainStep, fc.Tensor, dict[str, str], Any]:
    g, t, variables = _mlp()
    step = st.sync_data_parallel(g, t["loss"], {"x": t["x"], "y": t["y"]}, variables, SGD(0.1), list(devices))
    with g.as_default():
        init = fc.global_variables_initializer(g)
    assert step.placement is not None
    placement = {n: step.placement.get(n, devices[0]) for n in g.nodes}
    rng = np.random.default_rng(0)
    feeds = step.feeds({"x": rng.standard_normal((batch, 256)).astype(np.float32),
                        "y": rng.integers(0, 10, batch).astype(np.int32)})
    return step, init, placement, feeds


def sync_examples_per_s(configs: Mapping[str, tuple[OpenSyncSession, Sequence[str]]], batch: int = 256,
                        steps: int = 20, rounds: int = 5) -> dict[str, dict[str, Any]]:
    """Examples/s of sync data parallel on the bench MLP for each config (an opener and its
    devices): every session open at once, `rounds` rounds of `steps` steps taken in turn (so the
    machine's drift hits every config alike), the median round per config."""
    out: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        runs = {}
        for label, (opener, devices) in configs.items():
            step, init, placement, feeds = _sync_step(devices, batch)
            s = stack.enter_context(opener(step.graph, placement, devices))
            s.run(init)
            s.run([step.loss, step.train_op], feeds)  # warm-up: plans, first calls
            runs[label] = (s, step, feeds)
            out[label] = {"graph": step.graph, "placement": placement, "rounds": []}
        for _ in range(rounds):
            for label, (s, step, feeds) in runs.items():
                t0 = time.perf_counter()
                for _ in range(steps):
                    s.run([step.loss, step.train_op], feeds)
                out[label]["rounds"].append(time.perf_counter() - t0)
    for label, r in out.items():
        r["examples_per_s"] = batch * steps / statistics.median(r.pop("rounds"))
    return out


def measure(repeat: int = 7, steps: int = 20) -> dict[str, Any]:
    from flowctl.engine.distributed import RaySession, worker_cluster
    from flowctl.engine.placement.cost import StaticCostModel
    from flowctl.engine.placement.simulator import simulate

    w0, w1 = canonical("worker0/cpu:0"), canonical("worker1/cpu:0")
    c0, c1 = canonical("cpu:0"), canonical("cpu:1")

    @contextlib.contextmanager
    def local(g: fc.Graph, pl: dict[str, str], devices: Sequence[str] = (c0, c1)) -> Iterator[DistributedSession]:
        cluster = Cluster.local(len(devices))
        # As the trainer runs it: the process's BLAS pool at one device's share of the cores.
        with blas_limits(cluster), DistributedSession(g, cluster, pl, store=ContainerStore()) as s:
            yield s

    def on_ray(g: fc.Graph, pl: dict[str, str], devices: Sequence[str] = (w0, w1)) -> RaySession:
        return RaySession(g, worker_cluster(devices), pl)

    out: dict[str, Any] = {"links": {
        "in_process": chain_link(lambda g, pl: local(g, pl), c0, c1, repeat=repeat),
        "ray_workers": chain_link(lambda g, pl: on_ray(g, pl), w0, w1, repeat=repeat, together=False),
    }}
    out["link_rates"] = link_rates(lambda g, pl: on_ray(g, pl), w0, w1, repeat=repeat)
    out["step_overhead"] = {
        "in_process": run_overhead(lambda g, pl: local(g, pl, [c0]), c0),
        "ray_worker": run_overhead(lambda g, pl: on_ray(g, pl, [w0]), w0),
    }
    sync = sync_examples_per_s({"ray_1_worker": (on_ray, [w0]), "ray_2_workers": (on_ray, [w0, w1]),
                                "local_1_cpu": (local, [c0]), "local_2_cpus": (local, [c0, c1])}, steps=steps)
    two = sync["ray_2_workers"]
    ray_link = out["links"]["ray_workers"]
    cluster = worker_cluster([w0, w1], link=Link(ray_link["bandwidth_Bps"], ray_link["latency_s"]))
    two["simulated_step_s"] = simulate(two["graph"], two["placement"], cluster,
                                       StaticCostModel(cluster, batch=256)).step_time
    two["measured_step_s"] = 256 / two["examples_per_s"]
    for r in sync.values():
        del r["graph"], r["placement"]
    sync["ray_speedup_2_vs_1"] = sync["ray_2_workers"]["examples_per_s"] / sync["ray_1_worker"]["examples_per_s"]
    sync["local_speedup_2_vs_1"] = sync["local_2_cpus"]["examples_per_s"] / sync["local_1_cpu"]["examples_per_s"]
    out["sync_data_parallel"] = sync
    return out


def links(repeat: int = 7) -> dict[str, Any]:
    """Only the cross-worker rates per tensor size (`link_rates`)."""
    from flowctl.engine.distributed import RaySession, worker_cluster

    w0, w1 = canonical("worker0/cpu:0"), canonical("worker1/cpu:0")
    return {"link_rates": link_rates(lambda g, pl: RaySession(g, worker_cluster([w0, w1]), pl), w0, w1,
                                     repeat=repeat)}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--links-only", action="store_true", help="only the cross-worker rates per tensor size")
    args = p.parse_args(argv)
    import ray

    from flowctl.engine.distributed import connect

    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    started = connect(None, num_cpus=4, temp_dir=tmp, object_store_memory=600 << 20)
    try:
        result = links(args.repeat) if args.links_only else measure(args.repeat, args.steps)
        result["ray_version"] = ray.__version__
    finally:
        if started:
            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
