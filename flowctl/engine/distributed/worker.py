"""A worker task of a Ray cluster (whitepaper §3, Figure 3; §3.2.2; §3.3): the body of one Ray actor.

A `Worker` is `/job:worker/task:N`. It owns its devices, the Variables and random states placed on
them (they live in its own `ContainerStore`), and one execution thread per device. The master sends
it, once per run signature, its partitions as GraphDef JSON; it compiles them with the same `Plan`
and kernels as a local run (`runtime.compile_partition`) and runs each step through the same
`DeviceThreads` step protocol as `DistributedSession`. Only the rendezvous differs.

The rendezvous (§3.3: "Send/Receive node pairs that communicate across worker processes use remote
communication mechanisms"). A step's `WorkerRendezvous` is a `LocalRendezvous` whose Send to a device
of another task hands the tensor to Ray instead of its own table: a call `deliver(key, value)` on the
destination worker's actor, made straight from the Send kernel (no master hop, §3.2.2: the master
issues one Run per worker and the Send/Recv pairs do the rest); the destination puts what arrives
into its own step rendezvous, where the Recv is (or will be) waiting. Each worker confirms its
outgoing transfers at the end of its Run, so a failed transfer fails the step.

How a tensor moves. A small one (up to Ray's 100 KiB inline limit) rides in the call. A large one is
put into the object store once by the sender and the call carries only its ObjectRef (`Stored`); the
destination reads it zero-copy: a read-only numpy view of the store's shared memory, which stays
valid (the store keeps the object while a reader maps it) after the sender drops its ref. The view
goes to the Recv as it is. No kernel writes into it: buffer forwarding, LoopSum and the in-place
updates write only into a writeable array they own (executor.whole, kernels.state._owns_buffer);
a kernel that took a read-only input for its output would fail, not change the store. Only a tensor
that may outlive the step -- a Recv whose value can reach an Assign or a queue (`kept_recvs`) -- is
copied on arrival, so no Variable or queue pins the store's memory. Measured on the shared 2-core
machine (`python -m flowctl.bench.ray --links-only`): a 64 MiB crossing took 32-65 ms when the call
carried the tensor and the destination copied it (a fresh 64 MiB copy alone is 15 ms), 13-18 ms
now; what is left is the sender's `ray.put` (1.4-4 ms for 4 MiB, 8-21 ms for 64 MiB in a worker,
most of it Ray's own calls to its raylet, whatever the size below a few MiB) and ~1.5 ms of actor
calls, so a 4 MiB tensor moves at 1.2-1.3 GB/s beyond a 4-byte crossing and a 64 MiB one at 5.5-5.9.

Order. Several steps may be in flight (asynchronous training issues Runs from several client
threads), and each device runs its steps one after another: two workers queuing two steps in opposite
orders could wait on each other forever. The master numbers each worker's Runs (`seq`) under one lock
and a worker queues them on its device threads strictly in that order (`DeviceThreads.start_step`), so
every device of every worker sees the steps in the master's order (runtime.py does the same in one
process).

Abort. A Run fails with the first kernel or transfer error; the master then sends `abort(step)` to
every other worker of the step, which fails that step's rendezvous there and wakes every waiting Recv
(`LocalRendezvous.abort`), so all partitions stop. A transfer or an abort that arrives before the Run
it belongs to is kept under the step id until the Run comes; one that arrives after the step ended is
dropped.
"""
from __future__ import annotations

import collections
import os
import platform
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from flowctl.engine.container import ContainerStore, RngState
from flowctl.engine.devices import parse_device
from flowctl.engine.errors import ExecutionError, FlowctlError
from flowctl.engine.executor import RunStats
from flowctl.engine.graph import GRAPHDEF_VERSION, Graph, Node, parse_ref
from flowctl.engine.opdef import get_op
from flowctl.engine.rendezvous import LocalRendezvous, RendezvousKey, StepContext
from flowctl.engine.runtime import DevicePlan, DeviceThreads, PartitionSpec, compile_partition, root_cause
from flowctl.engine.session import Session
from flowctl.kernels.registry import Ready, to_host
from flowctl.version import __version__

