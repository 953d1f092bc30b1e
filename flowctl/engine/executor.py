"""Plans and executors (whitepaper §3.1, §4.2).

A `Plan` is compiled once per (fetches, feeds, targets) signature: the graph is pruned to the nodes
the fetches need, every kernel is bound with its attributes and resources, every tensor gets a value
slot, and each slot's last use is known so its buffer is dropped the moment no consumer remains
(the paper's reference counting). A step then does no graph work.

Two ways to run a plan:
- `run`: the plan's order compiled into straight-line Python (`v3 = k3(v1, v2); del v1`), which
  costs about one Python call per node. Used for partitions with no asynchronous kernels.
- `run_dataflow`: the §3.1 executor proper: a pending count per node and a ready queue, values
  released by reference count. Asynchronous kernels (Recv, queues) need this one, and a plan that
  holds one always runs this way (`run` hands over).
Both keep the same accounting: bytes of live tensors and their peak, and which nodes ran.

Buffer forwarding (TensorFlow's forward_input_or_allocate_output). An op whose OpDef lists
`forward` inputs (Add, Mul, BiasAdd, ReluGrad, XentGrad, ...) writes its output into one of those
inputs' buffers instead of a new one when the step owns that buffer outright: the op is the
value's last reader, nobody fetched or fed it, and nothing else holds the array -- the value
slot's reference is the only one (`sys.getrefcount`, as numpy's own temporary elision decides),
and the array owns its buffer or views all of one that only it holds (`whole`) -- which rules
out a Variable's array, a snapshot, a view's base and a tensor another device of this process
still reads. Such a step holds one buffer where it held two (NMT's logits and their BiasAdd:
293 MB). The in-place kernels give the allocating kernels' bits. The frame executor (loops,
conditionals) does not forward.

Asynchronous kernels (§5.3). An op whose OpDef says `is_async` has a kernel of the form
`start(step, inputs, done)`: `step` is the per-step context (a `StepContext` from
`flowctl.engine.rendezvous`: step id, rendezvous, frame; None under a plain `Session`, where only
Send/Recv, which meet in a rendezvous, cannot run), `inputs` the tuple of input arrays, and
`done(outputs, error)` the continuation, which may be called from any thread, before or after
`start` returns. The executor never blocks inside `start`; it keeps running whatever else is ready
and only waits (on a condition) when nothing is ready and async work is outstanding. All executor
bookkeeping (values, pending counts) stays on the executor's own thread: a continuation only
appends to a completion queue.

Order (the simulator's too): ready nodes take turns in the plan's order, the earliest built first
(`Graph.topo_order(earliest_first=True)`), as the straight-line code runs them: a model built
layer by layer runs each layer's chain before the next layer's (an unrolled LSTM's two layers
interleaved evicted each one's weights between its steps; lstm_lm's dataflow step took 708 ms at
one thread in ready order against 649 in this one, 645 straight-line). Ahead of that queue, first
come first served: asynchronous kernels (a Send above all, so a transfer leaves when its producer
finishes) and *prompt* nodes, the producers of a Send's input up to `PROMPT_HOPS` edges back (the
gradient and the reshape or concat readying it for the wire) and past them the scalars it needs
(a loss averaged over the replicas, its guard): a value bound for another device leaves as soon
as it can be made, not when the plan's order reaches the nodes an all-reduce added after the
whole backward pass. A value that arrived while a kernel ran counts as ready before that
kernel's outputs. (The frame executor, for plans with loops or conditionals, keeps one queue,
first come first served: frame_executor.py.)
"""
from __future__ import annotations

import heapq
import itertools
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence

import numpy as np

from flowctl.engine.dtypes import is_float
from flowctl.engine.errors import ExecutionError, GraphError, NonFiniteError
from flowctl.engine.frame_executor import FrameTables, run_frames
from flowctl.engine.frames import has_control_flow
from flowctl.engine.graph import Graph, Node, parse_ref
from flowctl.engine.ledger import Ledger
from flowctl.engine.opdef import COLLECTIVE, COMMUNICATION, CONTROL, STATE, resident
from flowctl.kernels.registry import array_module, bind, bind_into, check_finite

