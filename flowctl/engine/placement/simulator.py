"""A discrete-event simulation of one step of a placed graph (whitepaper §3.2.1: "the placement
algorithm first runs a simulated execution of the graph"). It is the single source of predicted
numbers: every placer's result, `place --explain` and `bench`'s prediction come from here.

The model, chosen to match what the runtime does:
- Each device runs one op at a time (a device partition runs on its own executor thread; a
  virtual CPU device's extra threads go to BLAS inside one op, which the cost model's peak FLOP/s
  already counts). Ready ops take turns as the executor has them: an op whose output crosses to
  another device, one that feeds such an op on its device, and the scalars those need first, by
  the time they became ready; then the others in the order the graph was built (`CostTable.built`).
- Every cross-device edge is one transfer per (tensor, destination device), shared by all the
  consumers there (§3.2.2: one Recv per tensor per device), queued FIFO on the directed link
  (src, dst) and taking the cost model's transfer time. A cross-device control edge is a 0-byte
  transfer (the partitioner sends a token), so it costs the link's latency.
- Memory: a tensor is allocated on its device when its op starts, and a received tensor when its
  transfer arrives; it is freed once its last consumer on that device has finished (and, on the
  producer's device, once its outgoing transfers are done). Outputs of Variables, Consts and fed
  Placeholders are resident for the whole step. A view (a Reshape, a Split, a Slice: the kernel
  hands back its input's buffer, `CostTable.views`) allocates nothing and keeps the buffer it views
  alive until the view itself is freed, as numpy and cupy do; what crosses a link is a copy. An
  op that forwards (OpDef.forward: Add, Mul, BiasAdd, ...) allocates nothing when it starts as
  the last reader of one of those inputs (`CostTable.forward`; no other reader, view, transfer or
  fetch holds it): its output takes that buffer over, as the executors do. A state write (an
  optimizer update) writes into its variable's array once no reader of the variable's value is
  left, holding nothing new, on a CPU and a GPU alike (kernels/state.updatable_in_place). A
  device whose peak exceeds its memory makes the placement invalid: `SimResult.valid` is false
  and `check()` raises `PlacementError`.
- Contention: synchronous devices of one process (virtual CPU devices) share caches and memory
  bandwidth. While two or more of them run ops, each progresses at 1/`contention` of its measured
  speed (processor sharing; the cost model's `contention`, 1 by default, measured by `bench`).
- Jitter: an op never takes exactly its cost. `simulate` is the schedule at exactly those costs;
  `expected_step_time` is the mean step over runs where every op's time is off by a random factor
  of the cost model's measured spread. The two differ where a schedule depends on near-ties
  between devices: a placement that interleaves devices op by op can lose its lucky order to a
  1% change in one op (measured: greedy's lstm_lm placement, 974 ms exactly, 1,165 ms expected
  at 1% jitter, while the expert's moves by 0.1%). Predictions of measured time use the expectation.
"""
from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from flowctl.engine.cluster import Cluster
from flowctl.engine.devices import canonical
from flowctl.engine.errors import PlacementError
from flowctl.engine.executor import needed_nodes, prompt_nodes
from flowctl.engine.graph import Graph, parse_ref
from flowctl.engine.placement.cost import CostModel, CostTable


