"""The multi-device runtime (whitepaper §3.2, §3.2.2, §3.3, §5.3).

`DistributedSession(graph, cluster, placement)` is a `Session` whose graph is placed across the
devices of a `Cluster`. It is a subclass rather than extra arguments to `Session` so the single-device
path stays as it was (straight-line plans, no threads) and this one can own threads and a lifetime
(`close()`, or use it as a context manager).

Per (fetches, feeds, targets) signature, once: prune the graph to what the fetches need (§4.2),
partition the rest by the placement (§3.2.2: Send/Recv on every cross-device edge), and compile
one `Plan` per device. Per step: a fresh step id and rendezvous, then one Run per partition (the
master issues one request per device, the Send/Recv pairs do the rest of the synchronisation),
each on that device's own execution thread, all at once. Feeds go straight to every partition that
reads them; fetches come back from the partition that holds them.

Failure (§3.3): the first kernel error on any device aborts the step's rendezvous, which wakes every
waiting Recv on every device with that error, so all partitions stop; the session waits for all of
them (no thread is left running a dead step) and raises the first error, which names the node, its
op and its device. The session stays usable: the next step starts clean.

Steps may be issued from several client threads (§7 asynchronous training): every step's Runs are
queued on all device threads in one atomic action, so each device runs steps in the same order and
two steps can never wait on each other crosswise.

State: Variables live in the session's `ContainerStore` exactly as with `Session` (a partition binds
the same slots by node name), and each random op keeps one RngState seeded from the graph seed and
its own name, so it draws the same numbers wherever it is placed.

Threads and BLAS (ARCHITECTURE "Devices"). Each device has one execution thread, created once with
the session. `Device.threads` cannot be enforced per device inside one process: OpenBLAS (numpy's
BLAS here), like MKL and BLIS, keeps one process-wide thread pool, and threadpoolctl changes that
global setting; it cannot give one Python thread a different limit from another. What the runtime
offers is `blas_limits(cluster)`: a context manager that sets the process-wide BLAS pool to one
device's share of the cores (Cluster.local splits them evenly), so N concurrent device threads each
calling BLAS use about the machine's cores, not N times them. Truly separate limits need separate
processes (one per device), which is what the Ray workers of the distributed engine give
(`flowctl.engine.distributed`: each worker sets its own process's pool).

The pieces are separate so that a remote worker reuses them: `split_signature` (pure graph work:
prune and partition, done by the master), `compile_partition` (bind kernels and resources on the
device's side) and `DeviceThreads` (one thread per device and the step protocol).
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping, Sequence

import numpy as np

from flowctl.engine.cluster import Cluster
from flowctl.engine.container import ContainerStore
from flowctl.engine.devices import canonical, parse_device
from flowctl.engine.dtypes import np_dtype
from flowctl.engine.errors import ExecutionError, PlacementError
from flowctl.engine.executor import Plan, RunStats, needed_nodes
from flowctl.engine.graph import Graph, Node, parse_ref
from flowctl.engine.opdef import COMMUNICATION
from flowctl.engine.partition import RECV_SCHEDULES, feed_node_name, partition, short_device
from flowctl.engine.rendezvous import LocalRendezvous, RendezvousAborted, StepContext, next_step_id
from flowctl.engine.session import Session, cpu_passes, require_device
from flowctl.kernels.registry import array_module, on_gpu, to_host, use_gpu


@dataclass
class PartitionSpec:
    """One device's share of a signature before compilation: plain graph data, so a remote worker
    can be sent it (as GraphDef JSON) and compile it there."""

    device: str
    graph: Graph
    fetches: list[str]  # refs this partition returns
    feeds: list[str]  # refs of its feed placeholders, in feed_index order
    targets: list[str]
    feed_index: list[int]  # positions in the signature's feed list
    fetch_index: list[int]  # positions in the signature's fetch list


@dataclass
class DevicePlan:
    """One device's share of a signature: its partition, its compiled plan, and where its feeds and
    fetches sit in the session's lists."""

    device: str
    graph: Graph
    plan: Plan
    feed_index: list[int]  # positions in the signature's feed list, in plan.feeds order
    fetch_index: list[int]  # positions in the signature's fetch list, in plan.fetches order


