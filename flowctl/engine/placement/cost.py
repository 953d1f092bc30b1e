"""Cost models (whitepaper §3.2.1): how long an op takes on a device, how big a tensor is, and how
long a tensor takes to cross a link. Two models answer the same three questions:

- `StaticCostModel`: a roofline over the device profile, op_overhead + max(FLOPs / peak FLOP/s,
  bytes / memory bandwidth), with FLOPs and bytes from each op's registered cost function on
  concrete shapes: unknown dimensions of inputs set to `batch`, then every shape function re-run
  (`concrete_shapes`). Transfers are latency + bytes / bandwidth.
- `MeasuredCostModel`: per-op times from a profiling run on the real device, keyed by
  (op, input shapes, output shapes, device profile), saved to and loaded from JSON (the run dir's
  cache). A node with no record is costed by the static model and listed in `fallbacks`, so a
  prediction never silently mixes the two.

`CostTable` evaluates a model once over the nodes of one step, so the simulator and every placer
read the same numbers (and do no per-node dictionary work in their inner loops).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from flowctl.engine.cluster import Cluster, Link
from flowctl.engine.dtypes import itemsize
from flowctl.engine.devices import parse_device
from flowctl.engine.errors import PlacementError
from flowctl.engine.frames import has_control_flow, output_counts, run_counts
from flowctl.engine.graph import Graph, Node, parse_ref
from flowctl.engine.opdef import COLLECTIVE, CONTROL, ELEMENTWISE, view_reshape, view_same
from flowctl.engine.opdef import resident as is_resident
from flowctl.engine.shapes import TensorSpec, concrete

MEASURED_VERSION = 1
DEFAULT_JITTER = 0.05
JITTER_MIN_NODES = 5  # nodes sharing a key before their spread counts towards the jitter
STREAM = "|stream"  # a record key's suffix for the device time of an asynchronous (GPU) kernel


class CostModel(Protocol):
    """The one interface placers and the simulator see (ARCHITECTURE.md, Placement item 2)."""

    name: str
    batch: int

    def op_time(self, graph: Graph, node: Node, device: str) -> float: ...

    def tensor_bytes(self, graph: Graph, ref: str) -> int: ...

    def transfer_time(self, nbytes: int, src: str, dst: str) -> float: ...

    def fallbacks(self) -> list[str]: ...


def collective_transfer(model: Any, graph: Graph, node: Node) -> float:
    """Seconds a collective node (CollectiveAllReduce) spends on the wire: as a ring all-reduce
    does, each rank sends and receives 2(N-1)/N of the buffer, here over the link from its device
    to the next rank's (its `devices` attr; none named: free). 0 for any other node. Added to the
    node's own time, so the simulator and every placer see what the transfer costs (a collective
    has no Send/Recv for them to price)."""
    if node.opdef.group != COLLECTIVE:
        return 0.0
    n, k, devices = int(node.attrs["group_size"]), int(node.attrs["rank"]), node.attrs["devices"]
    if n < 2 or len(devices) != n:
        return 0.0
    wire = int(model.tensor_bytes(graph, f"{node.name}:0") * 2 * (n - 1) / n)
    return float(model.transfer_time(wire, devices[k], devices[(k + 1) % n]))


def _ref_skipped(node: Node) -> tuple[int, ...]:
    return node.opdef.ref_inputs


def concrete_shapes(graph: Graph, batch: int) -> dict[str, list[tuple[int, ...]]]:
    """Every node's output shapes with the batch filled in: unknown dimensions of sources become
    `batch`, and every op's shape function is re-run on concrete inputs, so a dimension derived
    from the batch (a [batch * time, units] fold) gets its real size, not `batch`."""
    out: dict[str, list[tuple[int, ...]]] = {}
    for name in graph.topo_order():
        node = graph.nodes[name]
        if all(None not in s.shape for s in node.outputs) or not node.inputs:
            out[name] = [concrete(s.shape, batch) for s in node.outputs]
            continue
        ins = []
        for ref in node.inputs:
            src, port = parse_ref(ref)
            if graph.is_back_edge(node, ref):
                continue  # a loop's Merge: its entry value gives the shape (§4.4)
            ins.append(TensorSpec(out[src][port], graph.nodes[src].outputs[port].dtype))
        try:
            specs = node.opdef.infer(ins, node.attrs)
            out[name] = [concrete(tuple(sp.shape), batch) for sp in specs]
        except Exception:  # noqa: BLE001 -- a shape function that insists on its static view
            out[name] = [concrete(sp.shape, batch) for sp in node.outputs]
    return out


class StaticCostModel:
    """Roofline estimates from the op registry's cost functions over the cluster's profiles."""

    name = "static"
    # How much one kernel's time varies from run to run, as the standard deviation of its log
    # (see simulator.expected_step_time). Assumed for hardware that is not here; the measured
    # model measures it (lstm_lm's profiles on a 2-core VM: 0.21-0.25).
    jitter = DEFAULT_JITTER

    def __init__(self, cluster: Cluster, batch: int = 1) -> None:
        self.cluster = cluster
        self.batch = int(batch)
        self._shapes: tuple[Graph, dict[str, list[tuple[int, ...]]]] | None = None

    def shapes(self, graph: Graph) -> dict[str, list[tuple[int, ...]]]:
        """Concrete output shapes per node for this model's batch (cached per graph)."""
        if self._shapes is None or self._shapes[0] is not graph or len(self._shapes[1]) != len(graph):
            self._shapes = (graph, concrete_shapes(graph, self.batch))
        return self._shapes[1]

    def in_out(self, graph: Graph, node: Node) -> tuple[list[TensorSpec], list[TensorSpec]]:
        sh = self.shapes(graph)
        ins = []
        for ref in node.inputs:
            src, port = parse_ref(ref)
            ins.append(TensorSpec(sh[src][port], graph.nodes[src].outputs[port].dtype))
        outs = [TensorSpec(shape, spec.dtype) for shape, spec in zip(sh[node.name], node.outputs)]
        return ins, outs

    def estimate(self, graph: Graph, node: Node) -> tuple[float, float]:
        """(FLOPs, bytes moved) of one execution of `node`."""
        ins, outs = self.in_out(graph, node)
        return node.opdef.estimate(ins, outs, node.attrs, self.batch)

    def time_of(self, flops: float, nbytes: float, device: str) -> float:
        p = self.cluster.device(device).profile
        return p.op_overhead + max(flops / p.peak_flops, nbytes / p.mem_bandwidth)

    def op_time(self, graph: Graph, node: Node, device: str) -> float:
        flops, nbytes = self.estimate(graph, node)
        return self.time_of(flops, nbytes, device) + collective_transfer(self, graph, node)

    def tensor_bytes(self, graph: Graph, ref: str) -> int:
        name, port = parse_ref(ref)
        n = 1
        for d in self.shapes(graph)[name][port]:
            n *= d
        return n * itemsize(graph.nodes[name].outputs[port].dtype)

    def transfer_time(self, nbytes: int, src: str, dst: str) -> float:
        if src == dst:
            return 0.0
        link = self.cluster.link(src, dst)
        return link.latency + nbytes / link.bandwidth

    def fallbacks(self) -> list[str]:
        return []