def step_nodes(graph: Graph, targets: Iterable[str] | None = None) -> list[str]:
    """The nodes one step runs, in topological order: everything `targets` (node names or
    `node:port` refs) needs, or the whole graph when no targets are given."""
    if targets is None:
        return graph.topo_order()
    roots = [parse_ref(t.lstrip("^"))[0] for t in targets]
    for r in roots:
        if r not in graph.nodes:
            graph.tensor(r)  # raises with a did-you-mean
    return graph.topo_order(needed_nodes(graph, roots, set()))


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class DeviceStats:
    device: str
    ops: int = 0
    flops: float = 0.0
    busy: float = 0.0  # seconds spent running ops
    bytes_in: int = 0  # received from other devices
    bytes_out: int = 0  # sent to other devices
    resident: int = 0  # Variables, Consts, fed inputs
    peak_memory: int = 0  # resident + the largest live working set
    capacity: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LinkStats:
    src: str
    dst: str
    bytes: int = 0
    transfers: int = 0
    busy: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SimResult:
    step_time: float  # the makespan, seconds
    devices: list[DeviceStats]
    links: list[LinkStats]
    start: dict[str, float] = field(default_factory=dict)
    finish: dict[str, float] = field(default_factory=dict)
    device_of: dict[str, str] = field(default_factory=dict)  # the placement simulated (step nodes)
    problems: list[str] = field(default_factory=list)  # memory overflows, one line per device

    @property
    def valid(self) -> bool:
        return not self.problems

    def device(self, name: str) -> DeviceStats:
        name = canonical(name)
        for d in self.devices:
            if d.device == name:
                return d
        raise KeyError(name)

    def check(self) -> SimResult:
        """Raise PlacementError if the placement overflows a device's memory (§4.3: never accept
        a placement silently that cannot run)."""
        if self.problems:
            raise PlacementError("placement is invalid: " + "; ".join(self.problems))
        return self

    def to_dict(self, nodes: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"step_time": self.step_time, "valid": self.valid, "problems": list(self.problems),
                             "devices": [x.to_dict() for x in self.devices],
                             "links": [x.to_dict() for x in self.links if x.transfers]}
        if nodes:
            d["nodes"] = {n: {"device": self.device_of[n], "start": self.start[n], "finish": self.finish[n]}
                          for n in self.start}
        return d


@dataclass
class Expectation:
    """The step time over `samples` jittered simulations: mean, and the 10th and 90th percentiles."""

    mean: float
    low: float
    high: float
    jitter: float
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Jittered simulations per expectation: each costs one simulation (0.1 s for a 6,600-node step).
# With the same draws for every placement of a step, 8 already order placements fairly; bench,
# which sets a prediction beside a measurement, takes more.
EXPECTATION_SAMPLES = 8
_AFTER_PROMPT = 1e9  # queue keys of non-prompt nodes start here: past any step's seconds (_Run.turn)


def simulate(graph: Graph, placement: Mapping[str, str], cluster: Cluster, cost_model: CostModel,
             targets: Iterable[str] | None = None, keep: Iterable[str] = ()) -> SimResult:
    """Simulate one step of `graph` under `placement` (node name -> device name). `targets`: what
    the step runs (default the whole graph); `keep`: refs the client fetches, never freed."""
    table, dev = _tabulate(graph, placement, cluster, cost_model, targets)
    return simulate_table(table, dev, cluster, keep)


def expect(graph: Graph, placement: Mapping[str, str], cluster: Cluster, cost_model: CostModel,
           targets: Iterable[str] | None = None, samples: int = EXPECTATION_SAMPLES, seed: int = 0) -> Expectation:
    """`simulate`'s step time in expectation over the cost model's jitter (`expected_step_time`)."""
    table, dev = _tabulate(graph, placement, cluster, cost_model, targets)
    return expected_step_time(table, dev, cluster, samples, seed)


def _tabulate(graph: Graph, placement: Mapping[str, str], cluster: Cluster, cost_model: CostModel,
              targets: Iterable[str] | None) -> tuple[CostTable, list[int]]:
    table = CostTable.build(graph, cluster, cost_model, step_nodes(graph, targets))
    index = {d: i for i, d in enumerate(table.devices)}
    dev = []
    for n in table.names:
        if n not in placement:
            raise PlacementError(f"node '{n}' ({graph.nodes[n].op}) has no device in the placement")
        try:
            dev.append(index[canonical(placement[n])])
        except KeyError:
            raise PlacementError(f"node '{n}' is placed on {placement[n]}, which is not in the cluster; "
                                 f"devices: {', '.join(table.devices)}") from None
    return table, dev


@dataclass
class _Dependencies:
    """What a placement makes each node wait for: local predecessors, and one transfer per
    (tensor, destination device) shared by every consumer there (§3.2.2). Counts that the event
    loop consumes (`pending`, `src_refs`, `recv_refs`) are copied per run; the rest is read-only,
    so jittered runs of one placement share it."""

    pending: list[int]
    local_succ: list[list[int]]
    xfer_waiters: dict[tuple[int, int, int], list[int]]
    out_xfers: list[list[tuple[int, int]]]  # per node: (port or -1, dst device), in link order
    src_refs: dict[tuple[int, int], int]  # (node, port) -> local readers + outgoing transfers
    recv_refs: dict[tuple[int, int, int], int]  # (node, port, device) -> readers there