@dataclass
class StepPlan:
    """Everything a step of one signature needs; built once, reused every step."""

    devices: list[DevicePlan]
    fed_fetches: list[tuple[int, int]] = field(default_factory=list)  # (fetch pos, feed pos)

    @property
    def partitions(self) -> dict[str, Graph]:
        return {d.device: d.graph for d in self.devices}


def split_signature(graph: Graph, placement: Mapping[str, str], devices: Sequence[str], refs: list[str],
                    feed_refs: list[str], targets: list[str], *, compress: bool = False,
                    recv_schedule: str = "asap", durations: Mapping[str, float] | None = None
                    ) -> tuple[list[PartitionSpec], list[tuple[int, int]]]:
    """Prune the graph to what (refs, feed_refs, targets) need (§4.2) and partition it by
    `placement` (§3.2.2), in `devices` order. Returns the partitions and the (fetch pos, feed pos)
    pairs of fetches that are fed (answered by the master without running anything)."""
    for ref in refs + feed_refs:
        graph.tensor(ref)  # raises with a did-you-mean on an unknown name
    fed = set(feed_refs)
    roots = [parse_ref(r)[0] for r in refs if r not in fed] + list(targets)
    need = needed_nodes(graph, roots, fed)
    parts = partition(graph, placement, nodes=need, feeds=feed_refs, compress=compress,
                      recv_schedule=recv_schedule, durations=durations)
    feed_pos = {r: i for i, r in enumerate(feed_refs)}
    out: list[PartitionSpec] = []
    for dev in devices:
        g = parts.get(dev)
        if g is None:
            continue
        d_feeds = [r for r in feed_refs if feed_node_name(r) in g.nodes]
        fetch_index = [i for i, r in enumerate(refs) if r not in fed and placement[parse_ref(r)[0]] == dev]
        d_targets = [t for t in targets if placement[t] == dev]
        d_targets += [n.name for n in g.nodes.values() if n.op == "Send"]
        spec = PartitionSpec(dev, g, [refs[i] for i in fetch_index], [f"{feed_node_name(r)}:0" for r in d_feeds],
                             d_targets, [feed_pos[r] for r in d_feeds], fetch_index)
        fed_here = set(spec.feeds)
        ran = needed_nodes(g, [parse_ref(r)[0] for r in spec.fetches if r not in fed_here] + d_targets, fed_here)
        unrun = {n for n in g.nodes if n in need and n not in ran}
        if unrun:  # partitioning must keep every needed node reachable from the device's roots
            raise ExecutionError(f"partition for {dev} would skip needed node(s) {sorted(unrun)[:5]}", device=dev)
        out.append(spec)
    fed_fetches = [(i, feed_pos[r]) for i, r in enumerate(refs) if r in fed]
    return out, fed_fetches


def partition_graph(spec: PartitionSpec) -> Graph:
    """The graph a partition runs: a CPU partition's after the CPU's plan passes, as one CPU
    device's whole step (session.cpu_passes; deterministic, so a master that asks gets the graph
    its worker runs), any other as it is."""
    if parse_device(spec.device).type == "cpu":
        return cpu_passes(spec.graph, spec.fetches, spec.feeds, spec.targets)
    return spec.graph


def compile_partition(spec: PartitionSpec, resources: Callable[[Node], Any]) -> DevicePlan:
    """Bind one partition's kernels and resources on its device (done where the device is), on
    the graph it runs (`partition_graph`: a trace names its nodes)."""
    graph = partition_graph(spec)
    plan = Plan(graph, spec.fetches, spec.feeds, spec.targets, spec.device, resources)
    return DevicePlan(spec.device, graph, plan, spec.feed_index, spec.fetch_index)