# What the master sends per partition: (device, GraphDef JSON, fetch refs, feed refs, targets).
PartitionWire = tuple[str, str, list[str], list[str], list[str]]
_FINISHED_KEPT = 4096  # step ids remembered as finished, so late transfers and aborts are dropped
# Ray passes an argument up to this size inside the call (its max_direct_call_object_size); above
# it a tensor goes through the object store, put there by the sender itself.
INLINE_BYTES = 100 * 1024
# Ops that keep an input's array past the step: Assign makes it a Variable's, a queue holds it.
_KEEPS_INPUT = frozenset({"Assign"})


class Stored(NamedTuple):
    """A transfer's tensor in Ray's object store: the call carries the ref, not the bytes."""
    ref: Any


def state_graph(seed: int, nodes: Sequence[Mapping[str, Any]]) -> Graph:
    """The stateful nodes a worker owns (Variables, random ops, queues) from their GraphDef JSON
    entries, inputs dropped: resources are looked up by name and attributes alone."""
    g = Graph(seed=seed)
    for d in nodes:
        opdef = get_op(d["op"])
        attrs = opdef.normalize_attrs(opdef.decode_attrs(d.get("attrs", {}), d["name"]), d["name"])
        g.nodes[d["name"]] = Node(d["name"], d["op"], attrs=attrs, assigned_device=d.get("assigned_device"))
        g._counts.setdefault(d["name"], 0)
    return g


def writable(value: Any) -> Any:
    """`value`, copied if it is a read-only host array (a view of Ray's shared-memory store)."""
    if isinstance(value, np.ndarray) and not value.flags.writeable:
        return value.copy()
    return value


def kept_recvs(graph: Graph) -> set[tuple[str, str]]:
    """(receiving device, tensor name) of each Recv in `graph` whose value may outlive the step: it
    reaches, through any chain of ops (a view or an Identity passes the array on), an Assign or a
    queue op. Such a value is copied on arrival instead of pinning the object store's memory."""
    consumers: dict[str, list[Node]] = {}
    for node in graph.nodes.values():
        for ref in node.inputs:
            if not ref.startswith("^"):
                consumers.setdefault(parse_ref(ref)[0], []).append(node)
    out = set()
    for recv in graph.nodes.values():
        if recv.op != "Recv":
            continue
        seen, todo = {recv.name}, [recv.name]
        while todo:
            for c in consumers.get(todo.pop(), []):
                if c.op in _KEEPS_INPUT or c.opdef.resource == "queue":
                    out.add((recv.attrs["recv_device"], recv.attrs["tensor_name"]))
                    todo = []
                    break
                if c.name not in seen:
                    seen.add(c.name)
                    todo.append(c.name)
    return out


class WorkerRendezvous(LocalRendezvous):
    """One step's rendezvous on one worker: local pairs meet here, Sends to other tasks go to Ray."""

    def __init__(self, worker: "Worker") -> None:
        super().__init__()
        self.worker = worker
        self.outgoing: list[tuple[RendezvousKey, Any]] = []  # (key, the deliver call's ObjectRef, or its Future)

    def send(self, key: tuple[Any, ...], value: Any) -> None:
        k = RendezvousKey(*key)
        task = parse_device(k.dst_device).task
        if task == self.worker.task:
            super().send(k, value)
            return
        if self.error is not None:
            raise self._aborted(k)
        peer = self.worker.peers.get(task)
        if peer is None:
            raise ExecutionError(f"no worker task {task} for the transfer {k}", device=k.src_device)
        if isinstance(value, Ready):  # a GPU tensor: wait for the kernel that made it, then copy it out
            value.event.synchronize()
            value = value.array
        value = to_host(value)
        if isinstance(value, np.ndarray) and value.nbytes > INLINE_BYTES:
            # Put once, so the call is small and the destination reads the store zero-copy; on the
            # worker's sending thread, so this device goes on with its next op meanwhile (a put is
            # mostly a wait on Ray's raylet). The thread's reference to the array keeps the
            # executor from forwarding its buffer and an update from writing into it until the put
            # has copied it (both take a buffer only when nothing else refers to it).
            self.outgoing.append((k, self.worker.sending.submit(_put_and_deliver, peer, tuple(k), value)))
            return
        self.outgoing.append((k, peer.deliver.remote(tuple(k), value)))

    def accept(self, key: tuple[Any, ...], value: Any) -> None:
        """A tensor from another task arrives for a Recv here: as it came (a store's tensor as a
        read-only view, see the module doc), copied only where the value may outlive the step."""
        k = RendezvousKey(*key)
        if (k.dst_device, k.tensor_name) in self.worker.kept:
            value = writable(value)
        super().send(k, value)