def _dependencies(table: CostTable, dev: Sequence[int]) -> _Dependencies:
    n, inputs, controls = len(table.names), table.inputs, table.controls
    pending = [0] * n
    local_succ: list[list[int]] = [[] for _ in range(n)]
    xfer_waiters: dict[tuple[int, int, int], list[int]] = {}
    out_xfers: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    src_refs: dict[tuple[int, int], int] = {}
    recv_refs: dict[tuple[int, int, int], int] = {}
    for i in range(n):
        d = dev[i]
        node_deps: set[int] = set()
        keys: list[tuple[int, int, int]] = []
        for j, p in inputs[i]:
            if dev[j] == d:
                node_deps.add(j)
                src_refs[(j, p)] = src_refs.get((j, p), 0) + 1
            else:
                key = (j, p, d)
                if key not in xfer_waiters:
                    xfer_waiters[key] = []
                    out_xfers[j].append((p, d))
                    src_refs[(j, p)] = src_refs.get((j, p), 0) + 1
                xfer_waiters[key].append(i)
                recv_refs[key] = recv_refs.get(key, 0) + 1
                keys.append(key)
        for j in controls[i]:
            if dev[j] == d:
                node_deps.add(j)
            else:
                key = (j, -1, d)
                if key not in xfer_waiters:
                    xfer_waiters[key] = []
                    out_xfers[j].append((-1, d))
                xfer_waiters[key].append(i)
                keys.append(key)
        for j in node_deps:
            local_succ[j].append(i)
        pending[i] = len(node_deps) + len(keys)
    for j in range(n):
        out_xfers[j].sort(key=lambda pd: (pd[1], pd[0]))  # deterministic link order
    return _Dependencies(pending, local_succ, xfer_waiters, out_xfers, src_refs, recv_refs)