class DeviceThreads:
    """One execution thread per device, kept for the owner's life, and the step protocol over them:
    one Run per partition, all queued at once, the first failure aborting the step everywhere (§3.3).
    Used by `DistributedSession` for this process's devices and by each Ray worker for its own."""

    def __init__(self, devices: Sequence[str]) -> None:
        # `Device.threads` is not a count of execution threads: it is the device's share of cores,
        # which only BLAS could use (see blas_limits).
        # A GPU's thread makes its own CUDA device current (gpu:1's kernels on GPU 1, not GPU 0).
        self._pools = {d: cf.ThreadPoolExecutor(1, thread_name_prefix=f"flowctl-{short_device(d)}",
                                                initializer=_use_device, initargs=(d,))
                       for d in devices}
        self._submit_lock = threading.Lock()

    def run_step(self, plans: Sequence[DevicePlan], feeds: Sequence[list[Any]], step: StepContext,
                 stats: Mapping[str, RunStats] | None, check: bool, timeout: float | None) -> list[list[Any]]:
        """Run every plan (with its feeds) as one step; each plan's fetched values, in order. On any
        failure, every partition has stopped before the root cause is raised."""
        return self.finish_step(self.start_step(plans, feeds, step, stats, check), step, timeout)

    def start_step(self, plans: Sequence[DevicePlan], feeds: Sequence[list[Any]], step: StepContext,
                   stats: Mapping[str, RunStats] | None, check: bool) -> list[tuple[DevicePlan, cf.Future[Any]]]:
        """Queue the step's Run on every plan's device thread, all at one point of every queue."""

        def job(d: DevicePlan, f: list[Any], st: RunStats | None) -> list[Any]:
            try:
                return d.plan.run_dataflow(f, st, check, step)
            except BaseException as e:
                step.rendezvous.abort(e)  # §3.3: one device's failure stops every device's step
                raise

        with self._submit_lock:  # every device queues this step at the same point (see module doc)
            return [(d, self._pools[d.device].submit(job, d, f, None if stats is None else stats[d.device]))
                    for d, f in zip(plans, feeds)]

    def finish_step(self, futures: list[tuple[DevicePlan, cf.Future[Any]]], step: StepContext,
                    timeout: float | None) -> list[list[Any]]:
        """Wait for a started step; abort it everywhere after `timeout` seconds (None: wait)."""
        done, waiting = cf.wait([f for _, f in futures], timeout=timeout)
        if waiting:
            stuck = [d.device for d, f in futures if f in waiting]
            step.rendezvous.abort(ExecutionError(
                f"step {step.step_id} timed out after {timeout} s; still running on {', '.join(stuck)}"))
            cf.wait([f for _, f in futures])  # a Recv wakes on abort; a running kernel finishes first
        if step.rendezvous.error is not None:
            raise root_cause(step.rendezvous.error)
        return [f.result() for _, f in futures]

    def close(self, wait: bool = True) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=wait)


def run_arguments(session: Session, fetches: Any,
                  feeds: Mapping[Any, Any] | None) -> tuple[Any, list[str], list[str], list[str], list[Any]]:
    """A multi-device run's fetches and feeds as refs: (the fetches' nesting, fetched refs, target
    nodes, fed refs in order, their values as host arrays)."""
    refs: list[str] = []
    targets: list[str] = []
    template = session._flatten(fetches, refs, targets)
    items = sorted((feeds or {}).items(), key=lambda kv: session._ref(kv[0]))
    feed_refs = [session._ref(k) for k, _ in items]
    feed_vals = [host_feed(session.graph, r, v) for r, (_, v) in zip(feed_refs, items)]
    return template, refs, targets, feed_refs, feed_vals