if TYPE_CHECKING:
    from flowctl.engine.rendezvous import StepContext

_plan_ids = itertools.count()

# numpy's floating-point warnings inside a step ("divide by zero encountered"): off. A non-finite
# value is the step guard's and check_numerics' to report, with the node that made it. (A new
# errstate each time: one instance keeps its saved state on itself, and device threads run steps
# at once.)
def _quiet() -> Any:
    return np.errstate(all="ignore")

# Buffer forwarding on (see the module doc); FLOWCTL_FORWARD=0 turns it off, for comparisons.
FORWARD = os.environ.get("FLOWCTL_FORWARD", "1") != "0"
PROMPT_HOPS = 2  # a Send's producers this many data or control edges back run promptly (Plan.prompt)


def _base_refs(v: Any) -> int:
    b = v.base
    return sys.getrefcount(b)


def _sole_counts() -> tuple[int, int, int]:
    """sys.getrefcount of an array held by nothing but one local variable, by nothing but one list
    item (read the way the compiled step and the dataflow step read their values), and of a base
    held by nothing but one view (through `_base_refs`): the counts at which the step owns the
    array outright, measured on this interpreter."""
    import numpy as np

    def local() -> int:
        v0 = np.empty(1)
        return sys.getrefcount(v0)

    def listed() -> int:
        values = [np.empty(1)]
        return sys.getrefcount(values[0])

    return local(), listed(), _base_refs(np.empty(2).reshape(1, 2))


SOLE_LOCAL, SOLE_LISTED, SOLE_BASE = _sole_counts()


def whole(v: Any) -> bool:
    """`v` owns its buffer, or is a C-contiguous view of all of a buffer that nothing but `v` holds
    (the logits a Reshape hands on): writing into `v` then overwrites nothing anyone will read."""
    if not getattr(v.flags, "writeable", True):  # a read-only array (a restored, mapped one); cupy has no flag
        return False
    if v.base is None:
        return True
    if _base_refs(v) != SOLE_BASE:  # counted first: a local holding the base would count too
        return False
    b = v.base
    return type(b) is type(v) and b.base is None and v.nbytes == b.nbytes and v.flags.c_contiguous


class CompletionQueue(Protocol):
    """Where an async kernel's continuation leaves (node, outputs, error) for the executor."""

    def append(self, item: tuple[int, Any, BaseException | None], /) -> None: ...


@dataclass
class RunStats:
    """What one step did, from the executor's own accounting."""

    nodes_run: list[str] = field(default_factory=list)
    peak_bytes: int = 0  # peak bytes of the buffers the step's live values hold (ledger.py: views share theirs)
    # Dataflow executor only: (node, time.perf_counter()) as each node was *started*, in order. For a
    # synchronous kernel start and finish are adjacent; for an async one (Recv) they are not, and
    # this is where §5.2 receive scheduling shows.
    starts: list[tuple[str, float]] = field(default_factory=list)
    # Dataflow executor only: (node, time.perf_counter()) as each node *finished* (an async
    # kernel: when the executor took its completion), in order. With `starts`, a trace of the step.
    finishes: list[tuple[str, float]] = field(default_factory=list)
    # Dataflow executor only, counted by the executor's thread around the whole step and not from
    # the per-node times above: seconds from entering the step to leaving it (`wall_s`), the part of
    # them spent waiting for an asynchronous kernel with nothing else ready (`idle_s`), and the
    # thread's CPU seconds (`cpu_s`, time.thread_time: preemption and GIL waits excluded).
    wall_s: float = 0.0
    idle_s: float = 0.0
    cpu_s: float = 0.0
    # A multi-device step: each device's own stats (the fields above then aggregate them).
    devices: dict[str, "RunStats"] = field(default_factory=dict)

    def runs(self) -> list[tuple[str, float, float]]:
        """(node, start, finish) of every kernel run, in finishing order. A node in a loop runs
        once per iteration: each finish is paired with that node's earliest unfinished start."""
        pending: dict[str, deque[float]] = {}
        for name, t in self.starts:
            pending.setdefault(name, deque()).append(t)
        out = []
        for name, t in self.finishes:
            began = pending.get(name)
            if began:
                out.append((name, began.popleft(), t))
        return out

    @property
    def busy_s(self) -> float:
        """The seconds the executor's thread worked on the step: kernels and its own bookkeeping."""
        return self.wall_s - self.idle_s