def _put_and_deliver(peer: Any, key: tuple[Any, ...], value: np.ndarray) -> Any:
    """A large transfer, on the sending thread: into the object store, then the call (its ref)."""
    import ray

    return peer.deliver.remote(key, Stored(ray.put(value)))


class Worker:
    """The actor body; `flowctl.engine.distributed.session` wraps it with `ray.remote`."""

    def __init__(self, task: int, devices: list[str], graph_seed: int, state_nodes: list[dict[str, Any]],
                 blas_threads: int | None = None, transfer_timeout: float = 60.0) -> None:
        self.task = task
        self.devices = list(devices)
        self.transfer_timeout = transfer_timeout
        self.peers: dict[int, Any] = {}
        self.store = ContainerStore()
        self.rng: dict[str, RngState] = {}
        self.state = state_graph(graph_seed, state_nodes)
        self._blas = None
        if blas_threads:
            # Its own process, so its own BLAS pool (runtime.blas_limits cannot do this per device).
            from threadpoolctl import threadpool_limits

            self._blas = threadpool_limits(limits=blas_threads, user_api="blas")
        self._problem: FlowctlError | None = None
        self.sessions: dict[str, Session] = {}
        try:
            for d in self.devices:
                s = Session(self.state, device=d, store=self.store, executor="dataflow")
                s.rng = self.rng  # one random state per op, whichever device's plan binds it
                self.sessions[d] = s
        except FlowctlError as e:  # reported by hello(): an actor that fails to start hides the reason
            self._problem = e
        self.threads = DeviceThreads(self.devices)
        # Large outgoing transfers are put into the object store here (WorkerRendezvous.send).
        self.sending = ThreadPoolExecutor(max_workers=2, thread_name_prefix="flowctl-send")
        self.signatures: dict[int, list[DevicePlan]] = {}
        self.kept: set[tuple[str, str]] = set()  # Recvs copied on arrival (kept_recvs), every signature's
        self._lock = threading.Lock()
        self._turn = threading.Condition(self._lock)
        self._next_seq = 0
        self._steps: dict[int, WorkerRendezvous] = {}
        self._finished: collections.OrderedDict[int, None] = collections.OrderedDict()

    # ------------------------------------------------------------------ set-up
    def hello(self) -> dict[str, Any]:
        """Who and where this worker is, or the PlacementError that stops it using its devices."""
        if self._problem is not None:
            raise self._problem
        import ray

        ctx = ray.get_runtime_context()
        return {"task": self.task, "pid": os.getpid(), "node_id": ctx.get_node_id(),
                "ip": ray.util.get_node_ip_address(), "ray": ray.__version__, "flowctl": __version__,
                "graphdef": GRAPHDEF_VERSION, "python": platform.python_version()}

    def set_peers(self, peers: dict[int, Any]) -> None:
        self.peers = dict(peers)

    def load(self, sig: int, parts: list[PartitionWire]) -> None:
        """Compile this worker's partitions of signature `sig` (once; a restarted worker is sent them
        again)."""
        plans = []
        for device, graph_json, fetches, feeds, targets in parts:
            spec = PartitionSpec(device, Graph.from_json(graph_json), fetches, feeds, targets, [], [])
            plans.append(compile_partition(spec, self.sessions[device]._resource))
            self.kept |= kept_recvs(spec.graph)
        self.signatures[sig] = plans

    def ping(self) -> int:
        return os.getpid()

    # ------------------------------------------------------------------ steps
    def run(self, sig: int, step_id: int, seq: int, feeds: list[list[Any]], want_stats: bool = False,
            check_numerics: bool = False) -> tuple[list[list[Any]], dict[str, RunStats] | None]:
        """One Run (§3.2.2): every partition of signature `sig` on its device, with `feeds` per
        partition; each partition's fetched values (host arrays) and, if asked, its RunStats."""
        plans = self.signatures[sig]
        stats = {d.device: RunStats() for d in plans} if want_stats else None
        with self._turn:
            while self._next_seq != seq:  # the master's order (see module doc)
                self._turn.wait()
            rv = self._step(step_id)
            try:
                futures = None
                if rv.error is None:  # aborted before its turn: run nothing (no update applies)
                    step = StepContext(step_id, rv)
                    futures = self.threads.start_step(plans, [[writable(v) for v in f] for f in feeds], step,
                                                      stats, check_numerics)
            finally:
                self._next_seq += 1
                self._turn.notify_all()
        try:
            if futures is None:
                assert rv.error is not None
                raise root_cause(rv.error)
            outs = self.threads.finish_step(futures, StepContext(step_id, rv), None)
            self._confirm_transfers(rv)
            return [[to_host(v) for v in out] for out in outs], stats
        except BaseException as e:
            rv.abort(e)
            raise _plain(root_cause(e)) from None
        finally:
            with self._lock:
                self._steps.pop(step_id, None)
                self._finished[step_id] = None
                while len(self._finished) > _FINISHED_KEPT:
                    self._finished.popitem(last=False)

    def _step(self, step_id: int) -> WorkerRendezvous:
        """The step's rendezvous, made by whichever comes first: its Run, a transfer, an abort.
        Called with the lock held."""
        rv = self._steps.get(step_id)
        if rv is None:
            rv = self._steps[step_id] = WorkerRendezvous(self)
        return rv

    def _confirm_transfers(self, rv: WorkerRendezvous) -> None:
        """§3.3 (a): an error in a communication between a Send and its Recv fails the step."""
        if not rv.outgoing:
            return
        import ray

        refs = []
        for key, ref in rv.outgoing:
            try:
                if isinstance(ref, Future):  # a large transfer: its put and call, made on the sending thread
                    ref = ref.result(timeout=self.transfer_timeout)
            except Exception as e:  # noqa: BLE001 -- any failure to deliver is the transfer's
                raise _transfer_failed(key, e) from None
            refs.append((key, ref))
        try:  # one wait for all the deliveries (a call to Ray per transfer cost the step ~1 ms)
            ray.get([ref for _, ref in refs], timeout=self.transfer_timeout)
            return
        except Exception:  # noqa: BLE001 -- find which transfer failed, below
            pass
        for key, ref in refs:
            try:
                ray.get(ref, timeout=self.transfer_timeout)
            except Exception as e:  # noqa: BLE001 -- any failure to deliver is the transfer's
                raise _transfer_failed(key, e) from None
        raise ExecutionError(f"a transfer from worker task {self.task} failed", device=refs[0][0].src_device)

    def deliver(self, key: tuple[Any, ...], value: Any) -> bool:
        """A Send on another worker hands over a tensor for step key[0] (a large one as `Stored`)."""
        if isinstance(value, Stored):
            import ray

            value = ray.get(value.ref)  # zero-copy: a read-only view of the store's shared memory
        with self._lock:
            if key[0] in self._finished:
                return False
            rv = self._step(key[0])
        try:
            rv.accept(key, value)
        except ExecutionError:
            return False  # the step was aborted here already; the abort reports the cause
        return True

    def abort(self, step_id: int, message: str) -> None:
        with self._lock:
            if step_id in self._finished:
                return
            rv = self._step(step_id)
        rv.abort(ExecutionError(message))

    # ------------------------------------------------------------------ state (checkpoints)
    def variable_values(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for s in self.sessions.values():
            out.update(s.variable_values())
        return out

    def load_variables(self, values: dict[str, Any]) -> None:
        by_device: dict[str, dict[str, Any]] = {}
        for name, v in values.items():
            by_device.setdefault(self._device_of(name), {})[name] = writable(v)
        for d, vals in by_device.items():
            self.sessions[d].load_variables(vals)

    def rng_states(self) -> dict[str, dict[str, Any]]:
        if not self.sessions:
            return {}
        return next(iter(self.sessions.values())).rng_states()  # one shared table

    def set_rng_states(self, states: dict[str, dict[str, Any]]) -> None:
        for name, st in states.items():
            self.sessions[self._device_of(name)].set_rng_states({name: st})

    def _device_of(self, name: str) -> str:
        node = self.state.nodes.get(name)
        if node is None or node.assigned_device not in self.sessions:
            raise ExecutionError(f"worker task {self.task} does not hold '{name}'")
        return node.assigned_device


def _transfer_failed(key: RendezvousKey, err: BaseException) -> ExecutionError:
    first = (str(err).strip().splitlines() or [""])[0]
    return ExecutionError(f"transfer {key} failed: {type(err).__name__}: {first}", device=key.src_device)


def _plain(err: BaseException) -> BaseException:
    """An error that pickles back to the master intact (only message and attributes travel)."""
    return err if isinstance(err, FlowctlError) else ExecutionError(f"{type(err).__name__}: {err}")