def checked_placement(cluster: Cluster, placement: Any, recv_schedule: str) -> dict[str, str]:
    """node -> canonical device, every device one of `cluster`'s. A placer's Placement object
    carries the mapping as `.assignment` and is accepted as it is."""
    assignment: Mapping[str, str] = getattr(placement, "assignment", placement)
    out = {n: canonical(d) for n, d in assignment.items()}
    unknown = sorted(set(out.values()) - set(cluster.names))
    if unknown:
        raise PlacementError(f"the placement uses device(s) {', '.join(unknown)} that the cluster lacks; "
                             f"devices: {', '.join(cluster.names)}")
    if recv_schedule not in RECV_SCHEDULES:
        raise ValueError(f"recv_schedule must be one of {RECV_SCHEDULES}, not {recv_schedule!r}")
    return out


class DistributedSession(Session):
    def __init__(self, graph: Graph, cluster: Cluster, placement: Mapping[str, str],
                 store: ContainerStore | None = None, check_numerics: bool = False, compress: bool = False,
                 recv_schedule: str = "asap", durations: Mapping[str, float] | None = None,
                 step_timeout: float | None = None) -> None:
        """`placement`: node name -> device of `cluster` (any spelling), for at least every node a
        run needs (or a placer's `Placement`, whose `.assignment` is that mapping). `compress`: §5.5 lossy float32 transfers. `recv_schedule`: "asap" or "alap"
        (§5.2), with `durations` (node -> estimated seconds) for the ALAP calculation.
        `step_timeout`: seconds after which a step still waiting is aborted (None: wait)."""
        super().__init__(graph, device=cluster.devices[0].name, store=store, check_numerics=check_numerics,
                         executor="dataflow")
        self.cluster = cluster
        self.placement = checked_placement(cluster, placement, recv_schedule)
        for dev in dict.fromkeys(self.placement.values()):
            require_device(dev)
        self.compress = compress
        self.recv_schedule = recv_schedule
        self.durations = dict(durations or {})
        self.step_timeout = step_timeout
        self._step_plans: dict[tuple[Any, ...], StepPlan] = {}
        self._plan_lock = threading.Lock()
        self._threads = DeviceThreads(cluster.names)  # each device's thread starts with its first step
        self._closed = False

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop the device threads (waiting for any step in flight)."""
        if not self._closed:
            self._closed = True
            self._threads.close()

    def __enter__(self) -> "DistributedSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        threads = getattr(self, "_threads", None)
        if threads is not None:
            threads.close(wait=False)

    # ------------------------------------------------------------------ Run
    def run(self, fetches: Any, feeds: Mapping[Any, Any] | None = None, stats: RunStats | None = None) -> Any:
        if self._closed:
            raise ExecutionError("this DistributedSession is closed")
        template, refs, targets, feed_refs, feed_vals = run_arguments(self, fetches, feeds)
        key = (tuple(refs), tuple(feed_refs), tuple(targets))
        sp = self._step_plans.get(key)
        if sp is None:
            with self._plan_lock:
                sp = self._step_plans.get(key)
                if sp is None:
                    sp = self._step_plans[key] = self._build(refs, feed_refs, targets)

        values: list[Any] = [None] * len(refs)
        per_device = self._run_step(sp, feed_vals, values, stats)
        for fetch_pos, feed_pos in sp.fed_fetches:
            values[fetch_pos] = feed_vals[feed_pos]
        if stats is not None:
            stats.devices = per_device
            stats.nodes_run = [n for s in per_device.values() for n in s.nodes_run]
            stats.peak_bytes = sum(s.peak_bytes for s in per_device.values())  # an upper bound
            stats.starts = sorted((st for s in per_device.values() for st in s.starts), key=lambda x: x[1])
            stats.finishes = sorted((st for s in per_device.values() for st in s.finishes), key=lambda x: x[1])
        return self._rebuild(template, iter([to_host(v) for v in values]))

    def _run_step(self, sp: StepPlan, feed_vals: list[Any], values: list[Any],
                  stats: RunStats | None) -> dict[str, RunStats]:
        step = StepContext(next_step_id(), LocalRendezvous())
        per_device = {d.device: RunStats() for d in sp.devices}
        feeds = [[on_device(feed_vals[i], d.device) for i in d.feed_index] for d in sp.devices]
        outs = self._threads.run_step(sp.devices, feeds, step, per_device if stats is not None else None,
                                      self.check_numerics, self.step_timeout)
        for d, out in zip(sp.devices, outs):
            for pos, v in zip(d.fetch_index, out):
                values[pos] = v
        return per_device

    # ------------------------------------------------------------------ planning
    def _build(self, refs: list[str], feed_refs: list[str], targets: list[str]) -> StepPlan:
        # Cluster order: a stable thread submission order.
        specs, fed_fetches = split_signature(self.graph, self.placement, self.cluster.names, refs, feed_refs,
                                             targets, compress=self.compress, recv_schedule=self.recv_schedule,
                                             durations=self.durations)
        return StepPlan([compile_partition(p, self._resource) for p in specs], fed_fetches)

    def step_plan(self, fetches: Any, feeds: Mapping[Any, Any] | None = None) -> StepPlan:
        """The partitions and per-device plans a run with these fetches and feeds uses."""
        refs: list[str] = []
        targets: list[str] = []
        self._flatten(fetches, refs, targets)
        feed_refs = sorted(self._ref(k) for k in (feeds or {}))
        key = (tuple(refs), tuple(feed_refs), tuple(targets))
        with self._plan_lock:
            if key not in self._step_plans:
                self._step_plans[key] = self._build(refs, feed_refs, targets)
            return self._step_plans[key]

    def plan_for(self, fetches: Any, feeds: Mapping[Any, Any] | None = None) -> Plan:
        raise ExecutionError("a DistributedSession has one plan per device: use step_plan()")


def host_feed(graph: Graph, ref: str, value: Any) -> np.ndarray:
    """A fed value as a host array of the tensor's dtype, its shape checked against the tensor's."""
    spec = graph.tensor(ref).spec
    arr = np.asarray(to_host(value), dtype=np_dtype(spec.dtype))
    if len(arr.shape) != len(spec.shape) or any(
            d is not None and d != a for d, a in zip(spec.shape, arr.shape)):
        raise ExecutionError(f"feed for '{ref}' has shape {tuple(arr.shape)}, but the tensor's shape "
                             f"is {spec.shape}", node=parse_ref(ref)[0])
    return arr


def on_device(value: Any, device: str) -> Any:
    d = parse_device(device)
    if d.type == "cpu":
        return value
    with on_gpu(d.index):  # onto that device's own GPU
        return array_module(d.type).asarray(value)


def _use_device(device: str) -> None:
    """A device thread's initializer: a GPU's thread works on its own CUDA device."""
    d = parse_device(device)
    if d.type == "gpu":
        use_gpu(d.index)


def root_cause(err: BaseException) -> BaseException:
    """The failure behind a chain of aborted Sends and Recvs, as an ExecutionError."""
    while isinstance(err, RendezvousAborted):
        err = err.cause
    if isinstance(err, ExecutionError):
        return err
    return ExecutionError(f"step failed: {type(err).__name__}: {err}")


def blas_limits(cluster: Cluster) -> ContextManager[Any]:
    """Set the process-wide BLAS thread pool to the largest per-device thread count of `cluster`
    while the context is open (see the module doc for why this cannot be per device)."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=max(d.threads for d in cluster.devices), user_api="blas")


def count_transfers(parts: Mapping[str, Graph]) -> dict[tuple[str, str], int]:
    """(source device, destination device) -> number of Recv nodes (tensors moved per step)."""
    out: dict[tuple[str, str], int] = {}
    for g in parts.values():
        for n in g.nodes.values():
            if n.op == "Recv" and n.opdef.group == COMMUNICATION:
                key = (n.attrs["send_device"], n.attrs["recv_device"])
                out[key] = out.get(key, 0) + 1
    return out