def prompt_nodes(first: Iterable[int], preds: Callable[[int], Iterable[int]], runs: Callable[[int], bool],
                 scalars: Callable[[int], bool]) -> set[int]:
    """The nodes that run ahead of the plan's order (module doc), walking back from `first` (what
    a transfer to another device reads: one edge back from a Send): they and their producers up
    to PROMPT_HOPS edges back from the transfer (the gradient and the reshape or concat readying
    it for the wire), and past them whatever makes only scalars (`scalars`: a loss averaged over
    replicas and its guard: nothing to run, and a peer waits on it). `runs(i)`: whether node i
    takes a turn at all (an asynchronous kernel starts at once). Shared with the simulator."""
    out = set(first)
    near, hops = set(out), 1
    while near:
        hops += 1
        near = {p for i in near for p in preds(i) if p not in out and runs(p) and (hops <= PROMPT_HOPS or scalars(p))}
        out |= near
    return out


def _prompt(nodes: Sequence[Node], preds_of: Sequence[set[int]], is_async: Sequence[bool]) -> list[bool]:
    """Per node of a plan, whether it is prompt (`prompt_nodes`, from its Sends' inputs)."""
    first = {p for i, n in enumerate(nodes) if n.op == "Send" for p in preds_of[i] if not is_async[p]}
    chosen = prompt_nodes(first, preds_of.__getitem__, lambda p: not is_async[p], lambda p: _scalars(nodes[p]))
    return [i in chosen for i in range(len(nodes))]


def _scalars(node: Node) -> bool:
    return bool(node.outputs) and all(s.shape is not None and all(d == 1 for d in s.shape) for s in node.outputs)


def needed_nodes(graph: Graph, roots: Sequence[str], fed: set[str]) -> set[str]:
    """§4.2 partial execution: the nodes that must run to produce `roots`, given the fed tensors.
    A node whose every consumed output is fed does not run."""
    need: set[str] = set()
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name in need:
            continue
        need.add(name)
        node = graph.nodes[name]
        skip = node.opdef.ref_inputs
        for i, ref in enumerate(node.inputs):
            if ref not in fed and i not in skip:
                stack.append(parse_ref(ref)[0])
        stack.extend(node.control_inputs)
    return need


def _output_dtypes(node: Node) -> list[str] | None:
    """The node's output dtypes, which tell the registry to run a node on bfloat16 in float32
    (kernels/bf16.py); None for the ops that keep or move values whatever their dtype (state,
    queues, asynchronous transfers, control flow), which see their arrays as they are. Ops whose
    resource is a random state (Dropout, the random draws) compute, so they follow the rule."""
    d = node.opdef
    if d.ref_inputs or d.is_async or d.group in (STATE, CONTROL):
        return None
    return [s.dtype for s in node.outputs]


def _input_specs(graph: Graph, node: Node) -> list[Any] | None:
    """The node's inputs' inferred specs, for the kernel registry's variant rules (None where the
    graph cannot say: the reference kernel is then bound)."""
    try:
        return graph.input_specs(node)
    except GraphError:
        return None