class _Run:
    """One simulation's state, and the event loop's steps over it. The loop is the placers' hot
    path (the learned and auto placers simulate thousands of placements), so the two methods
    called once per op, `dispatch` and `op_finished`, take what they touch from one prebuilt
    tuple (one unpack instead of a dozen attribute loads: measured, the split alone cost 9%)."""

    unstarted = 0.0  # `start` before a node is dispatched (_Watched tells the two apart)

    def __init__(self, table: CostTable, dev: Sequence[int], cluster: Cluster, keep: Iterable[str],
                 deps: _Dependencies) -> None:
        n, D = len(table.names), len(table.devices)
        self.table, self.dev, self.n, self.D = table, dev, n, D
        self.keep_refs = _keep_refs(table, keep)
        self.pending, self.src_refs, self.recv_refs = list(deps.pending), dict(deps.src_refs), dict(deps.recv_refs)
        self.local_succ, self.xfer_waiters, self.out_xfers = deps.local_succ, deps.xfer_waiters, deps.out_xfers
        self.stats = [DeviceStats(name, capacity=int(cluster.device(name).profile.memory)) for name in table.devices]
        self.mem = self.memory(self._initial_memory())
        self.peak = list(self.mem)
        self.links: dict[tuple[int, int], LinkStats] = {}
        self.link_free: dict[tuple[int, int], float] = {}
        self.start = [self.unstarted] * n
        self.finish = [0.0] * n
        self.queues: list[list[tuple[float, int]]] = [[] for _ in range(D)]
        # A ready node's key in its device's queue (the executor's order, executor._prompt): a node
        # whose output crosses to another device, one feeding such a node on its device, and the
        # scalars those need, by the time it became ready (-1 here: the ready time is pushed); any
        # other by its place in the build order, after every prompt one (keys past any step's seconds).
        self.turn = [-1.0 if p else _AFTER_PROMPT + table.rank(i) for i, p in enumerate(self._prompt())]
        self.running = [-1] * D
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.done = 0
        self.host = table.host or [0.0] * n
        self.lanes = table.lanes or list(range(D))
        self.host_free = [0.0] * (max(self.lanes, default=0) + 1)
        # An asynchronous device (a GPU): its thread is free again once an op is launched, and the
        # op's kernels run on the device's stream in launch order. Consumers on the same device may
        # launch at once (the stream orders them); a transfer out waits for the kernel to finish.
        self.is_async = table.is_async or [False] * D
        self.stream_free = [0.0] * D
        self.kernel_end = [0.0] * n
        # Contention (processor sharing): synchronous devices of one process that run ops at the
        # same time each progress at 1/contention of full speed. A running op keeps its remaining
        # work at full speed; whenever the number of busy devices in its process changes, its
        # finish moves.
        self.shared = self._contention_groups()
        self.contended = [False] * D
        for ds in self.shared:
            for d in ds:
                self.contended[d] = True
        self.work_left = [0.0] * D  # full-speed seconds left of the op running on d
        self.work_since = [0.0] * D  # when work_left was last brought up to date (or the op's start)
        self.rate = [1.0] * D
        self.began = [0.0] * D
        self.live = [-1] * n  # the seq of node i's current finish event; older ones are stale
        # Views: per view node, how many of its outputs are still alive here (its base lives on).
        self.views = table.views
        self.views_left = [len(b) for b in table.out_bytes] if table.views else []
        # Buffer forwarding: the (producer, port, device) of each buffer an op's output took over
        # from an input (or from the buffer an input views), which its release then leaves alone,
        # until the old owner frees it (the op finished). A received tensor is the receiver's own copy
        # only on a device that copies in (a GPU); virtual CPUs of one process share the array.
        self.taken: set[tuple[int, int, int]] = set()  # buffers so taken, until their old owner frees them
        self.copies_in = [cluster.device(name).type != "cpu" for name in table.devices]
        self.slow = 1.0 / table.contention if table.contention > 0 else 1.0
        # What dispatch and op_finished read, aliased: these lists are mutated, never rebound.
        # Per node: forwarding candidates or a state write to look at when it starts (None: neither).
        special = [bool(table.forward and table.forward[i]) or bool(table.writes and table.writes[i] >= 0)
                   for i in range(n)] if (table.forward or table.writes) else [False] * n
        self._dispatch_state = (table, self.is_async, self.host, self.lanes, self.host_free, table.held,
                                table.resident, self.mem, self.peak, self.stats, self.contended, self.live,
                                self.events, self.start, special)
        self._finish_state = (table.times, table.inputs, table.out_bytes, table.resident, dev, self.mem,
                              self.running, self.finish, self.kernel_end, self.is_async, self.contended,
                              self.recv_refs, self.src_refs, self.keep_refs, self.pending, self.local_succ,
                              self.queues, self.out_xfers, self.turn)
        for i in range(n):
            if self.pending[i] == 0:
                self.queues[dev[i]].append((max(self.turn[i], 0.0), i))
        for q in self.queues:
            heapq.heapify(q)

    def _prompt(self) -> list[bool]:
        """Per node, whether it takes its turn first (executor.prompt_nodes, from the nodes whose
        outputs cross to another device)."""
        table, dev = self.table, self.dev

        def local_preds(i: int) -> list[int]:
            return [j for j in [*(j for j, _ in table.inputs[i]), *table.controls[i]] if dev[j] == dev[i]]

        chosen = prompt_nodes([i for i in range(self.n) if self.out_xfers[i]], local_preds, lambda j: True,
                              lambda j: bool(table.out_bytes[j]) and max(table.out_bytes[j]) <= 8)
        return [i in chosen for i in range(self.n)]

    def memory(self, resident: list[int]) -> list[int]:
        """The per-device byte counts the loop updates in place (a subclass watches them)."""
        return resident

    def _initial_memory(self) -> list[int]:
        """Each device's resident bytes (Variables, Consts, fed inputs: held the whole step)."""
        mem = [0] * self.D
        out_bytes, dev, stats = self.table.out_bytes, self.dev, self.stats
        for i, res in enumerate(self.table.resident):
            if res:
                b = sum(out_bytes[i])
                stats[dev[i]].resident += b
                mem[dev[i]] += b
        return mem

    def _contention_groups(self) -> list[list[int]]:
        """The synchronous devices of each process that has more than one (none without contention)."""
        if self.table.contention == 1.0:
            return []
        by_lane: dict[int, list[int]] = {}
        for d in range(self.D):
            if not self.is_async[d]:
                by_lane.setdefault(self.lanes[d], []).append(d)
        return [ds for ds in by_lane.values() if len(ds) > 1]

    def run(self) -> None:
        events, heappop, live, shared = self.events, heapq.heappop, self.live, self.shared
        dispatch, reshare, op_finished, transfer_arrived = (self.dispatch, self.reshare, self.op_finished,
                                                            self.transfer_arrived)
        t = 0.0
        while True:
            dispatch(t)
            if shared:
                reshare(t)
            if not events:
                break
            t = events[0][0]
            while events and events[0][0] == t:
                _, ev_seq, kind, payload = heappop(events)
                if kind == 0:
                    if ev_seq == live[payload]:  # else rescheduled since: the contention changed
                        op_finished(payload, t)
                else:
                    transfer_arrived(payload, t)
        if self.done != self.n:  # cannot happen for a graph that passed topo_order; an invariant check
            stuck = [self.table.names[i] for i in range(self.n) if self.pending[i] > 0][:5]
            raise PlacementError(f"simulation stalled with {self.n - self.done} node(s) never ready, e.g. {stuck}")

    def dispatch(self, t: float) -> None:
        """Every idle device starts its earliest-ready op at time t -- once its process's
        interpreter is free for the op's dispatch share (devices of one process take turns)."""
        running, queues = self.running, self.queues
        (table, is_async, host, lanes, host_free, held, resident, mem, peak, stats, contended, live,
         events, start, special) = self._dispatch_state
        seq = self.seq
        for d in range(self.D):
            if running[d] < 0 and queues[d]:
                _, i = heapq.heappop(queues[d])
                running[d] = i
                begin = t
                # A GPU launch is Python and driver calls end to end: all of it holds the lane.
                h = table.issue[i][d] if is_async[d] else host[i]
                if h:
                    begin = max(t, host_free[lanes[d]])
                    host_free[lanes[d]] = begin + h
                start[i] = begin
                s = stats[d]
                if is_async[d]:
                    dur = table.issue[i][d]
                    k0 = max(begin + dur, self.stream_free[d])
                    self.kernel_end[i] = self.stream_free[d] = k0 + table.stream[i][d]
                    s.busy += table.stream[i][d]
                else:
                    dur = table.times[i][d]
                    s.busy += dur
                if not resident[i]:
                    mem[d] += sum(held[i]) - (self.reused(i, d) if special[i] else 0)
                    if mem[d] > peak[d]:
                        peak[d] = mem[d]
                s.ops += 1
                s.flops += table.flops[i]
                if contended[d]:  # scheduled by reshare, at the speed the process allows now
                    self.work_left[d], self.work_since[d], self.began[d], live[i] = dur, begin, begin, -1
                    continue
                seq += 1
                live[i] = seq
                heapq.heappush(events, (begin + dur, seq, 0, i))
        self.seq = seq

    def reused(self, i: int, d: int) -> int:
        """The bytes of node i's outputs that are not new memory on device d: a buffer it forwards
        into (`take`), or its variable's array for a state write in place (`in_place`)."""
        table = self.table
        if table.forward and table.forward[i]:
            return self.take(i, d)
        return sum(table.held[i]) if self.in_place(i, d) else 0

    def take(self, i: int, d: int) -> int:
        """Buffer forwarding as the executors do it: node i, starting on device d, writes its output
        into the first of its `forward` inputs it is the last reader of (no other reader, view,
        transfer or fetch holds it); the bytes it so does not allocate."""
        table, views = self.table, self.views
        for pos in table.forward[i]:
            j, p = table.inputs[i][pos]
            while True:  # down a chain of whole-buffer views (forwards_of), each held only by the next
                if self.dev[j] == d:
                    if self.src_refs[(j, p)] != 1 or (j, p) in self.keep_refs:
                        break
                elif not self.copies_in[d] or self.recv_refs.get((j, p, d)) != 1:
                    break
                if self.dev[j] != d or not views or views[j] is None:
                    self.taken.add((j, p, d))
                    return table.out_bytes[j][p]
                j, p = views[j]  # type: ignore[misc]
        return 0

    def in_place(self, i: int, d: int) -> bool:
        """Whether state write i, starting on device d, writes into its variable's array: once no
        reader of the variable's value is left (kernels/state.updatable_in_place, numpy's and
        cupy's arrays alike) and the step does not fetch it (a fetched value keeps its bits). Its
        outputs (that array) then hold nothing new."""
        var = self.table.writes[i]
        if self.src_refs.get((var, 0), 0) or (var, 0) in self.keep_refs:
            return False
        for p in range(len(self.table.out_bytes[i])):
            self.taken.add((i, p, d))
        return True

    def freed(self, j: int, p: int, d: int) -> None:
        """Buffer (j, p) on device d (its own or a received copy) has no reader left."""
        if self.taken and (j, p, d) in self.taken:
            self.taken.discard((j, p, d))  # an op's output holds it now
        else:
            self.mem[d] -= self.table.out_bytes[j][p]

    def op_finished(self, i: int, t: float) -> None:
        """Node i's op ends at t: free its device, release what it read, wake its local
        successors, and queue its outgoing transfers on their links."""
        (times, inputs, out_bytes, resident, dev, mem, running, finish, kernel_end, is_async, contended,
         recv_refs, src_refs, keep_refs, pending, local_succ, queues, out_xfers, turn) = self._finish_state
        d = dev[i]
        running[d] = -1
        if contended[d]:
            self.stats[d].busy += (t - self.began[d]) - times[i][d]  # the time it really held d
            self.rate[d] = 1.0
        finish[i] = max(t, kernel_end[i]) if is_async[d] else t  # when the output exists
        self.done += 1
        views = self.views
        base = views[i] if views else None  # a view's base stays until the view is freed
        taken = self.taken
        for j, p in inputs[i]:
            if dev[j] == d:  # `release`, inlined: this is the loop's innermost line
                if base is not None and (j, p) == base:
                    continue
                left = src_refs[(j, p)] - 1
                src_refs[(j, p)] = left
                if left == 0 and not resident[j] and (j, p) not in keep_refs:
                    if views and views[j] is not None:
                        self.view_freed(j)
                    elif taken:
                        self.freed(j, p, d)
                    else:
                        mem[d] -= out_bytes[j][p]
            else:
                key = (j, p, d)
                if base is not None and key[:2] == base:
                    continue
                recv_refs[key] -= 1
                if recv_refs[key] == 0:
                    self.freed(j, p, d)
        if not resident[i]:
            for p, b in enumerate(out_bytes[i]):
                if src_refs.get((i, p), 0) == 0 and (i, p) not in keep_refs:
                    if base is not None:
                        self.view_freed(i)
                    elif taken:
                        self.freed(i, p, d)
                    else:
                        mem[d] -= b  # produced but never read here: dropped at once
        for c in local_succ[i]:
            pending[c] -= 1
            if pending[c] == 0:
                heapq.heappush(queues[d], (t if turn[c] < 0 else turn[c], c))
        for p, dd in out_xfers[i]:
            self.send(i, p, d, dd)

    def send(self, i: int, p: int, d: int, dd: int) -> None:
        """Queue node i's output `p` (-1: a control token) on the link d -> dd (FIFO per link)."""
        table = self.table
        nbytes = table.out_bytes[i][p] if p >= 0 else 0
        lk = (d, dd)
        begin = max(self.finish[i], self.link_free.get(lk, 0.0))
        dur = table.crossing(i, p, d, dd)
        nbytes = int(nbytes * table.runs(i))
        self.link_free[lk] = begin + dur
        ls = self.links.get(lk)
        if ls is None:
            ls = self.links[lk] = LinkStats(table.devices[d], table.devices[dd])
        ls.bytes += nbytes
        ls.transfers += 1
        ls.busy += dur
        self.stats[d].bytes_out += nbytes
        self.stats[dd].bytes_in += nbytes
        self.seq += 1
        heapq.heappush(self.events, (begin + dur, self.seq, 1, (i, p, dd)))

    def transfer_arrived(self, key: tuple[int, int, int], t: float) -> None:
        """Tensor (j, p) (p = -1: a control token) reaches device dd at t: it takes memory there,
        and its waiters on dd may become ready."""
        j, p, dd = key
        if p >= 0:
            mem, peak = self.mem, self.peak
            mem[dd] += self.table.out_bytes[j][p]
            if mem[dd] > peak[dd]:
                peak[dd] = mem[dd]
            self.release(j, p)
        pending, queue, turn = self.pending, self.queues[dd], self.turn
        for c in self.xfer_waiters[key]:
            pending[c] -= 1
            if pending[c] == 0:
                heapq.heappush(queue, (t if turn[c] < 0 else turn[c], c))

    def release(self, j: int, p: int) -> None:
        """One reader (or outgoing transfer) of tensor (j, p) on its producer's device is done."""
        key = (j, p)
        left = self.src_refs[key] - 1
        self.src_refs[key] = left
        if left == 0 and not self.table.resident[j] and key not in self.keep_refs:
            if self.views and self.views[j] is not None:
                self.view_freed(j)
            else:
                self.freed(j, p, self.dev[j])

    def view_freed(self, j: int) -> None:
        """One output of view node j is freed; once all are, so is its hold on the buffer it views
        (which may be a view's in turn, or a received copy)."""
        self.views_left[j] -= 1
        if self.views_left[j]:
            return
        a, q = self.views[j]  # type: ignore[misc]
        d = self.dev[j]
        if self.dev[a] == d:
            self.release(a, q)
        else:
            key = (a, q, d)
            self.recv_refs[key] -= 1
            if self.recv_refs[key] == 0:
                self.freed(a, q, d)

    def reshare(self, now: float) -> None:
        """Bring each contended process's running ops up to `now` and, where the number of busy
        devices changed their speed (or an op just started), move their finish events."""
        running, work_left, work_since, rate, live = self.running, self.work_left, self.work_since, self.rate, self.live
        slow = self.slow
        for ds in self.shared:
            busy_n = sum(1 for d in ds if running[d] >= 0)
            r = slow if busy_n > 1 else 1.0
            for d in ds:
                i = running[d]
                if i < 0:
                    continue
                if now > work_since[d]:
                    work_left[d] -= (now - work_since[d]) * rate[d]
                    work_since[d] = now
                if r != rate[d] or live[i] < 0:
                    rate[d] = r
                    self.seq += 1
                    live[i] = self.seq
                    heapq.heappush(self.events, (work_since[d] + max(0.0, work_left[d]) / r, self.seq, 0, i))

    def result(self) -> SimResult:
        problems = []
        for d, s in enumerate(self.stats):
            s.peak_memory = int(self.peak[d])
            if s.peak_memory > s.capacity:
                problems.append(f"device {s.device} needs {fmt_bytes(s.peak_memory)} at peak "
                                f"({fmt_bytes(s.resident)} resident) but holds {fmt_bytes(s.capacity)}")
        table, dev, names, links = self.table, self.dev, self.table.names, self.links
        return SimResult(
            step_time=max(self.finish, default=0.0), devices=self.stats,
            links=[links[k] for k in sorted(links)],
            start=dict(zip(names, self.start)), finish=dict(zip(names, self.finish)),
            device_of={names[i]: table.devices[dev[i]] for i in range(self.n)}, problems=problems)


