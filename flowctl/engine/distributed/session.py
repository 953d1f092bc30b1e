"""The master of a distributed run on Ray (whitepaper §3, Figure 3; §3.2.2; §3.3).

`RaySession(graph, cluster, placement)` has the interface of `DistributedSession` (run, the state
methods checkpoints use, close), but each task of the cluster's `/job:worker` is a Ray actor in its
own process, possibly on another machine (`worker.Worker`). This process is the client and master.

Per run signature, once: prune and partition exactly as `DistributedSession` does
(`runtime.split_signature`), and send each worker its partitions as GraphDef JSON; the worker
compiles them on its devices. Per step: one Run per worker (§3.2.2: the master is not involved in
the Send/Recv traffic, which goes worker to worker through Ray), the feeds each worker's partitions
read going with its Run and the fetches coming back with its result.

State. A Variable or random op lives on the worker whose device the placement gives it (§3.3:
"Variable nodes refer to tensors that persist across executions"); `variable_values`,
`load_variables`, `rng_states` and `set_rng_states` gather from and scatter to the workers, so
`checkpoint.capture` and `checkpoint.apply` work unchanged and a checkpoint moves between a Ray run
and a local one. State nodes the placement leaves out never run and stay in this process.

Fault tolerance (§3.3). A step fails as a whole, within a bounded time, when
- a worker's actor dies (Ray reports it to the master's wait at once): `WorkerLostError`;
- a worker misses a health check: while a step runs, every `health_interval` seconds without
  progress the master pings the workers still running and one that does not answer within
  `health_timeout` is lost: `WorkerLostError`;
- a transfer fails (the sending worker confirms its deliveries) or a kernel fails: `ExecutionError`;
- the step runs past `step_timeout`: `ExecutionError`.
Every other worker of the step is then told to abort it, which wakes its waiting Recvs, and the
master waits (at most `health_timeout`) for their Runs to end before raising. A lost worker stays lost:
the next `run` raises `WorkerLostError` until `restart_lost_workers()` has replaced it, sent it its
partitions again and returned the restarted tasks; its Variables are then uninitialised, and the
caller restores every worker's state from the last checkpoint (`checkpoint.apply`) before going on,
as §3.3 has it (restart from scratch, Restore from the last Save).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from flowctl.engine.cluster import Cluster
from flowctl.engine.container import ContainerStore
from flowctl.engine.devices import CPU0, parse_device
from flowctl.engine.distributed.cluster import TaskSpec, check_resources, connect, tasks_of
from flowctl.engine.distributed.ray_log import RayLog
from flowctl.engine.distributed.worker import PartitionWire, writable
from flowctl.engine.errors import ExecutionError, FlowctlError, GraphError, PlacementError, WorkerLostError
from flowctl.engine.executor import RunStats
from flowctl.engine.graph import GRAPHDEF_VERSION, Graph
from flowctl.engine.rendezvous import next_step_id
from flowctl.engine.runtime import PartitionSpec, checked_placement, partition_graph, run_arguments, split_signature
from flowctl.engine.session import Session

_MAX_CONCURRENCY = 32  # actor threads: Runs waiting their turn, transfers, aborts, pings
WorkerEvent = Callable[[int, str, str], None]  # (task, state, detail)


@dataclass
class WorkerInfo:
    """Where a task's actor runs (from its `hello`)."""

    task: int
    pid: int
    node_id: str
    ip: str

    @property
    def node(self) -> str:
        return f"{self.ip} (node {self.node_id[:12]})"


@dataclass
class _Signature:
    sig: int
    specs: list[PartitionSpec]
    fed_fetches: list[tuple[int, int]]
    wire: dict[int, list[PartitionWire]]  # task -> what its worker is sent
    by_task: dict[int, list[PartitionSpec]]