class Plan:
    def __init__(self, graph: Graph, fetches: Sequence[str], feeds: Sequence[str], targets: Sequence[str],
                 device: str, resources: Callable[[Node], Any],
                 guards: Callable[[Node], Any] | None = None) -> None:
        """`guards(node)`: the StepGuard a node's kernel writes or reads (the step's CheckNumerics
        and the state writes that wait for it, on a device whose steps are captured), or None."""
        self.graph = graph
        self.guards = guards
        self.device = device
        self.device_type = device.rsplit("device:", 1)[-1].split(":")[0]
        self.fetches = list(fetches)
        self.feeds = list(feeds)
        for ref in self.fetches + self.feeds:
            graph.tensor(ref)  # raises with a did-you-mean on an unknown name
        fed_refs = set(self.feeds)
        roots = [parse_ref(r)[0] for r in self.fetches if r not in fed_refs] + list(targets)
        self.order = graph.topo_order(needed_nodes(graph, roots, fed_refs), earliest_first=True)
        self.nodes = [graph.nodes[n] for n in self.order]
        self.resources = resources
        self.kernels = [self._bind(graph, n, resources) for n in self.nodes]

        # Value slots: feeds first, then every node output.
        slot: dict[str, int] = {}
        for ref in self.feeds:
            slot[ref] = len(slot)
        self.out_slots: list[list[int]] = []
        for n in self.nodes:
            outs = []
            for p in range(len(n.outputs)):
                ref = f"{n.name}:{p}"
                if ref not in slot:
                    slot[ref] = len(slot)
                outs.append(slot[ref])
            self.out_slots.append(outs)
        self.in_slots = [[slot[r] for i, r in enumerate(n.inputs) if i not in n.opdef.ref_inputs]
                         for n in self.nodes]
        self.fetch_slots = [slot[r] for r in self.fetches]
        self.num_slots = len(slot)
        self.float_out = [[is_float(s.dtype) for s in n.outputs] for n in self.nodes]
        self.is_async = [n.opdef.is_async for n in self.nodes]
        self.has_async = any(self.is_async)
        # Accounting counts what the step produces; constants belong to the plan, feeds to the
        # caller, a Variable's value to its container.
        self.counted = {s for n, outs in zip(self.nodes, self.out_slots) if not resident(n.opdef) for s in outs}

        # Last use of each slot (fetched and fed slots are never released by the step).
        keep = set(self.fetch_slots) | set(range(len(self.feeds)))
        self.last_use: dict[int, int] = {}
        for i, ins in enumerate(self.in_slots):
            for s in ins:
                self.last_use[s] = i
        self.release_after: list[list[int]] = [[] for _ in self.nodes]
        for i, outs in enumerate(self.out_slots):
            for s in outs:
                if s not in keep and s not in self.last_use:
                    self.release_after[i].append(s)  # produced but never read: drop at once
        for s, i in self.last_use.items():
            if s not in keep:
                self.release_after[i].append(s)

        # Dataflow structure: successors and pending counts over data and control edges.
        index = {n: i for i, n in enumerate(self.order)}
        self.succ: list[list[int]] = [[] for _ in self.nodes]
        self.pending0 = [0] * len(self.nodes)
        fed = set(self.feeds)
        preds_of: list[set[int]] = []
        for i, n in enumerate(self.nodes):
            preds = {index[parse_ref(r)[0]] for i, r in enumerate(n.inputs)
                     if r not in fed and i not in n.opdef.ref_inputs}
            preds |= {index[c] for c in n.control_inputs}
            preds_of.append(preds)
            self.pending0[i] = len(preds)
            for p in preds:
                self.succ[p].append(i)
        self.prompt = _prompt(self.nodes, preds_of, self.is_async)
        self.slot_uses = [0] * self.num_slots
        for ins in self.in_slots:
            for s in ins:
                self.slot_uses[s] += 1
        self._plan_forwarding(graph, resources, keep)

        self._compiled: dict[tuple[bool, bool], tuple[Callable[..., Any], str, list[int]]] = {}
        # §4.4: a plan with control flow runs on the frame-aware executor (tagged values).
        # A Recv that may deliver a dead value (a cond's untaken branch on another device) needs the
        # same executor, which propagates deadness, even in a partition without control-flow ops.
        dead_recv = any(n.op == "Recv" and n.attrs.get("maybe_dead") for n in self.nodes)
        self.frame_tables = FrameTables(self) if has_control_flow(self.nodes) or dead_recv else None

    def _bind(self, graph: Graph, node: Node, resources: Callable[[Node], Any]) -> Callable[..., Any]:
        attrs = self._attrs(node, resources)
        if self.guards is not None:
            g = self.guards(node)
            if g is not None:
                attrs["_guard"] = g
        try:
            return bind(node.op, self.device_type, attrs, _input_specs(graph, node), _output_dtypes(node))
        except KeyError:
            raise GraphError(f"node '{node.name}' ({node.op}) has no kernel for device {self.device}") from None

    @staticmethod
    def _attrs(node: Node, resources: Callable[[Node], Any]) -> dict[str, Any]:
        attrs = dict(node.attrs)
        attrs["_node"] = node.name
        if node.opdef.resource:
            attrs["_resource"] = resources(node)
        return attrs

    def _plan_forwarding(self, graph: Graph, resources: Callable[[Node], Any], keep: set[int]) -> None:
        """Per node, the (input position, slot) pairs whose buffer its output may take (OpDef.forward),
        in order of preference, and its in-place kernel: where the input is made by this step (not
        fed, fetched, nor a Variable's or Const's), read once by the node, and of the output's dtype
        and shape. Whether the step owns the buffer is decided when the node runs."""
        self.forward: list[list[tuple[int, int]]] = [[] for _ in self.nodes]
        self.into: list[Callable[..., Any] | None] = [None] * len(self.nodes)
        self.ndarray: Any = None
        if not FORWARD:
            return
        for i, node in enumerate(self.nodes):
            if not node.opdef.forward or not node.outputs:
                continue
            positions = [k for k in range(len(node.inputs)) if k not in node.opdef.ref_inputs]
            out = node.outputs[node.opdef.forward_to]
            cands = []
            for k in node.opdef.forward:
                if k not in positions:
                    continue
                pos = positions.index(k)
                s = self.in_slots[i][pos]
                src, port = parse_ref(node.inputs[k])
                spec = graph.nodes[src].outputs[port]
                if (s in keep or s not in self.counted or self.in_slots[i].count(s) != 1
                        or spec.dtype != out.dtype or spec.shape != out.shape):
                    continue
                cands.append((pos, s))
            if not cands:
                continue
            fn = bind_into(node.op, self.device_type, self._attrs(node, resources), _input_specs(graph, node),
                           _output_dtypes(node))
            if fn is not None:
                self.forward[i], self.into[i] = cands, fn
        if any(self.forward):
            self.ndarray = array_module(self.device_type).ndarray

    # ------------------------------------------------------------------ straight-line execution
    def _compile(self, stats: bool, check: bool) -> tuple[Callable[..., Any], str, list[int]]:
        key = (stats, check)
        if key in self._compiled:
            return self._compiled[key]
        filename = f"<flowctl plan {next(_plan_ids)}>"
        lines: list[str] = ["def step(F, K, _L, _chk, _ran):"]
        owner: list[int] = [-1]

        def emit(text: str, node: int) -> None:
            lines.append("    " + text)
            owner.append(node)

        if self.feeds:
            emit(", ".join(f"v{i}" for i in range(len(self.feeds))) + ", = F", -1)
        if self.nodes:
            emit(", ".join(f"k{i}" for i in range(len(self.nodes))) + ", = K", -1)
        if stats:
            for i in range(len(self.feeds)):
                emit(f"_L.resident(v{i})", -1)
        namespace: dict[str, Any] = {"_nd": self.ndarray, "_rc": sys.getrefcount, "_whole": whole}
        for i, node in enumerate(self.nodes):
            args = ", ".join(f"v{s}" for s in self.in_slots[i])
            outs = self.out_slots[i]
            call = f"k{i}({args})"
            lhs = ", ".join(f"v{s}" for s in outs) + ("," if len(outs) > 1 else "")
            owned = [(pos, s) for pos, s in self.forward[i] if self.last_use.get(s) == i]
            if owned:  # buffer forwarding: into the first input the step owns outright
                namespace[f"i{i}"] = self.into[i]
                for n, (pos, s) in enumerate(owned):
                    emit(f"{'if' if n == 0 else 'elif'} type(v{s}) is _nd and _rc(v{s}) == {SOLE_LOCAL} "
                         f"and _whole(v{s}):", i)
                    emit(f"    {lhs} = i{i}({pos}, {args})", i)
                emit("else:", i)
                emit(f"    {lhs} = {call}", i)
            elif not outs:
                emit(call, i)
            else:
                emit(f"{lhs} = {call}", i)
            if stats:
                emit(f"_ran({i})", i)
                for s in outs:
                    emit(f"_L.{'acquire' if s in self.counted else 'resident'}(v{s})", i)
            if check:
                for s, f in zip(outs, self.float_out[i]):
                    if f:
                        emit(f"_chk(v{s})", i)
            rel = self.release_after[i]
            if rel:
                if stats:
                    for s in rel:
                        if s in self.counted:
                            emit(f"_L.release(v{s})", i)
                emit("del " + ", ".join(f"v{s}" for s in rel), i)
        ret = "(" + "".join(f"v{s}, " for s in self.fetch_slots) + ")"
        emit(f"return {ret}", -1)
        src = "\n".join(lines) + "\n"
        exec(compile(src, filename, "exec"), namespace)
        result = (namespace["step"], filename, owner)
        self._compiled[key] = result
        return result

    def run(self, feeds: Sequence[Any], stats: RunStats | None = None, check_numerics: bool = False,
            step: "StepContext | None" = None) -> list[Any]:
        if self.has_async or self.frame_tables is not None:
            # Straight-line code cannot wait for a continuation (§5.3) nor loop (§4.4).
            return self.run_dataflow(feeds, stats, check_numerics, step)
        fn, filename, owner = self._compile(stats is not None, check_numerics)
        ran: list[int] = []
        ledger = Ledger() if stats is not None else None
        try:
            with _quiet():  # a NaN or Inf is reported by the step's guard or check_numerics, not numpy
                out = fn(feeds, self.kernels, ledger, check_finite, ran.append)
        except Exception as e:  # noqa: BLE001 -- every kernel failure is reported with its node
            raise self._error(e, self._failing(e.__traceback__, filename, owner)) from e
        if stats is not None:
            stats.nodes_run = [self.order[i] for i in ran]
            stats.peak_bytes = ledger.peak if ledger is not None else 0
        return list(out)

    def _failing(self, tb: TracebackType | None, filename: str, owner: list[int]) -> int:
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == filename:
                return owner[tb.tb_lineno - 1]
            tb = tb.tb_next
        return -1

    def _error(self, e: BaseException, i: int) -> ExecutionError:
        if isinstance(e, ExecutionError):
            return e
        if i < 0:
            return ExecutionError(f"step failed on {self.device}: {type(e).__name__}: {e}", device=self.device)
        node = self.nodes[i]
        where = f" (made by {node.source})" if node.source else ""
        cls = NonFiniteError if isinstance(e, FloatingPointError) else ExecutionError
        detail = str(e) if isinstance(e, (FloatingPointError, ValueError)) else f"{type(e).__name__}: {e}"
        return cls(f"node '{node.name}' ({node.op}) on {self.device}{where}: {detail}",
                   node=node.name, op=node.op, device=self.device)

    # ------------------------------------------------------------------ §3.1 dataflow execution
    def run_dataflow(self, feeds: Sequence[Any], stats: RunStats | None = None,
                     check_numerics: bool = False, step: "StepContext | None" = None) -> list[Any]:
        """Run the plan with a pending count per node and a ready queue (§3.1). `step` is the
        context handed to asynchronous kernels (§5.3); a plan without them ignores it."""
        if stats is None:
            with _quiet():
                return self._run_dataflow(feeds, None, check_numerics, step)
        t0, c0 = time.perf_counter(), time.thread_time()
        with _quiet():
            out = self._run_dataflow(feeds, stats, check_numerics, step)
        stats.wall_s, stats.cpu_s = time.perf_counter() - t0, time.thread_time() - c0
        return out

    def _run_dataflow(self, feeds: Sequence[Any], stats: RunStats | None, check_numerics: bool,
                      step: "StepContext | None") -> list[Any]:
        if self.frame_tables is not None:
            return run_frames(self, feeds, stats, check_numerics, step)
        run = _DataflowStep(self, feeds, check_numerics, step, timed=stats is not None)
        run.run()
        if len(run.ran) != len(self.nodes):
            raise ExecutionError(f"step on {self.device} stopped with {len(self.nodes) - len(run.ran)} node(s) "
                                 f"never ready", device=self.device)
        if stats is not None:
            stats.nodes_run = run.ran
            stats.peak_bytes = run.ledger.peak if run.ledger is not None else 0
            stats.starts = run.starts
            stats.finishes = run.finishes
            stats.idle_s = run.idle
        return [run.values[s] for s in self.fetch_slots]

    def _start_async(self, i: int, step: "StepContext | None", inputs: tuple[Any, ...],
                     completed: "CompletionQueue", cond: threading.Condition) -> None:
        """Start async kernel i; its continuation only queues the result and wakes the executor."""
        if step is None and self.nodes[i].opdef.group in (COMMUNICATION, COLLECTIVE):
            # Queue kernels (§4.6) need no rendezvous and run under a plain Session; Send/Recv and
            # collectives do.
            node = self.nodes[i]
            raise ExecutionError(f"node '{node.name}' ({node.op}) on {self.device} is asynchronous and "
                                 f"needs a step context (a rendezvous): run partitioned graphs through "
                                 f"flowctl.engine.runtime.DistributedSession", node=node.name, op=node.op,
                                 device=self.device)

        def done(out: Any = None, err: BaseException | None = None) -> None:
            with cond:
                completed.append((i, out, err))
                cond.notify()

        try:
            self.kernels[i](step, inputs, done)
        except Exception as e:  # noqa: BLE001 -- a failure to start is the node's failure
            done(None, e)