@dataclass
class Held:
    """A tensor that occupies a device's memory at its peak."""

    node: str
    port: int
    bytes: int
    kind: str  # "resident" (Variables, Consts, fed inputs), "output", or "received" (a copy from another device)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Counted(list):  # type: ignore[type-arg]
    """A run's per-device memory that counts its changes, notes the change at which each device
    first reached its highest value, and hands the run's state to `at` at chosen changes."""

    def __init__(self, values: list[int], at: Mapping[int, Any]) -> None:
        super().__init__(values)
        self.changes = 0
        self.top = list(values)
        self.when = [0] * len(values)
        self.at = at

    def __setitem__(self, d: Any, v: Any) -> None:
        list.__setitem__(self, d, v)
        self.changes += 1
        if v > self.top[d]:
            self.top[d], self.when[d] = v, self.changes
        hook = self.at.get(self.changes)
        if hook is not None:
            hook()


class _Watched(_Run):
    """A run that can say what each device holds at a chosen change of its memory: every
    non-resident tensor allocated there (an op dispatched, a copy arrived) and not yet freed."""

    unstarted = -1.0

    def __init__(self, table: CostTable, dev: Sequence[int], cluster: Cluster, keep: Iterable[str],
                 deps: _Dependencies, snapshots: Mapping[int, int]) -> None:
        self.hooks = {k: (lambda d=d: self._snapshot(d)) for k, d in snapshots.items()}
        self.arrived: set[tuple[int, int, int]] = set()
        self.held: dict[int, list[Held]] = {}
        super().__init__(table, dev, cluster, keep, deps)

    def memory(self, resident: list[int]) -> list[int]:
        return _Counted(resident, self.hooks)

    def transfer_arrived(self, key: tuple[int, int, int], t: float) -> None:
        self.arrived.add(key)
        super().transfer_arrived(key, t)

    def _snapshot(self, d: int) -> None:
        t, names = self.table, self.table.names
        taken = self.taken  # buffers a running op has taken over: listed as its output
        out: list[Held] = []
        for j in range(self.n):
            if self.dev[j] != d:
                continue
            if t.resident[j]:
                out += [Held(names[j], p, b, "resident") for p, b in enumerate(t.out_bytes[j]) if b]
            elif self.start[j] >= 0:
                running = self.running[d] == j
                for p, b in enumerate(t.held[j]):
                    if (b and (running or self.src_refs.get((j, p), 0) > 0 or (j, p) in self.keep_refs)
                            and (j, p, d) not in taken):
                        out.append(Held(names[j], p, b, "output"))
        for (j, p, dd) in self.arrived:
            if dd == d and p >= 0 and self.recv_refs.get((j, p, dd), 0) > 0 and (j, p, dd) not in taken:
                out.append(Held(names[j], p, t.out_bytes[j][p], "received"))
        self.held[d] = sorted(out, key=lambda h: (-h.bytes, h.node, h.port))