def record_key(op: str, in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]],
               device_kind: str) -> str:
    """The JSON key of one measurement: op, concrete input and output shapes, device profile."""
    fmt = lambda shapes: json.dumps([list(map(int, s)) for s in shapes], separators=(",", ":"))
    return f"{op}|{fmt(in_shapes)}|{fmt(out_shapes)}|{device_kind}"


class MeasuredCostModel:
    """Per-op times measured on real devices. Keyed by device *profile* name, not type alone: two
    virtual CPU devices with different thread counts run a MatMul at different speeds."""

    name = "measured"

    def __init__(self, cluster: Cluster, batch: int = 1, records: Mapping[str, float] | None = None) -> None:
        self.cluster = cluster
        self.batch = int(batch)
        self.records: dict[str, float] = dict(records or {})
        self.static = StaticCostModel(cluster, batch)
        self._missed: dict[str, None] = {}
        # Seconds the runtime spends per node beyond its kernel (executor bookkeeping, Python
        # dispatch): profiling times kernels alone, so `calibrate` measures this once per step.
        self.dispatch = 0.0
        # The same, calibrated per device profile where it was (a GPU's launches and a CPU's
        # kernels leave different runtime overheads); `dispatch` serves the others.
        self.dispatch_by: dict[str, float] = {}
        self.links: dict[tuple[str, str], Link] = {}  # measured, by (src, dst) device name
        # Per profile, a factor on the profiled times, below 1 only where the step ran faster than
        # its kernels profiled one at a time (the machine sped up, or timing one op at a time cost
        # more than running it): `calibrate` scales them to the step as measured.
        self.scale_by: dict[str, float] = {}
        # Synchronous devices of one process slow each other while both compute (shared caches
        # and memory bandwidth): the simulator's processor-sharing factor (see simulator.py).
        self.contention = 1.0
        # The spread of one kernel's time (sd of its log), measured by `profile` across nodes that
        # share a key; the static model's assumption until then.
        self.jitter = DEFAULT_JITTER

    # ------------------------------------------------------------------ the interface
    def key_for(self, graph: Graph, node: Node, device: str) -> str:
        skip = _ref_skipped(node)
        ins, outs = self.static.in_out(graph, node)
        return record_key(node.op, [s.shape for i, s in enumerate(ins) if i not in skip], [s.shape for s in outs],
                          self.cluster.device(device).profile.name)

    def op_time(self, graph: Graph, node: Node, device: str) -> float:
        """Seconds the device's thread is busy with the node: kernel and dispatch on a CPU; on a
        GPU the launch and dispatch alone (the kernel itself runs on the stream: `stream_time`)."""
        t = self.records.get(self.key_for(graph, node, device))
        if t is None:
            if node.op == "Placeholder":  # fed: the step runs no kernel for it
                return 0.0
            if node.opdef.group != COLLECTIVE:  # never profiled alone: it needs its N ranks
                self._missed[node.name] = None
            # (a collective's wire time over this model's links: measured where they are)
            return self.static.op_time(graph, node, device) - collective_transfer(self.static, graph, node) \
                + collective_transfer(self, graph, node)
        return t * self._scale(device) + self.dispatch_by.get(self.cluster.device(device).profile.name, self.dispatch) \
            + collective_transfer(self, graph, node)

    def _scale(self, device: str) -> float:
        return self.scale_by.get(self.cluster.device(device).profile.name, 1.0)

    def stream_time(self, graph: Graph, node: Node, device: str) -> float | None:
        """Seconds the node's kernels keep an asynchronous device (a GPU stream) busy, measured
        between CUDA events; None for a synchronous device, or one profiled before streams were."""
        if node.op == "Placeholder":
            return None
        t = self.records.get(self.key_for(graph, node, device) + STREAM)
        return None if t is None else t * self._scale(device)

    def host_time(self, node: Node) -> float:
        """The part of a node's time spent in the runtime's Python dispatch, which holds the
        interpreter: devices of one process take turns at it (the simulator's host lane)."""
        return 0.0 if node.op == "Placeholder" else self.dispatch

    def calibrate(self, step_seconds: float, graph: Graph, nodes: Sequence[str], device: str) -> float:
        """Set the per-node dispatch cost d so that `nodes` (one step, run on `device` alone) take
        the measured `step_seconds`; returns it (never negative). On a synchronous device the step
        is the sum of (kernel + d); on a GPU each node costs max(launch + d, kernel), the host and
        the stream overlapping, so d is found by bisection (the sum grows with d). A step faster
        than its profiled kernels leaves d at 0 and scales the profile's times down to it instead
        (`scale_by`), so one device's predicted step is the measured one either way."""
        profile = self.cluster.device(device).profile.name
        self.dispatch_by[profile] = 0.0
        self.scale_by[profile] = 1.0
        issue = [self.op_time(graph, graph.nodes[n], device) for n in nodes]
        stream = [self.stream_time(graph, graph.nodes[n], device) or 0.0 for n in nodes]
        runs = run_counts(graph)  # §4.4: a node in a loop runs, and dispatches, once per iteration
        weight = [runs.get(n, 1.0) for n in nodes]

        def step(d: float) -> float:
            return sum(w * max(a + d, b) for w, a, b in zip(weight, issue, stream))

        d = 0.0
        if step(0.0) < step_seconds:
            lo, hi = 0.0, step_seconds / max(1.0, sum(weight))
            for _ in range(60):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if step(mid) < step_seconds else (lo, mid)
            d = (lo + hi) / 2
        elif step_seconds > 0 and step(0.0) > step_seconds:
            self.scale_by[profile] = step_seconds / step(0.0)  # max(s*a, s*b) = s*max(a, b)
        self.dispatch_by[profile] = d
        if len(self.dispatch_by) == 1 or self.cluster.device(device).type == "cpu":
            self.dispatch = d  # the host lane's share, and the default: a CPU's where there is one
        return d

    def tensor_bytes(self, graph: Graph, ref: str) -> int:
        return self.static.tensor_bytes(graph, ref)

    def transfer_time(self, nbytes: int, src: str, dst: str) -> float:
        """latency + bytes / bandwidth, of the link as measured through the runtime's Send/Recv
        where `links` has it (see training.benchmark.measure_links), else the cluster's figures."""
        if src == dst:
            return 0.0
        link = self.links.get((src, dst)) or self.links.get((dst, src))
        if link is None:
            return self.static.transfer_time(nbytes, src, dst)
        return link.latency + nbytes / link.bandwidth

    def fallbacks(self) -> list[str]:
        """Nodes asked about so far that had no measurement and were costed statically."""
        return list(self._missed)

    # ------------------------------------------------------------------ measurements
    def record_times(self, times_by_key: Mapping[str, Sequence[float]]) -> int:
        """Record one time per key from the times of every node that has it (flowctl.engine.
        placement.profiler measures them); their spread becomes the jitter. Returns the number
        of keys that were new."""
        added = sum(1 for k in times_by_key if k not in self.records)
        spread = log_spread(times_by_key)
        if spread is not None:
            self.jitter = spread
        for key, ts in times_by_key.items():
            # Each node's best of its repeats drops one-off stalls; across the nodes that share a
            # key (the 35 identical cells of an LSTM) the median, since the minimum of many samples
            # on a busy machine is optimistic (measured: it under-predicted a step by 25%).
            self.records[key] = statistics.median(ts)
        return added

    # ------------------------------------------------------------------ the run dir cache
    def save(self, path: str | os.PathLike[str]) -> None:
        data = {"version": MEASURED_VERSION, "batch": self.batch, "dispatch": self.dispatch,
                "dispatch_by": dict(sorted(self.dispatch_by.items())),
                "scale_by": dict(sorted(self.scale_by.items())), "contention": self.contention,
                "jitter": self.jitter,
                "links": [[a, b, lk.bandwidth, lk.latency] for (a, b), lk in sorted(self.links.items())],
                "records": dict(sorted(self.records.items()))}
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)  # a crash mid-write never leaves a truncated cache behind

    @classmethod
    def load(cls, path: str | os.PathLike[str], cluster: Cluster, batch: int | None = None) -> MeasuredCostModel:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise PlacementError(f"cannot read measured costs from {os.fspath(path)}: {e}") from None
        if data.get("version") != MEASURED_VERSION:
            raise PlacementError(f"measured costs {os.fspath(path)}: version {data.get('version')!r} is not "
                                 f"{MEASURED_VERSION}")
        model = cls(cluster, int(batch if batch is not None else data.get("batch", 1)),
                    {str(k): float(v) for k, v in data["records"].items()})
        model.dispatch = float(data.get("dispatch", 0.0))
        model.dispatch_by = {str(k): float(v) for k, v in data.get("dispatch_by", {}).items()}
        model.scale_by = {str(k): float(v) for k, v in data.get("scale_by", {}).items()}
        model.contention = float(data.get("contention", 1.0))
        model.jitter = float(data.get("jitter", DEFAULT_JITTER))
        model.links = {(str(a), str(b)): Link(float(bw), float(lat)) for a, b, bw, lat in data.get("links", [])}
        return model