class _DataflowStep:
    """One step of the §3.1 executor: values by slot, pending counts, the ready queue, and the
    completion queue async continuations append to (consumed on this thread only)."""

    def __init__(self, plan: Plan, feeds: Sequence[Any], check_numerics: bool,
                 step: "StepContext | None", timed: bool) -> None:
        self.plan = plan
        self.check = check_numerics
        self.step = step
        self.timed = timed
        self.values: list[Any] = [None] * plan.num_slots
        for i, v in enumerate(feeds):
            self.values[i] = v
        self.uses = list(plan.slot_uses)
        self.pending = list(plan.pending0)
        # Two ready sets: asynchronous and prompt nodes, first come first served, ahead of the
        # compute, which runs in the plan's order (a heap of plan positions; module doc).
        self.urgent = deque(i for i, p in enumerate(self.pending) if p == 0 and plan.is_async[i])
        self.urgent.extend(i for i, p in enumerate(self.pending)
                           if p == 0 and plan.prompt[i] and not plan.is_async[i])
        self.ready = [i for i, p in enumerate(self.pending) if p == 0 and not plan.is_async[i] and not plan.prompt[i]]
        self.keep = set(plan.fetch_slots) | set(range(len(plan.feeds)))
        self.ledger = Ledger() if timed else None  # memory accounting, for RunStats
        if self.ledger is not None:
            for v in feeds:
                self.ledger.resident(v)
        self.ran: list[str] = []
        self.starts: list[tuple[str, float]] = []
        self.finishes: list[tuple[str, float]] = []
        self.completed: deque[tuple[int, Any, BaseException | None]] = deque()
        self.cond = threading.Condition()
        self.outstanding = 0
        self.deferred: tuple[int, Any] | None = None  # a finished kernel whose successors wait their turn
        self.idle = 0.0  # timed steps: seconds spent waiting with nothing ready

    def run(self) -> None:
        while True:
            done: tuple[int, Any] | None
            if self.completed:  # a continuation fired: finish that node before starting another
                done = self._take_completion()
            elif self.deferred is not None:
                done, self.deferred = self.deferred, None
            elif self.urgent:
                done = self._start(self.urgent.popleft())
            elif self.ready:
                done = self._start(heapq.heappop(self.ready))
            elif self.outstanding:
                t = time.perf_counter() if self.timed else 0.0
                with self.cond:  # nothing to run until some asynchronous kernel completes
                    while not self.completed:
                        self.cond.wait()
                if self.timed:
                    self.idle += time.perf_counter() - t
                continue
            else:
                return
            if done is not None:
                self._finish(*done)
                done = None  # the outputs' only references are their slots (buffer forwarding)

    def _take_completion(self) -> tuple[int, Any]:
        i, out, err = self.completed.popleft()
        self.outstanding -= 1
        if err is not None:
            raise self.plan._error(err, i) from err
        if self.timed:
            self.finishes.append((self.plan.order[i], time.perf_counter()))
        return i, out

    def _start(self, i: int) -> tuple[int, Any] | None:
        """Run node i, or start it if asynchronous; returns (i, outputs) when it finished now."""
        plan = self.plan
        if self.timed:
            self.starts.append((plan.order[i], time.perf_counter()))
        into = self._owned(i) if plan.forward[i] else -1
        inputs = [self.values[s] for s in plan.in_slots[i]]
        if plan.is_async[i]:
            self.outstanding += 1
            plan._start_async(i, self.step, tuple(inputs), self.completed, self.cond)
            return None
        try:
            out = plan.kernels[i](*inputs) if into < 0 else plan.into[i](into, *inputs)  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001
            raise plan._error(e, i) from e
        if self.timed:
            self.finishes.append((plan.order[i], time.perf_counter()))
        if self.completed:
            # Values that arrived while the kernel ran were ready before its outputs: their
            # consumers queue first (ready-time order, as the simulator has it).
            self.deferred = (i, out)
            return None
        return i, out

    def _owned(self, i: int) -> int:
        """The input position whose buffer node i may write its output into (buffer forwarding: its
        last reader, the slot's reference the array's only one, and the buffer all its own), or -1."""
        values, nd = self.values, self.plan.ndarray
        for pos, s in self.plan.forward[i]:
            if (self.uses[s] == 1 and type(values[s]) is nd and sys.getrefcount(values[s]) == SOLE_LISTED
                    and whole(values[s])):
                return pos
        return -1

    def _finish(self, i: int, out: Any) -> None:
        """Node i finished with outputs `out`: store them, release inputs, wake successors."""
        self._store(i, out)
        self._release(i)
        plan = self.plan
        for c in plan.succ[i]:
            self.pending[c] -= 1
            if self.pending[c] == 0:
                if plan.is_async[c]:
                    # A Send (or Recv, or queue op) only hands a tensor over or registers a
                    # callback: start it before the queued compute, so another device is not
                    # kept waiting behind this one's backlog (TF runs such cheap kernels inline).
                    self.urgent.appendleft(c)
                elif plan.prompt[c]:
                    self.urgent.append(c)
                else:
                    heapq.heappush(self.ready, c)

    def _store(self, i: int, out: Any) -> None:
        plan = self.plan
        node = plan.nodes[i]
        outs = plan.out_slots[i]
        if len(outs) == 1:
            out = (out,)
        try:
            for s, v, f in zip(outs, out or (), plan.float_out[i]):
                self.values[s] = v
                if self.check and f:
                    check_finite(v)
        except Exception as e:  # noqa: BLE001
            raise plan._error(e, i) from e
        self.ran.append(node.name)
        led = self.ledger
        if led is not None:
            for s in outs:
                (led.acquire if s in plan.counted else led.resident)(self.values[s])
        for s in outs:
            if self.uses[s] == 0 and s not in self.keep:
                if led is not None and s in plan.counted:
                    led.release(self.values[s])
                self.values[s] = None

    def _release(self, i: int) -> None:
        plan = self.plan
        for s in plan.in_slots[i]:
            self.uses[s] -= 1
            if self.uses[s] == 0 and s not in self.keep:
                if self.ledger is not None and s in plan.counted:
                    self.ledger.release(self.values[s])
                self.values[s] = None  # §3.1: the buffer goes the moment its last consumer ran