def held_at_peak(table: CostTable, dev: Sequence[int], cluster: Cluster, keep: Iterable[str] = ()) -> list[list[Held]]:
    """Per device, the tensors it holds at its simulated peak, largest first (their bytes add up
    to the peak). Two runs of the deterministic loop: one finds the change of each device's
    memory at which its peak is reached, the second stops there to look."""
    deps = _dependencies(table, dev)
    first = _Watched(table, dev, cluster, keep, deps, {})
    first.run()
    counted = first.mem
    assert isinstance(counted, _Counted)
    second = _Watched(table, dev, cluster, keep, deps, {k: d for d, k in enumerate(counted.when) if k})
    for d, k in enumerate(counted.when):
        if not k:  # never above its resident state: that is its peak, seen before anything runs
            second._snapshot(d)
    second.run()
    return [second.held[d] for d in range(len(table.devices))]


def _keep_refs(table: CostTable, keep: Iterable[str]) -> set[tuple[int, int]]:
    """The (node, port) pairs of the fetched refs `keep` in this step: never freed."""
    out: set[tuple[int, int]] = set()
    for ref in keep:
        name, port = parse_ref(ref)
        if name in table.index:
            out.add((table.index[name], port))
    return out


def simulate_table(table: CostTable, dev: Sequence[int], cluster: Cluster, keep: Iterable[str] = (),
                   deps: _Dependencies | None = None) -> SimResult:
    """The event loop over a prepared CostTable; `dev[i]` is node i's device index. `deps`: the
    placement's `_dependencies`, where the caller simulates it more than once."""
    run = _Run(table, dev, cluster, keep, deps or _dependencies(table, dev))
    run.run()
    return run.result()