def log_spread(times_by_key: Mapping[str, Sequence[float]]) -> float | None:
    """The jitter of one op's time: over the keys that at least JITTER_MIN_NODES nodes share (an
    LSTM's 35 cells do the same work), the median of the standard deviation of their log times.
    How far the nodes of one key stray from each other is how far an op strays from its record
    in a real step. None where no key has enough nodes. GPU stream times are left out (the
    launches' spread is the one the host sees)."""
    spreads = [statistics.pstdev(math.log(t) for t in ts) for key, ts in times_by_key.items()
               if len(ts) >= JITTER_MIN_NODES and min(ts) > 0 and not key.endswith(STREAM)]
    return statistics.median(spreads) if spreads else None


# ---------------------------------------------------------------------------- per-step cost table
def views_of(graph: Graph, names: list[str], index: dict[str, int],
             shapes: Mapping[str, list[tuple[int, ...]]]) -> list[tuple[int, int] | None]:
    """Per step node (topological `names`): the (producer, port) of input 0 whose buffer its outputs
    view (OpDef.view), or None. C-contiguity is followed through the step, since a Reshape of a
    strided view copies: a fresh output is contiguous, except an element-wise op's over a strided
    input (numpy keeps the input's layout); a tensor from outside the step counts as contiguous,
    and a view of one is counted as a copy (the simulator holds no buffer for it to keep alive)."""
    contiguous: dict[tuple[int, int], bool] = {}
    out: list[tuple[int, int] | None] = []
    for i, name in enumerate(names):
        node = graph.nodes[name]
        refs = [parse_ref(r) for r in node.inputs]
        ins = [contiguous.get((index[s], p), True) if s in index else True for s, p in refs]
        view: tuple[int, int] | None = None
        if node.opdef.view is not None and refs and refs[0][0] in index:
            src, port = refs[0]
            shares, c = node.opdef.view(node.attrs, shapes[src][port], ins[0])
            view = (index[src], port) if shares else None
        else:
            c = all(ins) if node.opdef.group == ELEMENTWISE else True
        for p in range(len(node.outputs)):
            contiguous[(i, p)] = c
        out.append(view)
    return out if any(v is not None for v in out) else []