class RaySession(Session):
    def __init__(self, graph: Graph, cluster: Cluster, placement: Mapping[str, str], *,
                 store: ContainerStore | None = None, check_numerics: bool = False, compress: bool = False,
                 recv_schedule: str = "asap", durations: Mapping[str, float] | None = None,
                 address: str | None = None, resources: Mapping[int, Mapping[str, float]] | None = None,
                 step_timeout: float | None = 600.0, health_interval: float = 2.0, health_timeout: float = 20.0,
                 start_timeout: float = 120.0, on_worker: WorkerEvent | None = None,
                 log: Path | None = None) -> None:
        """`cluster`: devices of worker tasks (`distributed.worker_cluster`); `placement`: node ->
        device of it, for at least every node a run needs (or a placer's `Placement`). `address`:
        the Ray cluster to join when this process is not connected yet ('auto', 'ray://host:10001';
        None starts a local one). `resources`: task -> extra Ray resources that pin its actor.
        Timeouts in seconds: a step (None: no limit), the wait between health checks during a step
        and for a ping's answer, and for an actor to start. `on_worker(task, state, detail)` is told
        each worker's state as it changes ("starting", "running", "lost", "restarting"), for a
        console to show. `log`: a file for Ray's own text while the session is open (its logger,
        the raylet's account of a dead worker: ray_log.py), instead of the terminal. Other arguments
        as DistributedSession."""
        # The base Session is this process's share: state nodes the placement leaves out, on the host.
        super().__init__(graph, device=CPU0, store=store or ContainerStore(),
                         check_numerics=check_numerics, executor="dataflow")
        self.cluster = cluster
        self.placement = checked_placement(cluster, placement, recv_schedule)
        self.compress = compress
        self.recv_schedule = recv_schedule
        self.durations = dict(durations or {})
        self.step_timeout = step_timeout
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.start_timeout = start_timeout
        self._on_worker = on_worker
        self.tasks: dict[int, TaskSpec] = {t.task: t for t in tasks_of(cluster, resources)}
        # Which worker holds each stateful node (§3.3: state lives where its device is).
        self.owner: dict[str, int] = {n.name: parse_device(self.placement[n.name]).task
                                      for n in graph.nodes.values()
                                      if n.opdef.resource in ("variable", "rng", "queue") and n.name in self.placement}
        self.workers: dict[int, WorkerInfo] = {}
        self.lost: set[int] = set()
        self._actors: dict[int, Any] = {}
        self._seq: dict[int, int] = {}
        self._signatures: dict[tuple[Any, ...], _Signature] = {}
        self._plan_lock = threading.Lock()
        self._submit_lock = threading.Lock()
        self._closed = False
        self.log = RayLog(log).open() if log is not None else None
        self._owns_ray = False
        try:
            self._owns_ray = connect(address, num_cpus=int(sum(t.num_cpus for t in self.tasks.values())))
            check_resources(list(self.tasks.values()))
            self._start(list(self.tasks))
            self._introduce()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ workers
    def _start(self, tasks: list[int]) -> None:
        """Create the actors of `tasks` and wait (up to start_timeout) until each says hello."""
        import ray

        from flowctl.engine.distributed.worker import Worker

        actor_class = ray.remote(Worker)
        refs = {}
        for t in tasks:
            spec = self.tasks[t]
            mine = [self.graph.nodes[n].to_dict() for n, owner in self.owner.items() if owner == t]
            for d in mine:
                d["assigned_device"] = self.placement[d["name"]]
            threads = sum(self.cluster.device(d).threads for d in spec.devices
                          if parse_device(d).type == "cpu") or None
            self._actors[t] = actor_class.options(
                num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, resources=spec.resources or None,
                max_concurrency=_MAX_CONCURRENCY, max_restarts=0,
            ).remote(t, spec.devices, self.graph.seed, mine, threads)
            self._seq[t] = 0
            self._tell(t, "starting", ", ".join(f"{k}={v:g}" for k, v in spec.needs.items()))
            refs[t] = self._actors[t].hello.remote()
        ready, waiting = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.start_timeout)
        if waiting:
            late = sorted(t for t, r in refs.items() if r in waiting)
            raise PlacementError(f"worker task(s) {late} did not start within {self.start_timeout:g} s: the Ray "
                                 f"cluster has no free node with {self.tasks[late[0]].needs} (busy with other work?)")
        for t, ref in refs.items():
            info = self._get(ref, t, "starting")
            if info["ray"] != ray.__version__ or info["graphdef"] != GRAPHDEF_VERSION:
                raise PlacementError(f"worker task {t} on {info['ip']} runs Ray {info['ray']} with GraphDef "
                                     f"version {info['graphdef']}; this process has Ray {ray.__version__} and "
                                     f"version {GRAPHDEF_VERSION}: install the same versions on every node")
            self.workers[t] = WorkerInfo(t, info["pid"], info["node_id"], info["ip"])
            self._tell(t, "running", f"{self.workers[t].node}, pid {info['pid']}")

    def _introduce(self) -> None:
        """Every worker learns every other worker's actor (Sends call them directly)."""
        import ray

        ray.get([a.set_peers.remote(dict(self._actors)) for a in self._actors.values()])

    def _get(self, ref: Any, task: int, doing: str, timeout: float | None = None) -> Any:
        """ray.get with the worker's own FlowctlError raised as itself and a dead worker as lost."""
        import ray

        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, FlowctlError):
                raise cause from None
            raise ExecutionError(f"worker task {task} failed while {doing}: {_first_line(e)}",
                                 device=f"/job:worker/task:{task}") from None
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            self._mark_lost([task], f"{type(e).__name__} while {doing}")
            raise self._lost_error(task, doing, e) from None

    def _lost_error(self, task: int, doing: str, err: BaseException | str) -> WorkerLostError:
        info = self.workers.get(task)
        node = info.node if info else "an unknown node"
        reason = err if isinstance(err, str) else f"{type(err).__name__}: {_first_line(err)}"
        return WorkerLostError(f"worker task {task} (/job:worker/task:{task}) on {node} was lost while {doing}: "
                               f"{reason}", task=task, node=info.node if info else None)

    def health(self, timeout: float | None = None, skip: set[int] | frozenset[int] = frozenset()) -> dict[int, bool]:
        """§3.3 (b): ping every worker but `skip`; task -> answered within `timeout` (health_timeout)."""
        import ray

        refs = {t: a.ping.remote() for t, a in self._actors.items() if t not in skip}
        if not refs:
            return {}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout or self.health_timeout)
        out = {}
        for t, ref in refs.items():
            try:
                out[t] = ray.get(ref, timeout=0) == self.workers[t].pid
            except Exception:  # noqa: BLE001 -- dead, unreachable or late: not healthy
                out[t] = False
        return out

    def restart_lost_workers(self) -> list[int]:
        """Replace every lost or unresponsive worker by a new actor and send it its partitions again;
        the restarted tasks. Their state is gone: restore it (every worker's) from the last checkpoint
        before the next step. WorkerLostError naming the task and node when one cannot be restarted."""
        if self._closed:
            raise ExecutionError("this RaySession is closed")
        with self._submit_lock, self._plan_lock:
            gone = sorted(self.lost | {t for t, ok in self.health(skip=self.lost).items() if not ok})
            for t in gone:
                self._tell(t, "restarting", "")
            self._kill(gone)  # a hung process holds its resources until Ray kills it
            try:
                self._start(gone)
            except FlowctlError as e:
                self._kill(gone)  # a replacement still starting would hold the task's resources too
                t = gone[0]
                old = self.workers.get(t)
                raise WorkerLostError(f"worker task {t} (/job:worker/task:{t}) last on "
                                      f"{old.node if old else 'an unknown node'} could not be restarted: {e}",
                                      task=t, node=old.node if old else None) from None
            self._introduce()
            for s in self._signatures.values():
                loads = {t: self._actors[t].load.remote(s.sig, s.wire[t]) for t in gone if t in s.wire}
                for t, ref in loads.items():
                    self._get(ref, t, "compiling its partitions again", timeout=self.start_timeout)
            self.lost.clear()
        return gone

    def _tell(self, task: int, state: str, detail: str) -> None:
        if self._on_worker is not None:
            self._on_worker(task, state, detail)

    def _mark_lost(self, tasks: list[int], reason: str) -> None:
        for t in tasks:
            if t not in self.lost:
                self.lost.add(t)
                self._tell(t, "lost", reason)

    def _kill(self, tasks: list[int]) -> None:
        import ray

        for t in tasks:
            actor = self._actors.pop(t, None)
            if actor is not None:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 -- already gone
                    pass

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """End the workers (and Ray, if this session started it)."""
        if self._closed:
            return
        self._closed = True
        import ray

        if ray.is_initialized():
            self._kill(list(self._actors))
        self._actors.clear()
        if self._owns_ray:
            ray.shutdown()
        if self.log is not None:  # after the shutdown: Ray's last words go to the file too
            self.log.close()

    def __enter__(self) -> "RaySession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ Run
    def run(self, fetches: Any, feeds: Mapping[Any, Any] | None = None, stats: RunStats | None = None) -> Any:
        if self._closed:
            raise ExecutionError("this RaySession is closed")
        template, refs, targets, feed_refs, feed_vals = run_arguments(self, fetches, feeds)
        sig = self._signature(refs, feed_refs, targets)
        values: list[Any] = [None] * len(refs)
        per_device = self._run_step(sig, feed_vals, values, stats is not None)
        for fetch_pos, feed_pos in sig.fed_fetches:
            values[fetch_pos] = feed_vals[feed_pos]
        if stats is not None:
            stats.devices = per_device
            stats.nodes_run = [n for s in per_device.values() for n in s.nodes_run]
            stats.peak_bytes = sum(s.peak_bytes for s in per_device.values())
            # perf_counter is each machine's monotonic clock: one timeline per machine, not across.
            stats.starts = sorted((st for s in per_device.values() for st in s.starts), key=lambda x: x[1])
            stats.finishes = sorted((st for s in per_device.values() for st in s.finishes), key=lambda x: x[1])
        return self._rebuild(template, iter([writable(v) for v in values]))

    def _signature(self, refs: list[str], feed_refs: list[str], targets: list[str]) -> _Signature:
        key = (tuple(refs), tuple(feed_refs), tuple(targets))
        with self._plan_lock:
            s = self._signatures.get(key)
            if s is not None:
                return s
            specs, fed_fetches = split_signature(self.graph, self.placement, self.cluster.names, refs, feed_refs,
                                                 targets, compress=self.compress,
                                                 recv_schedule=self.recv_schedule, durations=self.durations)
            by_task: dict[int, list[PartitionSpec]] = {}
            for p in specs:
                by_task.setdefault(parse_device(p.device).task, []).append(p)
            wire = {t: [(p.device, p.graph.to_json(), p.fetches, p.feeds, p.targets) for p in ps]
                    for t, ps in by_task.items()}
            s = _Signature(len(self._signatures), specs, fed_fetches, wire, by_task)
            self._require_alive(list(wire))
            loads = {t: self._actors[t].load.remote(s.sig, w) for t, w in wire.items()}
            for t, ref in loads.items():
                self._get(ref, t, "compiling its partitions", timeout=self.start_timeout)
            self._signatures[key] = s
            return s

    def partitions(self, fetches: Any, feeds: Mapping[Any, Any] | None = None) -> dict[str, Graph]:
        """device -> partition graph a run with these fetches and feeds uses (as its worker runs it:
        a CPU partition after the CPU's plan passes)."""
        refs: list[str] = []
        targets: list[str] = []
        self._flatten(fetches, refs, targets)
        s = self._signature(refs, sorted(self._ref(k) for k in (feeds or {})), targets)
        return {p.device: partition_graph(p) for p in s.specs}

    def _require_alive(self, tasks: list[int]) -> None:
        lost = sorted(self.lost & set(tasks))
        if lost:
            raise self._lost_error(lost[0], "idle", "it was lost earlier; call restart_lost_workers()")

    def _run_step(self, s: _Signature, feed_vals: list[Any], values: list[Any],
                  want_stats: bool) -> dict[str, RunStats]:
        self._require_alive(list(s.by_task))
        step_id = next_step_id()
        runs: dict[Any, int] = {}
        with self._submit_lock:  # each worker numbers its Runs in one order (see worker.py)
            for t, ps in s.by_task.items():
                feeds = [[feed_vals[i] for i in p.feed_index] for p in ps]
                ref = self._actors[t].run.remote(s.sig, step_id, self._seq[t], feeds, want_stats, self.check_numerics)
                self._seq[t] += 1
                runs[ref] = t
        results = self._await(step_id, runs)
        per_device: dict[str, RunStats] = {}
        for t, (outs, stats) in results.items():
            for p, out in zip(s.by_task[t], outs):
                for pos, v in zip(p.fetch_index, out):
                    values[pos] = v
            per_device.update(stats or {})
        return per_device

    def _await(self, step_id: int, runs: dict[Any, int]) -> dict[int, Any]:
        """Each task's Run result, or the step aborted everywhere and its root cause raised."""
        import ray

        pending = dict(runs)
        results: dict[int, Any] = {}
        error: BaseException | None = None
        deadline = None if self.step_timeout is None else time.monotonic() + self.step_timeout
        while pending and error is None:
            wait = self.health_interval
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            for ref in ready:
                t = pending.pop(ref)
                try:
                    # Not "step {step_id}": step_id numbers every Run of this process (initialisation
                    # and evaluation too); the step's number is its caller's to say (the trainer's).
                    results[t] = self._get(ref, t, "running a step")
                except FlowctlError as e:
                    error = e
                    break
            if ready or error is not None:
                continue
            if deadline is not None and time.monotonic() >= deadline:
                error = ExecutionError(f"step {step_id} timed out after {self.step_timeout:g} s; still running "
                                       f"on worker task(s) {sorted(pending.values())}")
                break
            ok = self.health()
            dead = sorted(t for t in pending.values() if not ok.get(t, False))
            if dead:
                self._mark_lost(dead, "no answer to a health check")
                error = self._lost_error(dead[0], "running a step",
                                         f"no answer to a health check within {self.health_timeout:g} s")
        if error is None:
            return results
        dead = self._abort(step_id, pending, error)
        if dead and not isinstance(error, WorkerLostError):
            # A failed transfer to a worker that died is reported as the death: it can be recovered.
            raise self._lost_error(dead[0], "running a step", f"it died ({error})")
        raise error

    def _abort(self, step_id: int, pending: dict[Any, int], error: BaseException) -> list[int]:
        """Tell every worker still running the step to abort it and wait (bounded) for them; the
        tasks whose Run ended because their worker died."""
        import ray

        live = {ref: t for ref, t in pending.items() if t not in self.lost}
        for t in set(live.values()):
            self._actors[t].abort.remote(step_id, f"step {step_id} was aborted: {error}")
        dead = []
        if live:
            done, _ = ray.wait(list(live), num_returns=len(live), timeout=self.health_timeout)
            for ref in done:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError:
                    dead.append(live[ref])
                except Exception:  # noqa: BLE001 -- the abort's own error: expected
                    pass
        self._mark_lost(dead, "its worker process died")
        return sorted(dead)

    # ------------------------------------------------------------------ state (checkpoints)
    def _by_owner(self, names: Any) -> tuple[dict[int, list[str]], list[str]]:
        remote: dict[int, list[str]] = {}
        here: list[str] = []
        for n in names:
            t = self.owner.get(n)
            if t is None:
                here.append(n)
            else:
                remote.setdefault(t, []).append(n)
        return remote, here

    def _each_worker(self, method: str, args: Mapping[int, Any] | None = None) -> dict[int, Any]:
        tasks = sorted(args) if args is not None else sorted({t for t in self.owner.values()})
        self._require_alive(tasks)
        refs = {t: getattr(self._actors[t], method).remote(*(() if args is None else (args[t],))) for t in tasks}
        return {t: self._get(ref, t, method.replace("_", " "), timeout=self.start_timeout) for t, ref in refs.items()}

    def variable_values(self) -> dict[str, np.ndarray]:
        out = super().variable_values()  # state nodes the placement leaves out
        for vals in self._each_worker("variable_values").values():
            out.update({k: writable(v) for k, v in vals.items()})
        return {n: out[n] for n in self.graph.nodes if n in out}

    def load_variables(self, values: Mapping[str, Any]) -> None:
        for name in values:
            node = self.graph.nodes.get(name)
            if node is None or node.op != "Variable":
                raise GraphError(f"no Variable named '{name}' in the graph")
        remote, here = self._by_owner(values)
        super().load_variables({n: values[n] for n in here})
        self._each_worker("load_variables", {t: {n: np.asarray(values[n]) for n in ns} for t, ns in remote.items()})

    def rng_states(self) -> dict[str, dict[str, Any]]:
        out = super().rng_states()
        for states in self._each_worker("rng_states").values():
            out.update(states)
        return out

    def set_rng_states(self, states: Mapping[str, dict[str, Any]]) -> None:
        for name in states:
            if name not in self.graph.nodes:
                raise GraphError(f"random state for unknown node '{name}'")
        remote, here = self._by_owner(states)
        super().set_rng_states({n: states[n] for n in here})
        self._each_worker("set_rng_states", {t: {n: states[n] for n in ns} for t, ns in remote.items()})

    def plan_for(self, fetches: Any, feeds: Mapping[Any, Any] | None = None) -> Any:
        raise ExecutionError("a RaySession's plans are compiled on its workers: use partitions()")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