def expected_step_time(table: CostTable, dev: Sequence[int], cluster: Cluster, samples: int = EXPECTATION_SAMPLES,
                       seed: int = 0, jitter: float | None = None) -> Expectation:
    """The mean simulated step when each op's time (its thread's share, its host share and its
    stream time alike) is multiplied by exp(N(-s^2/2, s^2)), a factor of mean 1 with s =
    `jitter` (default: the table's, from the cost model). The same `seed` draws the same factors
    for every placement of one table, so two placements compare on the same runs. With no
    jitter, or no samples, it is the exact schedule's step time."""
    s = table.jitter if jitter is None else float(jitter)
    if s <= 0 or samples <= 0:
        t = simulate_table(table, dev, cluster).step_time
        return Expectation(t, t, t, 0.0, 0)
    rng = np.random.default_rng(seed)
    n = len(table.names)
    times_a = np.asarray(table.times, dtype=np.float64).reshape(n, -1)
    host_a = np.asarray(table.host, dtype=np.float64) if table.host else None
    issue_a = np.asarray(table.issue, dtype=np.float64) if table.issue else None
    stream_a = np.asarray(table.stream, dtype=np.float64) if table.stream else None
    deps = _dependencies(table, dev)
    steps = []
    for _ in range(samples):
        f = np.exp(rng.normal(-s * s / 2, s, size=n))
        col = f[:, None]
        jittered = dataclasses.replace(
            table, times=(times_a * col).tolist(),
            host=(host_a * f).tolist() if host_a is not None else table.host,
            issue=(issue_a * col).tolist() if issue_a is not None else table.issue,
            stream=(stream_a * col).tolist() if stream_a is not None else table.stream)
        steps.append(simulate_table(jittered, dev, cluster, deps=deps).step_time)
    lo, hi = np.percentile(steps, [10, 90])
    return Expectation(float(np.mean(steps)), float(lo), float(hi), s, samples)