def forwards_of(graph: Graph, names: list[str], index: dict[str, int], inputs: list[list[tuple[int, int]]],
                out_bytes: list[list[int]], resident: list[bool],
                views: list[tuple[int, int] | None]) -> list[tuple[int, ...]]:
    """Per step node, the positions in `inputs[i]` whose buffer its output `forward_to` may take
    (OpDef.forward), as the executors' `Plan` finds them: an input made by the step (no Variable,
    Const or feed), read once by the node, of the output's dtype and shape, and owning its buffer
    or a whole-buffer view of one (Reshape, ExpandDims, Identity: the executors' `whole`). None
    in a step with control flow (its frames run on the frame executor, which does not forward)."""
    if not any(graph.nodes[n].opdef.forward for n in names) or has_control_flow(graph.nodes[n] for n in names):
        return []
    out: list[tuple[int, ...]] = []
    for i, name in enumerate(names):
        node = graph.nodes[name]
        cands: list[int] = []
        for k in node.opdef.forward if node.outputs else ():
            if k >= len(node.inputs) or node.inputs.count(node.inputs[k]) != 1:
                continue
            src, port = parse_ref(node.inputs[k])
            j = index.get(src)
            if j is None or (j, port) not in inputs[i] or not _whole_buffer(graph, names, j, port, out_bytes,
                                                                            resident, views):
                continue
            spec, o = graph.nodes[src].outputs[port], node.outputs[node.opdef.forward_to]
            if spec.dtype == o.dtype and spec.shape == o.shape and out_bytes[j][port] == out_bytes[i][node.opdef.forward_to]:
                cands.append(inputs[i].index((j, port)))
        out.append(tuple(cands))
    return out if any(out) else []


def referenced_state(graph: Graph, step: Iterable[str]) -> dict[str, str]:
    """The Variables a step names by reference only (ref inputs: the executors neither wait for
    nor pass them, `needed_nodes`), each with the step node that names it first: optimizer
    slots (momentum, Adam's moments) and counters (Adam's step) that their update alone touches.
    The step runs nothing of theirs, yet their arrays are held for the whole step on the device
    of the update that names them (colocated with it, §4.3), which is its variable's: resident
    memory, as the parameters are. Left out, a step with Adam counted as one with SGD (NMT on one
    K40 capped at 1300 MiB was accepted, though its variables alone are 1,475 MiB)."""
    names = list(step)
    inside = set(names)
    out: dict[str, str] = {}
    for name in names:
        node = graph.nodes[name]
        for k in node.opdef.ref_inputs:
            if k < len(node.inputs):
                src = parse_ref(node.inputs[k])[0]
                if src not in inside and src not in out and graph.nodes[src].opdef.resource == "variable":
                    out[src] = name
    return out


def writes_of(graph: Graph, names: list[str], index: dict[str, int]) -> list[int]:
    """Per step node, the index of the Variable its first ref input names where it writes state
    (OpDef.resource "variable_input(s)"), else -1; empty where no node does."""
    out = []
    for name in names:
        node = graph.nodes[name]
        j = -1
        if node.opdef.resource in ("variable_input", "variable_inputs") and node.opdef.ref_inputs:
            k = node.opdef.ref_inputs[0]
            if k < len(node.inputs):
                j = index.get(parse_ref(node.inputs[k])[0], -1)
        out.append(j)
    return out if any(j >= 0 for j in out) else []


def _whole_buffer(graph: Graph, names: list[str], j: int, p: int, out_bytes: list[list[int]], resident: list[bool],
                  views: list[tuple[int, int] | None]) -> bool:
    """Whether output (j, p) is a step-made buffer, or a chain of views each of all of one
    (view_same / view_reshape, the same bytes) down to a step-made buffer."""
    while views and views[j] is not None:
        if graph.nodes[names[j]].opdef.view not in (view_same, view_reshape):
            return False
        a, q = views[j]  # type: ignore[misc]
        if out_bytes[a][q] != out_bytes[j][p]:
            return False
        j, p = a, q
    return not resident[j]


@dataclass
class CostTable:
    """One step's nodes (topological order) with their costs on every device of the cluster.

    Edges are by index: `inputs[i]` lists (producer, port) pairs read by node i (ref inputs
    excluded: they name state, they move no bytes), `controls[i]` its control predecessors
    (including the data inputs of a Group, which waits for them but reads nothing),
    `succ[i]` every consumer. `resident[i]` is true for nodes whose outputs live across steps
    (Variables, Consts, fed Placeholders): the simulator counts them as resident memory. The
    nodes at `referenced` are the state the step names only by reference (`referenced_state`:
    optimizer slots): resident on their device, they take no time (the step runs nothing of theirs)."""

    names: list[str]
    index: dict[str, int]
    devices: list[str]
    times: list[list[float]]  # [node][device] seconds
    flops: list[float]
    out_bytes: list[list[int]]  # [node][port]
    inputs: list[list[tuple[int, int]]]
    controls: list[list[int]]
    succ: list[list[int]]
    resident: list[bool]
    model: Any  # the CostModel, for transfer times
    # Seconds of each node's time that hold its process's interpreter (Python dispatch: it
    # cannot overlap with dispatch on another device of the same process), and each device's
    # process ("lane"). All zero for models that do not measure it.
    host: list[float] = field(default_factory=list)
    lanes: list[int] = field(default_factory=list)
    # Asynchronous devices (a GPU with measured stream times): the device's thread is busy only
    # `issue[i][d]` (dispatch and launch) while the kernels take `stream[i][d]` on the device's
    # stream, in launch order; `times` then holds max(issue, stream), an op's cost in a busy
    # pipeline, for the placers. Empty when no device is asynchronous.
    is_async: list[bool] = field(default_factory=list)
    issue: list[list[float]] = field(default_factory=list)
    stream: list[list[float]] = field(default_factory=list)
    # Synchronous devices of one process share its caches and memory bandwidth: while two or
    # more of them run ops at once, each runs at 1/contention of its measured speed (1: no effect).
    contention: float = 1.0
    # The spread of one op's time around its cost (sd of its log): see simulator.expected_step_time.
    jitter: float = 0.0
    # [node] how many times per step its outputs cross to another device when they do (a value
    # made in a loop crosses once per iteration); empty: once each.
    out_runs: list[float] = field(default_factory=list)
    # [node] the (producer, port) whose buffer the node's outputs are views of (None: outputs of
    # its own): a view holds no bytes and keeps that buffer alive while it lives. Empty: no views.
    views: list[tuple[int, int] | None] = field(default_factory=list)
    # [node] positions in `inputs[i]` whose buffer output `forward_to` may take when the node is
    # its last reader (OpDef.forward, the executors' buffer forwarding): inputs the step makes, or
    # whole-buffer views of them, of the output's bytes (`forwards_of`). Empty: no node forwards.
    forward: list[tuple[int, ...]] = field(default_factory=list)
    # [node] the Variable a state write (an optimizer update, an Assign) writes, -1 for other
    # nodes; empty: none. A write goes into the variable's own array once nothing else reads that
    # array (kernels/state.updatable_in_place, on a CPU and a GPU alike), holding no new bytes.
    writes: list[int] = field(default_factory=list)
    referenced: list[int] = field(default_factory=list)  # `referenced_state`: resident, never run
    # [node] its place in the order the graph was built (Graph.nodes), which the executors' ready
    # nodes take turns by (engine/executor.py); empty: the table's own order.
    built: list[int] = field(default_factory=list)
    _held: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def held(self) -> list[list[int]]:
        """[node][port] the bytes each output holds on its device: `out_bytes`, but none for a view
        (`views`); a transfer of a view still moves (and its receiver holds) all of its bytes."""
        if self._held is None:
            views = self.views
            self._held = [[0] * len(b) if views and views[i] is not None else b for i, b in enumerate(self.out_bytes)]
        return self._held

    def transfer(self, nbytes: int, src: int, dst: int) -> float:
        return float(self.model.transfer_time(nbytes, self.devices[src], self.devices[dst]))

    def runs(self, i: int) -> float:
        """How many times per step node i's outputs cross to another device when they do."""
        return self.out_runs[i] if self.out_runs else 1.0

    def crossing(self, i: int, p: int, src: int, dst: int) -> float:
        """Seconds per step for node i's output p (-1: a control token) to reach dst from src:
        one message per loop iteration for a value made in a loop (§4.4), which the step's
        schedule collapses into one run of the node."""
        nbytes = self.out_bytes[i][p] if p >= 0 else 0
        return self.transfer(nbytes, src, dst) * self.runs(i)

    def rank(self, i: int) -> int:
        """Node i's turn among ready nodes of its device (module doc of engine/executor.py)."""
        return self.built[i] if self.built else i

    @classmethod
    def build(cls, graph: Graph, cluster: Cluster, model: CostModel, step: Iterable[str]) -> CostTable:
        """The table of `step` (the nodes one step runs, in topological order) and of the state it
        names only by reference (`referenced_state`), each just before the node that names it
        first: Variables have no inputs, so the order stays topological, and every group of nodes
        (a slot is colocated with its variable's update) first appears where it did without them,
        so placers that follow the step's order choose as they did."""
        run = list(step)
        before: dict[str, list[str]] = {}
        for state, user in referenced_state(graph, run).items():
            before.setdefault(user, []).append(state)
        names = [x for n in run for x in (*before.get(n, ()), n)]
        quiet = {x for xs in before.values() for x in xs}
        index = {n: i for i, n in enumerate(names)}
        devices = cluster.names
        # A cost model answers by device profile (ARCHITECTURE: profiles describe devices), so ask
        # once per distinct profile and share the answer among devices that have it.
        reps: dict[str, int] = {}
        col = []
        for d, name in enumerate(devices):
            col.append(reps.setdefault(cluster.device(name).profile.name, d))
        rep_list = sorted(set(col))
        static = model if isinstance(model, StaticCostModel) else getattr(model, "static", None)
        if not isinstance(static, StaticCostModel):  # FLOPs for the explanation come from the registry
            static = StaticCostModel(cluster, model.batch)
        times, flops, out_bytes, inputs, controls, resident = [], [], [], [], [], []
        stream_time = getattr(model, "stream_time", None)
        streamed: dict[int, bool] = {}
        stream_rows: list[list[float]] = []
        succ: list[list[int]] = [[] for _ in names]
        runs = run_counts(graph)  # §4.4: a loop costs its iteration's cost times its trip count
        for i, name in enumerate(names):
            node = graph.nodes[name]
            fl, nb = static.estimate(graph, node)
            w = runs.get(name, 1.0)
            fl, nb = fl * w, nb * w
            if name in quiet:  # held, never run: no time, no launch
                fl = 0.0
                per = {r: 0.0 for r in rep_list}
                if model is not static and stream_time is not None:
                    stream_rows.append([0.0] * len(devices))
            elif model is static:  # one estimate serves every profile
                wire = w * collective_transfer(static, graph, node)
                per = {r: static.time_of(fl, nb, devices[r]) + wire for r in rep_list}
            else:
                per = {r: w * float(model.op_time(graph, node, devices[r])) for r in rep_list}
                if stream_time is not None:
                    for r in rep_list:
                        st = stream_time(graph, node, devices[r])
                        if st is not None:
                            streamed[r] = True
                    stream_rows.append([float(stream_time(graph, node, devices[col[d]]) or 0.0)
                                        for d in range(len(devices))])
            times.append([per[col[d]] for d in range(len(devices))])
            flops.append(float(fl))
            out_bytes.append([model.tensor_bytes(graph, f"{name}:{p}") for p in range(len(node.outputs))])
            skip = node.opdef.ref_inputs
            # A Group (or other output-less CONTROL op) only waits for its inputs: across devices
            # the partition needs a token from each, not the tensor itself.
            waits_only = node.opdef.group == CONTROL and not node.outputs
            ins: list[tuple[int, int]] = []
            ctrl_names = list(node.control_inputs)
            for k, ref in enumerate(node.inputs):
                if k in skip or graph.is_back_edge(node, ref):
                    continue
                src, port = parse_ref(ref)
                j = index.get(src)
                if waits_only:
                    ctrl_names.append(src)
                elif j is not None and (j, port) not in ins:
                    ins.append((j, port))
            ctrl = [index[c] for c in dict.fromkeys(ctrl_names) if c in index]
            inputs.append(ins)
            controls.append(ctrl)
            for j in dict.fromkeys([j for j, _ in ins] + ctrl):
                succ[j].append(i)
            resident.append(is_resident(node.opdef))
        host_time = getattr(model, "host_time", None)
        host = [float(host_time(graph.nodes[n])) if host_time and n not in quiet else 0.0 for n in names]
        procs: dict[tuple[str, int], int] = {}
        lanes = [procs.setdefault((p.job, p.task), len(procs)) for p in map(parse_device, devices)]
        is_async = [streamed.get(col[d], False) for d in range(len(devices))]
        issue: list[list[float]] = []
        stream: list[list[float]] = []
        if any(is_async):
            issue = [list(row) for row in times]
            stream = [[row[d] if is_async[d] else 0.0 for d in range(len(devices))] for row in stream_rows]
            times = [[max(a, b) for a, b in zip(ri, rs)] for ri, rs in zip(issue, stream)]
        else:
            is_async = []
        crossings = output_counts(graph)
        out_runs = [float(crossings.get(n, 1.0)) for n in names] if crossings else []
        views = views_of(graph, names, index, static.shapes(graph))
        return cls(names, index, devices, times, flops, out_bytes, inputs, controls, succ, resident, model,
                   host, lanes, is_async, issue, stream, float(getattr(model, "contention", 1.0)),
                   float(getattr(model, "jitter", 0.0)), out_runs, views,
                   forwards_of(graph, names, index, inputs, out_bytes, resident, views), writes_of(graph, names, index),
                   [i for i, n in enumerate(names) if n in quiet], _built_order(graph, names))


def _built_order(graph: Graph, names: Sequence[str]) -> list[int]:
    position = {n: k for k, n in enumerate(graph.nodes)}
    return [position.get(n, len(position) + i) for i, n in enumerate(names)]
